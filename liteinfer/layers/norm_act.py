"""RMSNorm and the SwiGLU activation, with Triton kernels on CUDA and plain torch elsewhere."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """Hugging Face LlamaRMSNorm, with the residual add fused in front (same rounding order)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_triton:
            from liteinfer.kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    def __init__(self, use_triton: bool = False):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from liteinfer.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        return silu_and_mul_torch(x)
