"""Each row's share of its physical floor (bench/floor.py), against byte counts worked out by
hand from the packaged Llama configs."""
from __future__ import annotations

import pytest

from liteinfer.bench.floor import (
    floor_share,
    kv_bytes_per_token,
    packaged_model_config,
    weight_bytes,
)

ONE_B, EIGHT_B = "llama-3.2-1b-instruct", "llama-3.1-8b-instruct"


def test_weight_and_kv_bytes_of_the_llama_configs():
    one_b = packaged_model_config(ONE_B)
    # 16 layers of q, k, v, o (2048 x (2048 + 2 x 512) + 2048 x 2048) and gate, up, down
    # (3 x 2048 x 8192), the tied LM head 128,256 x 2048, 33 norms of 2048; all bf16, or e4m3
    # but for the norms.
    layer = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192
    head, norms = 128256 * 2048, 33 * 2048
    assert weight_bytes(one_b) == 2 * (16 * layer + head + norms)
    assert weight_bytes(one_b) == pytest.approx(2.47e9, rel=0.002)  # NOTES.md's floor
    assert weight_bytes(one_b, "fp8") == 16 * layer + head + 2 * norms
    assert weight_bytes(one_b, "int4") == round(16 * layer * (0.5 + 8 / 128)) + 2 * (head + norms)
    assert kv_bytes_per_token(one_b) == 2 * 16 * 8 * 64 * 2
    assert kv_bytes_per_token(one_b, fp8_kv=True) == 2 * 16 * 8 * 64
    eight_b = packaged_model_config(EIGHT_B)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    # Untied: the LM head is read, the embedding table only at the step's own tokens.
    assert weight_bytes(eight_b) == 2 * (32 * layer + 128256 * 4096 + 65 * 4096)
    assert packaged_model_config("no-such-model") is None


def row(**overrides):
    return {"model": ONE_B, "gpu": "NVIDIA H200", "isl": 128, "osl": 256, "width": 1,
            "itl_p50": 0.888, "engine_args": {"dtype": "bfloat16"}, **overrides}


def test_floor_share_is_the_floor_step_time_over_the_itl():
    one_b = packaged_model_config(ONE_B)
    floor_s = (weight_bytes(one_b) + 256 * kv_bytes_per_token(one_b)) / 4.3e12
    assert floor_share(row()) == pytest.approx(floor_s / 0.888e-3)
    assert 0.6 < floor_share(row()) < 0.7
    # 128 rows read 128 KV caches; fp8 halves the projections' and the cache's bytes.
    wide = (weight_bytes(one_b) + 128 * 256 * kv_bytes_per_token(one_b)) / 4.3e12 / 1.62e-3
    assert floor_share(row(width=128, itl_p50=1.62)) == pytest.approx(wide)
    fp8 = row(engine_args={"quantization": "fp8", "kv_cache_dtype": "fp8"})
    assert floor_share(fp8) == pytest.approx(
        (weight_bytes(one_b, "fp8") + 256 * kv_bytes_per_token(one_b, True)) / 4.3e12 / 0.888e-3)


@pytest.mark.parametrize("unknown", [{"gpu": "NVIDIA A100"}, {"model": "my-model"},
                                     {"isl": "mixed2048"}, {"itl_p50": None}])
def test_floor_share_is_none_where_a_term_is_unknown(unknown):
    assert floor_share(row(**unknown)) is None
