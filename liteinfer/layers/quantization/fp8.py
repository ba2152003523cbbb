"""FP8 (e4m3) linear layers: per-output-channel weight scales, activations quantized per token.

y = (x_q W_q^T) * s_x * s_w, where W_q holds each output row divided by its scale s_w (max |row| /
448) and x_q each token's row divided by its s_x (dynamic: max |x| / 448; static: the
checkpoint's `input_scale`). The activation is quantized by the kernel that produces it: the
RMSNorm in front of qkv and gate/up, the SwiGLU in front of down (kernels/norm.py,
kernels/activation.py); only o_proj's input, the attention output, takes a pass of its own.
Those are Triton kernels when the model's RMSNorm and SiluAndMul are (`use_triton`, from
LayerOps.triton), else their torch versions followed by `quantize_per_token`.
On CUDA in bf16 the product is `torch._scaled_mm` (an FP8 GEMM with row-wise scales); a
one-token step takes the GEMV kernel, which streams the e4m3 weight and keeps the activation in
the model dtype, and a step of a few rows the few-row GEMM (kernels/fewrow_gemm.py), where
cuBLASLt's FP8 kernels read the weight at a third to a half of the copy bandwidth. Elsewhere
(the CPU, and CUDA in fp16 or fp32, which `_scaled_mm` with row-wise scales cannot write) the
weight is dequantized once loaded, and each activation is quantized and
dequantized per token before a plain matmul: the same operands the GPU multiplies, so CPU tests
check the numbers it computes, at the speed of an unquantized model.

A bf16/fp16/fp32 checkpoint is quantized after loading (`process_weights_after_loading`); an FP8
checkpoint (compressed-tensors) loads e4m3 weights and their scales as they are, per-tensor
scales spread over their shard's rows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from liteinfer.kernels import FP8_DTYPE, FP8_MAX, MIN_AMAX
from liteinfer.layers.norm_act import rms_norm_torch, silu_and_mul_torch
from liteinfer.layers.quantization.base import LinearMethod, MoEMethod

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul


@dataclass(frozen=True)
class Fp8Config:
    """serialized: the checkpoint holds e4m3 weights and `weight_scale`s (else the weights are
    quantized at load). static_input: activations use the checkpoint's `input_scale`."""

    serialized: bool = False
    static_input: bool = False

    def linear_method(self, use_triton: bool) -> LinearMethod:
        return Fp8LinearMethod(self, use_triton)

    def lm_head_method(self, use_triton: bool) -> LinearMethod | None:
        """The LM head's method: e4m3 when the model is quantized at load, the model dtype's
        (None) under a checkpoint's own quantization, which leaves the head unquantized.
        Quantizing it halves the largest single read of a decode step (the 8B's head is an
        eighth of its fp8 weights, the 1B's over a third) within the accuracy rule of
        tests/test_fp8.py."""
        return None if self.serialized else Fp8LinearMethod(self, use_triton)

    def moe_method(self, use_triton: bool) -> MoEMethod:
        if self.serialized:
            raise ValueError("FP8 checkpoints of mixture-of-experts models are not supported; "
                             "load the bf16 checkpoint with quantization='fp8'")
        return Fp8MoEMethod(use_triton)


