"""Qwen3-MoE and Mixtral on CUDA through the Triton paths (router kernel, expert GEMVs and
grouped GEMMs, captured decode and prompt steps) against transformers on the same fp32 weights,
and one sparse layer at the real models' shapes against the torch path (run with
`pytest -m gpu`)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import TINY_LLAMA, build_llm, make_tiny_model_dir
from liteinfer import SamplingParams
from liteinfer.layers.fused_moe import fused_moe_torch, route_torch
from liteinfer.loader import load_model_source
from reference import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WIDTH = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=4096)
FAMILIES = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                      norm_topk_prob=True, head_dim=128, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=64),
}
CONFIGS = {"eager": {"enforce_eager": True}, "default": {},
           "chunked": {"max_num_batched_tokens": 64}}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, list[list[int]], list[list[int]]]:
    name = request.param
    directory = make_tiny_model_dir(tmp_path_factory.mktemp(f"gpu-{name}"), name,
                                    **WIDTH, **FAMILIES[name])
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
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
    outputs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    alone = llm.generate(prompts[:1], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == reference[0]


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b-instruct"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_sparse_layer_at_full_size(model: str, quantization: str | None) -> None:
    """One sparse layer of the real model (bf16, random weights) through the Triton router
    and experts, eager and replayed from a CUDA graph, against the torch path in float32 on the
    same (for fp8: e4m3-rounded) weights, at 1, 8, 64 and 1,024 tokens."""
    from liteinfer.layers.quantization import process_weights_after_loading
    from liteinfer.layers.quantization.fp8 import Fp8Config
    from liteinfer.models.llama import LayerOps
    from liteinfer.models.moe import SparseMoeBlock

    cfg = load_model_source(model).model_config
    torch.manual_seed(0)
    quant = Fp8Config() if quantization else None
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = SparseMoeBlock(cfg.hidden_size, cfg.moe, LayerOps(triton=True, quant=quant),
                                   0, 1)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.02)
        block.experts.w13_weight.normal_(0, 0.02)
        block.experts.w2_weight.normal_(0, 0.02)
    process_weights_after_loading(block)
    experts = block.experts
    w13, w2 = experts.w13_weight.float(), experts.w2_weight.float()
    if quantization:
        assert experts.w13_weight.dtype == torch.float8_e4m3fn
        w13 = w13 * experts.w13_scale[..., None]
        w2 = w2 * experts.w2_scale[..., None]
    for tokens in (1, 8, 64, 1024):
        h = torch.randn(tokens, cfg.hidden_size, device="cuda").bfloat16()
        weights, ids = block.gate(h)
        ref_weights, ref_ids = route_torch(h.float(), block.gate.weight.float(), cfg.moe.top_k,
                                           cfg.moe.renormalize)
        # Summed in another order, near-equal logits may swap experts; nearly all must agree.
        agree = (ids.long() == ref_ids).all(-1)
        assert agree.float().mean() > 0.95
        torch.testing.assert_close(weights[agree], ref_weights[agree], rtol=1e-3, atol=1e-4)
        out = experts(h, weights, ids)
        ref = fused_moe_torch(h.float(), w13, w2, weights, ids.long())
        assert _relative_error(out, ref) < 2e-2
        graph = torch.cuda.CUDAGraph()
        static_h = h.clone()
        with torch.cuda.graph(graph):
            w_, ids_ = block.gate(static_h)
            static_out = experts(static_h, w_, ids_)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out)
