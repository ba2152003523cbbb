"""A row's share of its physical floor: the bytes one decode step must read, at the GPU's measured
copy bandwidth, against the row's measured step time (its ITL p50).

A decode step reads every weight it multiplies by once (the layers' projections and norms, and
the LM head, e4m3 under fp8 as liteinfer quantizes it, bf16 under int4) and each row's whole KV
cache; the embedding table only at the step's own tokens, so not at all for an untied model's
count. The rows' contexts are taken at the run's mean, ISL + OSL / 2. Biases and fp8 scales,
under 0.1% of the bytes, are left out; int4's fp32 scale and min per group of 128 are counted.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from liteinfer.config import ModelConfig
from liteinfer.loader import load_model_source

# Bytes/s that a device-to-device copy reaches on each GPU (NOTES.md, "The floors").
COPY_BANDWIDTH = {"NVIDIA H200": 4.3e12}
BF16, FP8 = 2, 1
INT4 = 0.5 + 8 / 128  # a code, and its group's fp32 scale and min


@cache
def packaged_model_config(model: str) -> ModelConfig | None:
    """The config of a model the loader knows by this name (`load_model_source`), else None."""
    try:
        return load_model_source(model, "dummy").model_config
    except ValueError:
        return None


def weight_bytes(config: ModelConfig, quantization: str | None = None) -> int:
    """The weights one decode step reads, under `EngineConfig.quantization`."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    projections = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
    norms = 2 * hidden * config.num_hidden_layers + hidden
    lm_head = config.vocab_size * hidden
    if quantization == "int4":
        return round(config.num_hidden_layers * projections * INT4 + (lm_head + norms) * BF16)
    return ((config.num_hidden_layers * projections + lm_head)
            * (FP8 if quantization == "fp8" else BF16) + norms * BF16)


def kv_bytes_per_token(config: ModelConfig, fp8_kv: bool = False) -> int:
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * (FP8 if fp8_kv else BF16))


def floor_share(row: dict[str, Any]) -> float | None:
    """The row's floor step time over its ITL p50 (1 = at the floor); None where the GPU's
    bandwidth, the model's config, a fixed ISL or the ITL is not known."""
    config = packaged_model_config(str(row.get("model")))
    bandwidth = COPY_BANDWIDTH.get(str(row.get("gpu")))
    itl_ms = row.get("itl_p50")
    if config is None or bandwidth is None or not itl_ms or not str(row["isl"]).isdigit():
        return None
    args = row.get("engine_args") or {}
    context = int(row["isl"]) + row["osl"] / 2
    nbytes = (weight_bytes(config, args.get("quantization"))
              + row["width"] * context * kv_bytes_per_token(config,
                                                            args.get("kv_cache_dtype") == "fp8"))
    return nbytes / bandwidth / (itl_ms / 1e3)