class Fp8Activation(NamedTuple):
    """An activation quantized per token: e4m3 [T, K] and fp32 scales [T, 1]."""

    data: torch.Tensor
    scale: torch.Tensor


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> Fp8Activation:
    """torch's version of kernels/quant_fp8.py: each row of x [T, K] over its own scale (or
    static_scale, fp32 [1]). The scales are contiguous, as `torch._scaled_mm` takes them."""
    xf = x.float()
    if static_scale is None:
        scale = xf.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return Fp8Activation((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows of weight [N, K] and their fp32 scales [N]."""
    q = quantize_per_token(weight)
    return q.data, q.scale.reshape(-1)


def dequantize(x: Fp8Activation, dtype: torch.dtype) -> torch.Tensor:
    return (x.data.float() * x.scale).to(dtype)


def fp8_matmul(x: Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor
               ) -> torch.Tensor:
    """(x.data weight^T) * x.scale * weight_scale in bf16 (the only dtype `torch._scaled_mm`
    writes with row-wise scales), on CUDA."""
    return torch._scaled_mm(x.data, weight.t(), scale_a=x.scale,
                            scale_b=weight_scale.reshape(1, -1), out_dtype=torch.bfloat16)


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: Fp8Config, use_triton: bool):
        self.config = config
        self.use_triton = use_triton  # Triton or torch norm, SwiGLU and quantization passes
        self.out_dtype = torch.get_default_dtype()  # the model dtype, as the layer is built

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        dtype = FP8_DTYPE if self.config.serialized else None  # None: the model dtype
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                    requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        if self.config.serialized:
            layer.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32),
                                              requires_grad=False)
            layer.weight_scale.weight_loader = self._scale_loader(layer)
        if self.config.static_input:
            # The largest of a fused layer's shards' scales: none of them clips.
            layer.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32),
                                             requires_grad=False)
            layer.input_scale.weight_loader = _max_loader

    @staticmethod
    def _scale_loader(layer: nn.Module) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
            loaded = loaded.float().reshape(-1)
            if loaded.numel() == 1:  # per-tensor: the shard's checkpoint rows share it
                loaded = loaded.expand(dict(layer.checkpoint_shapes(param))[shard])
            layer.weight_loader(param, loaded, shard)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.serialized:
            weight, scale = quantize_weight(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        # e4m3 stays only where fp8_matmul multiplies it (CUDA, bf16); anywhere else the weight
        # is dequantized here, once, so that no call copies it.
        if not (layer.weight.is_cuda and self.out_dtype == torch.bfloat16):
            deq = layer.weight.data.float() * layer.weight_scale.data[:, None]
            layer.weight = nn.Parameter(deq.to(self.out_dtype), requires_grad=False)
            layer.weight_scale = None

    def _input_scale(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.input_scale if self.config.static_input else None

    def _quantize(self, layer: nn.Module, x: torch.Tensor) -> Fp8Activation:
        if self.use_triton:
            from liteinfer.kernels.quant_fp8 import per_token_quant_fp8
            return Fp8Activation(*per_token_quant_fp8(x, self._input_scale(layer)))
        return quantize_per_token(x, self._input_scale(layer))

    def _matmul(self, layer: nn.Module, x: Fp8Activation,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T in the model dtype, or residual += x W^T in place (returning residual)."""
        if layer.weight_scale is None:  # dequantized at load
            y = nn.functional.linear(dequantize(x, self.out_dtype), layer.weight)
        else:
            if self.use_triton:
                from liteinfer.kernels import num_sms
                from liteinfer.kernels.fewrow_gemm import fewrow_gemm, fewrow_tiles
                n, k = layer.weight.shape
                tiles = fewrow_tiles(x.data.shape[0], n, k, 1, num_sms(x.data.device))
                if tiles is not None:
                    return fewrow_gemm(x.data, layer.weight, x_scale=x.scale,
                                       weight_scale=layer.weight_scale, residual=residual,
                                       out_dtype=self.out_dtype, tiles=tiles,
                                       workspace=layer.scratch.split_k)
            y = fp8_matmul(x, layer.weight, layer.weight_scale)
        return y if residual is None else residual.add_(y)

    def gemv_weight_scale(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.weight_scale  # None once dequantized

    def split_k_launch(self, layer: nn.Module, sms: int) -> tuple[int, int] | None:
        if not self.use_triton or layer.weight_scale is None:
            return None
        from liteinfer.kernels.fewrow_gemm import FEWROW_MAX_ROWS, fewrow_tiles
        n, k = layer.weight.shape
        # Only the widest steps' (swapped) tiles cut K, by the same count at any row count.
        tiles = fewrow_tiles(FEWROW_MAX_ROWS, n, k, 1, sms)
        return (n, tiles.splits) if tiles is not None and tiles.splits > 1 else None

    def gemm(self, layer: nn.Module, x: torch.Tensor | Fp8Activation,
             residual: torch.Tensor | None) -> torch.Tensor:
        xq = x if isinstance(x, Fp8Activation) else self._quantize(layer, x)
        return self._matmul(layer, xq, residual)

    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> torch.Tensor | Fp8Activation:
        static = self._input_scale(layer)
        if self.use_triton:
            from liteinfer.kernels.norm import rms_norm_fp8
            xq = Fp8Activation(*rms_norm_fp8(x, norm.weight, norm.eps, static))
        else:
            xq = quantize_per_token(rms_norm_torch(x, norm.weight, norm.eps), static)
        y = self._matmul(layer, xq)
        if act is None:
            return y
        if self.config.static_input:  # down_proj quantizes it over its own static scale
            return act(y)
        # Dynamic scales: the SwiGLU kernel quantizes its output for down_proj on its way out.
        if self.use_triton:
            from liteinfer.kernels.activation import silu_and_mul_fp8
            return Fp8Activation(*silu_and_mul_fp8(y))
        return quantize_per_token(silu_and_mul_torch(y))


def _max_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1)))


class Fp8MoEMethod(MoEMethod):
    """e4m3 experts, each row of each expert over its own scale, quantized at load. The Triton
    kernels (CUDA, bf16) stream the e4m3 weights and widen them in registers against the
    activations in the model dtype, as the GEMV kernel does for dense layers; elsewhere the
    experts are dequantized once loaded and each GEMM's input is quantized per token and back,
    as Fp8LinearMethod does off the GPU."""

    def __init__(self, use_triton: bool):
        self.use_triton = use_triton
        self.out_dtype = torch.get_default_dtype()  # the model dtype, as the layer is built

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight").data
            q, scale = quantize_weight(weight.reshape(-1, weight.shape[-1]))
            scale = scale.reshape(weight.shape[:2])
            if self.use_triton and weight.is_cuda and self.out_dtype == torch.bfloat16:
                q, scale = q.reshape(weight.shape), nn.Parameter(scale, requires_grad=False)
            else:  # dequantized here, once
                deq = q.float().reshape(weight.shape) * scale[..., None]
                q, scale = deq.to(weight.dtype), None
            setattr(layer, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_triton:  # e4m3 with scales, or dequantized (scales None) off CUDA bf16
            from liteinfer.kernels.fused_moe import fused_moe
            return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             layer.w13_scale, layer.w2_scale, residual)
        from liteinfer.layers.fused_moe import fused_moe_torch
        return fused_moe_torch(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                               _through_e4m3, residual)


def _through_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x quantized per token and dequantized: the activation an FP8 GEMM multiplies."""
    return dequantize(quantize_per_token(x), x.dtype)
