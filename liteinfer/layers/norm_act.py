"""RMSNorm and the SwiGLU activation, with Triton kernels on CUDA and plain torch elsewhere."""
from __future__ import annotations

import torch
from torch import nn

from liteinfer.layers.ops import LayerOps


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm (same rounding order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class RMSNorm(nn.Module):
    """`invariant`: the torch path's batch-invariant form (layers/batch_invariant.py); the
    Triton kernel, one program a row, is batch-invariant as it is."""

    def __init__(self, hidden_size: int, eps: float, ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = ops.triton
        self.invariant = ops.invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from liteinfer.kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        if self.invariant:
            from liteinfer.layers.batch_invariant import rms_norm_invariant
            return rms_norm_invariant(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)


class SiluAndMul(nn.Module):
    """`invariant` as for RMSNorm; the Triton kernel is elementwise, so invariant already."""

    def __init__(self, ops: LayerOps):
        super().__init__()
        self.use_triton = ops.triton
        self.invariant = ops.invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from liteinfer.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        if self.invariant:
            from liteinfer.layers.batch_invariant import silu_and_mul_invariant
            return silu_and_mul_invariant(x)
        return silu_and_mul_torch(x)
