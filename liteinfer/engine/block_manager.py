"""The pool of fixed-size KV blocks, each sequence's block table, and the prefix cache.

With prefix caching, a block whose tokens are all computed is registered under a key of its
tokens and the key of the block before it, so the key names the whole prefix up to the block's
end. A new prompt's leading full blocks are looked up by those keys: blocks found are shared (a
reference count per block) and their tokens are not computed again. A freed block that holds a
registered prefix is kept, evictable, until a new block is needed and the free list is empty;
the least recently freed goes first, and a sequence frees its blocks last to first, so a
prefix's tail is evicted before its head.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from liteinfer.engine.sequence import Sequence
from liteinfer.utils import cdiv

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


class BlockManager:
    """Hands out KV-cache blocks. A sequence of n tokens holds ceil(n / block_size) blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached: dict[BlockKey, int] = {}  # prefix key -> block holding it
        self.block_keys: dict[int, BlockKey] = {}  # the inverse, for registered blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks
        # Prompt tokens looked up in the prefix cache at admission, and those found.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given: free ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    def unreferenced_blocks(self) -> list[int]:
        return [*self.free_blocks, *self.evictable]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError("KV pool exhausted; the scheduler should have preempted")
        for _ in range(needed):
            seq.block_table.append(self._take())

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, sharing the cached blocks of its
        longest cached prefix (whose tokens then count as computed). False if the pool cannot
        hold it; then nothing changes."""
        hits, hashes = self._cached_prefix(seq)
        reused = sum(1 for b in hits if self.ref_counts[b] == 0)  # evictable ones stop being so
        if cdiv(len(seq), self.block_size) - len(hits) > self.num_free_blocks - reused:
            return False
        for b in hits:
            self._ref(b)
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += len(hits) * self.block_size
        seq.block_table = hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.block_key_hashes = hashes
        self.allocate(seq, len(seq))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks whose tokens are all computed and known on the host."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        hashes = seq.block_key_hashes
        if full <= len(hashes):  # most calls: no block newly full
            return
        for i in range(len(hashes), full):
            key = self._key(seq, i, hashes[-1] if hashes else 0)
            if key not in self.cached:  # else another sequence computed the same prefix first
                self.cached[key] = seq.block_table[i]
                self.block_keys[seq.block_table[i]] = key
            hashes.append(hash(key))

    def free(self, seq: Sequence) -> None:
        released = []
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                released.append(block)
        self.free_blocks.extend(b for b in released if b not in self.block_keys)
        for block in reversed(released):
            if block in self.block_keys:
                self.evictable[block] = None
        seq.block_table = []
        seq.block_key_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: evictable blocks become free, and blocks that running
        sequences hold are no longer found by new prompts."""
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.block_keys.clear()

    def _key(self, seq: Sequence, i: int, parent: int) -> BlockKey:
        return parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks of seq's leading full blocks, and their keys' hashes, leaving at least
        its last token to compute (its logits are needed). None for a sequence that wants its
        prompt's logprobs: those need every prompt token computed."""
        hits: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return hits, hashes
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            key = self._key(seq, i, hashes[-1] if hashes else 0)
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
            hashes.append(hash(key))
        return hits, hashes

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently freed cached one."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys.pop(block)]
        self.ref_counts[block] = 1
        return block
