"""Packed (ragged, chunked) prefill attention over the paged pool against a float64 reference."""
import math

import numpy as np
import pytest
import torch

from liteinfer.kernels.decode_splits import DecodeWorkspace
from liteinfer.kernels.prefill_attention import packed_prefill_attention
from liteinfer.kernels.prefill_tiles import (
    DECODE_CHUNK_TOKENS,
    prefill_tile_map,
    prefill_tile_tokens,
    split_counts,
    split_entries,
)


def _check(PagedKV, attention_ref, assert_close, seqs, num_q_heads, num_kv_heads, head_dim,
           block_size, dtype, device, first_seq=0, spare_tiles=0, head_major=True,
           decode_splits=(), kv_dtype=None, prompt_splits=None, tile_tokens=None):
    """seqs: (q_len, context_len) per sequence; context_len - q_len tokens are a cached
    prefix. Only the decoding rows (the first sequences, one query token each, in
    decode_splits[b] programs) and the sequences from `first_seq` on (in prompt_splits[j]
    programs along their keys where that is above 1) are mapped (the rows of those between
    must stay untouched), into a tile map with `spare_tiles` unused rows."""
    decodes = len(decode_splits)
    q_lens = [q for q, _ in seqs]
    contexts = [c for _, c in seqs]
    kv = PagedKV(contexts, num_kv_heads, head_dim, block_size, dtype, device,
                 head_major=head_major, kv_dtype=kv_dtype)
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    tile_tokens = tile_tokens or prefill_tile_tokens(max(q_lens[first_seq:]),
                                                     num_q_heads // num_kv_heads)
    tiles = prefill_tile_map(q_lens[first_seq:], contexts[first_seq:], tile_tokens, first_seq,
                             decode_splits=decode_splits, prompt_splits=prompt_splits)
    if spare_tiles:
        tiles = prefill_tile_map(q_lens[first_seq:], contexts[first_seq:], tile_tokens,
                                 first_seq, num_tiles=len(tiles) + spare_tiles,
                                 decode_splits=decode_splits, prompt_splits=prompt_splits)
    # A split row's partials take a workspace row a query token.
    max_splits = max([*decode_splits, *(prompt_splits or [])], default=1)
    workspace = DecodeWorkspace.allocate(sum(q_lens), num_q_heads, head_dim, max_splits, device)
    for _ in range(2):  # a second launch finds the split counters as the first left them
        packed_prefill_attention(q, kv.k_cache, kv.v_cache, cu, kv.context_lens_t,
                                 kv.block_tables, torch.from_numpy(tiles).to(device),
                                 tile_tokens, scale, out, workspace, with_decodes=decodes > 0)
    assert (workspace.counters == 0).all()
    start = int(cu[first_seq])
    assert out[decodes:start].isnan().all(), "rows of unmapped sequences were written"
    mapped = [b for b in range(len(seqs)) if b < decodes or b >= first_seq]
    ref = torch.cat([attention_ref(q[cu[b]:cu[b + 1]], *kv.kv64(b, num_q_heads),
                                   seqs[b][1] - seqs[b][0], scale) for b in mapped])
    assert_close(torch.cat([out[:decodes], out[start:]]), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(PagedKV, attention_ref, assert_close, needs_dot, device, full,
                                   group, head_dim, block_size, dtype):
    """Ragged prompts and chunks after cached prefixes; one prompt spans several query tiles."""
    needs_dot(dtype)
    if full:
        seqs, num_kv_heads = [(1, 1), (700, 700), (3000, 5000), (129, 129), (64, 2111)], 32 // group
    else:
        seqs, num_kv_heads = [(1, 1), (150, 150), (20, 37), (3, 70), (64, 64)], 1
    _check(PagedKV, attention_ref, assert_close, seqs, num_kv_heads * group, num_kv_heads,
           head_dim, block_size, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reads_fp8_pool(PagedKV, attention_ref, assert_close, needs_dot, device, full,
                                group, dtype):
    """An e4m3 pool, widened in registers: prompts, chunks after cached prefixes and decoding
    rows in splits, against attention over the pool's own values."""
    needs_dot(dtype)
    if full:
        seqs, num_kv_heads = [(1, 3000), (1, 90), (700, 700), (3000, 5000), (64, 2111)], 8
    else:
        seqs, num_kv_heads = [(1, 300), (1, 40), (150, 150), (20, 37), (3, 70)], 1
    _check(PagedKV, attention_ref, assert_close, seqs, num_kv_heads * group, num_kv_heads, 128,
           16, dtype, device, first_seq=2, decode_splits=(3, 1), kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(9, 3), (6, 1)])
def test_prefill_group_not_a_power_of_two(PagedKV, attention_ref, assert_close, device,
                                          num_q_heads, num_kv_heads):
    """A tile's tokens times G rows (e.g. 42 x 3) are padded to a power of two; the pad rows
    must not be written."""
    seqs = [(150, 150), (5, 40), (60, 77)]
    _check(PagedKV, attention_ref, assert_close, seqs, num_q_heads, num_kv_heads, 64, 16,
           torch.float32, device)


@pytest.mark.parametrize("seqs", [
    # Short chunks over long prefixes; prefixes of 62/63 put the diagonal at a KV tile edge.
    [(1, 40), (3, 3), (16, 97), (2, 33), (4, 66), (2, 65)],
    [(37, 37)] * 3 + [(5, 200)],
], ids=["short-chunks", "many-prompts"])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
def test_prefill_ragged_batches(PagedKV, attention_ref, assert_close, device, full, seqs,
                                head_major):
    dtype = torch.bfloat16 if full else torch.float16
    _check(PagedKV, attention_ref, assert_close, seqs, 8, 2, 64, 16, dtype, device,
           head_major=head_major)


def test_prefill_tile_map_of_a_mixed_step(PagedKV, attention_ref, assert_close, device, full):
    """As in a mixed step: decoding rows first (left to the decode kernel, unmapped), then
    prompt chunks, with the map padded to a fixed length as a captured step has it."""
    dtype = torch.bfloat16 if full else torch.float16
    seqs = [(1, 90), (1, 17), (1, 0), (40, 40), (7, 51), (130, 300)]
    _check(PagedKV, attention_ref, assert_close, seqs, 8, 2, 64, 16, dtype, device,
           first_seq=3, spare_tiles=5)


@pytest.mark.parametrize("group", [4, 3])
def test_prefill_with_decoding_rows(PagedKV, attention_ref, assert_close, device, full, group):
    """A mixed step's decoding rows in the prefill launch, whole or split (more splits than a
    short row has KV tiles leaves some empty), beside prompt chunks; an unmapped padding row
    between them."""
    dtype = torch.bfloat16 if full else torch.float16
    ctx = [2176, 1, 900, 5000] if full else [300, 1, 17, 600]
    seqs = [(1, c) for c in ctx] + [(1, 0), (40, 40), (7, 51), (130, 300)]
    _check(PagedKV, attention_ref, assert_close, seqs, 2 * group, 2, 64, 16, dtype, device,
           first_seq=5, spare_tiles=3, decode_splits=[3, 1, 2, 5])


@pytest.mark.parametrize("with_chunk", [True, False], ids=["beside-a-chunk", "alone"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_splits_verifications(PagedKV, attention_ref, assert_close, needs_dot, device,
                                      full, group, dtype, with_chunk):
    """Verifications (1 + k query tokens over a long context) split along their keys beside
    decoding rows (and a prompt chunk, which makes their tiles wider than they are), and
    verifications left whole: more splits than KV tiles (empty trailing ones), a last split
    whose diagonal crosses a KV tile edge, and a one-token query split like a decoding row.
    The map is padded, and the launch runs twice (the counters must be left at zero)."""
    needs_dot(dtype)
    if full:
        decode_ctx, verify = [9000, 300], [(5, 16000), (8, 8190), (2, 130), (4, 3000), (1, 5000)]
        decode_splits, verify_splits = (8, 1), [24, 12, 3, 1, 6]
    else:
        decode_ctx, verify = [300, 17], [(5, 300), (8, 134), (2, 40), (4, 66), (1, 200)]
        decode_splits, verify_splits = (3, 1), [4, 3, 8, 1, 2]
    chunk = [(40, 120 if full else 60)] if with_chunk else []
    seqs = [(1, c) for c in decode_ctx] + [(1, 0)] + chunk + verify
    _check(PagedKV, attention_ref, assert_close, seqs, 2 * group, 2, 128 if full else 64, 16,
           dtype, device, first_seq=3, spare_tiles=4, decode_splits=decode_splits,
           prompt_splits=[1] * len(chunk) + verify_splits)


def test_prefill_tile_map_orders_heaviest_first():
    tiles = prefill_tile_map([130, 5], [130, 900], 64, first_seq=2, num_tiles=6)
    # (seq 3: 895 KV positions) > (seq 2, rows 128..: 129) > (rows 64..: 65) > (rows 0..: 1)
    assert tiles.tolist() == [[3, 0], [2, 128], [2, 64], [2, 0], [-1, 0], [-1, 0]]
    # Decoding rows first, entry -1 - ((split << 8) | splits).
    tiles = prefill_tile_map([130, 5], [130, 900], 64, first_seq=2, decode_splits=[1, 2])
    assert tiles.tolist() == [[0, -2], [1, -3], [1, -259], [3, 0], [2, 128], [2, 64], [2, 0]]
    # Then the split queries (sequence 3 in two), before the query tiles.
    tiles = prefill_tile_map([130, 5], [130, 900], 64, first_seq=2, decode_splits=[1],
                             prompt_splits=[1, 2])
    assert tiles.tolist() == [[0, -2], [3, -3], [3, -259], [2, 128], [2, 64], [2, 0]]


def test_split_counts_fit_their_entries():
    chunk = DECODE_CHUNK_TOKENS
    counts = split_counts([3 * chunk - 5, 100, chunk], 6 + 32, 33, alone=False)
    assert counts.tolist() == [3, 1, 1]
    # Too many tokens for chunks of DECODE_CHUNK_TOKENS in the entries: longer chunks.
    ctx = np.full(32, 4 * chunk)
    counts = split_counts(ctx, split_entries(32), 33, alone=False)
    assert counts.sum() <= split_entries(32) and counts.tolist() == [2] * 32
    assert split_counts([15 * chunk], split_entries(1), 4, alone=False).tolist() == [4]
    # Alone in the launch (a verification and a decoding row): the even share of 33 programs,
    # and rows under twice the least split whole.
    counts = split_counts([16000, 8000, 500], split_entries(1) + 2, 33, alone=True)
    assert counts.tolist() == [22, 11, 1]
    # Entries bound the splits of many long rows.
    counts = split_counts(np.full(8, 16000), split_entries(0) + 8, 33, alone=True)
    assert counts.sum() <= split_entries(0) + 8 and counts.tolist() == [4] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [[(15360, 15360)], [(128, 128)] * 32, [(2048, 2048)] * 8,
                                  [(1024, 9000), (1, 16000), (500, 500)]],
                         ids=["1x15360", "32x128", "8x2048", "chunked"])
def test_prefill_full_shapes(PagedKV, attention_ref, assert_close, device, seqs):
    if device != "cuda":
        pytest.skip("full shapes run on the GPU")
    _check(PagedKV, attention_ref, assert_close, seqs, 32, 8, 64, 16, torch.bfloat16, device)
