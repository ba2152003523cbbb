"""How packed prefill attention is tiled (kernels/prefill_attention.py): query tokens per tile,
the tile shapes, and the host-built map of (sequence, first token) per query tile that the
kernel's programs read instead of deriving their tile from the grid. Rows that split along
their keys come first in the map, in as many programs as `split_counts` gives each: a mixed
step's decoding rows, and short queries over a long context whose tokens fit one query tile
(a verification's 1 + k tokens), which one program per KV head would otherwise stream alone.

A tile's rows are its query tokens times the G query heads that share one KV head (grouped-query
attention), so each K/V tile is loaded once for all G heads."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from liteinfer.kernels.decode_splits import MIN_SPLIT_TOKENS
from liteinfer.utils import next_power_of_2, ragged_index

MAX_TILE_ROWS = 128
# A split row's programs beside prompt tiles each take at least this many KV tokens: beside a
# 2k-token prompt piece, rows of up to 2k tokens ran fastest whole, and a 15k-token row in
# programs of a few thousand tokens (docs/notes/journal.md, item 42).
DECODE_CHUNK_TOKENS = 4096
SPLIT_BITS = 8  # a split's map entry packs (split << 8) | splits, negated
SPARE_SPLIT_ENTRIES = 32  # map entries a step reserves beyond one a row for rows to split


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # rows: query tokens x G, padded to a power of two
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tile_tokens(max_seqlen_q: int, group_size: int) -> int:
    """Query tokens per tile: 128 rows' worth for long prompts (32 tokens of 4 heads); short
    chunks (e.g. a few tokens over a long cached prefix) shrink the tile instead of wasting MMA
    rows, down to the 16 rows tl.dot needs."""
    rows = min(MAX_TILE_ROWS, max(16, next_power_of_2(max_seqlen_q * group_size)))
    return max(1, rows // group_size)


def prefill_tiles(head_dim: int, block_size: int, tile_tokens: int,
                  group_size: int) -> PrefillTiles:
    """Hopper choice for tiles of `tile_tokens` query tokens. For head_dim 64, 128 rows (a KV
    head's query group) against 64-key tiles with 8 warps measured best
    (scripts/bench_kernels.py --sweep; docs/notes/journal.md, items 33 and 52). Three stages
    give the K/V tiles looked up ahead in launches with decoding rows their second buffer, and
    prompts alone are as fast or faster with them."""
    rows = next_power_of_2(tile_tokens * group_size)
    num_warps = 8 if rows == MAX_TILE_ROWS else 4
    return PrefillTiles(rows, max(64, block_size), num_warps, num_stages=3)


def split_entries(num_decodes: int) -> int:
    """Tile-map entries a step with `num_decodes` decoding rows reserves for the programs of its
    split rows beyond their own tiles: one a decoding row, and as many again plus
    SPARE_SPLIT_ENTRIES so that long rows (a verification's too) can split."""
    return 2 * num_decodes + SPARE_SPLIT_ENTRIES


def split_counts(context_lens: np.ndarray, max_entries: int, max_splits: int,
                 alone: bool) -> np.ndarray:
    """Programs per split row (its KV tokens given; a verification's: its first query token's):
    beside prompt tiles, chunks of at least DECODE_CHUNK_TOKENS KV tokens; `alone` (no prompt
    tile in the launch), the decode kernel's even share, the rows' tokens spread over max_splits
    programs a KV head (about SPLIT_WAVES waves of SMs) and rows under two MIN_SPLIT_TOKENS
    whole. Chunks are longer where needed for all rows' programs to fit `max_entries` (at least
    one a row), and a row takes at most max_splits."""
    ctx = np.asarray(context_lens, dtype=np.int64)
    spare = max(max_entries - len(ctx), 1)
    total = int(ctx.sum())
    least = max(MIN_SPLIT_TOKENS, -(-total // max_splits)) if alone else DECODE_CHUNK_TOKENS
    chunk = max(least, -(-total // spare))
    counts = np.where(ctx < 2 * MIN_SPLIT_TOKENS, 1, -(-ctx // chunk))
    return np.clip(counts, 1, max_splits)


def prefill_tile_map(query_lens: np.ndarray, context_lens: np.ndarray, tile_tokens: int,
                     first_seq: int = 0, num_tiles: int | None = None,
                     decode_splits: Sequence[int] | np.ndarray = (),
                     prompt_splits: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """int32 [num_tiles, 2]: (sequence, first query token) of each query tile of `tile_tokens`
    tokens of the sequences `first_seq`, `first_seq + 1`, ... (their query and context lengths
    given), heaviest first so the causal tail does not straggle; rows past the real tiles are
    (-1, 0) and exit at once. Split rows come first, each in n entries whose second column
    -1 - ((split << 8) | n) tells the kernel its share of the row's KV: memory-bound programs
    that run on the SMs beside the compute-bound prompt tiles. They are the decoding sequences
    0, 1, ... (one query token each), decode_splits[b] entries for sequence b, then the
    sequences with prompt_splits[j] > 1 (default all 1), whose queries fit one tile. num_tiles:
    at least the entry count (default: exactly it)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    prompt_splits = (np.ones(len(query_lens), dtype=np.int64) if prompt_splits is None
                     else np.asarray(prompt_splits, dtype=np.int64))
    split_prompts = np.flatnonzero(prompt_splits > 1)
    assert (query_lens[split_prompts] <= tile_tokens).all(), "a split query must fit one tile"
    splits = np.concatenate([np.asarray(decode_splits, dtype=np.int64),
                             prompt_splits[split_prompts]])
    split_seqs = np.concatenate([np.arange(len(decode_splits)), split_prompts + first_seq])
    row, split = ragged_index(splits)
    num_split = len(row)
    seq, tile = ragged_index(np.where(prompt_splits > 1, 0, -(-query_lens // tile_tokens)))
    m0 = tile * tile_tokens
    # Work of a tile: the KV positions its last row sees.
    work = np.asarray(context_lens, dtype=np.int64)[seq] - query_lens[seq] + m0
    order = np.argsort(-work, kind="stable")
    used = num_split + len(seq)
    total = used if num_tiles is None else num_tiles
    assert total >= used, f"{used} tiles do not fit a map of {total}"
    tiles = np.zeros((total, 2), dtype=np.int32)
    tiles[:, 0] = -1
    tiles[:num_split, 0] = split_seqs[row]
    tiles[:num_split, 1] = -1 - ((split << SPLIT_BITS) | splits[row])
    tiles[num_split:used, 0] = seq[order] + first_seq
    tiles[num_split:used, 1] = m0[order]
    return tiles
