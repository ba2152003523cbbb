"""One-token linear layers (GEMV) with the elementwise work around them fused in.

A decode step of one sequence reads every weight once and does almost no math, so a projection
costs the time to stream its weight in; cuBLAS's kernels for this are latency-bound on the
small matrices (qkv and o at 2.2 and 1.45 TB/s on the H200), and each RMSNorm or SiLU kernel
between the projections costs a launch of its own. Here each program owns BLOCK_N output
features and loads their whole weight rows [BLOCK_N, K] at once, so every SM has many bytes in
flight, then reads the input row and reduces. Fused in:

- `norm`: the input is RMS-normalized first, after adding the pending `residual` (the
  residual stream as the previous layer leaves it); program 0 writes the sum, the new residual.
  Each program normalizes the row itself: K values, nothing next to its weight tile.
- `gated`: the weight is [gate; up] (2N rows); the program owning gate rows j.. also owns up
  rows N+j.. and writes silu(gate) * up.

Rounding follows the unfused layers (norm.py, activation.py): each intermediate that is a tensor
there is rounded to the activation dtype here.

On Hopper and later the kernel is a programmatic dependent launch: it is launched while the
previous kernel in the stream finishes, loads its weight tile (never written by a step), then
waits for that kernel before reading any activation, and lets the next kernel launch early in turn.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl

# Weight elements a program loads (16 KiB in bf16). The H200 sweep (scripts/bench_gemv.py)
# found 4k-32k within a few percent on every projection of the 1B model.
TILE_ELEMENTS = 8192
ELEMENTS_PER_THREAD = 64  # wider rows (K past 8k, e.g. an 8B model's down) get more warps


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, eps, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs < N
    k = tl.arange(0, BLOCK_K)
    k_mask = k < K
    w_mask = n_mask[:, None] & k_mask[None, :]
    w_rows = w_ptr + offs.to(tl.int64)[:, None] * stride_wn + k[None, :]
    w = tl.load(w_rows, mask=w_mask, other=0.0)
    if GATED:
        w_up = tl.load(w_rows + N * stride_wn, mask=w_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + k, mask=k_mask, other=0.0).to(tl.float32))
        x = x.to(dtype)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + k, x, mask=k_mask)
    xf = x.to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        norm_w = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xf = (norm_w * (xf * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * xf[None, :], 1)
    if GATED:
        g = y.to(dtype).to(tl.float32)
        up = tl.sum(w_up.to(tl.float32) * xf[None, :], 1).to(dtype).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up
    tl.store(out_ptr + offs, y.to(dtype), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, residual: torch.Tensor | None = None, gated: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [1, K]; weight: [N, K], or [2N, K] = [gate; up] when gated (rows contiguous).
    Returns out [1, N] = f(x) W^T, where f RMS-normalizes with norm_weight and eps when given.
    With norm_weight, returns (out, new_residual): new_residual = x + residual (a new tensor),
    or x itself when residual is None."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    in_features = x.shape[1]
    assert weight.shape[1] == in_features and x.dtype == weight.dtype
    assert residual is None or norm_weight is not None, "the residual is added before the norm"
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = x.new_empty(1, n) if out is None else out
    assert out.shape == (1, n) and out.stride(-1) == 1
    new_residual = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        new_residual = torch.empty_like(x)
    block_k = triton.next_power_of_2(in_features)
    block_n = max(1, TILE_ELEMENTS // ((1 + gated) * block_k))
    tile = (1 + gated) * block_n * block_k
    num_warps = min(16, max(4, tile // (32 * ELEMENTS_PER_THREAD)))
    pdl = supports_pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, residual if residual is not None else x, new_residual,
        norm_weight if norm_weight is not None else weight, eps, n, in_features,
        weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        ADD=residual is not None, GATED=gated, USE_PDL=pdl, num_warps=num_warps,
        launch_pdl=pdl)
    return out if norm_weight is None else (out, new_residual)
