"""How packed prefill attention is tiled (kernels/prefill_attention.py): query rows per tile,
the tile shapes, and the host-built map of (sequence, first row) per query tile that the kernel's
programs read instead of deriving their tile from the grid."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from liteinfer.utils import next_power_of_2


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_block_m(max_seqlen_q: int) -> int:
    """Query rows per tile: 128 for long prompts; short chunks (e.g. a few tokens over a long
    cached prefix) shrink the tile instead of wasting MMA rows."""
    return min(128, max(16, next_power_of_2(max_seqlen_q)))


def prefill_tiles(head_dim: int, block_size: int, block_m: int) -> PrefillTiles:
    """Hopper choice. For head_dim 64, 128-key tiles with 2 stages measured best on the H200
    (361 TFLOP/s at 15360 tokens, against 341 with 64-key tiles and 3 stages;
    scripts/bench_kernels.py --sweep)."""
    num_warps = 8 if block_m == 128 and head_dim >= 128 else 4
    block_n = 128 if head_dim <= 64 else 64
    return PrefillTiles(block_m, max(block_n, block_size), num_warps, num_stages=2)


def prefill_tile_map(query_lens: np.ndarray, context_lens: np.ndarray, block_m: int,
                     first_seq: int = 0, num_tiles: int | None = None) -> np.ndarray:
    """int32 [num_tiles, 2]: (sequence, first query row) of each query tile of the sequences
    `first_seq`, `first_seq + 1`, ... (their query and context lengths given), heaviest first so
    the causal tail does not straggle; rows past the real tiles are (-1, 0) and exit at once.
    num_tiles: at least the tile count (default: exactly it)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    per_seq = -(-query_lens // block_m)
    seq = np.repeat(np.arange(len(query_lens)), per_seq)
    m0 = (np.arange(len(seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block_m
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
