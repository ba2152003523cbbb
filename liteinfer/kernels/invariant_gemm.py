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

In front of a pre-norm projection (qkv, gate/up, the LM head) the RMSNorm is part of the same
launch: each loaded activation tile is multiplied by the norm's weight, its squares are summed
beside the product (per split, in the same order for every row, added in split order as the
products are), and the tile's full sums are scaled by each row's 1 / RMS: once, on the fp32
sum, so nothing waits for a row's RMS before its first product (the separate norm rounds each
normalized element to the model dtype instead; the bits differ from it, not among rows). A
gate/up projection writes silu(gate) * up: each program holds a gate tile and the matching up
tile, and applies the activation after the last split's sum.

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
# whose every form (normed, gated, both) compiles without spilling on sm_90 (journal item 134).
WIDE_BLOCK_M, WIDE_WARPS = 128, 8
MIN_K_PER_SPLIT = 512  # columns a split sums at least
PROGRAMS_PER_SM = 2  # what the splits aim for at one row tile
# Warps of a normed launch, whose activation tile passes through registers on its way to the
# MMA beside one or two accumulators and the squares. At 4 warps its serial forms spilled on
# sm_90 while each split had a K loop of its own (journal items 123, 133); the one-loop forms
# fit at 4 too, which is not yet measured against 8 (`bench_kernels.py --only invariant --sweep`).
NORMED_WARPS = 8


