"""Packed prefill attention over the paged KV pool.

All sequences' query tokens (whole prompts or chunks) form one flat run; query token i of
sequence b sits at absolute position context_lens[b] - q_len_b + i and attends causally to
every KV position up to it (cached prefix and this chunk), read from the pool through the
block table. One program per (KV head, query tile), flash-attention style: the tile's rows are
its tokens times the G query heads of that KV head, token-major, so each K/V tile is loaded
once for all of them; KV tiles entirely below the diagonal run without a mask, the few on it
with the causal mask.

The query tiles come from a tile map built on the host (kernels/prefill_tiles.py), not from
the grid shape: a captured step keeps one grid for any mix of prompt lengths. A mixed step's
decoding rows are in the map too (one query token each, over a range of their KV, merged by
the decode kernel's split-K epilogue), so their memory-bound programs share the SMs with the
compute-bound prompt tiles instead of running as a launch of their own. A query that fits one
tile over a long context (a verification's 1 + k tokens) splits along its keys the same way:
each of its programs is the query tile over a range of whole KV tiles, placed by its first
token's context so that every row sees a key in the range's first tile, the last range running
on over the diagonal (the only one masked); its partials go to the workspace one row a query
token, and its last program merges them token by token. Without that, one program a KV head
would stream the whole context (8 programs for 8 KV heads on 132 SMs). Such a launch ends
when the last decoding row's serial chain of KV tiles does, so there every loop looks the next
tile's block ids up ahead and its K/V copies overlap the current tile's softmax; a launch of
prompts alone is faster without (docs/notes/journal.md, item 52).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_DTYPE, dot_precision
from liteinfer.kernels.decode_attention import (
    LOG2E,
    attend_kv_range,
    decode_tiles,
    finish_split,
    query_rows,
    softmax_tile,
    split_range,
    workspace_args,
)
from liteinfer.kernels.decode_splits import DecodeWorkspace
from liteinfer.kernels.kv_cache import (
    first_tile_blocks,
    kv_tile_blocks,
    load_kv_rows,
    load_kv_tile,
    pool_strides,
)
from liteinfer.kernels.prefill_tiles import SPLIT_BITS, prefill_tiles


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, tile_map,
                    out_ptr, part_out, part_lse, counters,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_cb,
                    qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_pool_block, stride_pool_row, stride_pool_head,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    DECODE_ROWS: tl.constexpr, DECODE_BLOCK_N: tl.constexpr,
                    SPLIT_BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                    CHUNK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    LOOKAHEAD: tl.constexpr):
    kvh = tl.program_id(0)
    b = tl.load(tile_map + 2 * tl.program_id(1))
    if b < 0:
        return
    m0 = tl.load(tile_map + 2 * tl.program_id(1) + 1)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    ctx = tl.load(context_lens + b)
    d = tl.arange(0, HEAD_DIM)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_pool_head
    tok = q_start.to(tl.int64)
    # A split entry (m0 < 0) packs the split and the row's split count; a query tile is one
    # whole split.
    is_split = m0 < 0
    code = -1 - m0
    split = tl.where(is_split, code >> SPLIT_BITS, 0)
    n_splits = tl.where(is_split, code & ((1 << SPLIT_BITS) - 1), 1)
    if is_split & (q_len == 1):
        # A decoding row's split: its one query token (position ctx - 1) attends to a range of
        # whole KV tiles, as in the decode kernel, its G query heads padded to DECODE_ROWS.
        start, end = split_range(ctx, split, n_splits, DECODE_BLOCK_N)
        r = tl.arange(0, DECODE_ROWS)
        heads = kvh * G + r
        h_mask = r < G
        q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None], other=0.0)
        acc, l_i, m_i = attend_kv_range(q, k_cache, v_cache, bt_row, kv_head_off, start, end, d,
                                        qk_scale, stride_pool_block, stride_pool_row,
                                        DECODE_BLOCK_N, BLOCK_SIZE, DOT_PRECISION, LOOKAHEAD,
                                        end, False)
        finish_split(acc, l_i, m_i, out_ptr + tok * stride_ot, 0, stride_oh,
                     tl.zeros([DECODE_ROWS], dtype=tl.int32), heads, h_mask, d, q_start, 1,
                     kvh, split, n_splits, part_out, part_lse, counters, stride_pb, stride_ph,
                     stride_ps, stride_lb, stride_lh, stride_cb, G, HEAD_DIM, BLOCK_G, BLOCK_S,
                     CHUNK_S)
    else:
        _query_tile(q_ptr, k_cache, v_cache, out_ptr, tl.maximum(m0, 0), tok, q_len, ctx, kvh,
                    split, n_splits, bt_row, kv_head_off, d, qk_scale, part_out, part_lse,
                    counters, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_cb,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_pool_block,
                    stride_pool_row, G, HEAD_DIM, TILE_TOKENS, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                    BLOCK_G, BLOCK_S, CHUNK_S, DOT_PRECISION, LOOKAHEAD)


@triton.jit
def _query_tile(q_ptr, k_cache, v_cache, out_ptr, m0, tok, q_len, ctx, kvh, split, n_splits,
                bt_row, kv_head_off, d, qk_scale, part_out, part_lse, counters, stride_pb,
                stride_ph, stride_ps, stride_lb, stride_lh, stride_cb, stride_qt, stride_qh,
                stride_ot, stride_oh, stride_pool_block, stride_pool_row, G: tl.constexpr,
                HEAD_DIM: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
                LOOKAHEAD: tl.constexpr):
    """Query tokens m0 .. m0 + TILE_TOKENS - 1 of a sequence whose first query token is token
    `tok` of the step, over split `split` of n_splits of their keys (n_splits 1: all of them)."""
    prefix = ctx - q_len

    # Row r: token m0 + r // G, query head kvh * G + r % G; rows past TILE_TOKENS * G pad
    # BLOCK_M to a power of two.
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows // G
    heads = kvh * G + rows % G
    m_mask = (offs_m < q_len) & (rows < TILE_TOKENS * G)
    q = tl.load(q_ptr + (tok + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :], mask=m_mask[:, None], other=0.0)
    q_pos = prefix + offs_m
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # The keys the tile's first row sees; every row sees their whole KV tiles in full.
    first_ctx = prefix + m0 + 1
    full_end = first_ctx // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(ctx, prefix + m0 + TILE_TOKENS)
    # A split's keys: whole tiles of the first row's, the last split's running on to the
    # causal end, so every row sees a key in a split's first tile (softmax_tile's condition).
    # Only the last split crosses the diagonal.
    start, end = split_range(first_ctx, split, n_splits, BLOCK_N)
    end = tl.where((start < end) & (end == first_ctx), causal_end, end)

    # KV tiles every row sees in full: no mask, no bounds checks.
    blocks = first_tile_blocks(bt_row, start, ctx, BLOCK_N, BLOCK_SIZE, LOOKAHEAD)
    for start_n in range(start, tl.minimum(full_end, end), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tile_blocks, blocks = kv_tile_blocks(bt_row, blocks, offs_n, ctx, BLOCK_N, BLOCK_SIZE,
                                             LOOKAHEAD)
        k, v = load_kv_rows(k_cache, v_cache, tile_blocks, offs_n, d, kv_head_off,
                            stride_pool_block, stride_pool_row, BLOCK_SIZE, False, ctx)
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, None, qk_scale,
                                     False, DOT_PRECISION)
    # Tiles crossing the diagonal. The tile's first key (at most position prefix + m0) is
    # visible to every row (padding rows too), so each row's first tile has a finite max.
    for start_n in range(tl.maximum(full_end, start), end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_pool_block,
                            stride_pool_row, BLOCK_SIZE, True, ctx)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < ctx)[None, :]
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, visible, qk_scale,
                                     True, DOT_PRECISION)
    finish_split(acc, l_i, m_i, out_ptr + tok * stride_ot, stride_ot, stride_oh, offs_m, heads,
                 m_mask, d, tok, q_len, kvh, split, n_splits, part_out, part_lse, counters,
                 stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_cb, G, HEAD_DIM,
                 BLOCK_G, BLOCK_S, CHUNK_S)


def packed_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, tile_map: torch.Tensor,
                             tile_tokens: int, scale: float, out: torch.Tensor,
                             workspace: DecodeWorkspace | None = None,
                             with_decodes: bool = False) -> torch.Tensor:
    """q, out: [T, Hq, D] (last dim contiguous); caches: [num_blocks, block_size, Hkv, D] with
    equal strides, D contiguous, in q's dtype or e4m3;
    cu_seqlens_q: int32 [B+1]; context_lens: int32 [B] (>= each q_len; KV of this step
    already in the pool); block_tables: int32 [B, max_blocks]; tile_map: int32 [N, 2] from
    prefill_tile_map with `tile_tokens` query tokens a tile (prefill_tile_tokens), split rows
    included. A row in several splits needs `workspace`, whose rows are indexed by the step's
    token (a row for each query token of a split row, as many splits; its counters zero, as
    every launch leaves them).
    with_decodes: the map holds decoding rows; their launch looks each KV tile's block ids up
    one tile ahead (kv_cache.kv_tile_blocks). Only the mapped rows of out are written. Returns
    out."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    pool = pool_strides(k_cache, v_cache)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape
    assert num_q_heads % num_kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim)
    assert cu_seqlens_q.shape[0] == context_lens.shape[0] + 1 and block_tables.stride(-1) == 1
    assert tile_map.is_contiguous() and tile_map.shape[1:] == (2,)
    assert k_cache.dtype in (q.dtype, FP8_DTYPE)
    if num_tokens == 0 or tile_map.shape[0] == 0:
        return out
    group = num_q_heads // num_kv_heads
    tiles = prefill_tiles(head_dim, block_size, tile_tokens, group)
    max_splits = 1 if workspace is None else workspace.max_splits
    # The tile map's split rows index the workspace by token: prefill_tile_map's caller bounds
    # them (StepInputs.attention_tile_map), so no row count to check here.
    split_args, merge_tiles = workspace_args(workspace, max_splits, 0, num_kv_heads, group, out,
                                             context_lens)
    _prefill_kernel[(num_kv_heads, tile_map.shape[0])](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, tile_map, out,
        *split_args, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *pool,
        G=group, HEAD_DIM=head_dim, TILE_TOKENS=tile_tokens, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, DECODE_ROWS=query_rows(group),
        DECODE_BLOCK_N=decode_tiles(head_dim, block_size).block_n, SPLIT_BITS=SPLIT_BITS,
        **merge_tiles, DOT_PRECISION=dot_precision(q.dtype),
        LOOKAHEAD=with_decodes,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
