"""Paged split-K decode attention against a float64 reference."""
import math

import pytest
import torch

from liteinfer.kernels import decode_attention, num_sms
from liteinfer.kernels.decode_attention import NewKV, paged_decode_attention
from liteinfer.kernels.decode_splits import (
    MIN_SPLIT_TOKENS,
    MIN_SPLIT_TOKENS_WIDE_HEADS,
    SPLIT_WAVES,
    DecodeSplits,
    DecodeWorkspace,
    max_splits_for,
    min_split_tokens,
    program_slots,
    rows_may_split,
)
from liteinfer.layers.rotary import cos_sin_cache


def _contexts(full: bool, block_size: int, batch: int = 16) -> list[int]:
    """Ragged contexts: 1 token, exact block edges, several tiles, and a padding row (0)."""
    if full:
        lens = torch.randint(1, 16385, (batch - 3,)).tolist()
        return [1, block_size, 16384] + lens[:-1] + [0]
    return [1, block_size, block_size + 1, 3 * block_size + 5, 300, 0]


def _workspace(batch, num_q_heads, head_dim, max_splits, device) -> DecodeWorkspace:
    """Sized for a larger batch and grid, as the engine preallocates it once. The partials are
    NaN (stale splits must never be read); the counters stay zero, as allocated."""
    ws = DecodeWorkspace.allocate(batch + 2, num_q_heads, head_dim, max_splits + 3, device)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    return ws


