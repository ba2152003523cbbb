"""store_kv and rope_store_kv: exact pool writes, padding slots skipped, RoPE vs float64."""
import pytest
import torch

from liteinfer.kernels.kv_cache import rope_store_kv, store_kv
from liteinfer.layers.rotary import cos_sin_cache

DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def _pool(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, device: str, slot_dtype: torch.dtype):
    """A random pool, and distinct random slots for the tokens with every third one -1."""
    num_blocks = -(-2 * num_tokens // block_size) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::3] = -1
    return k_cache, v_cache, slots.to(slot_dtype)


def _expected_pool(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    expected = cache.clone()
    keep = slots >= 0
    expected.view(-1, *cache.shape[2:])[slots[keep].long()] = rows[keep]
    return expected


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(qkv_views, device, full, block_size, dtype, slot_dtype):
    num_tokens, heads, dim = (4096, 8, 128) if full else (37, 2, 64)
    k_cache, v_cache, slots = _pool(num_tokens, heads, dim, block_size, dtype, device, slot_dtype)
    _, key, value = qkv_views(num_tokens, heads, heads, dim, dtype, device)
    expected_k = _expected_pool(k_cache, slots, key)
    expected_v = _expected_pool(v_cache, slots, value)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_rope_store_kv(assert_close, rope_ref, qkv_views, device, full, group, head_dim, dtype):
    num_tokens, heads = (4096, 32 // group) if full else (19, 2)
    k_cache, v_cache, slots = _pool(num_tokens, heads, head_dim, 16, dtype, device, torch.int64)
    q, k, v = qkv_views(num_tokens, heads * group, heads, head_dim, dtype, device)
    max_pos = 1 << 15
    cos_sin = cos_sin_cache(head_dim, max_pos, 500000.0, None, device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device, dtype=torch.int32)
    q_ref, k_ref = rope_ref(q, positions, cos_sin), rope_ref(k, positions, cos_sin)
    expected_v = _expected_pool(v_cache, slots, v)
    k_cache_before = k_cache.clone()

    rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    # The pool holds exactly the rotated key written back in place; nothing else changed.
    assert torch.equal(k_cache, _expected_pool(k_cache_before, slots, k))
    assert torch.equal(v_cache, expected_v)
