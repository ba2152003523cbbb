"""Checkpoints in the compressed-tensors layout (llm-compressor's output, vLLM's common input),
`quantization_config.quant_method == "compressed-tensors"`, read through compressed-tensors' own
pydantic classes and packing helpers:

- FP8 (W8A8): e4m3 `weight`s with `weight_scale` per output channel ([N, 1]) or per tensor
  ([1]), and `input_scale` when the activations are static;
- W4A16 (`pack-quantized`, symmetric or asymmetric, grouped): `weight_packed` int32 [N, K / 8]
  (codes offset to unsigned, the first in the low bits: the packed layout of wna16.py as it
  is), `weight_scale` [N, K / G], `weight_zero_point` int32 [N / 8, K / G] packed along N when
  asymmetric, and `weight_shape`."""
from __future__ import annotations

from typing import Any

import torch
from compressed_tensors import CompressionFormat
from compressed_tensors.quantization import (
    ActivationOrdering,
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStrategy,
    QuantizationType,
)

from liteinfer.layers.quantization.fp8 import Fp8Config
from liteinfer.layers.quantization.wna16 import WNA16Config, ZeroPointFormat

_FORMATS = (CompressionFormat.float_quantized.value, CompressionFormat.naive_quantized.value)
_PACKED = CompressionFormat.pack_quantized.value
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


class PackQuantizedFormat(ZeroPointFormat):
    names = ("weight_packed", "weight_scale", None)
    extra = ("weight_shape",)

    def __init__(self, symmetric: bool):
        if not symmetric:
            self.names = ("weight_packed", "weight_scale", "weight_zero_point")

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        shape = torch.Size((t.shape[0] * 8, t.shape[1]))
        # Signed zero points, offset back to the codes' unsigned range.
        return unpack_from_int32(t, 4, shape, packed_dim=0).to(torch.int32) + 8


def _wna16_config(weights: QuantizationArgs) -> WNA16Config:
    if (weights.type != QuantizationType.INT or weights.num_bits != 4
            or weights.strategy != QuantizationStrategy.GROUP or weights.dynamic
            or weights.actorder not in (None, ActivationOrdering.WEIGHT)):
        raise ValueError(f"compressed-tensors pack-quantized weights are {weights.num_bits}-bit "
                         f"{weights.type} by {weights.strategy} (actorder={weights.actorder}); "
                         "only 4-bit integer groups in input order are supported")
    return WNA16Config(4, weights.group_size, PackQuantizedFormat(weights.symmetric))


def compressed_tensors_config(checkpoint: dict[str, Any]) -> Fp8Config | WNA16Config:
    """The config of a compressed-tensors `quantization_config` (FP8 W8A8 or pack-quantized
    W4A16); ValueError for any scheme it cannot serve exactly."""
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
    if fmt == _PACKED and scheme.input_activations is None:
        return _wna16_config(scheme.weights)
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
