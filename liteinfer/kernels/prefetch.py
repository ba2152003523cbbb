"""Weights put in flight into L2 before a programmatic dependent launch's wait.

No kernel of a step writes a weight, so a kernel launched while the one before it is still
running (PDL) may start streaming its weight at once; only its activations must wait. A
`prefetch.global.L2` asks for a 128-byte line and holds no register or shared memory while the
line is in flight, so a program can have a long stretch of its weight on its way, not only the
tiles its pipeline has room for, and its loop then reads those lines from L2. The chunked GEMV
(kernels/gemv.py) does this: the 8B's down at one request starts streaming while the GEMV before
it ends. The few-row GEMMs gained nothing from it (docs/notes/journal.md, items 102 and 103), so
they wait before their first load.

The lines one launch prefetches are capped at a third of the L2, leaving room for the
activations and the previous kernel's own traffic, so the lines are still there when the loop
reaches them.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LINE_BYTES = 128


@functools.cache
def prefetch_budget(device: torch.device) -> int:
    """Bytes one launch may prefetch into the L2 of `device` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size // 3


def prefetch_lines(rows: int, row_bytes: int, device: torch.device) -> int:
    """Lines each of a weight's `rows` rows of `row_bytes` prefetches from its start: a power of
    two (a tl.arange length), at most the row's, whose lines over all the rows fit the device's
    budget; 0 for none."""
    lines = min(triton.cdiv(row_bytes, LINE_BYTES), prefetch_budget(device) // (rows * LINE_BYTES))
    return triton.next_power_of_2(lines + 1) // 2 if lines > 0 else 0


@triton.jit
def prefetch_weight(w_ptr, rows, row_limit, col_limit, stride_row, LINES: tl.constexpr):
    """Prefetches the first LINES lines (of LINE_BYTES) of each weight row in `rows`. Rows and
    columns past their limits are clamped to the last valid one (a prefetch takes no mask), so
    no address leaves the tensor."""
    line_elems: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth * 8
    rows = tl.minimum(rows, row_limit - 1).to(tl.int64)
    cols = tl.minimum(tl.arange(0, LINES) * line_elems, col_limit - 1)
    ptrs = w_ptr + rows[:, None] * stride_row + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
