"""The pool of fixed-size KV blocks and each sequence's block table."""
from __future__ import annotations

from collections import deque

from liteinfer.engine.sequence import Sequence
from liteinfer.utils import cdiv


class BlockManager:
    """Hands out KV-cache blocks. A sequence of n tokens holds ceil(n / block_size) blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError("KV pool exhausted; the scheduler should have preempted")
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
