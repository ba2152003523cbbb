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
(`num_splits`), never by the number of rows, and the fp32 partials are summed in split order by
a second kernel. Once the rows' tiles alone fill the GPU, each program instead sums the splits
one after another in registers, each from zero and in the same order: the same bits, without
the partials' round trip through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision, num_sms

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
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 stride_rm, stride_os, k_per_split, BLOCK_M: tl.constexpr,
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
    if PARTIAL:  # this program's split; _sum_splits_kernel adds them
        split = tl.program_id(2)
        acc = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_xm, stride_wn,
                         split * k_per_split, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K,
                         DOT_PRECISION)
        tl.store(out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om
                 + cols[None, :], acc, mask=mask)
    else:
        # Every split in turn, each from zero, added in split order as _sum_splits_kernel adds
        # the partial programs' sums: the same bits without the partials' round trip.
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


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, res_ptr, M, N, stride_ps, stride_pm, stride_om,
                       stride_rm, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.load(part_ptr + row * stride_pm + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        total += tl.load(res_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


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
    in programs of their own: once its output tiles alone give the programs the splits aim for
    (the bits are the same either way; the partials' round trip through memory is saved)."""
    return triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N) >= sms * PROGRAMS_PER_SM


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor,
                   residual: torch.Tensor | None = None,
                   serial: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype; with residual [M, N], adds the product to it in
    place (in fp32, rounded once) and returns it. `serial`: run the K splits in one program
    each (default: `serial_splits`)."""
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
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLITS=splits,
                  HAS_RESIDUAL=residual is not None, DOT_PRECISION=dot_precision(x.dtype),
                  num_warps=4, num_stages=3)
    if splits == 1 or serial:
        _gemm_kernel[grid](x, weight, out, res, m, n, k, x.stride(0), weight.stride(0),
                           out.stride(0), res.stride(0), 0, per_split, PARTIAL=False, **common)
        return out
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _gemm_kernel[(*grid, splits)](x, weight, parts, res, m, n, k, x.stride(0),
                                  weight.stride(0), parts.stride(1), res.stride(0),
                                  parts.stride(0), per_split, PARTIAL=True, **common)
    block = 1024
    _sum_splits_kernel[(m, triton.cdiv(n, block))](
        parts, out, res, m, n, parts.stride(0), parts.stride(1), out.stride(0), res.stride(0),
        SPLITS=splits, BLOCK=block, HAS_RESIDUAL=residual is not None)
    return out
