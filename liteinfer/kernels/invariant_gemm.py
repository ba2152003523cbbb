"""Batch-invariant GEMM (`EngineConfig.batch_invariant` on CUDA): y = x W^T (+ residual) with one
order over K for every row count, so a row's bits never depend on how many rows the step has or
where the row sits.

The default linears change kernels with the batch (the fused GEMV for one row, the few-row GEMM
up to 128, cuBLAS above, whose split-K and tiles follow the shape), and each adds in its own
order. Here every output is the tensor cores' sum over K in 16-column MMA steps from the first
column on, cut into K splits fixed by the weight's shape and the GPU (`num_splits`), never by
the rows, each split summed from zero and the splits added in order. An MMA computes each
output from its own row and column only, and with the operands' roles exchanged gives the same
bits (one H100, journal item 170), so two kernels share that order:

- up to FEWROW_MAX_ROWS rows (decode steps), kernels/fewrow_gemm.py's swapped kernel: 64
  weight rows as wgmma's M side and the input rows its N, so that one row streams the weight as
  the default's few-row kernels do; each split its own program, whose fp32 partials go through
  the runner's SplitKWorkspace and the last program of a tile to arrive sums them in order;
- beyond (prompt steps), `_gemm_kernel`: 64- or WIDE_BLOCK_M-row tiles of the inputs (two
  warpgroups, each the same 64-row MMAs, sharing each weight tile), each program summing the
  splits one after another in registers, the same bits without the partials' round trip.

The RMSNorm before a projection is its own kernel (one program a row, so invariant as it is):
inside the GEMM, the activation tile it scales became wgmma's register operand, which made
the launches 1.3-3.2x slower than the norm's kernel and the plain GEMM together (one H100,
journal item 150). A gate/up projection writes silu(gate) * up: each program holds a gate tile
and the matching up tile, and applies the activation after the last split's sum; an output
projection adds its rounded product to the residual, as a separate add would.

On Hopper and later the launches are programmatic dependent launches, as the default's GEMV and
few-row GEMM are: a launch starts while the previous kernel drains and waits in-kernel for its
results, and the last-arriving program's counter reset is complete before the next launch reads
it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision, num_sms, supports_pdl
from liteinfer.kernels.fewrow_gemm import (
    SWAPPED_BLOCK_K_BYTES,
    SWAPPED_BLOCK_N,
    swapped_gemm,
    swiglu_rounded,
    tma_ready,
)
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_STAGES = 3
# Rows a tile of the serial launches of more than BLOCK_M rows, at WIDE_WARPS: the widest tile
# whose forms (plain, gated) compile without spilling on sm_90 (journal item 134).
WIDE_BLOCK_M, WIDE_WARPS = 128, 8
MIN_K_PER_SPLIT = 512  # columns a split sums at least
# A split's columns are whole K tiles of both kernels (the swapped kernel's 256 bytes: 128 bf16
# or 64 fp32 columns), so both add the same products in the same order.
SPLIT_ALIGN = 128
SWAPPED_STAGES = 4


@triton.jit
def _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, N, K, stride_xm, stride_wn, k_start,
               k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One split's fp32 sums over its K columns, from zero, in BLOCK_K steps: (x W^T over the
    weight's rows `cols`, over its rows N + `cols` when GATED)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :]
        b = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if GATED:
            b = tl.load(w_ptrs + N * stride_wn, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            up = tl.dot(a, tl.trans(b), up, input_precision=DOT_PRECISION)
    return acc, up


@triton.jit
def _epilogue(acc, up, out_ptr, res_ptr, rows, cols, mask, stride_om, stride_rm,
              HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr):
    """The tile's output from its full sums over K, as the swapped kernel writes it:
    silu(gate) * up when GATED, or the product rounded, plus the residual, rounded again (a
    separate add's bits)."""
    dtype = out_ptr.dtype.element_ty
    if GATED:
        acc = swiglu_rounded(acc, up, dtype)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
        acc = (acc.to(dtype).to(tl.float32)
               + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype),
             mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 stride_rm, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # every operand may be the previous kernel's output or still read by it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # Every split in turn, each from zero, added in split order as the swapped kernel's last
    # program adds its splits' partials: the same bits without the partials' round trip. The
    # sums start at -0.0, which the first split's sum adds to exactly, its sign included; one
    # loop, not one copy of the K loop a split, so the registers of one split's sums are reused.
    acc = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
    up = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
    for s in range(SPLITS):
        acc_s, up_s = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, N, K, stride_xm,
                                 stride_wn, s * k_per_split, k_per_split, BLOCK_M, BLOCK_N,
                                 BLOCK_K, GATED, DOT_PRECISION)
        acc += acc_s
        if GATED:
            up += up_s
    _epilogue(acc, up, out_ptr, res_ptr, rows, cols, row_ok[:, None] & col_ok[None, :],
              stride_om, stride_rm, HAS_RESIDUAL, GATED)


