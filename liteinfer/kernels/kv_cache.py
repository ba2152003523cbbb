"""Writing K/V into the paged pool, optionally fused with RoPE, and the pool-gather helper the
attention kernels share.

A layer's pool is indexed [num_blocks, block_size, num_kv_heads, head_dim] (head_dim
contiguous); the kernels take its other strides from the tensor, so the memory order of
blocks, rows and heads is the allocator's (attention.base.allocate_kv_pool). A token's flat
slot is block_id * block_size + row; slot -1 marks a padding token that is not written. A pool
of e4m3 holds K/V unscaled (attention.base.kv_cache_dtype): writes clamp to its range, and the
attention kernels widen the tiles they load to the query's dtype in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, cache):
    """x as the pool `cache` stores it; an e4m3 pool clamps to its finite range first."""
    if cache.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX)
    return x.to(cache.dtype.element_ty)


@triton.jit
def kv_block_ids(bt_row, offs_n, end, BLOCK_SIZE: tl.constexpr):
    """Pool block ids of one sequence's KV positions offs_n (0 from `end` on), through its
    block table row. Each position's block is looked up separately, so one tile may span
    several KV blocks."""
    return tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)


@triton.jit
def load_kv_rows(k_cache, v_cache, blocks, offs_n, d, kv_head_off, stride_block, stride_row,
                 BLOCK_SIZE: tl.constexpr, MASK_BOUNDS: tl.constexpr, end):
    """K and V rows at KV positions offs_n held in pool blocks `blocks` (of the KV head at
    kv_head_off); with MASK_BOUNDS, positions from `end` on read as zeros."""
    rows = blocks.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_row + kv_head_off
    ptrs = rows[:, None] + d[None, :]
    if MASK_BOUNDS:
        valid = (offs_n < end)[:, None]
        return (tl.load(k_cache + ptrs, mask=valid, other=0.0),
                tl.load(v_cache + ptrs, mask=valid, other=0.0))
    return tl.load(k_cache + ptrs), tl.load(v_cache + ptrs)


@triton.jit
def kv_tile_blocks(bt_row, blocks, offs_n, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   LOOKAHEAD: tl.constexpr):
    """Block ids in a loop over BLOCK_N-key tiles: (this tile's ids, the `blocks` to pass with
    the next tile), starting from first_tile_blocks. Without LOOKAHEAD a tile looks its ids up
    itself, so its K/V addresses wait on a load of the same iteration and the pipeliner copies
    one tile at a time. With it each tile looks up the next one's, and the K/V copies of tile
    i + 1 run during tile i's softmax (with 3 stages), at the cost of a second K/V buffer."""
    if LOOKAHEAD:
        return blocks, kv_block_ids(bt_row, offs_n + BLOCK_N, end, BLOCK_SIZE)
    return kv_block_ids(bt_row, offs_n, end, BLOCK_SIZE), blocks


@triton.jit
def first_tile_blocks(bt_row, start, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      LOOKAHEAD: tl.constexpr):
    """The `blocks` kv_tile_blocks takes with a loop's first tile (at KV position `start`)."""
    if LOOKAHEAD:
        return kv_block_ids(bt_row, start + tl.arange(0, BLOCK_N), end, BLOCK_SIZE)
    return tl.zeros([BLOCK_N], dtype=tl.int32)  # unread


@triton.jit
def load_kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off, stride_block, stride_row,
                 BLOCK_SIZE: tl.constexpr, MASK_BOUNDS: tl.constexpr, end):
    """One sequence's K and V rows at KV positions offs_n (of the KV head at kv_head_off),
    through its block table row; with MASK_BOUNDS, positions from `end` on read as zeros."""
    blocks = kv_block_ids(bt_row, offs_n, end, BLOCK_SIZE)
    return load_kv_rows(k_cache, v_cache, blocks, offs_n, d, kv_head_off, stride_block,
                        stride_row, BLOCK_SIZE, MASK_BOUNDS, end)


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_block, stride_row):
    """Element offset (int64) of flat slot `slot`'s pool row (add the KV head's offset)."""
    slot = slot.to(tl.int64)
    return slot // BLOCK_SIZE * stride_block + slot % BLOCK_SIZE * stride_row


