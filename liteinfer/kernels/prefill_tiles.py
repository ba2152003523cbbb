"""How packed prefill attention is tiled (kernels/prefill_attention.py): query tokens per tile,
the tile shapes, and the host-built map of (sequence, first token) per query tile that the
kernel's programs read instead of deriving their tile from the grid.

A tile's rows are its query tokens times the G query heads that share one KV head (grouped-query
attention), so each K/V tile is loaded once for all G heads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from liteinfer.utils import next_power_of_2

MAX_TILE_ROWS = 128


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
    """Hopper choice for tiles of `tile_tokens` query tokens. For head_dim 64, 128 rows against
    64-key tiles with 8 warps measured best on the H200 (scripts/bench_kernels.py --sweep): 15%
    faster than 128 rows of one head against 128-key tiles at one 2,016-token prompt, 2% at
    15,360 tokens."""
    rows = next_power_of_2(tile_tokens * group_size)
    num_warps = 8 if rows == MAX_TILE_ROWS else 4
    return PrefillTiles(rows, max(64, block_size), num_warps, num_stages=2)


def prefill_tile_map(query_lens: np.ndarray, context_lens: np.ndarray, tile_tokens: int,
                     first_seq: int = 0, num_tiles: int | None = None) -> np.ndarray:
    """int32 [num_tiles, 2]: (sequence, first query token) of each query tile of `tile_tokens`
    tokens of the sequences `first_seq`, `first_seq + 1`, ... (their query and context lengths
    given), heaviest first so the causal tail does not straggle; rows past the real tiles are
    (-1, 0) and exit at once. num_tiles: at least the tile count (default: exactly it)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    per_seq = -(-query_lens // tile_tokens)
    seq = np.repeat(np.arange(len(query_lens)), per_seq)
    m0 = (np.arange(len(seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * tile_tokens
    # Work of a tile: the KV positions its last row sees.
    work = np.asarray(context_lens, dtype=np.int64)[seq] - query_lens[seq] + m0
    order = np.argsort(-work, kind="stable")
    total = len(seq) if num_tiles is None else num_tiles
    assert total >= len(seq), f"{len(seq)} query tiles do not fit a map of {total}"
    tiles = np.zeros((total, 2), dtype=np.int32)
    tiles[:, 0] = -1
    tiles[:len(seq), 0] = seq[order] + first_seq
    tiles[:len(seq), 1] = m0[order]
    return tiles
