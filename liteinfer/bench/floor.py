"""A row's share of its physical floor: the bytes one decode step must read, at the GPU's measured
copy bandwidth, against the row's measured step time (its ITL p50).

A decode step reads every weight it multiplies by once (the layers' projections and norms, and
the LM head, e4m3 under fp8 as liteinfer quantizes it, bf16 under int4) and each row's whole KV
cache; the embedding table only at the step's own tokens, so not at all for an untied model's
count. The rows' contexts are taken at the run's mean, ISL + OSL / 2. Biases and fp8 scales,
under 0.1% of the bytes, are left out; int4's fp32 scale and min per group of 128 are counted.
A mixture's sparse layer reads its router and only the experts the step's tokens chose: as many
as a router spreading its picks evenly touches (`experts_touched`), which the dummy weights'
random routers come close to; a trained router concentrates its picks, reading fewer.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from liteinfer.config import ModelConfig, MoeConfig
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


def experts_touched(moe: MoeConfig, tokens: int) -> float:
    """Experts a sparse layer reads in a step of `tokens` tokens whose router spreads its picks
    evenly: each token picks top_k of the experts, so a given expert escapes a token with
    probability 1 - top_k / num_experts."""
    return moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** tokens)


def weight_bytes(config: ModelConfig, quantization: str | None = None,
                 tokens: int = 1) -> int:
    """The weights one decode step of `tokens` tokens reads, under `EngineConfig.quantization`
    (the tokens matter only to a mixture of experts)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    layers = config.num_hidden_layers
    moe = config.moe
    sparse = 0 if moe is None else len(moe.sparse_layers)
    mlps = (layers - sparse) * 3 * hidden * config.intermediate_size
    router = 0  # in the model dtype whatever the experts' quantization
    if moe is not None:
        mlps += sparse * experts_touched(moe, tokens) * 3 * hidden * moe.intermediate_size
        router = sparse * moe.num_experts * hidden
    projections = layers * (hidden * (q + 2 * kv) + q * hidden) + mlps
    norms = 2 * hidden * layers + hidden
    lm_head = config.vocab_size * hidden
    if quantization == "int4":
        return round(projections * INT4 + (lm_head + norms + router) * BF16)
    return round((projections + lm_head) * (FP8 if quantization == "fp8" else BF16)
                 + (norms + router) * BF16)


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
    nbytes = (weight_bytes(config, args.get("quantization"), row["width"])
              + row["width"] * context * kv_bytes_per_token(config,
                                                            args.get("kv_cache_dtype") == "fp8"))
    return nbytes / bandwidth / (itl_ms / 1e3)
