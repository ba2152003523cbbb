"""One-token linear layers (GEMV) with the elementwise work around them fused in.

A decode step of one sequence reads every weight once and does almost no math, so a projection
costs the time to stream its weight in; cuBLAS's kernels for this are latency-bound on the
small matrices (qkv and o at 2.2 and 1.45 TB/s on the H200), and each RMSNorm or SiLU kernel
between the projections costs a launch of its own. Here each program owns BLOCK_N output
features and loads their whole weight rows [BLOCK_N, K] at once, so every SM has many bytes in
flight, then reads the input row and reduces. Fused in:

- `norm`: the input (the residual stream) is RMS-normalized first. Each program normalizes the
  row itself: K values, nothing next to its weight tile.
- `gated`: the weight is [gate; up] (2N rows); the program owning gate rows j.. also owns up
  rows N+j.. and writes silu(gate) * up.
- `residual`: the output is added to the residual stream in place (an output projection); each
  program reads and writes only its own features.

FP8 weights (e4m3, one scale per output row, `weight_scale`) are read as they are stored, so a
step streams half the bytes; the input row stays in the activation dtype (weight-only
dequantization: with one row the activation's bytes are nothing next to the weight's) and each
output is multiplied by its row's scale after the reduction.

Rounding follows the unfused layers of Hugging Face's Llama (norm.py, activation.py): each
intermediate that is a tensor there is rounded to the activation dtype here.

The grid is persistent: a few programs an SM (PROGRAMS_PER_SM), each walking the tiles
p, p + grid, ... so that it reads and normalizes the input row once, not once a tile, and loads
its next tile's weights before it reduces the current one, so that its bytes stay in flight
while it adds. One program a tile reloads the row from L2 with every tile: on the 8B model's
down (K 14,336, one weight row a tile in bf16) that is as many bytes as the weight.

On Hopper and later the kernel is a programmatic dependent launch: it is launched while the
previous kernel in the stream finishes, loads its first weight tile (never written by a step),
then waits for that kernel before reading any activation, and lets the next kernel launch early
in turn.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import num_sms, supports_pdl

# Weight bytes a program loads: 8k bf16 or 16k e4m3 elements. The H200 sweeps (bench_gemv.py,
# the 1B model in bf16; bench_fp8.py --sweep, the 8B in both) found 8-32 KiB within a few
# percent on nearly every projection.
TILE_BYTES = 16384
# Weight bytes each thread holds, which sets the warps; wider rows (K past 8k, e.g. an 8B
# model's down) get more. Per byte, not per element: e4m3 at the 64 elements per thread that
# suit bf16 took 39.5 us on the 8B's gate/up against 33.2 at 128 (the same bytes as bf16's).
BYTES_PER_THREAD = 128
PROGRAMS_PER_SM = 4
PREFETCH = True


@triton.jit
def _load_tile(w_ptr, w_scale_ptr, tile, N, stride_wn, k, k_mask, BLOCK_N: tl.constexpr,
               GATED: tl.constexpr, W_SCALE: tl.constexpr):
    """The weight rows of one tile ([gate; up] rows when gated) and their scales; nothing is
    read for a tile past the end."""
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs < N
    rows = w_ptr + offs.to(tl.int64)[:, None] * stride_wn + k[None, :]
    mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(rows, mask=mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(rows + N * stride_wn, mask=mask, other=0.0)
    scale = tl.zeros([BLOCK_N], dtype=tl.float32)
    scale_up = scale
    if W_SCALE:
        scale = tl.load(w_scale_ptr + offs, mask=n_mask, other=0.0)
        if GATED:
            scale_up = tl.load(w_scale_ptr + N + offs, mask=n_mask, other=0.0)
    return w, w_up, scale, scale_up


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, norm_ptr, eps, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, GATED: tl.constexpr, W_SCALE: tl.constexpr,
                 PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    num_tiles = tl.cdiv(N, BLOCK_N)
    grid = tl.num_programs(0)
    k = tl.arange(0, BLOCK_K)
    k_mask = k < K
    w, w_up, scale, scale_up = _load_tile(w_ptr, w_scale_ptr, tl.program_id(0), N, stride_wn,
                                          k, k_mask, BLOCK_N, GATED, W_SCALE)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    xf = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        norm_w = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xf = (norm_w * (xf * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    for tile in range(tl.program_id(0), num_tiles, grid):
        if PREFETCH:
            next_w, next_w_up, next_scale, next_scale_up = _load_tile(
                w_ptr, w_scale_ptr, tile + grid, N, stride_wn, k, k_mask, BLOCK_N, GATED,
                W_SCALE)
        offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs < N
        if ADD:  # out is the residual stream; loaded before the sums so its latency hides
            res = tl.load(out_ptr + offs, mask=n_mask).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * xf[None, :], 1)
        if W_SCALE:
            y = y * scale
        if GATED:
            g = y.to(dtype).to(tl.float32)
            up = tl.sum(w_up.to(tl.float32) * xf[None, :], 1)
            if W_SCALE:
                up = up * scale_up
            up = up.to(dtype).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up
        if ADD:  # residual + (x W^T rounded), as Hugging Face's separate add
            y = y.to(dtype).to(tl.float32) + res
        tl.store(out_ptr + offs, y.to(dtype), mask=n_mask)
        if PREFETCH:
            w, w_up, scale, scale_up = next_w, next_w_up, next_scale, next_scale_up
        else:
            w, w_up, scale, scale_up = _load_tile(w_ptr, w_scale_ptr, tile + grid, N,
                                                  stride_wn, k, k_mask, BLOCK_N, GATED, W_SCALE)


def gemv_programs(num_tiles: int, device: torch.device) -> int:
    """The persistent grid: at most PROGRAMS_PER_SM an SM, as few as give every program the
    same number of tiles (give or take the last)."""
    tiles_each = triton.cdiv(num_tiles, min(num_tiles, num_sms(device) * PROGRAMS_PER_SM))
    return triton.cdiv(num_tiles, tiles_each)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, gated: bool = False, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None
         ) -> torch.Tensor:
    """x: [1, K]; weight: [N, K], or [2N, K] = [gate; up] when gated (rows contiguous), in x's
    dtype, or e4m3 with weight_scale (fp32, one per weight row).
    Returns out [1, N] = f(x) W^T, where f RMS-normalizes with norm_weight and eps when given.
    With residual ([1, N]), adds f(x) W^T to it in place instead and returns it."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    in_features = x.shape[1]
    assert weight.shape[1] == in_features
    if weight_scale is not None:
        assert weight_scale.shape == weight.shape[:1] and weight_scale.dtype == torch.float32
    else:
        assert x.dtype == weight.dtype
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if residual is not None:
        assert out is None and residual.dtype == x.dtype
        out = residual
    out = x.new_empty(1, n) if out is None else out
    assert out.shape == (1, n) and out.stride(-1) == 1
    block_k = triton.next_power_of_2(in_features)
    itemsize = weight.element_size()
    block_n = max(1, TILE_BYTES // (itemsize * (1 + gated) * block_k))
    tile_bytes = itemsize * (1 + gated) * block_n * block_k
    num_warps = min(16, max(4, tile_bytes // (32 * BYTES_PER_THREAD)))
    pdl = supports_pdl(x.device)
    _gemv_kernel[(gemv_programs(triton.cdiv(n, block_n), x.device),)](
        x, weight, weight_scale if weight_scale is not None else x, out,
        norm_weight if norm_weight is not None else weight, eps, n, in_features,
        weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
        ADD=residual is not None, GATED=gated, W_SCALE=weight_scale is not None,
        PREFETCH=PREFETCH, USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl)
    return out
