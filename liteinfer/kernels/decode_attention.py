"""Paged decode attention (one query token per sequence, or a verification's few) with
per-request split-K.

One program per (sequence, KV head, split) serves all G query heads of that KV head, so each
K/V tile is read from the pool once; the G query rows are padded to 16 for tl.dot. A row that
verifies drafts holds its query tokens' rows too (`query_len`: its newest token and its drafts
at its last positions, each masking the keys after its own), so speculation reads each tile
once for all of them. A sequence's
KV tiles are divided between its programs, as many as `decode_splits` says for its length and
the batch's (computed in the kernel: no launches to size the splits). A row with one split
writes its output directly. Otherwise each program writes an fp32 partial output and its
log-sum-exp to the workspace and bumps its (sequence, KV head) arrival counter; the program that
arrives last merges the partials and resets the counter, so split-K costs one launch. The grid
is fixed at (max_splits, B, Hkv) so CUDA graphs can replay it; programs past a row's split count
exit at once, early in the launch, since the split index varies fastest.

Given this step's un-rotated key/value (`NewKV`), the kernel also does the work of a separate
RoPE + KV-write launch: every program rotates its query rows in registers, and the program whose
range holds the row's last KV position rotates the new key and writes it and the value into the
pool before it reads its tiles. That saves one launch per layer in every decode step. It also
lets the kernel read what depends only on step inputs and earlier steps' KV before it waits for
the previous kernel (PDL), while that kernel finishes: the lengths in every launch, and in
launches small enough (`prefetches_first_tile`) the positions, the RoPE row and each program's
first K/V tile, into which the new row is put in registers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_DTYPE, dot_precision, num_sms, supports_pdl
from liteinfer.kernels.decode_splits import (
    MAX_SPLITS_CAP,
    SPLIT_WAVES,
    DecodeWorkspace,
    min_split_tokens,
    program_slots,
)
from liteinfer.kernels.kv_cache import (
    first_tile_blocks,
    kv_tile_blocks,
    load_kv_rows,
    load_kv_tile,
    pool_strides,
    slot_offset,
    to_cache,
)

LOG2E = math.log2(math.e)  # softmax runs in base 2 (exp2) with the scale folded in
MERGE_TILE = 4096  # fp32 partial elements the merging program loads at once (32 per thread)
FP16_MAX = tl.constexpr(torch.finfo(torch.float16).max)


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim: int, block_size: int) -> DecodeTiles:
    """Tile choice for Hopper: ~16 KiB of 16-bit K per tile keeps several loads in flight per
    SM. An e4m3 pool keeps these key counts: twice the keys (the same bytes) measured slower at
    D 64, and at D 128 faster only at 128 rows (journal item 98)."""
    block_n = max(128 if head_dim <= 64 else 64, block_size)
    return DecodeTiles(block_n=block_n, num_warps=4, num_stages=3)


@triton.jit
def softmax_tile(acc, l_i, m_i, q, k, v, mask, qk_scale,
                 APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a K/V tile. Scores are in base 2; every row must have a
    visible key in its first tile so that m_i is finite from then on. The scale multiplies the
    row maxima and enters the exponent through one FMA a score, instead of a pass of its own
    over the raw scores; the rescaled accumulator is the second product's addend. Tiles of an
    e4m3 pool are widened to q's dtype here, in registers; with bf16 q, to fp16 instead (and q
    with them, clamped to fp16's range, exact within it): Hopper widens e4m3 pairs to fp16 in
    one instruction and to bf16 in three, which made the conversion, not the halved bytes, set
    the kernel's pace."""
    if (k.dtype == tl.float8e4nv) & (q.dtype == tl.bfloat16):
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def split_range(ctx, split, n_splits, BLOCK_N: tl.constexpr):
    """KV positions [start, end) of split `split` of a row of ctx tokens in n_splits: splits
    own whole BLOCK_N-key tiles; trailing splits of a short row get an empty range."""
    tiles_per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), n_splits)
    start = split * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, ctx)


