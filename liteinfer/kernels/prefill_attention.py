"""Packed prefill attention over the paged KV pool.

All sequences' query tokens (whole prompts or chunks) form one flat run; query token i of
sequence b sits at absolute position context_lens[b] - q_len_b + i and attends causally to
every KV position up to it (cached prefix and this chunk), read from the pool through the
block table. One program per (q head, query tile, sequence), flash-attention style: KV tiles
entirely below the diagonal run without a mask, the few on it with the causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels.decode_attention import LOG2E, dot_precision, softmax_tile
from liteinfer.kernels.kv_cache import paged_kv_offsets


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(head_dim: int, block_size: int, max_seqlen_q: int) -> PrefillTiles:
    """Hopper choice: 128-query tiles for long prompts; short chunks (e.g. a few tokens over a
    long cached prefix) shrink the query tile instead of wasting MMA rows. For head_dim 64,
    128-key tiles with 2 stages measured best on the H200 (361 TFLOP/s at 15360 tokens, against
    341 with 64-key tiles and 3 stages; scripts/bench_kernels.py --sweep)."""
    block_m = min(128, max(16, triton.next_power_of_2(max_seqlen_q)))
    num_warps = 8 if block_m == 128 and head_dim >= 128 else 4
    block_n = 128 if head_dim <= 64 else 64
    return PrefillTiles(block_m, max(block_n, block_size), num_warps, num_stages=2)


@triton.jit
def _kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_slot,
             BLOCK_SIZE: tl.constexpr, MASK_BOUNDS: tl.constexpr, ctx):
    if MASK_BOUNDS:
        valid = offs_n < ctx
        rows = paged_kv_offsets(bt_row, offs_n, valid, BLOCK_SIZE, stride_slot) + kv_head_off
        ptrs = rows[:, None] + d[None, :]
        k = tl.load(k_cache + ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache + ptrs, mask=valid[:, None], other=0.0)
    else:
        rows = paged_kv_offsets(bt_row, offs_n, None, BLOCK_SIZE, stride_slot) + kv_head_off
        ptrs = rows[:, None] + d[None, :]
        k = tl.load(k_cache + ptrs)
        v = tl.load(v_cache + ptrs)
    return k, v


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out_ptr,
                    qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_slot, stride_ch,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    h = tl.program_id(0)
    # Heaviest (last) query tiles launch first so the causal tail does not straggle.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(context_lens + b)
    prefix = ctx - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None], other=0.0)
    q_pos = prefix + offs_m
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kv_head_off = (h // G) * stride_ch

    # KV tiles every row of this query tile sees in full: no mask, no bounds checks.
    full_end = (prefix + m0 + 1) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_slot,
                        BLOCK_SIZE, False, ctx)
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, None, qk_scale,
                                     False, DOT_PRECISION)
    # Tiles crossing the diagonal. Position 0 is visible to every row (padding rows too), so
    # each row's first tile has a finite max.
    causal_end = tl.minimum(ctx, prefix + m0 + BLOCK_M)
    for start_n in range(full_end, causal_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_slot,
                        BLOCK_SIZE, True, ctx)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < ctx)[None, :]
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, visible, qk_scale,
                                     True, DOT_PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def packed_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                             max_seqlen_q: int) -> torch.Tensor:
    """q, out: [T, Hq, D] (last dim contiguous); caches: [num_blocks, block_size, Hkv, D];
    cu_seqlens_q: int32 [B+1]; context_lens: int32 [B] (>= each q_len; KV of this step
    already in the pool); block_tables: int32 [B, max_blocks]; max_seqlen_q: host int, at
    least the longest q_len (sets the grid). Returns out."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = context_lens.shape[0]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape
    assert num_q_heads % num_kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim)
    assert cu_seqlens_q.shape[0] == batch + 1 and block_tables.stride(-1) == 1
    assert q.dtype == k_cache.dtype
    if num_tokens == 0 or batch == 0:
        return out
    tiles = prefill_tiles(head_dim, block_size, max_seqlen_q)
    grid = (num_q_heads, triton.cdiv(max_seqlen_q, tiles.block_m), batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        G=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
