"""Research kernel (not engine code): a Hopper-native few-row GEMM for decode steps.

y[M, N] = x[M, K] @ W[N, K]^T for M = 1..64 rows, computed as the transposed product
y^T[N, M] = W[N, K] @ x^T[K, M]: the weight tile [BLOCK_N, BLOCK_K] is the MMA's row (M)
operand, 64 or 128 output features a tile (wgmma's native m64, one or two warpgroups), and the
few rows are the MMA's N dimension, padded to BLOCK_M = 16, 32 or 64 (tl.dot needs >= 16).

Per program: one N tile and one of SPLITS contiguous K ranges of CPS = K / (SPLITS * BLOCK_K)
chunks of BLOCK_K.

- PRE chunks (one tl.load of [BLOCK_N, PRE * BLOCK_K], into registers) are issued before
  `griddepcontrol.wait`, so under programmatic dependent launch (PDL) they stream in while the
  previous kernel finishes; x is read only after the wait. The pipeliner cannot do this for a
  loop (its prologue is emitted right before the loop, after any wait), so the first chunks are
  peeled by hand and the remaining CPS - PRE chunks go through a software-pipelined loop
  (num_stages), with cp.async pointer loads or, with TMA, host-side tensor descriptors
  (`triton.tools.tensor_descriptor.TensorDescriptor`: the CUtensorMap travels as a kernel
  parameter, so no in-kernel descriptor creation, no global scratch, and it is captured by a
  CUDA graph as is).
- SPLITS > 1: the fp32 partials are reduced in the same launch.
  REDUCE_ATOMIC: every split red.adds its [BLOCK_N, M] partial into an fp32 accumulator tile
  (L2 atomics), then bumps the tile's arrival counter; the last to arrive reads the tile (one
  tile, whatever SPLITS), writes y, and zeroes the accumulator and the counter for the next
  launch. Summation order follows arrival (fp32 sums may differ in the last bit run to run).
  Ordered: every split stores its partial to its own slot; the last to arrive sums them in
  split order (deterministic, but it reads SPLITS tiles).
  Either way one launch, CUDA-graph safe (the workspace is zero again after every launch).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

MAX_ROWS = 64
WS_M = 64  # row stride (in rows of y) of the fp32 split-K workspace: [.., N, WS_M]


@dataclass(frozen=True)
class FewRowTiles:
    block_n: int = 128      # output features a program (the wgmma M side: 64 per warpgroup)
    block_k: int = 128      # K chunk of one pipeline stage
    splits: int = 1         # programs per N tile along K
    pre: int = 1            # chunks loaded before griddepcontrol.wait (power of 2, or 0)
    num_stages: int = 3     # pipeline depth of the loop over the remaining chunks
    num_warps: int = 8
    tma: bool = False       # loop loads through TMA descriptors (else cp.async pointer loads)
    reduce: str = "atomic"  # split-K reduction: "atomic" or "ordered"
    pre_last: bool = False  # multiply the peeled chunk after the loop (x_pre read last)

    def name(self) -> str:
        return (f"n{self.block_n}k{self.block_k}s{self.splits}p{self.pre}st{self.num_stages}"
                f"w{self.num_warps}{'-tma' if self.tma else ''}"
                f"{'-ord' if self.reduce == 'ordered' and self.splits > 1 else ''}"
                f"{'-last' if self.pre_last and 0 < self.pre else ''}")

    def weight_bytes_per_program(self, k: int, itemsize: int = 2) -> int:
        return self.block_n * (k // self.splits) * itemsize


def block_m_for(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


@triton.jit(do_not_specialize=["M"])
def _fewrow_kernel(x_ptr, w_ptr, x_desc, w_desc, xp_desc, wp_desc, out_ptr, ws_ptr, count_ptr,
                   M, N, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLITS: tl.constexpr, CPS: tl.constexpr, PRE: tl.constexpr,
                   PRE_LAST: tl.constexpr,
                   TMA: tl.constexpr, REDUCE_ATOMIC: tl.constexpr, WS_ROWS: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # The splits of an N tile are neighbours in launch order (their partials meet in L2).
    pid = tl.program_id(0)
    split = pid % SPLITS
    tile = pid // SPLITS
    n0 = tile * BLOCK_N
    k0 = split * (CPS * BLOCK_K)
    n = n0 + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask = n < N
    m_mask = m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m[:, None] * stride_xm

    # Peeled chunks: the weight (never written by a step) is requested before the wait.
    if PRE > 0:
        kp = k0 + tl.arange(0, PRE * BLOCK_K)
        if TMA:
            w_pre = wp_desc.load([n0, k0])
        else:
            w_pre = tl.load(w_rows + kp[None, :], mask=n_mask[:, None], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PRE > 0 and not PRE_LAST:
        if TMA:
            x_pre = xp_desc.load([0, k0])
        else:
            x_pre = tl.load(x_rows + kp[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w_pre, tl.trans(x_pre), acc)

    if CPS > PRE:  # (a constexpr test: the loop body is traced even for an empty range)
        kb = tl.arange(0, BLOCK_K)
        for c in range(PRE, CPS):
            kc = k0 + c * BLOCK_K
            if TMA:
                w = w_desc.load([n0, kc])
                x = x_desc.load([0, kc])
            else:
                w = tl.load(w_rows + (kc + kb)[None, :], mask=n_mask[:, None], other=0.0)
                x = tl.load(x_rows + (kc + kb)[None, :], mask=m_mask[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
    if PRE > 0 and PRE_LAST:
        # The peeled chunk's product last: the loop's first loads go out right after the wait
        # instead of after x_pre's round trip.
        if TMA:
            x_pre = xp_desc.load([0, k0])
        else:
            x_pre = tl.load(x_rows + kp[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w_pre, tl.trans(x_pre), acc)

    mask = n_mask[:, None] & m_mask[None, :]
    out_ptrs = out_ptr + m[None, :] * stride_om + n[:, None]
    if SPLITS == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + n[:, None] * WS_ROWS + m[None, :]
        if REDUCE_ATOMIC:
            tl.atomic_add(ws, acc, mask=mask, sem="relaxed", scope="gpu")
        else:
            tl.store(ws + split * N * WS_ROWS, acc, mask=mask)
        # Publish: the CTA barrier orders every thread's writes (atomics) before the one
        # thread's acq_rel counter atomic, whose release half (cumulative, gpu scope) makes them
        # visible to the program that reads the final count.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived < SPLITS - 1:
            return
        # Last split of the tile: nothing else touches the counter or the tile in this launch,
        # and the next launch is ordered after this one (under PDL too: it waits first).
        tl.store(count_ptr + tile, 0)
        if REDUCE_ATOMIC:
            acc = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(ws, tl.zeros_like(acc), mask=mask)
        else:
            acc = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                acc += tl.load(ws + s * N * WS_ROWS, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (device, N, kind) -> (fp32 workspace, int32 counters), zero between launches. Allocated on the
# first call of a shape, which must precede graph capture. Launches sharing a workspace must be
# stream-ordered (PDL included), never concurrent.
_WORKSPACES: dict = {}
_DESCS: dict = {}


def _workspace(device, n: int, splits: int, atomic: bool):
    key = (device, n, "atomic" if atomic else f"ordered{splits}")
    if key not in _WORKSPACES:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "fewrow_linear's first call for a shape must come before graph capture"
        slots = 1 if atomic else splits
        _WORKSPACES[key] = (
            torch.zeros(slots, n, WS_M, dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def _desc(t: torch.Tensor, block: list[int]):
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, tuple(block))
    d = _DESCS.get(key)
    if d is None:
        d = _DESCS[key] = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
    return d


def _default_pdl(device) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    try:
        from liteinfer.kernels import supports_pdl
        return supports_pdl(device)
    except ImportError:  # pragma: no cover
        return torch.cuda.get_device_capability(device)[0] >= 9


def fewrow_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                  block_n: int = 128, block_k: int = 128, splits: int = 1, pre: int = 1,
                  num_stages: int = 3, num_warps: int = 8, tma: bool = False,
                  reduce: str = "atomic", pre_last: bool = False,
                  pdl: bool | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 64, last dim contiguous); w: [N, K] (rows contiguous). Returns
    out [M, N] = x @ w^T, accumulated in fp32. Tile arguments as in FewRowTiles; K must be a
    multiple of splits * block_k, with at least `pre` chunks a split. pdl defaults to Hopper+."""
    assert x.dim() == 2 and x.stride(-1) == 1 and w.stride(-1) == 1
    rows, k = x.shape
    n = w.shape[0]
    assert 1 <= rows <= MAX_ROWS and w.shape[1] == k and x.dtype == w.dtype
    assert reduce in ("atomic", "ordered")
    assert block_n % 16 == 0 and block_k % 16 == 0
    assert k % (splits * block_k) == 0, f"K={k} not a multiple of splits*block_k={splits * block_k}"
    cps = k // (splits * block_k)
    assert pre in (0, 1, 2, 4, 8) and pre <= cps, f"pre={pre} with {cps} chunks a split"
    out = x.new_empty(rows, n) if out is None else out
    assert out.shape == (rows, n) and out.stride(-1) == 1
    block_m = block_m_for(rows)
    atomic = reduce == "atomic"
    if splits > 1:
        ws, counts = _workspace(x.device, n, splits, atomic)
    else:
        ws, counts = out, out  # unused
    pre_last = pre_last and 0 < pre < cps
    x_desc = w_desc = xp_desc = wp_desc = None
    if tma:  # host-side descriptors, cached per tensor: built once, passed by value
        assert TensorDescriptor is not None
        if cps > pre:
            x_desc, w_desc = _desc(x, [block_m, block_k]), _desc(w, [block_n, block_k])
        if pre:
            xp_desc = _desc(x, [block_m, pre * block_k])
            wp_desc = _desc(w, [block_n, pre * block_k])
    pdl = _default_pdl(x.device) if pdl is None else pdl
    if os.environ.get("TRITON_INTERPRET") == "1":
        pdl = False  # no griddepcontrol in the interpreter
    grid = (triton.cdiv(n, block_n) * splits,)
    _fewrow_kernel[grid](
        x, w, x_desc, w_desc, xp_desc, wp_desc, out, ws, counts, rows, n,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, CPS=cps, PRE=pre,
        PRE_LAST=pre_last, TMA=tma, REDUCE_ATOMIC=atomic, WS_ROWS=WS_M, USE_PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    return out


def fewrow_linear_tiles(x, w, out=None, tiles: FewRowTiles | None = None, pdl=None):
    return fewrow_linear(x, w, out, pdl=pdl, **asdict(tiles or FewRowTiles()))


def patch_interpreter_bf16_dot() -> None:
    """The interpreter (triton 3.9) keeps bf16 as raw uint16 and its create_dot multiplies the
    raw bits; widen bf16 operands to fp32 first (exact: a product of two bf16 fits fp32).
    For CPU checks under TRITON_INTERPRET=1 only."""
    import numpy as np
    from triton.runtime import interpreter as interp
    if getattr(interp.InterpreterBuilder.create_dot, "_bf16_patched", False):
        return
    orig = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.view(np.uint16).astype(np.uint32) << 16
            return interp.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._bf16_patched = True
    interp.InterpreterBuilder.create_dot = create_dot
