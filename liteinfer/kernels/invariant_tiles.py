"""How the batch-invariant attention kernel (kernels/invariant_attention.py) tiles a prompt or
mixed step's queries: host-side, without Triton, for the eager backend and the captured prompt
steps' layout (engine/prompt_graph.py) alike."""
from __future__ import annotations

import numpy as np

from liteinfer.utils import next_power_of_2, ragged_index


def block_q(group: int) -> int:
    """Query rows a program holds: at least tl.dot's 16, and every head of a KV group."""
    return max(16, next_power_of_2(group))


def tile_tokens(group: int) -> int:
    """Query tokens a tile holds."""
    return block_q(group) // group


def query_tiles(query_lens: np.ndarray, starts: np.ndarray, group: int,
                num_tiles: int | None = None) -> np.ndarray:
    """[N, 2] int32 (sequence, first token) of a prompt or mixed step: sequence s's
    query_lens[s] tokens, from token starts[s] on, cut into tiles of tile_tokens(group) tokens
    (a sequence of no tokens, none). num_tiles: at least the tile count; the entries past them
    are (-1, 0), which the kernel skips. A tile's token count is the kernel's to derive from the
    step's cu_seqlens, so a captured step's map needs no more than this."""
    per_tile = tile_tokens(group)
    seq, tile = ragged_index(-(-np.asarray(query_lens, dtype=np.int64) // per_tile))
    total = len(seq) if num_tiles is None else num_tiles
    assert total >= len(seq), f"{len(seq)} tiles do not fit a map of {total}"
    tiles = np.zeros((total, 2), dtype=np.int32)
    tiles[:, 0] = -1
    tiles[:len(seq), 0] = seq
    tiles[:len(seq), 1] = np.asarray(starts, dtype=np.int64)[seq] + tile * per_tile
    return tiles