@triton.jit
def attend_kv_range(q, k_cache, v_cache, bt_row, kv_head_off, start, end, d, qk_scale,
                    stride_block, stride_row, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, LOOKAHEAD: tl.constexpr, row_ends,
                    ROW_ENDS: tl.constexpr):
    """Online softmax of query rows q over one sequence's KV positions [start, end), read from
    the pool in BLOCK_N-key tiles through its block table row: (acc, l, m), fp32. LOOKAHEAD:
    see kv_cache.kv_tile_blocks. With ROW_ENDS, row r sees only the positions before
    row_ends[r] (a query token of a verification; at most `end`)."""
    acc = tl.zeros(q.shape, dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    return attend_kv_tiles(acc, l_i, m_i, q, k_cache, v_cache, bt_row, kv_head_off, start, end,
                           d, qk_scale, stride_block, stride_row, BLOCK_N, BLOCK_SIZE,
                           DOT_PRECISION, LOOKAHEAD, row_ends, ROW_ENDS)


@triton.jit
def attend_kv_tiles(acc, l_i, m_i, q, k_cache, v_cache, bt_row, kv_head_off, start, end, d,
                    qk_scale, stride_block, stride_row, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    LOOKAHEAD: tl.constexpr, row_ends, ROW_ENDS: tl.constexpr):
    """attend_kv_range continuing the online-softmax state (acc, l, m) of earlier tiles."""
    blocks = first_tile_blocks(bt_row, start, end, BLOCK_N, BLOCK_SIZE, LOOKAHEAD)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tile_blocks, blocks = kv_tile_blocks(bt_row, blocks, offs_n, end, BLOCK_N, BLOCK_SIZE,
                                             LOOKAHEAD)
        k, v = load_kv_rows(k_cache, v_cache, tile_blocks, offs_n, d, kv_head_off, stride_block,
                            stride_row, BLOCK_SIZE, True, end)
        visible = offs_n[None, :] < row_ends[:, None] if ROW_ENDS else (offs_n < end)[None, :]
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k, v, visible, qk_scale, True,
                                     DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _rope_rows(ptrs, d, mask, cos, sin, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Loads rows x at `ptrs` (+ d) and returns x * cos + rotate_half(x) * sin in fp32
    (HF Llama layout; cos/sin repeated over both halves). Whole rows, as tl.dot wants them; the
    rotation stays in registers. kv_cache._rotate_halves rotates in place instead, so there each
    thread holds both halves of its pairs and no thread reads a partner another already wrote."""
    x = tl.load(ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptrs + ((d + HALF) % HEAD_DIM)[None, :], mask=mask, other=0.0)
    rotated = tl.where(d < HALF, -partner.to(tl.float32), partner.to(tl.float32))
    return x * cos[None, :] + rotated * sin[None, :]


@triton.jit
def _new_row_inputs(pos_ptr, slot_ptr, cos_sin, b, stride_cs, d, HALF: tl.constexpr):
    """Row b's RoPE cos and sin (over both halves of a head) and its new token's pool slot."""
    pos = tl.load(pos_ptr + b).to(tl.int64)
    cos = tl.load(cos_sin + pos * stride_cs + d % HALF)
    sin = tl.load(cos_sin + pos * stride_cs + HALF + d % HALF)
    return cos, sin, tl.load(slot_ptr + b)


@triton.jit
def _split_count(context_lens, ctx, batch, num_kv_heads, program_slots, max_splits,
                 BLOCK_B: tl.constexpr, MIN_TOKENS: tl.constexpr):
    """decode_splits' rule for a row of `ctx` tokens: programs of at most the batch's even share
    of KV tokens per program slot (at least MIN_TOKENS); rows under 2 * MIN_TOKENS stay whole.
    Every program of the launch reads the same lengths, so a row's programs agree."""
    rows = tl.arange(0, BLOCK_B)
    total = tl.sum(tl.load(context_lens + rows, mask=rows < batch, other=0), 0)
    share = tl.maximum(total * num_kv_heads // program_slots, MIN_TOKENS)
    n = tl.where(ctx < 2 * MIN_TOKENS, 1, (ctx - 1) // share + 1)
    return tl.minimum(n, max_splits)


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, block_tables, context_lens, num_splits_ptr,
                   out_ptr, part_out, part_lse, counters,
                   stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_cb,
                   qk_scale, max_splits, batch, program_slots,
                   k_new, v_new, pos_ptr, slot_ptr, cos_sin,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_pool_block, stride_pool_row, stride_pool_head,
                   stride_kb, stride_kh, stride_vb, stride_vh, stride_cs,
                   G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                   SPLITS_GIVEN: tl.constexpr, BLOCK_B: tl.constexpr,
                   MIN_SPLIT_TOKENS: tl.constexpr, NEW_KV: tl.constexpr,
                   PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   USE_PDL: tl.constexpr, QUERY_LEN: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    # The lengths and split counts are step inputs, which no kernel writes: read before the
    # wait, so that surplus splits leave while the previous kernel is still finishing.
    ctx = tl.load(context_lens + b)
    if SPLIT_K:
        if SPLITS_GIVEN:
            n_splits = tl.minimum(tl.load(num_splits_ptr + b), max_splits)
        else:
            n_splits = _split_count(context_lens, ctx, batch, tl.num_programs(2), program_slots,
                                    max_splits, BLOCK_B, MIN_SPLIT_TOKENS)
    else:
        n_splits = 1
    if split >= n_splits:
        return
    # A verification's query tokens sit at the row's last QUERY_LEN positions; its ranges are
    # placed by its first token's context, so every row sees a key in a range's first tile,
    # and the last range runs on to the row's end.
    ctx_first = ctx - (QUERY_LEN - 1)
    start, end = split_range(ctx_first, split, n_splits, BLOCK_N)
    if QUERY_LEN > 1:
        end = tl.where((start < end) & (end == ctx_first), ctx, end)
    d = tl.arange(0, HEAD_DIM)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_pool_head
    HALF: tl.constexpr = HEAD_DIM // 2
    if PREFETCH:  # positions and slots are step inputs too, cos_sin a constant; earlier steps
        # wrote the first tile's KV rows, and the new one is patched in below
        cos, sin, slot = _new_row_inputs(pos_ptr, slot_ptr, cos_sin, b, stride_cs, d, HALF)
        offs_n = start + tl.arange(0, BLOCK_N)  # the range's first tile
        k_first, v_first = load_kv_tile(k_cache, v_cache, bt_row, offs_n, d, kv_head_off,
                                        stride_pool_block, stride_pool_row, BLOCK_SIZE, True,
                                        end)
    if USE_PDL:  # launched while the previous kernel finishes: wait for it before other reads
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # Tile row r: query token r // G of the row's QUERY_LEN, query head kvh * G + r % G.
    offs_h = tl.arange(0, BLOCK_H)
    first_row = b * QUERY_LEN
    if QUERY_LEN > 1:
        tok = offs_h // G
        h_mask = offs_h < QUERY_LEN * G
        heads = kvh * G + offs_h % G
        q_ptrs = q_ptr + (first_row + tok)[:, None] * stride_qb + heads[:, None] * stride_qh
    else:
        tok = tl.zeros([BLOCK_H], dtype=tl.int32)
        h_mask = offs_h < G
        heads = kvh * G + offs_h
        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if NEW_KV:
        if not PREFETCH:
            cos, sin, slot = _new_row_inputs(pos_ptr, slot_ptr, cos_sin, b, stride_cs, d, HALF)
        # Rounded to the activation dtype, as a separate RoPE kernel would store it.
        q = _rope_rows(q_ptrs, d, h_mask[:, None], cos, sin, HALF, HEAD_DIM)
        q = q.to(q_ptr.dtype.element_ty)
        # The new token is the row's last KV position: the split whose range holds it writes it
        # (padding rows have slot -1), and puts it into a prefetched first tile that holds it.
        # The barrier makes the write visible to all the program's threads before they load
        # the tiles read after it.
        if (slot >= 0) & (start < ctx) & (end == ctx):
            k = to_cache(_rope_rows(k_new + b * stride_kb + kvh * stride_kh, d,
                                    d[None, :] < HEAD_DIM, cos, sin, HALF, HEAD_DIM), k_cache)
            v = to_cache(tl.load(v_new + b * stride_vb + kvh * stride_vh + d), v_cache)
            dst = (slot_offset(slot, BLOCK_SIZE, stride_pool_block, stride_pool_row)
                   + kvh * stride_pool_head + d)
            tl.store(k_cache + dst[None, :], k)
            tl.store(v_cache + dst, v)
            if PREFETCH:
                new_row = (offs_n == ctx - 1)[:, None]
                k_first = tl.where(new_row, k, k_first)
                v_first = tl.where(new_row, v[None, :], v_first)
            tl.debug_barrier()
    else:
        q = tl.load(q_ptrs + d[None, :], mask=h_mask[:, None], other=0.0)
    if PREFETCH:
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        if start < end:  # softmax_tile needs a visible key in its first tile
            acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, k_first, v_first,
                                         (offs_n < end)[None, :], qk_scale, True, DOT_PRECISION)
        acc, l_i, m_i = attend_kv_tiles(acc, l_i, m_i, q, k_cache, v_cache, bt_row, kv_head_off,
                                        start + BLOCK_N, end, d, qk_scale, stride_pool_block,
                                        stride_pool_row, BLOCK_N, BLOCK_SIZE, DOT_PRECISION,
                                        False, end, False)
    else:  # every tile through the loop's pipeline (a peeled first tile costs wide launches)
        # Token t of a verification sees the keys before ctx_first + t.
        acc, l_i, m_i = attend_kv_range(q, k_cache, v_cache, bt_row, kv_head_off, start, end, d,
                                        qk_scale, stride_pool_block, stride_pool_row, BLOCK_N,
                                        BLOCK_SIZE, DOT_PRECISION, False,
                                        tl.minimum(ctx_first + tok, end), QUERY_LEN > 1)
    # A row's workspace rows and counter: one per query token from first_row on.
    finish_split(acc, l_i, m_i, out_ptr + first_row * stride_ob, stride_ob, stride_oh, tok,
                 heads, h_mask, d, first_row, QUERY_LEN, kvh, split, n_splits, part_out,
                 part_lse, counters, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 stride_cb, G, HEAD_DIM, BLOCK_G, BLOCK_S, CHUNK_S)


@triton.jit
def finish_split(acc, l_i, m_i, out_row, stride_ot, stride_oh, tokens, heads, row_mask, d, slot,
                 n_tokens, kvh, split, n_splits, part_out, part_lse, counters, stride_pb,
                 stride_ph, stride_ps, stride_lb, stride_lh, stride_cb, G: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                 CHUNK_S: tl.constexpr):
    """Ends split `split` of n_splits over a row's n_tokens query tokens and KV head kvh, tile
    row r holding query head heads[r] of token tokens[r] (output rows from out_row on): a whole
    row writes its output; a split writes its partials and log-sum-exps to the workspace, one
    workspace row a token from `slot` on, and the last of the row's splits to arrive (counted
    at (slot, kvh)) merges them into the output, token by token. A decoding row has one token
    (tokens all 0) and its sequence as its slot."""
    # Empty ranges (padding rows, surplus splits) give zeros and lse = -inf, never NaN.
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    if n_splits == 1:  # the whole row: final output, no workspace, no counter
        o_ptrs = (out_row + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
                  + d[None, :])
        tl.store(o_ptrs, o.to(out_row.dtype.element_ty), mask=row_mask[:, None])
    else:
        rows = slot + tokens
        p_ptrs = (part_out + rows[:, None] * stride_pb + heads[:, None] * stride_ph
                  + split * stride_ps)
        tl.store(p_ptrs + d[None, :], o, mask=row_mask[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse + rows * stride_lb + heads * stride_lh + split, lse, mask=row_mask)
        # Publish the partials. One thread performs the scalar atomic, so first the CTA barrier
        # orders every thread's stores before it; the release half of acq_rel (cumulative,
        # gpu scope) then makes them visible to whichever program observes the new count.
        tl.debug_barrier()
        cnt_ptr = counters + slot * stride_cb + kvh
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        # The acquire half orders the atomic before this thread's later loads; the barrier
        # extends that to all threads of the program before any of them reads the partials.
        tl.debug_barrier()
        if arrived == n_splits - 1:
            # Last of this row's programs: every other split has arrived and none touches the
            # counter again in this launch, so a plain store restores the zero invariant; the
            # next launch (next layer, graph replay) is ordered after it by the stream.
            tl.store(cnt_ptr, 0)
            for t in range(n_tokens):
                _merge_splits(part_out, part_lse, out_row + t * stride_ot, slot + t, kvh,
                              n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                              stride_oh, G, HEAD_DIM, BLOCK_G, BLOCK_S, CHUNK_S)


@triton.jit
def _merge_splits(part_out, part_lse, out_row, b, kvh, n_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_oh,
                  G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    """Log-sum-exp (base 2) merge of splits [0, n_splits) of KV head kvh's G query heads.
    Splits past n_splits hold stale data from earlier steps: masked, never read."""
    g = tl.arange(0, BLOCK_G)
    heads = kvh * G + g
    g_mask = g < G
    d = tl.arange(0, HEAD_DIM)
    lse_row = part_lse + b * stride_lb + heads[:, None] * stride_lh
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_row + s[None, :], mask=g_mask[:, None] & (s[None, :] < n_splits),
                  other=float("-inf"))
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    # Partials are read CHUNK_S splits at a time (loads in flight together, bounded registers).
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    p_row = part_out + b * stride_pb + heads[:, None, None] * stride_ph + d[None, None, :]
    for s0 in range(0, n_splits, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        mask = g_mask[:, None] & (sc[None, :] < n_splits)
        w = tl.exp2(tl.load(lse_row + sc[None, :], mask=mask, other=float("-inf")) - m[:, None])
        parts = tl.load(p_row + sc[None, :, None] * stride_ps, mask=mask[:, :, None], other=0.0)
        acc += tl.sum(w[:, :, None] * parts, 1)
    o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_row + heads[:, None] * stride_oh + d[None, :],
             o.to(out_row.dtype.element_ty), mask=g_mask[:, None])


@dataclass(frozen=True)
class NewKV:
    """This step's key and value rows ([B, Hkv, D], not yet rotated), written into the pool by
    the decode kernel at `slots` (int [B], -1 = padding row) as each row's last KV position,
    after RoPE at `positions` (int [B]) with cos_sin_cache (fp32 [max_pos, D], cos | sin)."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos_sin_cache: torch.Tensor


def query_rows(group: int) -> int:
    """Rows of a decoding row's query tile: its G heads (times a verification's query tokens),
    padded to the 16 tl.dot needs."""
    return max(16, triton.next_power_of_2(group))


def workspace_args(workspace: DecodeWorkspace | None, max_splits: int, rows: int,
                   num_kv_heads: int, group: int, out: torch.Tensor,
                   int_placeholder: torch.Tensor) -> tuple[list, dict[str, int]]:
    """Split-K's kernel arguments: the workspace's partial outputs, log-sum-exps and counters
    with their strides (unread placeholders when rows never split, max_splits 1), and the
    merge's tile sizes (`finish_split`)."""
    if max_splits > 1:
        part_out, part_lse, counters = (workspace.partial_out, workspace.partial_lse,
                                        workspace.counters)
        assert part_out.shape[0] >= rows and workspace.max_splits >= max_splits
        assert counters.shape[0] >= rows and counters.shape[1] >= num_kv_heads
    else:
        part_out, part_lse, counters = out, out, int_placeholder
    block_g = triton.next_power_of_2(group)
    block_s = triton.next_power_of_2(max_splits)
    head_dim = out.shape[-1]
    args = [part_out, part_lse, counters, part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1), counters.stride(0)]
    return args, dict(BLOCK_G=block_g, BLOCK_S=block_s,
                      CHUNK_S=min(block_s, max(1, MERGE_TILE // (block_g * head_dim))))


def prefetches_first_tile(batch: int, num_kv_heads: int, max_splits: int, num_sms: int) -> bool:
    """Whether a launch reads each program's first K/V tile before it waits for the previous
    kernel (only with the step's K/V fused in: a separate launch may still be writing the pool).
    Those loads overlap the previous kernel's last programs, but they hold the tile in registers,
    so only launches whose programs all fit on the SMs at once (two an SM) take them."""
    return batch * num_kv_heads * max_splits <= SPLIT_WAVES * num_sms


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, max_splits: int = 1,
                           workspace: DecodeWorkspace | None = None, new_kv: NewKV | None = None,
                           num_splits: torch.Tensor | None = None,
                           min_tokens: int | None = None, query_len: int = 1) -> torch.Tensor:
    """q, out: [B, Hq, D] (last dim contiguous); caches: [num_blocks, block_size, Hkv, D] with
    equal strides, D contiguous, in q's dtype or e4m3;
    block_tables: int32 [B, max_blocks]; context_lens: int32 [B], 0 for padding rows (their
    output rows are zeros). With max_splits > 1 rows split as `decode_splits` describes (with
    min_tokens, by default `min_split_tokens` of the head size), or into num_splits[b] programs
    when that int32 [B] tensor is given, clamped to max_splits; a workspace with at least B rows
    and max_splits splits holds the partials (allocated here when None); rows never read splits
    past their own count. The workspace's counters must be zero, as allocated; every launch
    leaves them so. With new_kv, q is rotated in registers (q itself is left as it is) and the
    new key/value are written before they are read. query_len > 1: each row is a verification
    of that many query tokens, q's rows b * query_len + t (t = 0.. query_len - 1) at the row's
    last positions, token t seeing keys up to its own (no new_kv; their K/V already in the
    pool; the workspace has a row per query token). Returns out."""
    tokens, num_q_heads, head_dim = q.shape
    batch = tokens // query_len
    assert batch * query_len == tokens and (query_len == 1 or new_kv is None)
    _, block_size, num_kv_heads, _ = k_cache.shape
    pool = pool_strides(k_cache, v_cache)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape
    assert num_q_heads % num_kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim)
    assert block_tables.stride(-1) == 1 and 1 <= max_splits <= MAX_SPLITS_CAP
    assert k_cache.dtype in (q.dtype, FP8_DTYPE)
    group = num_q_heads // num_kv_heads
    tiles = decode_tiles(head_dim, block_size)
    splits_given = num_splits is not None
    if max_splits > 1 and workspace is None:
        workspace = DecodeWorkspace.allocate(tokens, num_q_heads, head_dim, max_splits, q.device)
    split_args, merge_tiles = workspace_args(workspace, max_splits, tokens, num_kv_heads, group,
                                             out, context_lens)
    if not splits_given:
        num_splits = context_lens  # unread placeholder
    if new_kv is not None:
        key, value, cos_sin = new_kv.key, new_kv.value, new_kv.cos_sin_cache
        assert key.shape == value.shape == (batch, num_kv_heads, head_dim)
        assert key.stride(-1) == 1 and value.stride(-1) == 1 and cos_sin.stride(-1) == 1
        assert new_kv.positions.shape == new_kv.slots.shape == (batch,)
        assert cos_sin.shape[1] == head_dim
        pos, slots = new_kv.positions, new_kv.slots
    else:  # unread placeholders
        key = value = q
        pos = slots = cos_sin = context_lens
    pdl = supports_pdl(q.device)
    sms = num_sms(q.device)
    _decode_kernel[(max_splits, batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, num_splits, out, *split_args,
        scale * LOG2E, max_splits, batch,
        program_slots(batch, num_kv_heads, sms, max_splits),
        key, value, pos, slots, cos_sin,
        q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), *pool,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos_sin.stride(0),
        G=group, HEAD_DIM=head_dim, BLOCK_H=query_rows(group * query_len),
        BLOCK_N=tiles.block_n,
        BLOCK_SIZE=block_size, SPLIT_K=max_splits > 1, **merge_tiles,
        SPLITS_GIVEN=splits_given, BLOCK_B=triton.next_power_of_2(batch),
        MIN_SPLIT_TOKENS=min_tokens or min_split_tokens(head_dim), NEW_KV=new_kv is not None,
        PREFETCH=new_kv is not None and prefetches_first_tile(batch, num_kv_heads, max_splits,
                                                              sms),
        DOT_PRECISION=dot_precision(q.dtype), USE_PDL=pdl, QUERY_LEN=query_len,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
    return out
