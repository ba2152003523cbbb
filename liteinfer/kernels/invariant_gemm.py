"""Batch-invariant GEMM (`EngineConfig.batch_invariant` on CUDA): y = x W^T (+ residual) with one
tile configuration and one order over K for every row count, so a row's bits never depend on
how many rows the step has or where the row sits.

The default linears change kernels with the batch (the fused GEMV for one row, the few-row GEMM
up to 128, cuBLAS above, whose split-K and tiles follow the shape), and each adds in its own
order. Here every call runs the same kernel: BLOCK_M x BLOCK_N output tiles, each the tensor
cores' sum over K in BLOCK_K steps from the first column on; an MMA computes each output from
its own row and column only, so a row's result is the same among any others and in any tile
row. A projection with few output tiles is split along K so that a decode step has enough
programs to stream the weight: the split is fixed by the weight's shape and the GPU
(`num_splits`), never by the number of rows; the fp32 partials go through the runner's
SplitKWorkspace and the last program of a tile to arrive sums them in split order. Once the
rows' tiles alone fill the GPU (or outgrow the workspace), each program instead sums the splits
one after another in registers, each from zero and in the same order: the same bits, without
the partials' round trip through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision, num_sms
from liteinfer.kernels.fewrow_gemm import sum_splits
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace, split_buffers

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
MIN_K_PER_SPLIT = 512  # columns a split sums at least
PROGRAMS_PER_SM = 2  # what the splits aim for at one row tile


@triton.jit
def _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_xm, stride_wn, k_start,
               k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One split's fp32 sum over its K columns, from zero, in BLOCK_K steps."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
                 stride_wn, stride_om, stride_rm, k_per_split, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                 SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:  # this program's split; the tile's last to arrive adds them in split order
        split = tl.program_id(2)
        acc = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_xm, stride_wn,
                         split * k_per_split, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K,
                         DOT_PRECISION)
        parts = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        acc, last = sum_splits(acc, parts, mask, count_ptr + pid_m * tl.num_programs(1) + pid_n,
                               split, M * N, SPLITS)
        if last:
            if HAS_RESIDUAL:
                res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
                acc += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Every split in turn, each from zero, added in split order as the partial programs'
        # last adds their sums: the same bits without the partials' round trip.
        acc = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_xm, stride_wn,
                         0, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        for s in tl.static_range(1, SPLITS):
            acc += _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_xm,
                              stride_wn, s * k_per_split, k_per_split, BLOCK_M, BLOCK_N,
                              BLOCK_K, DOT_PRECISION)
        if HAS_RESIDUAL:
            res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
            acc += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def num_splits(k: int, n: int, sms: int) -> tuple[int, int]:
    """(splits, columns a split) of a [n, k] weight on a GPU of `sms` SMs: enough programs for
    PROGRAMS_PER_SM at one row tile, each split at least MIN_K_PER_SPLIT columns; a function
    of the weight's shape and the GPU alone."""
    wanted = triton.cdiv(sms * PROGRAMS_PER_SM, triton.cdiv(n, BLOCK_N))
    splits = max(1, min(wanted, k // MIN_K_PER_SPLIT))
    per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    return triton.cdiv(k, per_split), per_split


def serial_splits(m: int, n: int, sms: int) -> bool:
    """Whether an [m, n] product runs its splits one after another in each program instead of
    in programs of their own: beyond the rows a split's partials hold (FEWROW_MAX_ROWS, as the
    few-row GEMMs'), or once its output tiles alone give the programs the splits aim for. The
    bits are the same either way; the partials' round trip through memory is saved."""
    return (m > FEWROW_MAX_ROWS
            or triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N) >= sms * PROGRAMS_PER_SM)


def split_launch(n: int, k: int, sms: int) -> tuple[int, int] | None:
    """(features, splits) of an [n, k] weight's launches whose splits sum through a
    SplitKWorkspace (kernels/gemm_splits.py); None if its K is not split."""
    splits, _ = num_splits(k, n, sms)
    return (n, splits) if splits > 1 else None


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor,
                   residual: torch.Tensor | None = None, serial: bool | None = None,
                   workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype; with residual [M, N], adds the product to it in
    place (in fp32, rounded once) and returns it. `serial`: run the K splits in one program
    each (default: `serial_splits`); otherwise their partials and arrival counters are the
    workspace's (`split_buffers`)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    (m, k), n = x.shape, weight.shape[0]
    out = residual if residual is not None else x.new_empty(m, n)
    if m == 0:
        return out
    res = residual if residual is not None else out
    sms = num_sms(x.device)
    splits, per_split = num_splits(k, n, sms)
    if serial is None:
        serial = serial_splits(m, n, sms)
    assert serial or m <= FEWROW_MAX_ROWS, "a split's partials hold FEWROW_MAX_ROWS rows"
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    parts = counts = out  # unread unless split among programs
    if splits > 1 and not serial:
        parts, counts = split_buffers(workspace, n, splits, x.device)
        assert grid[0] * grid[1] <= counts.numel()
        grid = (*grid, splits)
    _gemm_kernel[grid](x, weight, out, res, parts, counts, m, n, k, x.stride(0),
                       weight.stride(0), out.stride(0), res.stride(0), per_split,
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       PARTIAL=len(grid) == 3, SPLITS=splits,
                       HAS_RESIDUAL=residual is not None, DOT_PRECISION=dot_precision(x.dtype),
                       num_warps=4, num_stages=3)
    return out
