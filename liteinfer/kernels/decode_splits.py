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
tiles: rounding down leaves some splits idle while the others take an extra tile (the sizing's
measurements: NOTES.md, "Measured choices in the code")."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_SPLITS_CAP = 64
MIN_SPLIT_TOKENS = 256  # heads of 64 (128-key tiles)
# Heads of 128 read twice the bytes a token in 64-key tiles, so one tile's worth already pays
# for the merge (docs/notes/journal.md, item 82).
MIN_SPLIT_TOKENS_WIDE_HEADS = 64
SPLIT_WAVES = 2  # program slots: about two (sequence, KV head, split) programs per SM
WIDE_SPLITS = 3  # width and share's waves for 17-32 rows (8 KV heads, 132 SMs) that may split


@dataclass
class DecodeWorkspace:
    """Preallocated split-K buffers, reused every step and layer (nothing is allocated per call;
    one launch at a time may use a workspace)."""

    # Rows: a decode step's sequences; in a prompt step, the query tokens of its split rows
    # (decoding rows and verifications, kernels/prefill_tiles.py) by their place in the step.
    partial_out: torch.Tensor  # fp32 [max_batch, Hq, max_splits, D]
    partial_lse: torch.Tensor  # fp32 [max_batch, Hq, max_splits]
    # int32 [max_batch, Hq]: arrival count of (row, KV head) in column KV head (Hq bounds Hkv
    # for any grouping); a split row counts at its first token's row. Zero between launches:
    # zeroed here once, and each launch's last program of a (row, KV head) resets the count it
    # raised.
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
    """The fewest KV tokens a split of a row gets; rows under twice that stay whole, where a
    second split costs more than it takes over (journal items 15 and 82)."""
    return MIN_SPLIT_TOKENS if head_dim <= 64 else MIN_SPLIT_TOKENS_WIDE_HEADS


def max_splits_for(batch_size: int, num_kv_heads: int, num_sms: int, may_split: bool = True,
                   waves: int = SPLIT_WAVES, cap: int = MAX_SPLITS_CAP) -> int:
    """Grid width for a batch size: enough (sequence, KV head, split) programs to fill about
    `waves` waves of SMs. Batches of up to twice that many programs get a width all the same
    when a row of theirs may split (`may_split`: one holds at least twice `min_split_tokens`):
    without it a ragged batch waits on the program of its longest row (journal item 41).
    Those of up to two waves of programs get WIDE_SPLITS, the others 2, which measured faster
    up to 48 rows of mixed lengths and slower beyond (items 43 and 44). Where no row can split,
    more splits would only cost time."""
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


class DecodeSplits:
    """A model's split-K decode sizing in one place: its workspace (allocated by the model
    runner into its scratch buffers, `allocate`), and from its KV heads, head size and the SMs,
    each decode batch's grid width and the split rows' bounds a prompt step's tile map keeps to.
    Called on every decode step's host path, so each answer is one rule with no extra work."""

    def __init__(self, workspace: DecodeWorkspace, num_kv_heads: int, head_dim: int,
                 num_sms: int):
        self.workspace = workspace
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_sms = num_sms

    @classmethod
    def allocate(cls, rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 num_sms: int, device: torch.device | str) -> DecodeSplits:
        """`rows` workspace rows (EngineConfig.split_workspace_rows), each as wide as the widest
        grid: one row's (`max_splits_for(1, ...)`)."""
        width = max_splits_for(1, num_kv_heads, num_sms)
        return cls(DecodeWorkspace.allocate(rows, num_q_heads, head_dim, width, device),
                   num_kv_heads, head_dim, num_sms)

    @property
    def max_splits(self) -> int:
        """Most programs a decoding row splits into."""
        return self.workspace.max_splits

    @property
    def rows(self) -> int:
        """Workspace rows: a prompt step's split rows (decoding rows, verifications) index them
        by token."""
        return self.workspace.partial_out.shape[0]

    def may_split(self, context_lens: Sequence[int] | np.ndarray) -> bool:
        """Whether a decoding row of these host-side lengths is long enough to split."""
        return rows_may_split(context_lens, self.head_dim)

    def width(self, num_decodes: int, may_split: bool) -> int:
        """The grid width of `num_decodes` decoding rows (1: none split)."""
        if num_decodes == 0:
            return 1
        return max_splits_for(num_decodes, self.num_kv_heads, self.num_sms, may_split)
