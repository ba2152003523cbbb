"""How split-K decode is sized: the grid width per batch size, each sequence's split count, and
the preallocated workspace the splits' partial results go through (kernels/decode_attention.py).

A row's split count is chosen in the decode kernel from the context lengths on the device, so
captured graphs never change shape and no launch is spent on it. A row splits into programs of
at most `share` KV tokens: what one program would hold if the batch's tokens were spread evenly
over SPLIT_WAVES waves of programs, and at least MIN_SPLIT_TOKENS; the count rounds up and is
clamped to the grid width. So a narrow batch fills the SMs, and in a wide one only rows longer
than the even share split, which keeps a ragged batch from waiting on its longest row. Rows
shorter than two minimal splits stay in one program: there the merge costs more than the tiles a
second split would take over (H200, 384 tokens: 5.5 us in one split, 6.4 us in two). Counts
round up because splits own whole tiles: 14 splits of a 3,712-token row (29 tiles) take 3 tiles
each and leave 4 idle (8.6 us against 7.9 in 15)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_SPLITS_CAP = 64
MIN_SPLIT_TOKENS = 256
SPLIT_WAVES = 2  # program slots: about two (sequence, KV head, split) programs per SM


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

    @classmethod
    def allocate(cls, max_batch: int, num_q_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        shape = (max_batch, num_q_heads, max_splits)
        return cls(torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                   torch.empty(*shape, dtype=torch.float32, device=device),
                   torch.zeros(max_batch, num_q_heads, dtype=torch.int32, device=device))


def max_splits_for(batch_size: int, num_kv_heads: int, num_sms: int, may_split: bool = True,
                   waves: int = SPLIT_WAVES, cap: int = MAX_SPLITS_CAP) -> int:
    """Grid width for a batch size: enough (sequence, KV head, split) programs to fill about
    `waves` waves of SMs. Batches of up to twice that many programs get width 2 all the same
    when a row of theirs may split (`may_split`: one holds at least 2 * MIN_SPLIT_TOKENS
    tokens): without it a ragged batch waits on the program of its longest row (H200, 28-32
    rows of 64-2,176 tokens: 34-35 us a layer in one split, 28-29 with the longest rows split;
    uniform rows of the same total 23-25). Where no row can split, the second split's programs
    would only cost time (32 rows of 128-384 tokens: a decode step 28 us longer)."""
    programs = max(1, batch_size * num_kv_heads)
    width = waves * num_sms // programs
    if width < 2 and may_split and programs < 2 * waves * num_sms:
        width = 2
    return max(1, min(cap, width))


def rows_may_split(context_lens: Sequence[int] | np.ndarray) -> bool:
    """Whether a row of a decode batch (host-side lengths) is long enough to split. Runs on
    every captured decode step's host path, so it reduces in numpy."""
    lens = np.asarray(context_lens)
    return lens.size > 0 and bool(lens.max() >= 2 * MIN_SPLIT_TOKENS)
