"""Linear layers of a few rows (decode steps of 2 to FEWROW_MAX_ROWS sequences) as one GEMM.

A decode step of a few sequences still reads every weight once and does little arithmetic, but
cuBLAS(Lt)'s kernels for such shapes stream the weight well below the copy bandwidth: on the
8B model's projections at 32 rows (H200), the e4m3 `torch._scaled_mm` reads 30-63% of the byte
floor's rate (down 37.5 us against 13.9) and bf16 cuBLAS 62-91%
(`benchmarks/experiments/fp8-kernels-8b-h200-2026-12-01-139f8e9.json`). Here each program owns
BLOCK_N output features and streams their weight rows through Triton's software pipeline in
BLOCK_K-wide tiles; the few input rows (padded to BLOCK_M >= 16 for tl.dot) come from L2 with
each tile. e4m3 operands (the weight and the activation quantized per token by the norm or
SwiGLU that produced it) multiply on the tensor cores with fp32 accumulation, so no thread
widens an e4m3 element; their per-token and per-channel scales multiply the fp32 tile. The
residual add of an output projection is the epilogue.

On Hopper and later the kernel is a programmatic dependent launch, as the GEMV kernel is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision, supports_pdl

# Rows the kernel takes: its input rows are one tile (BLOCK_M) held in registers.
FEWROW_MAX_ROWS = 128
# Programs (BLOCK_N features each) a projection is cut into at least, and the count past which a
# shallower pipeline pays (two programs an SM); past it, 65-128 rows go to cuBLAS. H200 sweeps
# of e4m3 tiles (row tiles of 16, 64 and 128, three widths, two depths, two K widths) at 4-128
# rows over the 1B and 8B projections (scripts/bench_fewrow_gemm.py,
# benchmarks/experiments/fewrow-gemm-h200-2026-12-02-*.json): the rule below picks the second
# sweep's best tile for every projection at every row count (a row tile of 64 on wgmma beats one
# of 16 on mma even at 4 rows: 8B, 16 rows, 66.6 us a layer against 73.3).
MIN_PROGRAMS = 96
MANY_PROGRAMS = 192


@dataclass(frozen=True)
class FewRowTiles:
    block_m: int  # input rows, padded (at least 16, tl.dot's minimum; 64 and up run on wgmma)
    block_n: int
    block_k_bytes: int  # per weight row and tile: 256 bytes = 256 e4m3 or 128 bf16 elements
    num_stages: int
    num_warps: int = 4


def fewrow_tiles(rows: int, n: int, itemsize: int) -> FewRowTiles | None:
    """The tile for `rows` rows of a projection with n output features and weights of
    `itemsize` bytes, or None where cuBLAS is as fast: in bf16 (within a few percent either
    way at 4-64 rows, in the same sweep), and for a wide projection (gate/up) at over 64 rows."""
    if itemsize != 1 or rows > FEWROW_MAX_ROWS:
        return None
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= MIN_PROGRAMS), 16)
    many = triton.cdiv(n, block_n) >= MANY_PROGRAMS
    if rows > 64 and many:
        return None
    return FewRowTiles(block_m=64 if rows <= 64 else 128, block_n=block_n, block_k_bytes=256,
                       num_stages=3 if many or (rows > 64 and block_n == 64) else 5)


@triton.jit
def _fewrow_gemm_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, SCALED: tl.constexpr, ADD: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if USE_PDL:  # every operand may be the previous kernel's output or still read by it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            k_mask = (k0 + offs_k) < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SCALED:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD:  # residual + (x W^T rounded), as a separate add sees it
        acc = acc.to(dtype).to(tl.float32) + tl.load(out_ptrs, mask=mask).to(tl.float32)
    tl.store(out_ptrs, acc.to(dtype), mask=mask)


def fewrow_gemm(x: torch.Tensor, weight: torch.Tensor, *, x_scale: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None,
                tiles: FewRowTiles | None = None) -> torch.Tensor:
    """x: [M, K] with M <= FEWROW_MAX_ROWS; weight: [N, K], both with contiguous rows. Either
    both in the model dtype, or both e4m3 with x_scale (fp32 [M, 1] or [M], one per row) and
    weight_scale (fp32 [N]). Returns x W^T (times the scales) in out_dtype (x's dtype unless
    e4m3: then given), or with residual ([M, N]) adds it to residual in place and returns it.
    `tiles`: the tile, by default `fewrow_tiles`'s (which must not be None for the shape)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert 1 <= rows <= FEWROW_MAX_ROWS and weight.shape[1] == k and x.dtype == weight.dtype
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    scaled = weight_scale is not None
    assert scaled == (x_scale is not None)
    if scaled:
        assert x_scale.numel() == rows and weight_scale.shape == (n,)
        assert x_scale.dtype == weight_scale.dtype == torch.float32
        x_scale = x_scale.reshape(rows)
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(-1) == 1
        out = residual
    else:
        out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    tiles = tiles or fewrow_tiles(rows, n, weight.element_size())
    assert tiles is not None and rows <= tiles.block_m
    block_k = tiles.block_k_bytes // weight.element_size()
    pdl = supports_pdl(x.device)
    _fewrow_gemm_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, x_scale if scaled else x, weight_scale if scaled else x, out, rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, SCALED=scaled, ADD=residual is not None,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
    return out
