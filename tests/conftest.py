"""Shared fixtures: tiny random Llama models, the real SmolLM2, and engines reused across tests.

Every engine a test touches must have all of its KV blocks back in the pool when the test ends.
"""
from __future__ import annotations

import gc
import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from fixtures import (
    API_KEY,
    ENGINES,
    QWEN3_ANSWER,
    QWEN3_PLAIN,
    QWEN3_REASONING,
    QWEN3_TOKENIZER,
    build_llm,
    make_scripted_qwen3_dir,
    make_tiny_llama_dir,
    serve,
    smollm2_gguf_path,
)

# pytest-xdist's workers share the host's cores, and a torch thread per core in every worker
# oversubscribes them: six workers on 16 cores took test_int4's CPU reference past 300 s.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_collection_modifyitems(items):
    """Tests given a longer timeout than the run's go first: on parallel workers the run then
    ends on short tests, not on a long one that started late (journal item 135)."""
    items.sort(key=lambda item: item.get_closest_marker("timeout") is None)


@pytest.fixture(autouse=True)
def all_blocks_returned():
    yield
    try:
        for llm in ENGINES:
            core = getattr(getattr(llm, "engine", None), "core", None)
            if core is None:
                continue
            bm = core.block_manager
            assert not core.has_unfinished_requests(), "a request was left running"
            assert bm.num_free_blocks == bm.num_blocks, \
                f"{bm.num_blocks - bm.num_free_blocks} KV blocks were not returned"
            assert sorted(bm.unreferenced_blocks()) == list(range(bm.num_blocks)), \
                "a KV block was returned twice"
            assert not any(bm.ref_counts), "a returned KV block is still referenced"
    finally:
        ENGINES.mark_checked()


@pytest.fixture(autouse=True, scope="module")
def engines_freed():
    """A module's engines that nothing holds any more are freed before the next module builds
    its own (an engine's parts refer to each other, so only the cycle collector frees them)."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The tiny random Llama of fixtures.py (GQA) with Llama-3 RoPE scaling."""
    torch.manual_seed(0)
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    return build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="session")
def smollm2_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    return build_llm(str(smollm2_path), dtype="float32", device="cpu", max_model_len=1024)


def _served(model: str, name: str, **args):
    """Serves `model` (an AsyncLLM on CPU) with ServerArgs `args`; yields the base URL."""
    from liteinfer.engine.async_llm import AsyncLLM
    from liteinfer.entrypoints.openai.cli_args import ServerArgs
    from test_server import assert_engine_idle

    engine = AsyncLLM.from_args(model, dtype="float32", device="cpu", max_model_len=2048)
    try:
        with serve(engine, name, ServerArgs(api_key=API_KEY, **args)) as url:
            yield url
            assert_engine_idle(url)
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def qwen3_url(tmp_path_factory):
    """A served tiny Qwen3 with the real Qwen3 tokenizer and chat template, scripted (see
    make_scripted_qwen3_dir) to think QWEN3_REASONING and answer QWEN3_ANSWER, or with
    thinking off (its chat template's enable_thinking) to answer QWEN3_PLAIN; greedy, it
    writes them whatever the prompt. Reasoning parser qwen3, tool-call parser hermes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    # The generation prompt ends with "\n"; with thinking off, with "</think>\n\n".
    thinking = ids("\n") + ids("<think>") + ids(QWEN3_REASONING) + ids("</think>") + ids(
        QWEN3_ANSWER)
    directory = make_scripted_qwen3_dir(tmp_path_factory.mktemp("qwen3"),
                                        [thinking, ids("\n\n") + ids(QWEN3_PLAIN)])
    yield from _served(str(directory), "qwen3", reasoning_parser="qwen3",
                       tool_call_parser="hermes")


@pytest.fixture(scope="session")
def smollm2_url(smollm2_path):
    """The served SmolLM2 (tool-call parser hermes)."""
    yield from _served(str(smollm2_path), "smollm2", tool_call_parser="hermes")
