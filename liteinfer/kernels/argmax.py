"""Greedy decoding's argmax over the vocabulary, split across the GPU.

torch's argmax gives each logits row to one thread block: over a 128,256-token vocabulary that
block walks 250 values a thread while the rest of the GPU idles, a visible share of a small
model's decode step (docs/notes/journal.md, item 86). Here a row is cut into CHUNK-wide pieces,
one program each, that write their piece's maximum and its first index; a second launch takes,
per row, the first piece holding the row's maximum. Ties go to the lowest index, as torch's
argmax does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl

CHUNK = 4096  # logits a program reads: 32 a thread at 4 warps


@triton.jit
def _chunk_max_kernel(x_ptr, stride_row, V, max_ptr, idx_ptr, NUM_CHUNKS,
                      CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, chunk * CHUNK + at)


@triton.jit
def _row_argmax_kernel(max_ptr, idx_ptr, out_ptr, NUM_CHUNKS, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_CHUNKS
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    best = tl.load(max_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    _, first = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    idx = tl.load(idx_ptr + row * NUM_CHUNKS + first)
    tl.store(out_ptr + row, idx.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype, rows contiguous) -> int64 [rows], each row's first
    index of its maximum."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    maxima = torch.empty(rows, chunks, device=logits.device, dtype=torch.float32)
    indices = torch.empty(rows, chunks, device=logits.device, dtype=torch.int32)
    out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    pdl = supports_pdl(logits.device)
    _chunk_max_kernel[(rows, chunks)](logits, logits.stride(0), vocab, maxima, indices, chunks,
                                      CHUNK=CHUNK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    _row_argmax_kernel[(rows,)](maxima, indices, out, chunks,
                                BLOCK=triton.next_power_of_2(chunks), USE_PDL=pdl, num_warps=1,
                                launch_pdl=pdl)
    return out