@triton.jit
def _split_dot(x_ptr, w_ptr, norm_ptr, rows, cols, row_ok, col_ok, N, K, stride_xm, stride_wn,
               k_start, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """One split's fp32 sums over its K columns, from zero, in BLOCK_K steps: (x W^T over the
    weight's rows `cols`, over its rows N + `cols` when GATED, each row's sum of squares of x
    when NORM). NORM multiplies each loaded activation tile by the norm's weight (rounded to
    x's dtype) and sums its squares per column lane, the lanes added by one tree at the end:
    the same order for a row in any tile position and at any row count."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lanes = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = a.to(tl.float32)
            lanes += xf * xf
            g = tl.load(norm_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (xf * g[None, :]).to(a.dtype)
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :]
        b = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if GATED:
            b = tl.load(w_ptrs + N * stride_wn, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            up = tl.dot(a, tl.trans(b), up, input_precision=DOT_PRECISION)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        squares = tl.sum(lanes, axis=1)
    return acc, up, squares


@triton.jit
def _epilogue(acc, up, squares, out_ptr, res_ptr, rows, cols, mask, K, stride_om, stride_rm,
              eps, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr):
    """The tile's output from its full sums over K: times each row's 1 / RMS when NORM; then
    silu(gate) * up as kernels/activation.py rounds it (gate and up rounded to the output's
    dtype first) when GATED, or plus the residual."""
    dtype = out_ptr.dtype.element_ty
    if NORM:
        inv_rms = tl.rsqrt(squares / K + eps)[:, None]
        acc = acc * inv_rms
        up = up * inv_rms
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
def _gemm_kernel(x_ptr, w_ptr, norm_ptr, out_ptr, res_ptr, part_ptr, count_ptr, M, N, K,
                 stride_xm, stride_wn, stride_om, stride_rm, k_per_split, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PARTIAL: tl.constexpr, SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 NORM: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr):
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
        acc, up, squares = _split_dot(x_ptr, w_ptr, norm_ptr, rows, cols, row_ok, col_ok, N,
                                      K, stride_xm, stride_wn, split * k_per_split,
                                      k_per_split, BLOCK_M, BLOCK_N, BLOCK_K, NORM, GATED,
                                      DOT_PRECISION)
        # A GATED launch's up partials sit beside its gate partials, as the weight's rows do;
        # after every split's tiles, each tile's splits' sums of squares (`split_features`).
        width = 2 * N if GATED else N
        parts = part_ptr + rows[:, None].to(tl.int64) * width + cols[None, :]
        tile = pid_m * tl.num_programs(1) + pid_n
        square_parts = (part_ptr + SPLITS * M * width + tile * SPLITS * BLOCK_M
                        + tl.arange(0, BLOCK_M))
        tl.store(parts + split * M * width, acc, mask=mask)
        if GATED:
            tl.store(parts + N + split * M * width, up, mask=mask)
        if NORM:
            tl.store(square_parts + split * BLOCK_M, squares)
        if split_arrive(count_ptr + tile, SPLITS):
            acc = split_total(parts, mask, M * width, SPLITS)
            if GATED:
                up = split_total(parts + N, mask, M * width, SPLITS)
            if NORM:
                squares = split_total(square_parts, row_ok, BLOCK_M, SPLITS)
            _epilogue(acc, up, squares, out_ptr, res_ptr, rows, cols, mask, K, stride_om,
                      stride_rm, eps, HAS_RESIDUAL, NORM, GATED)
    else:
        # Every split in turn, each from zero, added in split order as the partial programs'
        # last adds their sums: the same bits without the partials' round trip. The sums start
        # at -0.0, which the first split's sum adds to exactly, its sign included; one loop, not
        # one copy of the K loop a split, so the registers of one split's sums are reused.
        acc = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
        up = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)
        squares = tl.full((BLOCK_M,), -0.0, tl.float32)
        for s in range(SPLITS):
            acc_s, up_s, squares_s = _split_dot(x_ptr, w_ptr, norm_ptr, rows, cols, row_ok,
                                                col_ok, N, K, stride_xm, stride_wn,
                                                s * k_per_split, k_per_split, BLOCK_M,
                                                BLOCK_N, BLOCK_K, NORM, GATED, DOT_PRECISION)
            acc += acc_s
            if GATED:
                up += up_s
            if NORM:
                squares += squares_s
        _epilogue(acc, up, squares, out_ptr, res_ptr, rows, cols, mask, K, stride_om,
                  stride_rm, eps, HAS_RESIDUAL, NORM, GATED)


def split_features(n: int) -> int:
    """Features' worth of partials (FEWROW_MAX_ROWS fp32 each a split) a launch over an [n, k]
    weight takes: its n features' (gate and up side by side when gated), then, when normed,
    a sum of squares for each of its tiles' rows."""
    tiles = triton.cdiv(FEWROW_MAX_ROWS, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    return n + triton.cdiv(tiles * BLOCK_M, FEWROW_MAX_ROWS)


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
    return (split_features(n), splits) if splits > 1 else None


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor,
                   residual: torch.Tensor | None = None, serial: bool | None = None,
                   workspace: SplitKWorkspace | None = None, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                   gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype; with residual [M, N], adds the product to it in
    place (in fp32, rounded once) and returns it. `norm_weight` [K]: x is RMS-normalized first
    (with `eps`), inside the kernel; `gated`: the weight's rows are [gate | up] and the result
    is silu(gate) * up, [M, N / 2]. `serial`: run the K splits in one program each (default:
    `serial_splits`); otherwise their partials and arrival counters are the workspace's
    (`split_buffers`). The splits and that choice follow the weight's whole shape, gated or
    not."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    assert norm_weight is None or norm_weight.shape == (x.shape[1],)
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
    warps = WIDE_WARPS if wide else 4 if norm_weight is None else NORMED_WARPS
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_n, BLOCK_N))
    pdl = supports_pdl(x.device)
    parts = counts = out  # unread unless split among programs
    if splits > 1 and not serial:
        parts, counts = split_buffers(workspace, split_features(n), splits, x.device)
        assert grid[0] * grid[1] <= counts.numel()
        grid = (*grid, splits)
    _gemm_kernel[grid](x, weight, x if norm_weight is None else norm_weight, out, res, parts,
                       counts, m, out_n, k, x.stride(0), weight.stride(0), out.stride(0),
                       res.stride(0), per_split, eps,
                       BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       PARTIAL=len(grid) == 3, SPLITS=splits,
                       HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None,
                       GATED=gated, DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl,
                       num_warps=warps, num_stages=NUM_STAGES, launch_pdl=pdl)
    return out
