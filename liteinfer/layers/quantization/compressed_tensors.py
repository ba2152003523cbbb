"""FP8 checkpoints in the compressed-tensors layout (llm-compressor's output, vLLM's common
input): `quantization_config.quant_method == "compressed-tensors"`, e4m3 `weight`s with
`weight_scale` per output channel ([N, 1]) or per tensor ([1]), and `input_scale` when the
activations are static. The config is read through compressed-tensors' own pydantic classes."""
from __future__ import annotations

from typing import Any

from compressed_tensors import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStrategy,
    QuantizationType,
)

from liteinfer.layers.quantization.fp8 import Fp8Config

_FORMATS = (CompressionFormat.float_quantized.value, CompressionFormat.naive_quantized.value)
_WEIGHT_STRATEGIES = (QuantizationStrategy.CHANNEL, QuantizationStrategy.TENSOR)
# Left in the model dtype whatever a checkpoint says: the LM head.
_UNQUANTIZED = {"lm_head"}


def _check_fp8(args: QuantizationArgs | None, what: str) -> QuantizationArgs:
    if args is None:
        raise ValueError(f"compressed-tensors checkpoint without {what} quantization: only FP8 "
                         "weights with FP8 activations (W8A8) are supported")
    if args.type != QuantizationType.FLOAT or args.num_bits != 8 or not args.symmetric:
        raise ValueError(f"compressed-tensors {what} are {args.num_bits}-bit {args.type} "
                         f"(symmetric={args.symmetric}); only symmetric FP8 is supported")
    return args


def fp8_config(checkpoint: dict[str, Any]) -> Fp8Config:
    """The Fp8Config of a compressed-tensors `quantization_config`; ValueError for any scheme it
    cannot serve exactly."""
    config = QuantizationConfig.model_validate(checkpoint)
    if config.kv_cache_scheme is not None:
        raise ValueError("compressed-tensors kv_cache_scheme (calibrated K/V scales) is not "
                         "supported; use kv_cache_dtype='fp8' with an unscaled FP8 cache")
    ignored = set(config.ignore or [])
    if not ignored <= _UNQUANTIZED:
        raise ValueError(f"compressed-tensors checkpoint leaves {sorted(ignored - _UNQUANTIZED)}"
                         " unquantized; only the LM head may be")
    if len(config.config_groups) != 1:
        raise ValueError("compressed-tensors checkpoints with several config groups are not "
                         "supported")
    scheme = next(iter(config.config_groups.values()))
    if "Linear" not in scheme.targets:
        raise ValueError(f"compressed-tensors scheme targets {scheme.targets}, not 'Linear'")
    fmt = scheme.format or config.format
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({_FORMATS})")
    weights = _check_fp8(scheme.weights, "weights")
    if weights.strategy not in _WEIGHT_STRATEGIES or weights.dynamic:
        raise ValueError(f"compressed-tensors weight strategy {weights.strategy} is not "
                         "supported (channel or tensor)")
    inputs = _check_fp8(scheme.input_activations, "input activations")
    # Dynamic activations, per token or per tensor, run per token (finer, never coarser).
    static = not inputs.dynamic
    if static and inputs.strategy != QuantizationStrategy.TENSOR:
        raise ValueError(f"static compressed-tensors activations by {inputs.strategy} are not "
                         "supported (tensor)")
    return Fp8Config(serialized=True, static_input=static)
