"""Batch-invariant GEMM (`EngineConfig.batch_invariant` on CUDA): y = x W^T (+ residual) with one
order over K for every row count, so a row's bits never depend on how many rows the step has or
where the row sits.

The default linears change kernels with the batch (the fused GEMV for one row, the few-row GEMM
up to 128, cuBLAS above, whose split-K and tiles follow the shape), and each adds in its own
order. Here every call runs the same kernel: BLOCK_M x BLOCK_N output tiles, each the tensor
cores' sum over K in BLOCK_K steps from the first column on; an MMA computes each output from
its own row and column only, so a row's result is the same among any others, in any tile row
and in a tile of WIDE_BLOCK_M rows, which the wide launches below take (two warpgroups, each
the same 64-row MMAs, sharing each weight tile). A projection with few output tiles is split
along K so that a decode step has enough programs to stream the weight: the split is fixed by
the weight's shape and the GPU (`num_splits`), never by the number of rows; the fp32 partials
go through the runner's SplitKWorkspace and the last program of a tile to arrive sums them in
split order. Once the rows' tiles alone fill the GPU (or outgrow the workspace), each program
instead sums the splits one after another in registers, each from zero and in the same order:
the same bits, without the partials' round trip through memory; with more rows than one tile
holds, its tiles are WIDE_BLOCK_M rows, so each weight tile is read half as often.

The RMSNorm before a projection is its own kernel (one program a row, so invariant as it is):
inside the GEMM, the activation tile it scales became wgmma's register operand, which made
the launches 1.3-3.2x slower than the norm's kernel and the plain GEMM together (one H100,
journal item 150). A gate/up projection writes silu(gate) * up: each program holds a gate tile
and the matching up tile, and applies the activation after the last split's sum.

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
from liteinfer.kernels.fewrow_gemm import split_arrive, split_total
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace, split_buffers

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_STAGES = 3
# Rows a tile of the serial launches of more than BLOCK_M rows, at WIDE_WARPS: the widest tile
# whose forms (plain, gated) compile without spilling on sm_90 (journal item 134).
WIDE_BLOCK_M, WIDE_WARPS = 128, 8
MIN_K_PER_SPLIT = 512  # columns a split sums at least
PROGRAMS_PER_SM = 2  # what the splits aim for at one row tile


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
    """The tile's output from its full sums over K: silu(gate) * up as kernels/activation.py
    rounds it (gate and up rounded to the output's dtype first) when GATED, or plus the
    residual."""
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
        acc += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype),
             mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
                 stride_wn, stride_om, stride_rm, k_per_split, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                 SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # every operand may be the previous kernel's output or still read by it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:  # this program's split; the tile's last to arrive adds them in split order
        split = tl.program_id(2)
        acc, up = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, N, K, stride_xm,
                             stride_wn, split * k_per_split, k_per_split, BLOCK_M, BLOCK_N,
                             BLOCK_K, GATED, DOT_PRECISION)
        # A GATED launch's up partials sit beside its gate partials, as the weight's rows do.
        width = 2 * N if GATED else N
        parts = part_ptr + rows[:, None].to(tl.int64) * width + cols[None, :]
        tl.store(parts + split * M * width, acc, mask=mask)
        if GATED:
            tl.store(parts + N + split * M * width, up, mask=mask)
        if split_arrive(count_ptr + pid_m * tl.num_programs(1) + pid_n, SPLITS):
            acc = split_total(parts, mask, M * width, SPLITS)
            if GATED:
                up = split_total(parts + N, mask, M * width, SPLITS)
            _epilogue(acc, up, out_ptr, res_ptr, rows, cols, mask, stride_om, stride_rm,
                      HAS_RESIDUAL, GATED)
    else:
        # Every split in turn, each from zero, added in split order as the partial programs'
        # last adds their sums: the same bits without the partials' round trip. The sums start
        # at -0.0, which the first split's sum adds to exactly, its sign included; one loop, not
        # one copy of the K loop a split, so the registers of one split's sums are reused.
        acc = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
        up = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
        for s in range(SPLITS):
            acc_s, up_s = _split_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, N, K, stride_xm,
                                     stride_wn, s * k_per_split, k_per_split, BLOCK_M, BLOCK_N,
                                     BLOCK_K, GATED, DOT_PRECISION)
            acc += acc_s
            if GATED:
                up += up_s
        _epilogue(acc, up, out_ptr, res_ptr, rows, cols, mask, stride_om, stride_rm,
                  HAS_RESIDUAL, GATED)


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
                   workspace: SplitKWorkspace | None = None, *,
                   gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype; with residual [M, N], adds the product to it in
    place (in fp32, rounded once) and returns it. `gated`: the weight's rows are [gate | up]
    and the result is silu(gate) * up, [M, N / 2]. `serial`: run the K splits in one program
    each (default: `serial_splits`); otherwise their partials and arrival counters are the
    workspace's (`split_buffers`). The splits and that choice follow the weight's whole shape,
    gated or not."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    assert not (gated and residual is not None) and weight.shape[0] % (1 + gated) == 0
    (m, k), n = x.shape, weight.shape[0]
    out_n = n // 2 if gated else n
    out = residual if residual is not None else x.new_empty(m, out_n)
    if m == 0:
        return out
    res = residual if residual is not None else out
    sms = num_sms(x.device)
    splits, per_split = num_splits(k, n, sms)
    if serial is None:
        serial = serial_splits(m, n, sms)
    assert serial or m <= FEWROW_MAX_ROWS, "a split's partials hold FEWROW_MAX_ROWS rows"
    wide = serial and m > BLOCK_M
    block_m = WIDE_BLOCK_M if wide else BLOCK_M
    warps = WIDE_WARPS if wide else 4
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_n, BLOCK_N))
    pdl = supports_pdl(x.device)
    parts = counts = out  # unread unless split among programs
    if splits > 1 and not serial:
        parts, counts = split_buffers(workspace, n, splits, x.device)
        assert grid[0] * grid[1] <= counts.numel()
        grid = (*grid, splits)
    _gemm_kernel[grid](x, weight, out, res, parts, counts, m, out_n, k, x.stride(0),
                       weight.stride(0), out.stride(0), res.stride(0), per_split,
                       BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       PARTIAL=len(grid) == 3, SPLITS=splits,
                       HAS_RESIDUAL=residual is not None, GATED=gated,
                       DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, num_warps=warps,
                       num_stages=NUM_STAGES, launch_pdl=pdl)
    return out
