"""Batch-invariant linear layers, RMSNorm and SwiGLU (`EngineConfig.batch_invariant`): a row's
result never depends on how many other rows are in the step, or on where the row sits.

On the CPU, MKL/oneDNN choose a GEMM kernel by shape (fp32: a GEMV for one row, another kernel
from two; bf16: another from 64 rows), so one row multiplied alone and among others differs in
its last bits. A matmul at one fixed shape is the same for every row of it, wherever the row
sits (docs/notes/batch_invariance.md): `invariant_mm` therefore multiplies ROW_BLOCK rows at a
time, the last block padded with zeros. On CUDA a Triton GEMM with one tile configuration and
one K order for every row count does the same in one launch (kernels/invariant_gemm.py).

torch's CPU elementwise kernels compute the tail of a contiguous run (and a thread's share of it)
with scalar code and the rest with SIMD code; for silu, sigmoid and bf16 rsqrt the two differ in
the last bit, so a row's result would depend on its offset in the batch. The norm and activation
here use only operations whose vector and scalar forms agree: + - * / and sqrt are correctly
rounded, and exp goes through the same vectorized routine for tails; sums are `fold_sum`'s
fixed tree of elementwise adds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from liteinfer.layers.quantization.base import LinearMethod
from liteinfer.utils import cdiv

if TYPE_CHECKING:
    from liteinfer.kernels.gemm_splits import SplitKWorkspace
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul

# Rows one CPU matmul takes: small, since a decode step of one sequence pads up to it.
ROW_BLOCK = 16


def invariant_mm(x: torch.Tensor, weight: torch.Tensor,
                 residual: torch.Tensor | None = None,
                 workspace: SplitKWorkspace | None = None, triton: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with the same reduction order for every row at every M; with
    residual, added to it in place (and residual returned). `workspace`: where the Triton
    kernel's K splits sum (the runner's, LayerOps.scratch); `triton`: that kernel off CUDA too
    (its interpreter)."""
    if x.is_cuda or triton:
        from liteinfer.kernels.invariant_gemm import invariant_gemm
        return invariant_gemm(x, weight, residual, workspace=workspace)
    y = _blocked_mm(x, weight)
    return y if residual is None else residual.add_(y)


def _blocked_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """invariant_mm on the CPU: ROW_BLOCK rows a matmul."""
    rows = x.shape[0]
    padded = cdiv(rows, ROW_BLOCK) * ROW_BLOCK
    x = x.contiguous()
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = x.new_empty(padded, weight.shape[0])
    w_t = weight.t()
    for start in range(0, padded, ROW_BLOCK):
        torch.mm(x[start:start + ROW_BLOCK], w_t, out=out[start:start + ROW_BLOCK])
    return out[:rows]


def fold_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over x's last dimension as a fixed tree of halves (zero-padded to a power of
    two: adding zeros changes nothing)."""
    n = x.shape[-1]
    if n & (n - 1):
        x = torch.nn.functional.pad(x, (0, (1 << n.bit_length()) - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rms_norm_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm rounding, with the mean of squares folded (torch's row
    reduction splits a row of 32k+ elements among threads when it is alone) and 1 / sqrt for
    rsqrt."""
    h = x.float()
    mean_square = fold_sum(h * h)[..., None] / h.shape[-1]
    h = h / torch.sqrt(mean_square + eps)
    return weight * h.to(x.dtype)


def silu_and_mul_invariant(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with silu in fp32 as gate / (1 + exp(-gate)), rounded to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(x.dtype) * up


class BatchInvariantLinearMethod(LinearMethod):
    """The weight in the model dtype, multiplied by `invariant_mm` for every row count (the
    runner leaves LayerOps.gemv off in this mode: the one-row GEMV kernel's reduction order
    differs from the GEMM's). `use_triton`: the Triton GEMM, with SwiGLU inside it, on the CPU
    too (interpreted; on CUDA always)."""

    def __init__(self, use_triton: bool):
        self.use_triton = use_triton

    def _triton(self, t: torch.Tensor) -> bool:
        return t.is_cuda or self.use_triton

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        layer.weight.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: the weight is used as loaded."""

    def split_k_launch(self, layer: nn.Module, sms: int) -> tuple[int, int] | None:
        if not self._triton(layer.weight):  # the torch form multiplies whole rows
            return None
        from liteinfer.kernels.invariant_gemm import split_launch
        n, k = layer.weight.shape
        return split_launch(n, k, sms)

    def gemm(self, layer: nn.Module, x: torch.Tensor,
             residual: torch.Tensor | None) -> torch.Tensor:
        return invariant_mm(x, layer.weight, residual, layer.scratch.split_k,
                            self._triton(x))

    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> torch.Tensor:
        if self._triton(x):  # the norm's kernel, then the GEMM with SwiGLU in its epilogue
            from liteinfer.kernels.invariant_gemm import invariant_gemm
            return invariant_gemm(norm(x), layer.weight, workspace=layer.scratch.split_k,
                                  gated=act is not None)
        y = _blocked_mm(norm(x), layer.weight)
        return y if act is None else act(y)


class BatchInvariantConfig:
    """The linear method of a batch-invariant model: its decoder linears and its LM head
    (LayerOps.quant's place; quantized weights are refused in this mode)."""

    def linear_method(self, use_triton: bool) -> LinearMethod:
        return BatchInvariantLinearMethod(use_triton)

    def lm_head_method(self, use_triton: bool) -> LinearMethod:
        return BatchInvariantLinearMethod(use_triton)
