"""Batch-invariant paged attention (`EngineConfig.batch_invariant` on CUDA): one kernel for
decode, prompt chunks and mixed steps, so a query's output is the same bits whichever step
computes it.

The default kernels reduce a query's keys differently by step: decode splits a sequence's keys
into a number of ranges chosen from the batch (split-K), prefill walks them in tiles of its own
width, a lone long prompt goes through SDPA. Here a program takes a tile of BLOCK_Q query rows
(TOKENS consecutive tokens of one sequence times the G query heads of one KV head; a decoding
sequence fills one token's rows) and walks its keys from position 0 in KEY_BLOCK-key tiles,
each an MMA of the same shape followed by the online-softmax update. An MMA computes each row
from that row alone and the tiles sit at fixed key positions, so a row's arithmetic depends on
its own position only: tiles past it are masked to weights of exactly zero and leave its
running max, sum and accumulator unchanged. Decode steps (`decode`: token i is sequence i's)
need no tile map; prompt and mixed steps read theirs (kernels/invariant_tiles.py) from the
host eagerly and from the step's input buffer when captured (engine/prompt_graph.py), whose
grid holds a bucket's most tiles and whose unused entries exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision
from liteinfer.kernels.decode_attention import LOG2E
from liteinfer.kernels.invariant_tiles import block_q
from liteinfer.kernels.kv_cache import pool_strides

KEY_BLOCK = 32  # keys an online-softmax update takes


@triton.jit
def _attention_kernel(q_ptr, k_cache, v_cache, positions, block_tables, tiles, cu_seqlens,
                      out_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                      max_blocks, stride_pool_block, stride_pool_row, stride_pool_head,
                      G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                      KEY_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tile
        first = tile
        num_tokens = 1
    else:
        seq = tl.load(tiles + tile * 2)
        if seq < 0:  # an unused entry of a captured step's map
            return
        first = tl.load(tiles + tile * 2 + 1)
        num_tokens = tl.minimum(BLOCK_Q // G, tl.load(cu_seqlens + seq + 1) - first)
    r = tl.arange(0, BLOCK_Q)
    valid = r // G < num_tokens
    token = (first + r // G).to(tl.int64)
    head = kv_head * G + r % G
    pos = tl.load(positions + token, mask=valid, other=0)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None], other=0.0)
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, HEAD_DIM), dtype=tl.float32)
    last = tl.max(pos, 0)
    table = block_tables + seq.to(tl.int64) * stride_bt
    keys = tl.arange(0, KEY_BLOCK)
    for start in range(0, last + 1, KEY_BLOCK):
        key_pos = start + keys
        key_ok = key_pos <= last
        blocks = tl.load(table + key_pos // BLOCK_SIZE,
                         mask=key_ok & (key_pos // BLOCK_SIZE < max_blocks), other=0)
        rows = (blocks.to(tl.int64) * stride_pool_block + (key_pos % BLOCK_SIZE) * stride_pool_row
                + kv_head * stride_pool_head)
        k = tl.load(k_cache + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(key_pos[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                             input_precision=DOT_PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        positions: torch.Tensor, block_tables: torch.Tensor,
                        tiles: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                        scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of the rotated queries q [T, Hq, D] over the pool (their own K/V
    written already). `tiles`: query_tiles of a prompt or mixed step, whose sequences' first
    tokens are cu_seqlens [B + 1]; None for a decode step (T sequences, one token each, in
    block-table order)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    grid_tiles = num_tokens if tiles is None else tiles.shape[0]
    if grid_tiles == 0:
        return out
    s_block, s_row, s_head = pool_strides(k_cache, v_cache)
    _attention_kernel[(grid_tiles, num_kv_heads)](
        q, k_cache, v_cache, positions, block_tables, tiles if tiles is not None else positions,
        cu_seqlens if cu_seqlens is not None else positions, out, scale * LOG2E, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1],
        s_block, s_row, s_head, G=group,
        HEAD_DIM=head_dim, BLOCK_Q=block_q(group), KEY_BLOCK=KEY_BLOCK,
        BLOCK_SIZE=k_cache.shape[1], DECODE=tiles is None, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4)
    return out
