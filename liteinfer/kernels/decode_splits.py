"""How split-K decode is sized: the grid width per batch size, each sequence's split count
(chosen on the device, so captured graphs never change shape), and the preallocated workspace
the splits' partial results go through (kernels/decode_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SPLITS_CAP = 64


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


def max_splits_for(batch_size: int, num_kv_heads: int, num_sms: int, waves: int = 2,
                   cap: int = MAX_SPLITS_CAP) -> int:
    """Grid width for a batch size: enough (sequence, KV head, split) programs to fill about
    `waves` waves of SMs; batches that fill them already get 1 (no merge)."""
    return max(1, min(cap, waves * num_sms // max(1, batch_size * num_kv_heads)))


def choose_num_splits(context_lens: torch.Tensor, max_splits: int,
                      min_tokens_per_split: int = 256) -> torch.Tensor:
    """Per-row split counts on the device (torch ops only, graph-safe): one split per
    `min_tokens_per_split` KV tokens, clamped to [1, max_splits], except that rows shorter than
    two such chunks stay in one program: there the merge costs more than the tiles a second
    split would take over (H200, 384 tokens: 5.5 us in one split, 6.4 us in two). Rounding the
    count down instead would be worse for long rows, whose splits own whole tiles: 14 splits of
    a 3,712-token row (29 tiles) take 3 tiles each and leave 4 idle, 8.6 us against 7.9 us."""
    n = torch.div(context_lens + (min_tokens_per_split - 1), min_tokens_per_split,
                  rounding_mode="floor")
    n = torch.where(context_lens < 2 * min_tokens_per_split, 1, n)
    return n.clamp_(1, max_splits).to(torch.int32)
