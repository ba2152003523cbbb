"""One sparse layer of Qwen3-30B-A3B and of Mixtral-8x7B at their real shapes through the
Triton router and experts, eager and captured, against the torch path (run with
`pytest -m gpu`; the tiny MoE models run against transformers in test_gpu_families.py)."""
from __future__ import annotations

import pytest
import torch

from liteinfer.layers.fused_moe import fused_moe_torch, route_torch
from liteinfer.loader import load_model_source

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ~27 GB a case: two at once beside the other workers' engines can run the GPU out of memory.
@pytest.mark.xdist_group("full-size-moe")
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b-instruct"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_sparse_layer_at_full_size(model: str, quantization: str | None) -> None:
    """One sparse layer of the real model (bf16, random weights) through the Triton router
    and experts, eager and replayed from a CUDA graph, against the torch path in float32 on the
    same (for fp8: e4m3-rounded) weights, at 1, 8, 64 and 1,024 tokens; and the whole block
    (norm in the router, sum into the residual stream) against the norm and experts apart."""
    from liteinfer.kernels.norm import rms_norm
    from liteinfer.layers.norm_act import RMSNorm
    from liteinfer.layers.ops import LayerOps
    from liteinfer.layers.quantization import process_weights_after_loading
    from liteinfer.layers.quantization.fp8 import Fp8Config
    from liteinfer.models.moe import SparseMoeBlock

    cfg = load_model_source(model).model_config
    torch.manual_seed(0)
    quant = Fp8Config() if quantization else None
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = SparseMoeBlock(cfg.hidden_size, cfg.moe, LayerOps(triton=True, quant=quant))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.02)
        block.experts.w13_weight.normal_(0, 0.02)
        block.experts.w2_weight.normal_(0, 0.02)
    process_weights_after_loading(block)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, LayerOps(triton=True)).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
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
        # The whole block as the model runs it: the norm inside the router kernel (its output
        # that of the norm kernel), the sum added to the residual stream by the experts' last
        # kernel, rounded as adding their output; replayed, the same.
        x = torch.randn(tokens, cfg.hidden_size, device="cuda").bfloat16()
        w_, ids_, h_ = block.gate.forward_normed(x, norm)
        assert _relative_error(h_, rms_norm(x, norm.weight, norm.eps)) < 1e-3
        stream = x.clone()
        block(stream, norm)
        assert torch.equal(stream, x + experts(h_, w_, ids_))
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block(static_x, norm)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_x, stream)
