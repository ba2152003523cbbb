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
compute-bound prompt tiles instead of running as a launch of their own. Such a launch ends
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
from liteinfer.kernels.prefill_tiles import DECODE_SPLIT_BITS, prefill_tiles


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
    ctx = tl.load(context_lens + b)
    d = tl.arange(0, HEAD_DIM)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_pool_head
    if m0 < 0:
        # A decoding row's split: its one query token (position ctx - 1) attends to a range of
        # whole KV tiles, as in the decode kernel, its G query heads padded to DECODE_ROWS.
        code = -1 - m0
        split = code >> SPLIT_BITS
        n_splits = code & ((1 << SPLIT_BITS) - 1)
        start, end = split_range(ctx, split, n_splits, DECODE_BLOCK_N)
        r = tl.arange(0, DECODE_ROWS)
        heads = kvh * G + r
        h_mask = r < G
        tok = q_start.to(tl.int64)
        q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None], other=0.0)
        acc, l_i, m_i = attend_kv_range(q, k_cache, v_cache, bt_row, kv_head_off, start, end, d,
                                        qk_scale, stride_pool_block, stride_pool_row,
                                        DECODE_BLOCK_N, BLOCK_SIZE, DOT_PRECISION, LOOKAHEAD)
        finish_split(acc, l_i, m_i, out_ptr + tok * stride_ot, stride_oh, heads, h_mask, d, b,
                     kvh, split, n_splits, part_out, part_lse, counters, stride_pb, stride_ph,
                     stride_ps, stride_lb, stride_lh, stride_cb, G, HEAD_DIM, BLOCK_G, BLOCK_S,
                     CHUNK_S)
    else:
        _prompt_tile(q_ptr, k_cache, v_cache, cu_seqlens_q, out_ptr, b, m0, q_start, ctx, kvh,
                     bt_row, kv_head_off, d, qk_scale, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_pool_block, stride_pool_row, G, HEAD_DIM, TILE_TOKENS,
                     BLOCK_M, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, LOOKAHEAD)


@triton.jit
def _prompt_tile(q_ptr, k_cache, v_cache, cu_seqlens_q, out_ptr, b, m0, q_start, ctx, kvh,
                 bt_row, kv_head_off, d, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_pool_block, stride_pool_row, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 LOOKAHEAD: tl.constexpr):
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    prefix = ctx - q_len

    # Row r: token m0 + r // G, query head kvh * G + r % G; rows past TILE_TOKENS * G pad
    # BLOCK_M to a power of two.
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows // G
    heads = kvh * G + rows % G
    m_mask = (offs_m < q_len) & (rows < TILE_TOKENS * G)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=m_mask[:, None], other=0.0)
    q_pos = prefix + offs_m
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # KV tiles every row of this query tile sees in full: no mask, no bounds checks.
    full_end = (prefix + m0 + 1) // BLOCK_N * BLOCK_N
    blocks = first_tile_blocks(bt_row, 0, ctx, BLOCK_N, BLOCK_SIZE, LOOKAHEAD)
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tile_blocks, blocks = kv_tile_blocks(bt_row, blocks, offs_n, ctx, BLOCK_N, BLOCK_SIZE,
                                             LOOKAHEAD)
        k, v = load_kv_rows(k_cache, v_cache, tile_blocks, offs_n, d, kv_head_off,
                            stride_pool_block, stride_pool_row, BLOCK_SIZE, False, ctx)
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, None, qk_scale,
                                     False, DOT_PRECISION)
    # Tiles crossing the diagonal. Position 0 is visible to every row (padding rows too), so
    # each row's first tile has a finite max.
    causal_end = tl.minimum(ctx, prefix + m0 + TILE_TOKENS)
    for start_n in range(full_end, causal_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_pool_block,
                            stride_pool_row, BLOCK_SIZE, True, ctx)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < ctx)[None, :]
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, visible, qk_scale,
                                     True, DOT_PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


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
    prefill_tile_map with `tile_tokens` query tokens a tile (prefill_tile_tokens), decoding rows
    included. A decoding row in several splits needs `workspace` (a row for each decoding
    sequence and as many splits; its counters zero, as every launch leaves them).
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
    # Only the decoding rows (the first sequences) index the workspace, so no row count to check.
    split_args, merge_tiles = workspace_args(workspace, max_splits, 0, num_kv_heads, group, out,
                                             context_lens)
    _prefill_kernel[(num_kv_heads, tile_map.shape[0])](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, tile_map, out,
        *split_args, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *pool,
        G=group, HEAD_DIM=head_dim, TILE_TOKENS=tile_tokens, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, DECODE_ROWS=query_rows(group),
        DECODE_BLOCK_N=decode_tiles(head_dim, block_size).block_n, SPLIT_BITS=DECODE_SPLIT_BITS,
        **merge_tiles, DOT_PRECISION=dot_precision(q.dtype),
        LOOKAHEAD=with_decodes,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
