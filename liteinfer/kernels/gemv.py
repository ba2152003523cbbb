"""One-token linear layers (GEMV) with the elementwise work around them fused in.

A decode step of one sequence reads every weight once and does almost no math, so a projection
costs the time to stream its weight in; cuBLAS's kernels for this are latency-bound on the
small matrices, well under the copy bandwidth (NOTES.md, "Measured choices in the code"), and
each RMSNorm or SiLU kernel between the projections costs a launch of its own. Here each
program owns BLOCK_N output features and loads their whole weight rows [BLOCK_N, K] at once, so
every SM has many bytes in flight, then reads the input row and reduces. Fused in:

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

Rows longer than CHUNKED_MIN_K (an 8B model's down: 14,336) go through a second kernel
instead: a whole row is then a program's tile on its own, and one e4m3 row a program streams
those weights well under the copy bandwidth (journal items 90 and 91); CHUNKED_TILE's programs
own several rows and walk K in chunks that Triton's pipeline keeps in flight (a `tl.range` with
its stages: a plain loop without a dot is not pipelined), with the products
summed elementwise and reduced once. On the 8B's shorter rows (4,096) the whole-row kernel
stays faster.

On Hopper and later both kernels are programmatic dependent launches: launched while the
previous kernel in the stream finishes, they wait for it before reading any activation and let
the next kernel launch early in turn; the whole-row kernel loads its weight tile (never written
by a step) before it waits, and the chunked kernel puts the start of its rows in flight into L2
(prefetch.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl
from liteinfer.kernels.prefetch import prefetch_lines, prefetch_weight

# Weight bytes a program loads: 8k bf16 or 16k e4m3 elements; tiles of 8-32 KiB measured within
# a few percent of each other on nearly every projection (docs/notes/journal.md, items 16 and
# 64; scripts/bench_fp8.py --sweep).
TILE_BYTES = 16384
# Weight bytes each thread holds, which sets the warps; wider rows (K past 8k, e.g. an 8B
# model's down) get more. Per byte, not per element: e4m3 at bf16's elements per thread was
# slower than at bf16's bytes (item 64).
BYTES_PER_THREAD = 128
# Rows longer than this go through the chunked kernel, in tiles of (rows, chunk elements,
# warps, pipeline stages); shorter rows lose to the plain kernel when chunked (items 90, 91).
CHUNKED_MIN_K = 8192
CHUNKED_TILE = (8, 1024, 4, 3)


@triton.jit
def normalize(xf, norm_ptr, k, k_mask, inv_rms, dtype: tl.constexpr):
    """norm_w * (x * inv_rms), rounded to the activation dtype where Hugging Face's RMSNorm
    holds a tensor."""
    norm_w = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return (norm_w * (xf * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _row_inv_rms(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / RMS of the row x[:K], in a first pass over it (from L2) in BLOCK_K chunks, for
    kernels that then walk the row in chunks."""
    k = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xf = tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        squares += xf * xf
    return tl.rsqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def gemv_prologue(w_ptr, up_offset, offs, N, row_len, stride_row, x_ptr, K, eps,
                  USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, GATED: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """A chunked GEMV program's start: before the PDL wait (it reads nothing the step makes),
    the first lines of its weight rows (`offs`, of `row_len` elements) into L2, gate's and,
    `up_offset` elements on, up's; after it, the input row's 1 / RMS where the norm is fused
    (else 1)."""
    if USE_PDL:
        if PREFETCH_LINES > 0:
            prefetch_weight(w_ptr, offs, N, row_len, stride_row, PREFETCH_LINES)
            if GATED:
                prefetch_weight(w_ptr + up_offset, offs, N, row_len, stride_row,
                                PREFETCH_LINES)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv_rms = 1.0
    if NORM:
        inv_rms = _row_inv_rms(x_ptr, K, eps, BLOCK_K)
    return inv_rms


@triton.jit
def _program_rows(w_ptr, N, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's output features, their mask, the first BLOCK_K columns, and the pointers
    to those columns of the features' weight rows."""
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    return offs, offs < N, k, w_ptr + offs.to(tl.int64)[:, None] * stride_wn + k[None, :]


@triton.jit
def _row_scales(w_scale_ptr, offs, n_mask, N, GATED: tl.constexpr, W_SCALE: tl.constexpr):
    """The e4m3 rows' scales of the features at offs (and of their up rows when gated)."""
    scale = tl.zeros(offs.shape, dtype=tl.float32)
    scale_up = scale
    if W_SCALE:
        scale = tl.load(w_scale_ptr + offs, mask=n_mask, other=0.0)
        if GATED:
            scale_up = tl.load(w_scale_ptr + N + offs, mask=n_mask, other=0.0)
    return scale, scale_up


@triton.jit
def swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32, rounded to the activation dtype where Hugging Face's unfused
    layers hold a tensor (gate, up, silu(gate))."""
    g = gate.to(dtype).to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def store_outputs(y, up, scale, scale_up, res, out_ptr, offs, n_mask, GATED: tl.constexpr,
                   ADD: tl.constexpr, W_SCALE: tl.constexpr):
    """The epilogue of both kernels: row scales, SwiGLU of gate y and up, the residual add."""
    dtype = out_ptr.dtype.element_ty
    if W_SCALE:
        y = y * scale
    if GATED:
        if W_SCALE:
            up = up * scale_up
        y = swiglu(y, up, dtype)
    if ADD:  # residual + (x W^T rounded), as Hugging Face's separate add
        y = y.to(dtype).to(tl.float32) + res
    tl.store(out_ptr + offs, y.to(dtype), mask=n_mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, norm_ptr, eps, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 ADD: tl.constexpr, GATED: tl.constexpr, W_SCALE: tl.constexpr,
                 USE_PDL: tl.constexpr):
    offs, n_mask, k, w_rows = _program_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
    k_mask = k < K
    w_mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(w_rows, mask=w_mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(w_rows + N * stride_wn, mask=w_mask, other=0.0)
    scale, scale_up = _row_scales(w_scale_ptr, offs, n_mask, N, GATED, W_SCALE)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xf = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    res = scale
    if ADD:  # out is the residual stream; loaded with x, so its latency is not paid at the end
        res = tl.load(out_ptr + offs, mask=n_mask).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        xf = normalize(xf, norm_ptr, k, k_mask, inv_rms, out_ptr.dtype.element_ty)
    y = tl.sum(w.to(tl.float32) * xf[None, :], 1)
    up = y
    if GATED:
        up = tl.sum(w_up.to(tl.float32) * xf[None, :], 1)
    store_outputs(y, up, scale, scale_up, res, out_ptr, offs, n_mask, GATED, ADD, W_SCALE)


@triton.jit
def _gemv_chunked_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, norm_ptr, eps, N, K, stride_wn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                         ADD: tl.constexpr, GATED: tl.constexpr, W_SCALE: tl.constexpr,
                         USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    offs, n_mask, k, w_rows = _program_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
    inv_rms = gemv_prologue(w_ptr, N * stride_wn, offs, N, K, stride_wn, x_ptr, K, eps, USE_PDL,
                            PREFETCH_LINES, GATED, NORM, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = acc
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = k0 + k < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k0, mask=w_mask, other=0.0)
        if GATED:
            w_up = tl.load(w_rows + k0 + N * stride_wn, mask=w_mask, other=0.0)
        xf = tl.load(x_ptr + k0 + k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM:
            xf = normalize(xf, norm_ptr + k0, k, k_mask, inv_rms, out_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * xf[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * xf[None, :]
    scale, scale_up = _row_scales(w_scale_ptr, offs, n_mask, N, GATED, W_SCALE)
    res = scale
    if ADD:
        res = tl.load(out_ptr + offs, mask=n_mask).to(tl.float32)
    store_outputs(tl.sum(acc, 1), tl.sum(acc_up, 1), scale, scale_up, res, out_ptr, offs,
                   n_mask, GATED, ADD, W_SCALE)


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
    pdl = supports_pdl(x.device)
    args = (x, weight, weight_scale if weight_scale is not None else x, out,
            norm_weight if norm_weight is not None else weight, eps, n, in_features,
            weight.stride(0))
    flags = dict(NORM=norm_weight is not None, ADD=residual is not None, GATED=gated,
                 W_SCALE=weight_scale is not None, USE_PDL=pdl)
    itemsize = weight.element_size()
    if in_features > CHUNKED_MIN_K:
        block_n, block_k, num_warps, num_stages = CHUNKED_TILE
        lines = prefetch_lines(weight.shape[0], in_features * itemsize, x.device) if pdl else 0
        _gemv_chunked_kernel[(triton.cdiv(n, block_n),)](
            *args, BLOCK_N=block_n, BLOCK_K=block_k, **flags, PREFETCH_LINES=lines,
            NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
        return out
    block_k = triton.next_power_of_2(in_features)
    block_n = max(1, TILE_BYTES // (itemsize * (1 + gated) * block_k))
    tile_bytes = itemsize * (1 + gated) * block_n * block_k
    num_warps = min(16, max(4, tile_bytes // (32 * BYTES_PER_THREAD)))
    _gemv_kernel[(triton.cdiv(n, block_n),)](*args, BLOCK_N=block_n, BLOCK_K=block_k, **flags,
                                             num_warps=num_warps, launch_pdl=pdl)
    return out
