"""Each row's share of its physical floor (bench/floor.py), against byte counts worked out by
hand from the packaged Llama configs."""
from __future__ import annotations

import pytest

from liteinfer.bench.floor import (
    experts_touched,
    floor_share,
    kv_bytes_per_token,
    packaged_model_config,
    weight_bytes,
)

ONE_B, EIGHT_B = "llama-3.2-1b-instruct", "llama-3.1-8b-instruct"
QWEN3_MOE, MIXTRAL = "qwen3-30b-a3b", "mixtral-8x7b-instruct"


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


def test_a_mixture_reads_the_experts_its_tokens_touch():
    qwen = packaged_model_config(QWEN3_MOE)
    # One token reads its 8 experts of each of the 48 layers: gate, up, down 2048 x 768 each.
    assert experts_touched(qwen.moe, 1) == pytest.approx(8)
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    router, expert = 128 * 2048, 3 * 2048 * 768
    head, norms = 151936 * 2048, 97 * 2048
    assert weight_bytes(qwen) == pytest.approx(
        2 * (48 * (attention + router + 8 * expert) + head + norms), abs=2)
    assert weight_bytes(qwen) == pytest.approx(6.08e9, rel=0.001)  # NOTES.md's 6.1 GB
    # 32 tokens picking 8 of 128 evenly touch 128 (1 - (120 / 128)^32) = 111.8 experts a layer;
    # 128 tokens nearly all of them; e4m3 experts, the router and norms in bf16.
    assert experts_touched(qwen.moe, 32) == pytest.approx(111.8, abs=0.05)
    assert weight_bytes(qwen, tokens=128) == pytest.approx(
        2 * (48 * (attention + router + 128 * (1 - (120 / 128) ** 128) * expert) + head
             + norms), abs=2)
    assert weight_bytes(qwen, "fp8", 32) == pytest.approx(
        48 * (attention + experts_touched(qwen.moe, 32) * expert) + head
        + 2 * (48 * router + norms), abs=2)
    mixtral = packaged_model_config(MIXTRAL)  # top-2 of 8 experts of 14,336: all 8 from ~16
    assert experts_touched(mixtral.moe, 16) == pytest.approx(7.92, abs=0.01)
    assert weight_bytes(mixtral) == pytest.approx(25.5e9, rel=0.001)


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