def num_splits(k: int, n: int, sms: int) -> tuple[int, int]:
    """(splits, columns a split) of a [n, k] weight on a GPU of `sms` SMs: as many as give the
    swapped kernel's output tiles one program an SM at most, each split at least
    MIN_K_PER_SPLIT columns and a whole number of SPLIT_ALIGN; a function of the weight's shape
    and the GPU alone."""
    splits = max(1, min(sms // triton.cdiv(n, SWAPPED_BLOCK_N), k // MIN_K_PER_SPLIT))
    per_split = triton.cdiv(triton.cdiv(k, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return triton.cdiv(k, per_split), per_split


def split_launch(n: int, k: int, sms: int) -> tuple[int, int] | None:
    """(features, splits) of an [n, k] weight's launches whose splits sum through a
    SplitKWorkspace (kernels/gemm_splits.py); None if its K is not split."""
    splits, _ = num_splits(k, n, sms)
    return (n, splits) if splits > 1 else None


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor,
                   residual: torch.Tensor | None = None,
                   workspace: SplitKWorkspace | None = None, *,
                   gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype; with residual [M, N], adds the product (rounded)
    to it in place and returns it. `gated`: the weight's rows are [gate | up] and the result is
    silu(gate) * up, [M, N / 2]. Up to FEWROW_MAX_ROWS rows the swapped kernel multiplies, its
    splits' partials and arrival counters the workspace's (`split_buffers`); beyond, or where
    TMA cannot read the rows, the serial kernel. The splits follow the weight's whole shape,
    gated or not."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    assert not (gated and residual is not None) and weight.shape[0] % (1 + gated) == 0
    (m, k), n = x.shape, weight.shape[0]
    out_n = n // 2 if gated else n
    out = residual if residual is not None else x.new_empty(m, out_n)
    if m == 0:
        return out
    splits, per_split = num_splits(k, n, num_sms(x.device))
    if m <= FEWROW_MAX_ROWS and tma_ready(x, weight):
        block_k = SWAPPED_BLOCK_K_BYTES // x.element_size()
        # The tensor cores give a row the same bits in a tile of any height (item 170); the
        # interpreter's numpy dot does not, so there the tile is always of FEWROW_MAX_ROWS.
        block_m = max(16, triton.next_power_of_2(m)) if x.is_cuda else FEWROW_MAX_ROWS
        return swapped_gemm(x, weight, out, block_m=block_m,
                            block_k=block_k, splits=splits, chunks=per_split // block_k,
                            num_stages=SWAPPED_STAGES, add=residual is not None, gated=gated,
                            workspace=workspace)
    # More rows than one tile holds: WIDE_BLOCK_M-row tiles, each weight tile read half as often.
    block_m, warps = (WIDE_BLOCK_M, WIDE_WARPS) if m > BLOCK_M else (BLOCK_M, 4)
    res = residual if residual is not None else out
    pdl = supports_pdl(x.device)
    _gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_n, BLOCK_N))](
        x, weight, out, res, m, out_n, k, x.stride(0), weight.stride(0), out.stride(0),
        res.stride(0), per_split, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        SPLITS=splits, HAS_RESIDUAL=residual is not None, GATED=gated,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, num_warps=warps,
        num_stages=NUM_STAGES, launch_pdl=pdl)
    return out