def pool_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, row, head) element strides shared by a layer's K and V pools."""
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.dim() == 4 and k_cache.stride(3) == 1
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


@triton.jit
def _rotate_halves(ptrs1, ptrs2, mask, cos, sin):
    """Rotates x = [x1 | x2] in place (HF rotate_half), in fp32; returns the rounded halves."""
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    x2 = tl.load(ptrs2, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (x1f * cos - x2f * sin).to(x1.dtype)
    r2 = (x2f * cos + x1f * sin).to(x1.dtype)
    tl.store(ptrs1, r1, mask=mask)
    tl.store(ptrs2, r2, mask=mask)
    return r1, r2


@triton.jit
def _store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache, v_cache, slot_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_pool_block, stride_pool_row, stride_pool_head,
                     num_q_heads, num_kv_heads, BLOCK_SIZE: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                     BLOCK_HKV: tl.constexpr, APPLY_ROPE: tl.constexpr):
    # One program per token: all of its q heads (RoPE only) and kv heads.
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    kh = tl.arange(0, BLOCK_HKV)
    kv_mask = (kh < num_kv_heads)[:, None] & d_mask[None, :]
    k1_ptrs = k_ptr + t * stride_kt + kh[:, None] * stride_kh + d[None, :]
    if APPLY_ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0)[None, :]
        qh = tl.arange(0, BLOCK_HQ)
        q_mask = (qh < num_q_heads)[:, None] & d_mask[None, :]
        q1_ptrs = q_ptr + t * stride_qt + qh[:, None] * stride_qh + d[None, :]
        _rotate_halves(q1_ptrs, q1_ptrs + HALF, q_mask, cos, sin)
        k1, k2 = _rotate_halves(k1_ptrs, k1_ptrs + HALF, kv_mask, cos, sin)
    else:
        k1 = tl.load(k1_ptrs, mask=kv_mask)
        k2 = tl.load(k1_ptrs + HALF, mask=kv_mask)
    v1_ptrs = v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :]
    v1 = tl.load(v1_ptrs, mask=kv_mask)
    v2 = tl.load(v1_ptrs + HALF, mask=kv_mask)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        dst = (slot_offset(slot, BLOCK_SIZE, stride_pool_block, stride_pool_row)
               + kh[:, None] * stride_pool_head + d[None, :])
        tl.store(k_cache + dst, to_cache(k1, k_cache), mask=kv_mask)
        tl.store(k_cache + dst + HALF, to_cache(k2, k_cache), mask=kv_mask)
        tl.store(v_cache + dst, to_cache(v1, v_cache), mask=kv_mask)
        tl.store(v_cache + dst + HALF, to_cache(v2, v_cache), mask=kv_mask)


def _launch(query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor,
            positions: torch.Tensor | None, cos_sin_cache: torch.Tensor | None,
            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    strides = pool_strides(k_cache, v_cache)
    assert k_cache.shape[2:] == key.shape[1:] and value.shape == key.shape
    assert slot_mapping.shape == key.shape[:1]
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key.shape[-1] % 2 == 0
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    rope = query is not None
    q = query if rope else key  # placeholder pointer when RoPE is off; never read
    num_q_heads = q.shape[1]
    _store_kv_kernel[(num_tokens,)](
        q, key, value, positions if rope else slot_mapping, cos_sin_cache if rope else key,
        k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0) if rope else 0, *strides, num_q_heads, num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), APPLY_ROPE=rope, num_warps=4)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [T, Hkv, D] at their slots (int32 or int64 [T]; -1 = skip)."""
    _launch(None, key, value, None, None, k_cache, v_cache, slot_mapping)


def rope_store_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotates query [T, Hq, D] and key [T, Hkv, D] in place (HF Llama rotate_half, fp32 math
    rounded to their dtype) and writes the rotated key and the value at their slots.

    cos_sin_cache: fp32 [max_positions, D], cos in [:, :D/2] and sin in [:, D/2:].
    positions and slot_mapping: int32 or int64 [T]; slot -1 = not written (still rotated).
    """
    assert query.shape[0] == key.shape[0] and query.shape[2] == key.shape[2]
    assert query.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.shape[1] == key.shape[2] and positions.shape == slot_mapping.shape
    _launch(query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
