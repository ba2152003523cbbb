"""How packed prefill attention is tiled (kernels/prefill_attention.py): query tokens per tile,
the tile shapes, and the host-built map of (sequence, first token) per query tile that the
kernel's programs read instead of deriving their tile from the grid; a mixed step's decoding
rows come first in the map, in as many programs as `decode_split_counts` gives each.

A tile's rows are its query tokens times the G query heads that share one KV head (grouped-query
attention), so each K/V tile is loaded once for all G heads."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from liteinfer.utils import next_power_of_2, ragged_index

MAX_TILE_ROWS = 128
# A decoding row's programs in the prefill launch each take at least this many KV tokens: beside
# a 2k-token prompt piece, rows of up to 2k tokens ran fastest whole, and a 15k-token row in
# programs of a few thousand tokens (docs/notes/journal.md, item 42).
DECODE_CHUNK_TOKENS = 4096
DECODE_SPLIT_BITS = 8  # a decoding split's map entry packs (split << 8) | splits, negated


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


def decode_entries(num_decodes: int) -> int:
    """Tile-map entries a step with `num_decodes` decoding rows reserves for them: one a row,
    and as many again plus 32 so that long rows can split."""
    return 2 * num_decodes + 32 if num_decodes else 0


def decode_split_counts(context_lens: np.ndarray, max_entries: int,
                        max_splits: int) -> np.ndarray:
    """Programs per decoding row: chunks of at least DECODE_CHUNK_TOKENS KV tokens, longer when
    needed for all rows' programs to fit `max_entries` (at least one a row), and at most
    max_splits a row."""
    ctx = np.asarray(context_lens, dtype=np.int64)
    spare = max(max_entries - len(ctx), 1)
    chunk = max(DECODE_CHUNK_TOKENS, -(-int(ctx.sum()) // spare))
    return np.clip(-(-ctx // chunk), 1, max_splits)


def prefill_tile_map(query_lens: np.ndarray, context_lens: np.ndarray, tile_tokens: int,
                     first_seq: int = 0, num_tiles: int | None = None,
                     decode_splits: Sequence[int] | np.ndarray = ()) -> np.ndarray:
    """int32 [num_tiles, 2]: (sequence, first query token) of each query tile of `tile_tokens`
    tokens of the sequences `first_seq`, `first_seq + 1`, ... (their query and context lengths
    given), heaviest first so the causal tail does not straggle; rows past the real tiles are
    (-1, 0) and exit at once. Decoding sequences 0, 1, ... (one query token each) come first,
    decode_splits[b] entries for sequence b, whose second column -1 - ((split << 8) | splits)
    tells the kernel its share of the row's KV: memory-bound programs that run on the SMs
    beside the compute-bound prompt tiles. num_tiles: at least the entry count (default:
    exactly it)."""
    splits = np.asarray(decode_splits, dtype=np.int64)
    dec_seq, dec_split = ragged_index(splits)
    decodes = len(dec_seq)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq, tile = ragged_index(-(-query_lens // tile_tokens))
    m0 = tile * tile_tokens
    # Work of a tile: the KV positions its last row sees.
    work = np.asarray(context_lens, dtype=np.int64)[seq] - query_lens[seq] + m0
    order = np.argsort(-work, kind="stable")
    used = decodes + len(seq)
    total = used if num_tiles is None else num_tiles
    assert total >= used, f"{used} tiles do not fit a map of {total}"
    tiles = np.zeros((total, 2), dtype=np.int32)
    tiles[:, 0] = -1
    tiles[:decodes, 0] = dec_seq
    tiles[:decodes, 1] = -1 - ((dec_split << DECODE_SPLIT_BITS) | np.repeat(splits, splits))
    tiles[decodes:used, 0] = seq[order] + first_seq
    tiles[decodes:used, 1] = m0[order]
    return tiles
