"""Few-row linear layers: y [M, N] = x [M, K] W^T for the decode steps of 2..64 sequences.

Such a step still reads every weight once and does little math per weight byte, so a projection
costs the time to stream its weight in. cuBLAS reads the 1B model's weights at 1.2-4 TB/s on the
H200 at 32 rows (latency-bound on qkv, o and down). Here the weight is cut into about two programs
per SM, each owning BLOCK_N output features and a range of K in chunks of BLOCK_K, and each
program first loads a whole weight chunk in one go, so much of a small matrix is in flight.

- Small N (qkv, o, down): K is split between programs so that the grid fills the SMs. Each split
  writes its fp32 partial to a workspace and bumps its N tile's arrival counter; the last to
  arrive sums the partials in split order (the result does not depend on arrival order), writes
  y and resets the counter. One launch, safe to capture in a CUDA graph.
- Large N or many rows: the x chunk [BLOCK_M, BLOCK_K] lives in registers, which caps BLOCK_K,
  so a program's K range may span several chunks, looped. One-chunk splits instead would cost a
  workspace of splits x M x N fp32, written and read back: for the LM head at 64 rows (16 splits
  of 128 columns), as many bytes as its weight.

On Hopper and later the kernel is a programmatic dependent launch: it loads its first weight
chunk (never written by a step) while the previous kernel finishes, then waits for that kernel
before reading x or touching the workspace, and lets the next kernel launch early in turn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl
from liteinfer.kernels.decode_attention import dot_precision

MAX_ROWS = 64
# Loaded per chunk by a 4-warp program. Compiled for sm_90 these need at most 224 registers and 96
# KiB of shared memory (two stages), so two programs fit on an SM; a 32 KiB x chunk spills.
X_CHUNK_BYTES = 16 * 1024
W_CHUNK_BYTES = 32 * 1024
WAVES = 2  # programs per SM that the split count aims for: those that fit at once
MAX_SPLITS = 16  # the finishing program's sum over the splits is unrolled
CPU_SMS = 8  # stands in for the SM count under the interpreter

# (device, N, splits) -> (fp32 partials [splits, MAX_ROWS, N], int32 arrival counters, zero
# between launches). Allocated on a shape's first call, so that call must precede any graph
# capture (a warm-up); launches of one shape must not run concurrently on different streams.
_WORKSPACES: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class SkinnyTiles:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


def skinny_tiles(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *,
                 block_n: int | None = None, block_k: int | None = None,
                 splits: int | None = None, num_warps: int = 4,
                 num_stages: int = 2) -> SkinnyTiles:
    """Tiles for x [m, k] @ W[n, k]^T; any argument given overrides the rule. BLOCK_K is as long
    as the x chunk allows (512 bf16 columns up to 16 rows, 256 at 32, 128 at 64), BLOCK_N as the
    weight chunk then allows, at most 64 (the program finishing a tile reads every split's
    [BLOCK_M, BLOCK_N] fp32 partial). K is split for about WAVES programs per SM, then the split
    count is lowered to the fewest with the same longest split. A forced split count halves
    BLOCK_K (down to 16) until there are that many chunks."""
    size = dtype.itemsize
    block_m = max(16, triton.next_power_of_2(m))
    if block_k is None:
        block_k = max(16, min(triton.next_power_of_2(k), X_CHUNK_BYTES // (block_m * size)))
    if block_n is None:
        block_n = max(16, min(64, W_CHUNK_BYTES // (block_k * size)))
    if splits is None:
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else CPU_SMS)
        chunks = triton.cdiv(k, block_k)
        splits = min(MAX_SPLITS, chunks, max(1, WAVES * sms // triton.cdiv(n, block_n)))
        splits = triton.cdiv(chunks, triton.cdiv(chunks, splits))
    else:
        while triton.cdiv(k, block_k) < splits and block_k > 16:
            block_k //= 2
        splits = min(splits, triton.cdiv(k, block_k))
    return SkinnyTiles(block_m, block_n, block_k, splits, num_warps, num_stages)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                   stride_om, stride_part, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # The splits of an N tile are neighbours in launch order, so their partials stay in L2.
    split = tl.program_id(0) % SPLITS
    tile = tl.program_id(0) // SPLITS
    chunks = tl.cdiv(K, BLOCK_K)
    first, end = split * chunks // SPLITS, (split + 1) * chunks // SPLITS
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = first * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, m_mask = n < N, m < M
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptrs, mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for _ in range(first + 1, end):
        k += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS > 1:
        parts = part_ptr + m[:, None] * N + n[None, :]
        tl.store(parts + split * stride_part, acc, mask=mask)
        # Publish the partial. One thread performs the scalar atomic, so the CTA barrier first
        # orders every thread's stores before it; the release half of acq_rel (cumulative, gpu
        # scope) then makes them visible to the program that observes the final count.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        # The acquire half orders the atomic before this thread's later loads; the barrier
        # extends that to all of the program's threads.
        tl.debug_barrier()
        if arrived < SPLITS - 1:
            return
        # Last of the tile's splits: nothing else touches the counter in this launch, and the
        # next launch is ordered after this one by the stream (PDL included: it waits first).
        tl.store(count_ptr + tile, 0)
        # .cg reads L2, where the other programs' stores are, never a stale L1 line.
        acc = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(parts + s * stride_part, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def _workspace(device: torch.device, n: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, n, splits)
    if key not in _WORKSPACES:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "skinny_gemm's first call for a shape must come before graph capture"
        _WORKSPACES[key] = (
            torch.empty(splits, MAX_ROWS, n, dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS (rows strided, last dim contiguous); weight: [N, K] (rows
    contiguous). Returns out [M, N] = x W^T, accumulated in fp32; tiles default to skinny_tiles."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
    rows, in_features = x.shape
    n = weight.shape[0]
    assert 1 <= rows <= MAX_ROWS and weight.shape[1] == in_features and x.dtype == weight.dtype
    out = x.new_empty(rows, n) if out is None else out
    assert out.shape == (rows, n) and out.stride(-1) == 1
    tiles = tiles or skinny_tiles(rows, n, in_features, x.dtype, x.device)
    assert tiles.block_m >= rows and tiles.block_n % 16 == 0 and tiles.block_k % 16 == 0
    assert 1 <= tiles.splits <= triton.cdiv(in_features, tiles.block_k)
    parts, counts = _workspace(x.device, n, tiles.splits) if tiles.splits > 1 else (out, out)
    pdl = supports_pdl(x.device)
    _skinny_kernel[(triton.cdiv(n, tiles.block_n) * tiles.splits,)](
        x, weight, out, parts, counts, rows, n, in_features, x.stride(0), weight.stride(0),
        out.stride(0), parts.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, SPLITS=tiles.splits, DOT_PRECISION=dot_precision(x.dtype),
        USE_PDL=pdl, num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
    return out
