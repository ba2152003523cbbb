"""Quantized linear layers: which method a model's linears use, from the engine's
`quantization` setting and the checkpoint's own `quantization_config`."""
from __future__ import annotations

from typing import Any

from torch import nn

from liteinfer.layers.quantization.base import LinearMethod
from liteinfer.layers.quantization.fp8 import Fp8Config
from liteinfer.layers.quantization.gguf import GGUFConfig
from liteinfer.layers.quantization.wna16 import WNA16Config

QuantConfig = Fp8Config | WNA16Config | GGUFConfig


def _at_load(quantization: str) -> Fp8Config | WNA16Config:
    """Weights in the model dtype, quantized once loaded."""
    return Fp8Config() if quantization == "fp8" else WNA16Config()


def _checkpoint_config(checkpoint: dict[str, Any]) -> Fp8Config | WNA16Config:
    method = checkpoint.get("quant_method")
    if method == "compressed-tensors":
        from liteinfer.layers.quantization.compressed_tensors import compressed_tensors_config
        return compressed_tensors_config(checkpoint)
    if method == "awq":
        from liteinfer.layers.quantization.awq import awq_config
        return awq_config(checkpoint)
    if method == "gptq":
        from liteinfer.layers.quantization.gptq import gptq_config
        return gptq_config(checkpoint)
    raise ValueError(f"checkpoint quantization {method!r} is not supported (compressed-tensors "
                     "FP8 or pack-quantized, awq, gptq)")


def quant_config(quantization: str | None, hf_config: dict[str, Any],
                 load_format: str) -> QuantConfig | None:
    """The quantization of a model's linear layers: the checkpoint's when its config has a
    `quantization_config`, else `quantization` (a validated `EngineConfig.quantization`) applied
    at load (None: the model dtype). Dummy weights are drawn in the model dtype, so they are
    quantized at load either way, as `quantization` says or else as the checkpoint's method
    (FP8, or 4-bit groups for the integer formats). A GGUF file's blocks stay quantized
    unless `quantization` asks for another format (gguf.py)."""
    checkpoint = hf_config.get("quantization_config")
    if checkpoint is not None and checkpoint.get("quant_method") == "gguf":
        if load_format == "dummy":
            return None if quantization is None else _at_load(quantization)
        return GGUFConfig.from_config(checkpoint, None if quantization is None
                                      else _at_load(quantization))
    if checkpoint is None:
        return None if quantization is None else _at_load(quantization)
    config = _checkpoint_config(checkpoint)
    if load_format != "dummy":
        return config
    if quantization is not None:
        return _at_load(quantization)
    return Fp8Config() if isinstance(config, Fp8Config) else WNA16Config(config.bits,
                                                                         config.group_size)


def process_weights_after_loading(model: nn.Module) -> None:
    """Lets every linear layer's method convert its loaded weights (FP8: quantize them)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def split_k_launches(model: nn.Module, sms: int) -> list[tuple[int, int]]:
    """(features, splits) of every few-row launch of the model's loaded linear layers that cuts
    K on a GPU of `sms` SMs: what the runner's SplitKWorkspace must hold."""
    launches = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)  # (a mixture's experts have a MoEMethod)
        launch = (method.split_k_launch(module, sms) if isinstance(method, LinearMethod)
                  else None)
        if launch is not None:
            launches.append(launch)
    return launches


__all__ = ["GGUFConfig", "QuantConfig", "process_weights_after_loading", "quant_config",
           "split_k_launches"]
