"""How split-K decode is sized: the grid width per batch size, each sequence's split count, and
the preallocated workspace the splits' partial results go through (kernels/decode_attention.py).

A row's split count is chosen in the decode kernel from the context lengths on the device, so
captured graphs never change shape and no launch is spent on it. A row splits into programs of
at most `share` KV tokens: what one program would hold if the batch's tokens were spread evenly
over SPLIT_WAVES waves of programs (WIDE_SPLITS waves for a batch that fills the SMs on its own
and was widened to that many splits), and at least `min_split_tokens(head_dim)`; the count
rounds up and is clamped to the grid width. So a narrow batch fills the SMs, and in a wide one
only rows longer than the even share split, which keeps a ragged batch from waiting on its
longest row. Rows shorter than two minimal splits stay in one program: there the merge costs
more than the tiles a second split would take over. Counts round up because splits own whole
tiles: 14 splits of a 3,712-token row (29 tiles) take 3 tiles each and leave 4 idle (8.6 us
against 7.9 in 15)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_SPLITS_CAP = 64
MIN_SPLIT_TOKENS = 256  # heads of 64 (128-key tiles)
# Heads of 128 read twice the bytes a token in 64-key tiles, so one tile's worth already pays
# for the merge (H200, one row of the 8B model's heads, 384 tokens: 12.5 us whole, 5.9 in
# 64-token splits; 128 tokens 4.4 whole, 5.1 in two; scripts/bench_fewrow_gemm.py).
MIN_SPLIT_TOKENS_WIDE_HEADS = 64
SPLIT_WAVES = 2  # program slots: about two (sequence, KV head, split) programs per SM
WIDE_SPLITS = 3  # width and share's waves for 17-32 rows (8 KV heads, 132 SMs) that may split


@dataclass
class DecodeWorkspace:
    """Preallocated split-K buffers, reused every step and layer (nothing is allocated per call;
    one launch at a time may use a workspace)."""

    partial_out: torch.Tensor  # fp32 [max_batch, Hq, max_splits, D]
    partial_lse: torch.Tensor  # fp32 [max_batch, Hq, max_splits]
    # int32 [max_batch, Hq]: arrival count of (sequence, KV head) in column KV head (Hq bounds
    # Hkv for any grouping). Zero between launches: zeroed here once, and each launch's last
    # program of a (sequence, KV head) resets the count it raised.
    counters: torch.Tensor

    @property
    def max_splits(self) -> int:
        return self.partial_out.shape[2]

    @classmethod
    def allocate(cls, max_batch: int, num_q_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        shape = (max_batch, num_q_heads, max_splits)
        return cls(torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                   torch.empty(*shape, dtype=torch.float32, device=device),
                   torch.zeros(max_batch, num_q_heads, dtype=torch.int32, device=device))


def min_split_tokens(head_dim: int) -> int:
    """The fewest KV tokens a split of a row gets; rows under twice that stay whole (H200, heads
    of 64, 384 tokens: 5.5 us in one split, 6.4 us in two)."""
    return MIN_SPLIT_TOKENS if head_dim <= 64 else MIN_SPLIT_TOKENS_WIDE_HEADS


def max_splits_for(batch_size: int, num_kv_heads: int, num_sms: int, may_split: bool = True,
                   waves: int = SPLIT_WAVES, cap: int = MAX_SPLITS_CAP) -> int:
    """Grid width for a batch size: enough (sequence, KV head, split) programs to fill about
    `waves` waves of SMs. Batches of up to twice that many programs get a width all the same
    when a row of theirs may split (`may_split`: one holds at least twice `min_split_tokens`):
    without it a ragged batch waits on the program of its longest row (H200, 28-32 rows of
    64-2,176 tokens: 34-35 us a layer in one split, 28-29 with the longest rows split at the
    two-wave share; uniform rows of the same total 23-25). Those of up to two waves of
    programs get WIDE_SPLITS, the others 2 (H200, rows of 64-2,176 tokens at WIDE_SPLITS
    against 2: 20-24 rows 20.5-20.8 us a layer against 24.4-25.3, 32 rows 24.2 against 27.2, 48
    rows 37.4 against 42.2, but 64 rows 51.6 against 53.9 and 48 rows of 2,100 tokens 71.8
    against 61.1). Where no row can split, more splits would only cost time (32 rows of 128-384
    tokens at width 2: a decode step 28 us longer)."""
    programs = max(1, batch_size * num_kv_heads)
    width = waves * num_sms // programs
    if width < 2 and may_split and programs < 2 * waves * num_sms:
        width = WIDE_SPLITS if programs <= waves * num_sms else 2
    return max(1, min(cap, width))


def program_slots(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int) -> int:
    """Programs the kernel's even share spreads a batch's KV tokens over: SPLIT_WAVES waves of
    SMs, or as many as its width for a batch that fills the SMs on its own (max_splits_for)."""
    wide = batch_size * num_kv_heads > num_sms and max_splits > 1
    return num_sms * (max_splits if wide else SPLIT_WAVES)


def rows_may_split(context_lens: Sequence[int] | np.ndarray, head_dim: int) -> bool:
    """Whether a row of a decode batch (host-side lengths) is long enough to split. Runs on
    every captured decode step's host path, so it reduces in numpy."""
    lens = np.asarray(context_lens)
    return lens.size > 0 and bool(lens.max() >= 2 * min_split_tokens(head_dim))
