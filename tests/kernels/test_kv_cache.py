"""store_kv and rope_store_kv: exact pool writes, padding slots skipped, RoPE vs float64."""
import pytest
import torch

from liteinfer.kernels.kv_cache import rope_store_kv, store_kv
from liteinfer.layers.rotary import cos_sin_cache

DTYPES = [torch.float16, torch.float32, torch.bfloat16]


@pytest.fixture(name="random_pool")
def random_pool_fixture(pool, device):
    def make(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
             dtype: torch.dtype, slot_dtype: torch.dtype, head_major: bool = True):
        """A random pool, and distinct random slots for the tokens with every third one -1."""
        num_blocks = -(-2 * num_tokens // block_size) + 1
        k_cache, v_cache = (pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                 head_major).normal_() for _ in range(2))
        slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
        slots[::3] = -1
        return k_cache, v_cache, slots.to(slot_dtype)
    return make


@pytest.fixture(name="expected_pool")
def expected_pool_fixture(at):
    def expect(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        expected = cache.clone()
        keep = slots >= 0
        expected[at(cache, slots[keep])] = rows[keep]
        return expected
    return expect


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(random_pool, expected_pool, qkv_views, device, full, block_size, dtype,
                  slot_dtype, head_major):
    num_tokens, heads, dim = (4096, 8, 128) if full else (37, 2, 64)
    k_cache, v_cache, slots = random_pool(num_tokens, heads, dim, block_size, dtype, slot_dtype,
                                          head_major)
    _, key, value = qkv_views(num_tokens, heads, heads, dim, dtype, device)
    expected_k = expected_pool(k_cache, slots, key)
    expected_v = expected_pool(v_cache, slots, value)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_rope_store_kv(random_pool, expected_pool, assert_close, rope_ref, qkv_views, device,
                       full, group, head_dim, dtype):
    num_tokens, heads = (4096, 32 // group) if full else (19, 2)
    k_cache, v_cache, slots = random_pool(num_tokens, heads, head_dim, 16, dtype, torch.int64)
    q, k, v = qkv_views(num_tokens, heads * group, heads, head_dim, dtype, device)
    max_pos = 1 << 15
    cos_sin = cos_sin_cache(head_dim, max_pos, 500000.0, None, device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device, dtype=torch.int32)
    q_ref, k_ref = rope_ref(q, positions, cos_sin), rope_ref(k, positions, cos_sin)
    expected_v = expected_pool(v_cache, slots, v)
    k_cache_before = k_cache.clone()

    rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    # The pool holds exactly the rotated key written back in place; nothing else changed.
    assert torch.equal(k_cache, expected_pool(k_cache_before, slots, k))
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_fp8_pool(pool, expected_pool, qkv_views, needs_fp8_store, device, full,
                           dtype):
    """An e4m3 pool holds each K/V value rounded to nearest e4m3, values past its +-448 range
    clamped, and nothing else changes."""
    num_tokens, heads, dim = (4096, 8, 128) if full else (37, 2, 64)
    num_blocks = -(-2 * num_tokens // 16) + 1
    k_cache, v_cache = (pool(num_blocks, 16, heads, dim, torch.float32, device).normal_()
                        .to(torch.float8_e4m3fn) for _ in range(2))
    slots = torch.randperm(num_blocks * 16, device=device)[:num_tokens]
    slots[::3] = -1
    _, key, value = qkv_views(num_tokens, heads, heads, dim, dtype, device)
    key.mul_(200)  # about 3% of the keys past 448
    stored = [(t.float().clamp(-448, 448)).to(torch.float8_e4m3fn) for t in (key, value)]
    expected_k = expected_pool(k_cache, slots, stored[0])
    expected_v = expected_pool(v_cache, slots, stored[1])
    store_kv(key, value, k_cache, v_cache, slots)
    for got, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
