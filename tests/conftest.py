"""Shared fixtures: tiny random Llama models, the real SmolLM2, and engines reused across tests.

Every engine a test touches must have all of its KV blocks back in the pool when the test ends.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from fixtures import ENGINES, build_llm, make_tiny_llama_dir, smollm2_gguf_path


@pytest.fixture(autouse=True)
def all_blocks_returned():
    yield
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
