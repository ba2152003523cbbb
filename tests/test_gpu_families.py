"""Qwen2, Qwen3, Mistral, Qwen3-MoE and Mixtral on CUDA through the Triton paths (captured
decode, split-K, GEMV, prompt graphs; the MoE router and expert kernels) against transformers on
the same fp32 weights (run with `pytest -m gpu`)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import TINY_LLAMA, build_llm, make_tiny_model_dir
from liteinfer import SamplingParams
from reference import hf_greedy, random_prompts
from test_model_families import make_tiny_family_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Tiny in depth, 1B-like in width; Qwen3 with head_dim 128 (its real one), so its 8 query heads
# are wider than the hidden size.
WIDTH = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=4096)
HEAD_DIMS = {"qwen2": 64, "qwen3": 128, "mistral": 64, "qwen3_moe": 128, "mixtral": 64}
# The MoE families' experts: a dense layer among Qwen3-MoE's, top-4 of 16; Mixtral's top-2 of 8.
EXPERTS = {"qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                             norm_topk_prob=True, mlp_only_layers=[1]),
           "mixtral": dict(num_local_experts=8, num_experts_per_tok=2)}
CONFIGS = {
    # The Triton kernels eagerly: paged and split-K decode attention, packed and mixed prefill,
    # the one-sequence GEMV steps (the q/k/v bias added after the kernel).
    "eager": {"enforce_eager": True},
    "default": {},  # decode steps and prompt steps of up to 2,048 tokens replay graphs
    # Graphs for every step: prompt pieces of captured sizes beside decodes, and a decode
    # bucket that is not a power of two (12).
    "prompt-graphs-narrow": {"max_num_seqs": 12, "max_num_batched_tokens": 100,
                             "mixed_prompt_tokens": 64},
    "chunked": {"max_num_batched_tokens": 64},  # prompt chunks over cached prefixes, captured
    "no-prefix-cache": {"enable_prefix_caching": False},
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=list(HEAD_DIMS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model directory, prompts, transformers' fp32 greedy continuations on CUDA)."""
    name = request.param
    base = tmp_path_factory.mktemp(f"gpu-{name}")
    if name in EXPERTS:
        directory = make_tiny_model_dir(base, name, head_dim=HEAD_DIMS[name], **WIDTH,
                                        **EXPERTS[name])
    else:
        directory = make_tiny_family_dir(base, name, head_dim=HEAD_DIMS[name], **WIDTH)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    # Batch sizes 1..32 cross CUDA-graph sizes; lengths cross many KV blocks and split counts.
    prompts = random_prompts(32, TINY_LLAMA["vocab_size"], 1, 700, seed=3)
    reference = hf_greedy(hf, prompts, 16)
    del hf
    torch.cuda.empty_cache()
    return directory, prompts, reference


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_token_for_token(family, name: str) -> None:
    directory, prompts, reference = family
    llm = build_llm(str(directory), dtype="float32", max_model_len=1024,
                    **{"max_num_seqs": 48, **CONFIGS[name]})
    assert llm.engine.core.config.attention_backend == "triton"
    outputs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    alone = llm.generate(prompts[:1], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == reference[0]


def test_fp32_prefix_caching_hits(family) -> None:
    """Prompts sharing a prefix reuse its cached KV (on by default) and still match."""
    directory, prompts, reference = family
    llm = build_llm(str(directory), dtype="float32", max_model_len=1024)
    first = llm.generate(prompts[:4], greedy(16), use_tqdm=False)
    again = llm.generate(prompts[:4], greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + again] == reference[:4] * 2
    assert sum(o.num_cached_tokens for o in again) > 0
