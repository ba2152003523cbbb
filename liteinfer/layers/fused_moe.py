"""A mixture-of-experts MLP's layers: the router (`MoeRouter`) and the stacked experts
(`FusedMoE`), with the Triton kernels of kernels/fused_moe.py on the Triton path and plain torch
elsewhere.

Tensor parallelism splits each expert's channels as the dense MLP splits its own: every rank
holds all experts, each with I / tp_size of its gate, up (rows) and down (columns) channels, so
a rank's output is a partial sum that the caller all-reduces; the router is replicated. The
torch path runs the experts that received a token one after another, in ascending order as
transformers does, each over its tokens gathered by index.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from liteinfer.layers.norm_act import RMSNorm, silu_and_mul_torch
from liteinfer.layers.ops import LayerOps
from liteinfer.layers.quantization.base import MoEMethod

# A checkpoint tensor's place among the experts: (expert, "gate" | "up" | "down").
ExpertShard = tuple[int, str]


def route_torch(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fused_moe.moe_router in torch: fp32 weights and expert ids [T, top_k]."""
    probs = nn.functional.linear(x, gate_weight).softmax(-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/fused_moe.fused_moe in torch, expert by expert; `quantize` rounds each GEMM's
    input (FP8 experts: per token, through e4m3 and back). Given the residual stream, the sum
    is added to it in place and it is returned."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    flat_weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    for expert in flat_ids.unique().tolist():  # ascending
        rows = (flat_ids == expert).nonzero().squeeze(1)
        tokens = rows // top_k
        h = x[tokens]
        h = silu_and_mul_torch(nn.functional.linear(h if quantize is None else quantize(h),
                                                    w13[expert]))
        y = nn.functional.linear(h if quantize is None else quantize(h), w2[expert])
        # index_add_ takes ~0.1 s a call on the CPU builds of torch 2.13; a token is one of an
        # expert's rows at most once, so an accumulating put adds the same.
        out.index_put_((tokens,), (y * flat_weights[rows, None]).to(x.dtype), accumulate=True)
    return out if residual is None else residual.add_(out)


class UnquantizedMoEMethod(MoEMethod):
    """Experts in the model dtype."""

    def __init__(self, use_triton: bool):
        self.use_triton = use_triton

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: the experts are used as loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_triton:
            from liteinfer.kernels.fused_moe import fused_moe
            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             residual=residual)
        return fused_moe_torch(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                               residual=residual)


class MoeRouter(nn.Module):
    """The router: logits x W^T over the experts, each token's top_k of them and their weights.
    Replicated on every rank, in the model dtype whatever the experts' quantization."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                 ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.top_k, self.renormalize, self.use_triton = top_k, renormalize, ops.triton

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[None, tuple[int, ...]]]:
        return [(None, tuple(param.shape))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: None = None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"router checkpoint shape {tuple(loaded.shape)} != (experts, "
                             f"hidden) {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 routing weights and expert ids, [T, top_k] each."""
        if self.use_triton:
            from liteinfer.kernels.fused_moe import moe_router
            return moe_router(x, self.weight, self.top_k, self.renormalize)[:2]
        return route_torch(x, self.weight, self.top_k, self.renormalize)

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing of norm(x), and norm(x) itself for the experts: with the Triton norm
        the router kernel normalizes (no launch of the norm's own)."""
        if self.use_triton and norm.use_triton:
            from liteinfer.kernels.fused_moe import moe_router
            return moe_router(x, self.weight, self.top_k, self.renormalize,
                              norm_weight=norm.weight, eps=norm.eps)
        h = norm(x)
        return (*self(h), h)


class FusedMoE(nn.Module):
    """Every expert of one layer, stacked: this rank's intermediate / tp_size channels of each
    (see MoEMethod for the layout). forward gives this rank's partial sum."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 ops: LayerOps):
        super().__init__()
        tp_size = ops.tp_size
        if intermediate % tp_size:
            raise ValueError(f"experts of {intermediate} channels do not split over {tp_size} "
                             "ranks")
        self.num_experts, self.hidden = num_experts, hidden
        self.intermediate = intermediate // tp_size
        self.tp_rank, self.tp_size = ops.tp_rank, tp_size
        self.quant_method: MoEMethod = (UnquantizedMoEMethod(ops.triton) if ops.quant is None
                                        else ops.quant.moe_method(ops.triton))
        self.quant_method.create_weights(self, num_experts, hidden, self.intermediate)

    def checkpoint_shapes(self, param: nn.Parameter
                          ) -> list[tuple[ExpertShard, tuple[int, ...]]]:
        """Each expert's checkpoint projections that fill param, whole (all ranks together)."""
        full = self.intermediate * self.tp_size
        if param is self.w2_weight:
            return [((e, "down"), (self.hidden, full)) for e in range(self.num_experts)]
        return [((e, kind), (full, self.hidden)) for e in range(self.num_experts)
                for kind in ("gate", "up")]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: ExpertShard) -> None:
        """Copies this rank's channels of one expert's gate, up or down projection."""
        expert, kind = shard
        n = self.intermediate
        if kind == "down":
            param.data[expert].copy_(loaded.narrow(1, self.tp_rank * n, n))
        else:
            start = 0 if kind == "gate" else n
            param.data[expert, start:start + n].copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial sum [T, H], or, given the residual stream, that sum added to it
        in place (one rank only: the sum must be whole)."""
        return self.quant_method.apply(self, x, topk_weights, topk_ids, residual)
