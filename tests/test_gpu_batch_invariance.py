"""batch_invariant=True on CUDA (run with `pytest -m gpu`): 128 concurrent requests on the 1B
config (bf16 and fp32) and on a random model of the 8B's shapes with two layers give every
request the bits it gets alone, captured or eager, chunked, cached or preempted; the HTTP
server gives the offline engine's answers."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fixtures import build_llm, make_tiny_llama_dir, serve
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.loader.source import load_model_source
from reference import random_prompts
from test_batch_invariance import answer, request_params, run_arriving

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_NEW = 24
NUM_REQUESTS = 128
# What else changes between the runs: captured or eager steps, prompt chunks beside decodes,
# a pool too small for every sequence (preemption: requests arrive a few at a time, so a few
# hundred blocks would hold them all).
RUNS = {
    "graphs": {},
    "eager": {"enforce_eager": True},
    "chunked": {"max_num_batched_tokens": 256},
    "preempted": {"num_kv_blocks": 96, "max_model_len": 1024},  # the pool holds 1,536 tokens
}


@pytest.fixture(scope="module")
def eight_b_dir(tmp_path_factory):
    """The 8B config with two layers (dummy weights): its projections' and LM head's shapes."""
    from liteinfer.loader.source import _packaged_configs

    cfg = json.loads((_packaged_configs() / "llama-3.1-8b-instruct.json").read_text())
    directory = tmp_path_factory.mktemp("llama-8b-2-layers")
    (directory / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    return directory


def _close(llm) -> None:
    """Frees an engine's model and pool for the next one, once every block is back."""
    bm = llm.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def _prompts(model: str) -> list[list[int]]:
    """Prompts of 1 to 700 tokens, a quarter of them behind one shared 300-token prefix."""
    vocab = load_model_source(model, "dummy").model_config.vocab_size
    own = random_prompts(NUM_REQUESTS * 3 // 4, vocab, 1, 700, seed=21)
    prefix = random_prompts(1, vocab, 300, 300, seed=22)[0]
    tails = random_prompts(NUM_REQUESTS // 4, vocab, 1, 100, seed=23)
    return own + [prefix + t for t in tails]


# Five engines, each loading a model and capturing its graphs: 212 s for the 1B in fp32 beside
# five other pytest-xdist workers (journal item 126), past half of gpu-tests' 300 s a test.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("model, dtype", [
    ("llama-3.2-1b-instruct", "bfloat16"),
    ("llama-3.2-1b-instruct", "float32"),
    ("8b-shapes", "bfloat16"),
])
def test_concurrent_requests_match_alone(model, dtype, eight_b_dir):
    path = str(eight_b_dir) if model == "8b-shapes" else model
    prompts = _prompts(path)
    common = dict(load_format="dummy", dtype=dtype, max_model_len=2048, batch_invariant=True,
                  max_num_seqs=NUM_REQUESTS)
    llm = build_llm(path, enable_prefix_caching=False, num_kv_blocks=256, **common)
    alone = [answer(llm.generate([p], request_params(i, MAX_NEW), use_tqdm=False)[0])
             for i, p in enumerate(prompts)]
    _close(llm)
    for name, args in RUNS.items():
        llm = build_llm(path, **{"num_kv_blocks": 8192, **common, **args})
        # Prompt and mixed steps are captured too, unless eager.
        assert (llm.engine.core.runner.prompt_buckets is None) == (name == "eager"), name
        done = run_arriving(llm, prompts, seed=len(name), max_tokens=MAX_NEW)
        preempted = llm.engine.core.scheduler.num_preemptions > 0
        _close(llm)
        assert [done[i] for i in range(len(prompts))] == alone, name
        assert preempted == (name == "preempted"), name


def test_server_gives_the_offline_answers(tmp_path):
    """64 concurrent HTTP completions (OpenAI's client) of a 1B-wide model with a tokenizer:
    the offline engine's tokens (as text) and logprobs, bit for bit."""
    from openai import OpenAI

    model_dir = make_tiny_llama_dir(tmp_path, hidden_size=2048, intermediate_size=8192,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    num_hidden_layers=2, max_position_embeddings=2048)
    vocab = load_model_source(str(model_dir)).model_config.vocab_size
    prompts = random_prompts(64, vocab, 1, 500, seed=24)
    args = dict(dtype="bfloat16", max_model_len=1024, batch_invariant=True, max_num_seqs=64)
    offline = build_llm(str(model_dir), **args)
    expected = offline.generate(
        prompts, [request_params(i, MAX_NEW) for i in range(len(prompts))], use_tqdm=False)
    _close(offline)
    engine = AsyncLLM.from_args(str(model_dir), **args)

    def ask(client: OpenAI, i: int) -> tuple[str, list[float]]:
        p = request_params(i, MAX_NEW)
        extra = {"ignore_eos": True} if p.seed is None else {"ignore_eos": True, "top_p": 0.9}
        r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=MAX_NEW,
                                      temperature=p.temperature, seed=p.seed, logprobs=3,
                                      extra_body=extra)
        choice = r.choices[0]
        return choice.text, choice.logprobs.token_logprobs

    try:
        with serve(engine, "tiny") as url, ThreadPoolExecutor(len(prompts)) as pool:
            client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=300)
            served = list(pool.map(lambda i: ask(client, i), range(len(prompts))))
        want = [(o.outputs[0].text,
                 [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in expected]
        assert served == want
    finally:
        engine.shutdown()
