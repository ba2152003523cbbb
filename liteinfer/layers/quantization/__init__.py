"""Quantized linear layers: which method a model's linears use, from the engine's
`quantization` setting and the checkpoint's own `quantization_config`."""
from __future__ import annotations

from typing import Any

from torch import nn

from liteinfer.layers.quantization.fp8 import Fp8Config

QuantConfig = Fp8Config


def quant_config(quantization: str | None, hf_config: dict[str, Any],
                 load_format: str) -> QuantConfig | None:
    """The quantization of a model's linear layers: the checkpoint's when its config has a
    `quantization_config`, else `quantization` (a validated `EngineConfig.quantization`) applied
    at load (None: the model dtype). Dummy weights are drawn in the model dtype, so they are
    quantized at load either way."""
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is None or load_format == "dummy":
        return None if quantization is None and checkpoint is None else Fp8Config()
    method = checkpoint.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (FP8 "
                         "compressed-tensors checkpoints are)")
    from liteinfer.layers.quantization.compressed_tensors import fp8_config
    return fp8_config(checkpoint)


def process_weights_after_loading(model: nn.Module) -> None:
    """Lets every linear layer's method convert its loaded weights (FP8: quantize them)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


__all__ = ["QuantConfig", "process_weights_after_loading", "quant_config"]