def _check(PagedKV, attention_ref, assert_close, contexts, num_q_heads, num_kv_heads, head_dim,
           block_size, dtype, device, max_splits, num_splits=None, ws=None, head_major=True,
           min_tokens=MIN_SPLIT_TOKENS, kv_dtype=None):
    kv = PagedKV(contexts, num_kv_heads, head_dim, block_size, dtype, device,
                 head_major=head_major, kv_dtype=kv_dtype)
    batch = len(contexts)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    if ws is None:
        ws = _workspace(batch, num_q_heads, head_dim, max_splits, device)
    scale = 1 / math.sqrt(head_dim)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens_t, scale,
                           out, max_splits, ws, num_splits=num_splits, min_tokens=min_tokens)
    assert (ws.counters == 0).all(), "the last program of each row must reset its counter"
    rows = [b for b, c in enumerate(contexts) if c > 0]
    padding = [b for b, c in enumerate(contexts) if c == 0]
    assert (out[padding] == 0).all(), "padding rows must be zeros"
    ref = torch.stack([attention_ref(q[b:b + 1], *kv.kv64(b, num_q_heads), contexts[b] - 1,
                                     scale)[0] for b in rows])
    assert_close(out[rows], ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(PagedKV, attention_ref, assert_close, needs_dot, device, full,
                                  group, head_dim, block_size, max_splits, dtype):
    needs_dot(dtype)
    num_kv_heads = 32 // group if full else 2
    _check(PagedKV, attention_ref, assert_close, _contexts(full, block_size),
           num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, device, max_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reads_fp8_pool(PagedKV, attention_ref, assert_close, needs_dot, device, full,
                               group, max_splits, dtype):
    """An e4m3 pool: its tiles are widened to q's dtype in registers, so the output matches
    attention over the pool's own (e4m3) values within q's dtype's tolerance."""
    needs_dot(dtype)
    num_kv_heads = 8 if full else 2
    _check(PagedKV, attention_ref, assert_close, _contexts(full, 16), num_kv_heads * group,
           num_kv_heads, 128, 16, dtype, device, max_splits, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
def test_decode_per_row_splits(PagedKV, attention_ref, assert_close, device, full, head_major):
    """Split counts differ per row, exceed some rows' tile counts, and one exceeds max_splits
    (clamped); 3 query heads per KV head (padded to 16 rows); either pool layout."""
    max_splits = 8
    contexts = _contexts(full, 16, batch=24) if full else [1, 16, 129, 300, 0, 257]
    num_splits = torch.randint(1, max_splits + 3, (len(contexts),), dtype=torch.int32,
                               device=device)
    num_splits[:3] = torch.tensor([8, 1, 10], dtype=torch.int32)
    dtype = torch.bfloat16 if full else torch.float32
    _check(PagedKV, attention_ref, assert_close, contexts, 6, 2, 64, 16, dtype, device,
           max_splits, num_splits, head_major=head_major)


def test_decode_mixed_split_counts(PagedKV, attention_ref, assert_close, device):
    """One launch where some rows take the single-split path (output written directly, the
    workspace untouched) and others merge many splits, in several chunks (G=8, D=128: 4 splits
    a chunk at MERGE_TILE = 4096) and a count that is not a multiple of the chunk."""
    max_splits = 16
    contexts = [1000, 40, 1100, 0, 700, 5, 64 * 13]
    num_splits = torch.tensor([13, 1, 16, 1, 1, 3, 13], dtype=torch.int32, device=device)
    ws = _workspace(len(contexts), 16, 128, max_splits, device)
    _check(PagedKV, attention_ref, assert_close, contexts, 16, 2, 128, 16, torch.float32,
           device, max_splits, num_splits, ws)
    single = (num_splits == 1).nonzero()[:, 0]
    assert ws.partial_lse[single].isnan().all() and ws.partial_out[single].isnan().all()


def test_decode_workspace_reuse(PagedKV, attention_ref, assert_close, device):
    """Consecutive launches (layers, steps, graph replays) share one workspace: each must find
    the counters at zero and leave them so, whatever the previous launch's rows and splits."""
    max_splits = 8
    ws = _workspace(6, 8, 64, max_splits, device)
    first = ([300, 129, 0, 257, 16], [8, 5, 3, 1, 2])
    second = ([17, 400, 260, 1, 0, 90], [2, 8, 1, 4, 6, 8])
    for contexts, splits in (first, second, first):
        num_splits = torch.tensor(splits, dtype=torch.int32, device=device)
        _check(PagedKV, attention_ref, assert_close, contexts, 8, 2, 64, 16, torch.float16,
               device, max_splits, num_splits, ws)


def _check_verifications(PagedKV, attention_ref, assert_close, contexts, query_len, num_q_heads,
                         num_kv_heads, head_dim, dtype, device, max_splits, num_splits=None):
    """Rows of `query_len` query tokens each (a verification), token t of row b at position
    contexts[b] - query_len + t and seeing the keys up to it; rows of context 0 are padding."""
    kv = PagedKV(contexts, num_kv_heads, head_dim, 16, dtype, device)
    batch = len(contexts)
    q = torch.randn(batch * query_len, num_q_heads, head_dim, dtype=dtype, device=device)
    out = torch.full_like(q, float("nan"))
    ws = _workspace(batch * query_len, num_q_heads, head_dim, max_splits, device)
    scale = 1 / math.sqrt(head_dim)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens_t, scale,
                           out, max_splits, ws, num_splits=num_splits, query_len=query_len)
    assert (ws.counters == 0).all(), "the last program of each row must reset its counter"
    for b, ctx in enumerate(contexts):
        rows = slice(b * query_len, (b + 1) * query_len)
        if ctx == 0:
            assert (out[rows] == 0).all(), "padding rows must be zeros"
            continue
        assert_close(out[rows], attention_ref(q[rows], *kv.kv64(b, num_q_heads),
                                              ctx - query_len, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("query_len", [2, 5])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_verifications_match_reference(PagedKV, attention_ref, assert_close, needs_dot, device,
                                       full, group, query_len, max_splits, dtype):
    """A verification's 1 + k query tokens in one launch, beside their G query heads: each K/V
    tile is read once for all of them, each token masking the keys after its own position."""
    needs_dot(dtype)
    num_kv_heads = 8 if full else 2
    contexts = ([query_len, 300, 4096, 0, 16 * 40 + 3, 9000] if full
                else [query_len, 17, 0, 16 * 9 + query_len, 300])
    _check_verifications(PagedKV, attention_ref, assert_close, contexts, query_len,
                         num_kv_heads * group, num_kv_heads, 64, dtype, device, max_splits)


def test_verification_splits_past_the_first_tokens_context(PagedKV, attention_ref,
                                                           assert_close, device):
    """Split counts that leave a row's last range holding only its query tokens' own keys, or
    empty, and one per row past max_splits: every token still sees a key in each range's first
    tile, and the merge takes each token's ranges."""
    contexts = [5, 128 + 4, 256 + 5, 129, 0]
    num_splits = torch.tensor([4, 2, 3, 8, 2], dtype=torch.int32, device=device)
    _check_verifications(PagedKV, attention_ref, assert_close, contexts, 5, 6, 2, 64,
                         torch.float32, device, 6, num_splits)


def _kernel_split_counts(PagedKV, contexts, max_splits, num_kv_heads, device,
                         min_tokens=MIN_SPLIT_TOKENS):
    """The split count the kernel's own rule gives each row, read back from the workspace: a row
    in one split writes no partials (they stay NaN), a row in n writes the lse of splits 0..n-1."""
    kv = PagedKV(contexts, num_kv_heads, 64, 16, torch.float16, device)
    q = torch.randn(len(contexts), num_kv_heads, 64, dtype=torch.float16, device=device)
    ws = _workspace(len(contexts), num_kv_heads, 64, max_splits, device)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens_t, 0.125,
                           torch.empty_like(q), max_splits, ws, min_tokens=min_tokens)
    written = (~ws.partial_lse[:len(contexts), 0].isnan()).sum(-1)
    return torch.where(written == 0, 1, written).tolist()


@pytest.mark.parametrize("batch", [1, 4, 32, 128])
def test_decode_engine_policy(PagedKV, attention_ref, assert_close, device, full, batch):
    """The engine's path: grid width from the host policy, per-row splits chosen in the kernel."""
    num_kv_heads = 8 if full else 2
    if not full:
        batch = min(batch, 5)
    max_splits = max_splits_for(batch, num_kv_heads, num_sms(torch.device(device)))
    contexts = torch.randint(1, 16385 if full else 400, (batch,)).tolist()
    dtype = torch.bfloat16 if full else torch.float16
    _check(PagedKV, attention_ref, assert_close, contexts, 4 * num_kv_heads, num_kv_heads, 64,
           16, dtype, device, max_splits, min_tokens=256 if full else 64)


def test_split_policy():
    assert max_splits_for(1, 8, 132) >= 16  # one long sequence spreads over the SMs
    widths = [max_splits_for(b, 8, 132) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert widths[:5] == sorted(widths[:5], reverse=True)  # narrow: fill two waves of SMs
    # Wide batches: room for their longest rows (more where the batch fills one wave), then none.
    assert widths[-4:] == [3, 2, 1, 1] and max_splits_for(17, 8, 132) == 3
    assert program_slots(17, 8, 132, 3) == 3 * program_slots(16, 8, 132, 2) // 2
    # ... but only if a row may split; narrow batches fill the SMs either way.
    assert max_splits_for(32, 8, 132, may_split=False) == 1
    assert max_splits_for(4, 8, 132, may_split=False) == max_splits_for(4, 8, 132)
    assert not rows_may_split([0, 100, 511], 64) and rows_may_split([0, 512], 64)
    assert not rows_may_split([], 64) and not rows_may_split([0, 127], 128)
    assert rows_may_split([0, 128], 128)
    assert min_split_tokens(64) == MIN_SPLIT_TOKENS
    assert min_split_tokens(128) == MIN_SPLIT_TOKENS_WIDE_HEADS
    assert all(1 <= w <= 64 for w in widths)


def test_decode_splits_size_one_model():
    """A model's sizing: a workspace as wide as one row's grid, and each batch's width and
    whether its rows may split from the model's KV heads, head size and SMs."""
    splits = DecodeSplits.allocate(40, 8, 2, 128, 132, "cpu")
    width = max_splits_for(1, 2, 132)
    assert splits.workspace.partial_out.shape == (40, 8, width, 128)
    assert splits.workspace.counters.shape == (40, 8) and not splits.workspace.counters.any()
    assert splits.rows == 40 and splits.max_splits == width
    assert splits.width(0, True) == 1  # a prompt step without decoding rows
    for batch in (1, 40, 200):
        for may_split in (False, True):
            assert splits.width(batch, may_split) == max_splits_for(batch, 2, 132, may_split)
    assert splits.width(200, False) == 1 and splits.width(200, True) == 2
    assert splits.may_split([0, 128]) and not splits.may_split([0, 127])


def test_kernel_split_counts(PagedKV, device):
    """The kernel's split rule (decode_splits) with 16-token minimal splits. The ragged case
    takes as many KV heads as there are program slots over 8 (CPU: 2), so its even share is
    the same on any device: a total of 1,063 tokens / 8 = 132."""
    # Narrow: the even share is under the minimum, so rows split per 16 tokens from 32 on; a
    # lone long row fills the grid's width.
    assert _kernel_split_counts(PagedKV, [0, 1, 16, 31, 32, 70], 8, 1, device, 16) == [
        1, 1, 1, 1, 2, 5]
    assert _kernel_split_counts(PagedKV, [300], 8, 1, device, 16) == [8]
    # Wide and ragged: only the rows past the even share split.
    contexts = [20] * 30 + [150, 60, 120, 133]
    heads = SPLIT_WAVES * num_sms(torch.device(device)) // 8
    assert _kernel_split_counts(PagedKV, contexts, 2, heads, device, 16) == [1] * 30 + [2, 1, 1, 2]


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["kv-auto", "kv-fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_splits", [1, 4, 8])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True], ids=["tile-after-wait", "tile-before-wait"])
def test_decode_writes_new_token(PagedKV, at, attention_ref, rope_ref, qkv_views, assert_close,
                                 needs_dot, request, monkeypatch, device, full, prefetch, group,
                                 max_splits, dtype, kv_dtype):
    """With NewKV the kernel rotates q and the new key, writes key and value at the row's last
    KV position (poisoned with NaN until then, so reading it unwritten fails), and attends over
    it. Per-row split counts put that position in first, middle and last splits, and in the
    first or a later tile of its split. An e4m3 pool stores the key and value rounded to e4m3,
    and the output is attention over what it holds. Both places of the first tile's load: a
    tile read before the new row is written holds the poison until the kernel patches it."""
    needs_dot(dtype)
    monkeypatch.setattr(decode_attention, "prefetches_first_tile", lambda *_: prefetch)
    if kv_dtype is not None:
        request.getfixturevalue("needs_fp8_store")
    contexts = _contexts(full, 16, batch=24) if full else [1, 16, 129, 300, 0, 257]
    num_kv_heads, head_dim, batch = (8 if full else 2), 64, len(contexts)
    num_q_heads = num_kv_heads * group
    kv = PagedKV(contexts, num_kv_heads, head_dim, 16, dtype, device, kv_dtype=kv_dtype)
    last = torch.tensor([kv.slots(b)[-1].item() if c else -1 for b, c in enumerate(contexts)],
                        device=device)
    kv.k_cache[at(kv.k_cache, last[last >= 0])] = float("nan")
    kv.v_cache[at(kv.v_cache, last[last >= 0])] = float("nan")
    q, k, v = qkv_views(batch, num_q_heads, num_kv_heads, head_dim, dtype, device)
    q_before = q.clone()
    cos_sin = cos_sin_cache(head_dim, 1 << 15, 500000.0, None, device)
    positions = torch.randint(0, 1 << 15, (batch,), device=device)
    num_splits = torch.randint(1, max_splits + 1, (batch,), dtype=torch.int32, device=device)
    ws = _workspace(batch, num_q_heads, head_dim, max_splits, device)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens_t, scale,
                           out, max_splits, ws, NewKV(k, v, positions, last, cos_sin),
                           num_splits=num_splits)
    assert torch.equal(q, q_before), "q is rotated in registers, not in place"
    assert (ws.counters == 0).all()
    rows = [b for b, c in enumerate(contexts) if c > 0]
    assert (out[[b for b in range(batch) if b not in rows]] == 0).all()
    written = at(kv.k_cache, last[rows])
    if kv_dtype is None:
        assert torch.equal(kv.v_cache[written], v[rows])
    else:
        assert torch.equal(kv.v_cache[written].view(torch.uint8),
                           v[rows].to(kv_dtype).view(torch.uint8))
    assert_close(kv.k_cache[written], rope_ref(k[rows], positions[rows], cos_sin))
    q_rot = rope_ref(q, positions, cos_sin)
    ref = torch.stack([attention_ref(q_rot[b:b + 1], *kv.kv64(b, num_q_heads), contexts[b] - 1,
                                     scale)[0] for b in rows])
    assert_close(out[rows], ref, dtype)
