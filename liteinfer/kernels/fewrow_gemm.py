"""Linear layers of a few rows (decode steps of 2 to FEWROW_MAX_ROWS sequences) as one GEMM.

A decode step of a few sequences still reads every weight once and does little arithmetic, but
cuBLAS(Lt)'s kernels for such shapes stream the weight well below the copy bandwidth, its e4m3
ones (`torch._scaled_mm`) most of all (docs/notes/journal.md, item 81). e4m3 operands (the
weight and the activation quantized per token by the norm or SwiGLU that produced it) multiply
on the tensor cores with fp32 accumulation, so no thread widens an e4m3 element; their
per-token and per-channel scales multiply the fp32 tile. The residual add of an output
projection is the epilogue. Two kernels, by the number of rows:

- up to 64 rows, `_fewrow_gemm_kernel`: each program owns BLOCK_N output features and streams
  their weight rows through Triton's software pipeline in BLOCK_K-wide tiles; the few input rows
  (padded to BLOCK_M >= 16 for tl.dot) come from L2 with each tile and are the MMA's M side.
- 65-128 rows, `_fewrow_gemm_swapped_kernel`: y^T = W x^T, so 64 weight rows are wgmma's M side
  and the 128 input rows its N (m64n128 instead of m64n32-64), both operands by TMA. Where a
  projection has too few tiles to fill the GPU and long rows (a down projection), K is cut
  among 2-4 programs a tile whose fp32 partials the last to arrive sums in a fixed order
  (journal item 100). The batch-invariant GEMM (kernels/invariant_gemm.py) runs its decode
  steps, 1-128 rows, on this kernel too (`swapped_gemm`), gated (SwiGLU in the epilogue) or not.

On Hopper and later both are programmatic dependent launches, as the GEMV kernel is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from liteinfer.kernels import dot_precision, num_sms, supports_pdl
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace, split_buffers

# From this many rows the weight is the MMA's row operand (the swapped kernel below).
SWAPPED_MIN_ROWS = 65
# Programs (BLOCK_N features each) a projection is cut into at least, and the count past which a
# shallower pipeline pays (two programs an SM): with these, the rule below picks the best tile
# of item 81's sweeps (scripts/bench_fewrow_gemm.py) for every projection at every row count.
MIN_PROGRAMS = 96
MANY_PROGRAMS = 192
# The swapped kernel's K range a program keeps at least when K is cut among programs, and its
# tile: 64 weight rows (one warpgroup's m64) by 256 bytes of K, four stages, the best of item
# 100's sweep (scripts/bench_fewrow_gemm.py).
SPLIT_MIN_K = 4096
SWAPPED_BLOCK_N = 64
SWAPPED_BLOCK_K_BYTES = 256


@dataclass(frozen=True)
class FewRowTiles:
    block_m: int  # input rows, padded (at least 16, tl.dot's minimum; 64 and up run on wgmma)
    block_n: int
    block_k_bytes: int  # per weight row and tile: 256 bytes = 256 e4m3 or 128 bf16 elements
    num_stages: int
    num_warps: int = 4
    swapped: bool = False  # y^T = W x^T: the weight tile is the MMA's M side, loaded by TMA
    splits: int = 1  # programs a tile's K range is cut among (swapped only)


def fewrow_tiles(rows: int, n: int, k: int, itemsize: int, sms: int) -> FewRowTiles | None:
    """The tile for `rows` rows of a projection [n, k] with weights of `itemsize` bytes on a GPU
    of `sms` SMs, or None where cuBLAS is as fast: in bf16, and for a wide projection (gate/up)
    at over 64 rows (journal items 81 and 100)."""
    if itemsize != 1 or rows > FEWROW_MAX_ROWS:
        return None
    if rows < SWAPPED_MIN_ROWS:
        block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= MIN_PROGRAMS), 16)
        many = triton.cdiv(n, block_n) >= MANY_PROGRAMS
        return FewRowTiles(block_m=64, block_n=block_n, block_k_bytes=256,
                           num_stages=3 if many else 5)
    tiles = triton.cdiv(n, SWAPPED_BLOCK_N)
    if tiles >= MANY_PROGRAMS or k * itemsize % 16:  # (TMA needs 16-byte aligned rows)
        return None
    splits = max(s for s in (1, 2, 4) if s == 1 or (tiles * s <= sms and k // s >= SPLIT_MIN_K))
    return FewRowTiles(block_m=128, block_n=SWAPPED_BLOCK_N, block_k_bytes=SWAPPED_BLOCK_K_BYTES,
                       num_stages=4, swapped=True, splits=splits)


@triton.jit
def scale_add_store(acc, out_ptrs, mask, x_scale, w_scale, SCALED: tl.constexpr,
                     ADD: tl.constexpr):
    """The epilogue of both kernels: acc times the per-token and per-channel scales (each
    already broadcast to acc's shape), then residual + (that rounded), as a separate add sees
    it, or just that, stored in the output's dtype."""
    if SCALED:
        acc = acc * x_scale * w_scale
    dtype = out_ptrs.dtype.element_ty
    if ADD:
        acc = acc.to(dtype).to(tl.float32) + tl.load(out_ptrs, mask=mask).to(tl.float32)
    tl.store(out_ptrs, acc.to(dtype), mask=mask)


@triton.jit
def split_arrive(count_ptr, SPLITS: tl.constexpr):
    """Whether this program is the last of its tile's SPLITS to arrive, once its partials are
    stored; that one resets the counter for the next launch (which waits for this one to end).
    The CTA barrier orders every thread's stores before the counter's release."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        tl.store(count_ptr, 0)
    return last


@triton.jit
def split_total(parts, mask, split_stride, SPLITS: tl.constexpr):
    """The sum of a tile's SPLITS fp32 partials (split s at `parts` + s * split_stride), in
    split order: the same result whatever order they arrived in."""
    acc = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(parts + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


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
    x_scale = None
    w_scale = None
    if SCALED:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    scale_add_store(acc, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     m_mask[:, None] & n_mask[None, :], x_scale, w_scale, SCALED, ADD)


@triton.jit
def swiglu_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 sums, rounded as kernels/activation.py rounds it after a
    separate GEMM: gate and up to `dtype` first, silu in fp32, rounded again."""
    gate = gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit
def _fewrow_gemm_swapped_kernel(x_desc, w_desc, x_scale_ptr, w_scale_ptr, out_ptr, part_ptr,
                                count_ptr, M, N, K, chunks, stride_om,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                                NUM_STAGES: tl.constexpr, SCALED: tl.constexpr,
                                ADD: tl.constexpr, GATED: tl.constexpr,
                                DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # The splits of a tile are launch neighbours, so their partials meet in L2. A split sums
    # `chunks` BLOCK_K-wide tiles of K from zero; GATED: the weight is [gate; up], N rows each.
    tile = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    n0 = tile * BLOCK_N
    k0 = split * chunks * BLOCK_K
    k_end = tl.minimum(k0 + chunks * BLOCK_K, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in tl.range(k0, k_end, BLOCK_K, num_stages=NUM_STAGES):
        # TMA reads past K or N (a last split's tail, a last tile's rows) as zeros.
        x = tl.trans(x_desc.load([0, kk]))
        acc = tl.dot(w_desc.load([n0, kk]), x, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.dot(w_desc.load([N + n0, kk]), x, up, input_precision=DOT_PRECISION)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS > 1:
        # Partials at their weight rows' places: a gated launch's up rows follow its gate rows.
        rows = 2 * N if GATED else N
        parts = part_ptr + offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(parts + split * rows * BLOCK_M, acc, mask=mask)
        if GATED:
            tl.store(parts + (split * rows + N) * BLOCK_M, up, mask=mask)
        if not split_arrive(count_ptr + tile, SPLITS):
            return
        acc = split_total(parts, mask, rows * BLOCK_M, SPLITS)
        if GATED:
            up = split_total(parts + N * BLOCK_M, mask, rows * BLOCK_M, SPLITS)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if GATED:
        tl.store(out_ptrs, swiglu_rounded(acc, up, out_ptr.dtype.element_ty)
                 .to(out_ptr.dtype.element_ty), mask=mask)
    else:
        x_scale = None
        w_scale = None
        if SCALED:
            w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
            x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        scale_add_store(acc, out_ptrs, mask, x_scale, w_scale, SCALED, ADD)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read each tensor's rows: 16-byte aligned, like their stride."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in tensors)


def swapped_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, block_m: int,
                 block_k: int, splits: int, chunks: int, num_stages: int,
                 x_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                 add: bool = False, gated: bool = False,
                 workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """The swapped kernel's launch: out [M, N] = x W^T (x [M, K], M <= block_m), K cut into
    `splits` ranges of `chunks` block_k-wide tiles each; with `add`, out += it (out holds the
    residual); `gated`: weight [2N, K] = [gate; up] and out = silu(gate) * up."""
    rows, k = x.shape
    n = out.shape[1]
    scaled = weight_scale is not None
    assert tma_ready(x, weight), "TMA needs 16-byte aligned rows"
    assert not (gated and (add or scaled)), "a gated launch neither adds nor scales"
    # Descriptors are host objects, captured as kernel arguments.
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k])
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()),
                              [SWAPPED_BLOCK_N, block_k])
    parts, counts = (split_buffers(workspace, weight.shape[0], splits, x.device) if splits > 1
                     else (out, out))
    pdl = supports_pdl(x.device)
    _fewrow_gemm_swapped_kernel[(triton.cdiv(n, SWAPPED_BLOCK_N) * splits,)](
        x_desc, w_desc, x_scale if scaled else x, weight_scale if scaled else x, out, parts,
        counts, rows, n, k, chunks, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=SWAPPED_BLOCK_N, BLOCK_K=block_k, SPLITS=splits,
        NUM_STAGES=num_stages, SCALED=scaled, ADD=add, GATED=gated,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def fewrow_gemm(x: torch.Tensor, weight: torch.Tensor, *, x_scale: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, tiles: FewRowTiles | None = None,
                workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x: [M, K] with M <= FEWROW_MAX_ROWS; weight: [N, K], both with contiguous rows. Either
    both in the model dtype, or both e4m3 with x_scale (fp32 [M, 1] or [M], one per row) and
    weight_scale (fp32 [N]). Returns x W^T (times the scales) in out_dtype (x's dtype unless
    e4m3: then given), or with residual ([M, N]) adds it to residual in place and returns it.
    `tiles`: the tile, by default `fewrow_tiles`'s (which must not be None for the shape);
    `workspace`: where a tile cut along K sums its splits (`split_buffers`)."""
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
    tiles = tiles or fewrow_tiles(rows, n, k, weight.element_size(), num_sms(x.device))
    assert tiles is not None and rows <= tiles.block_m
    block_k = tiles.block_k_bytes // weight.element_size()
    pdl = supports_pdl(x.device)
    if not tiles.swapped:
        _fewrow_gemm_kernel[(triton.cdiv(n, tiles.block_n),)](
            x, weight, x_scale if scaled else x, weight_scale if scaled else x, out, rows, n, k,
            x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, SCALED=scaled, ADD=residual is not None,
            DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
        return out
    assert tiles.block_n == SWAPPED_BLOCK_N and tiles.num_warps == 4
    return swapped_gemm(x, weight, out, block_m=tiles.block_m, block_k=block_k,
                        splits=tiles.splits, chunks=triton.cdiv(triton.cdiv(k, block_k),
                                                                tiles.splits),
                        num_stages=tiles.num_stages, x_scale=x_scale,
                        weight_scale=weight_scale, add=residual is not None,
                        workspace=workspace)
