"""llama.cpp's GGUF block types, kept quantized: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tensors
are read into the packed layout of wna16.py without changing a value (the block layouts are
the `gguf` library's, `gguf.quants`; its `dequantize` is the reference the tests hold them to):

| type | bits a code | group | scale | min |
|---|---|---|---|---|
| Q4_0 | 4 | 32 | d | 8 d |
| Q4_1 | 4 | 32 | d | -m |
| Q8_0 | 8 (int8 + 128) | 32 | d | 128 d |
| Q4_K | 4 | 32 | d * sub-scale | dmin * sub-min |
| Q5_K | 8 (5 used) | 32 | d * sub-scale | dmin * sub-min |
| Q6_K | 8 (6 used) | 16 | d * sub-scale | 32 d * sub-scale |

A model's linears are created at the widest bits and finest group among its tensors (a
coarser tensor's scales repeat over the finer groups), and once loaded each is repacked to the
fewest bits and widest groups that hold its own values (`wna16.narrowest`): a Q4_K_M file's
Q4_K projections read 6 bits a weight, its Q6_K ones (v, down in some layers) 12. Blocks are
not kept as llama.cpp stores them: each group's scale and min are fp32 beside a plane of codes
(a 4-bit type then reads 6 bits a weight at group 32, against Q4_0's 4.5), which lets one
kernel serve every type.

With `quantization` set the blocks are dequantized at load and quantized again its way."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf.quants import Q4_K
from torch import nn

from liteinfer.layers.quantization.base import LinearMethod
from liteinfer.layers.quantization.wna16 import PackedMinFormat, WNA16Config, dequantize

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul
    from liteinfer.layers.quantization.fp8 import Fp8Config

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [B, block], scales, mins [B, groups]


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Each `width`-byte run's low nibbles, then its high nibbles."""
    shifted = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], np.uint8)[:, None]
    return (shifted & 0x0F).reshape(qs.shape[0], -1)


def _q4_0(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, 8 * d


def _q4_1(b: np.ndarray) -> Blocks:
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), -_f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return b[:, 2:].view(np.int8).astype(np.int16) + 128, d, 128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), _f16(b[:, 2:4]) * mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> Blocks:
    return (_nibbles(b[:, 16:], 32), *_k_scales(b))


def _q5_k(b: np.ndarray) -> Blocks:
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return (_nibbles(b[:, 48:], 32) | high.reshape(b.shape[0], -1) << 4, *_k_scales(b))


def _q6_k(b: np.ndarray) -> Blocks:
    low = _nibbles(b[:, :128], 64)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    scales = _f16(b[:, 208:]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return low | high.reshape(b.shape[0], -1) << 4, scales, 32 * scales


# type -> (bits a code, group size, block decoder)
KEPT_TYPES: dict[GGML, tuple[int, int, Callable[[np.ndarray], Blocks]]] = {
    GGML.Q4_0: (4, 32, _q4_0), GGML.Q4_1: (4, 32, _q4_1), GGML.Q8_0: (8, 32, _q8_0),
    GGML.Q4_K: (4, 32, _q4_k), GGML.Q5_K: (8, 32, _q5_k), GGML.Q6_K: (8, 16, _q6_k)}


def unpack_blocks(data: np.ndarray, kind: GGML) -> Blocks:
    """A kept tensor's blocks (uint8 [rows, bytes a row]) as codes uint8 [rows, K] and fp32
    scales and mins [rows, K / group]."""
    _, block_bytes = GGML_QUANT_SIZES[kind]
    rows = data.shape[0]
    codes, scales, mins = KEPT_TYPES[kind][2](np.ascontiguousarray(data).reshape(-1, block_bytes))
    return (codes.astype(np.uint8).reshape(rows, -1), scales.astype(np.float32).reshape(rows, -1),
            mins.astype(np.float32).reshape(rows, -1))


def linear_format(kinds: set[GGML]) -> dict[str, Any] | None:
    """The `quantization_config` of a file whose decoder linears are of types `kinds`, or None
    when any is not kept (then every tensor is dequantized at load)."""
    if not kinds or not kinds <= KEPT_TYPES.keys():
        return None
    return {"quant_method": "gguf", "bits": max(KEPT_TYPES[k][0] for k in kinds),
            "group_size": min(KEPT_TYPES[k][1] for k in kinds),
            "types": sorted(k.name for k in kinds)}


@dataclass(frozen=True)
class GGUFConfig:
    """A GGUF file's linears: kept in the packed layout (`requantize` None), or dequantized once
    loaded and handed to `requantize`'s method (`quantization="fp8"` or `"int4"`)."""

    packed: WNA16Config
    requantize: Fp8Config | WNA16Config | None = None

    @classmethod
    def from_config(cls, checkpoint: dict[str, Any],
                    requantize: Fp8Config | WNA16Config | None) -> GGUFConfig:
        return cls(WNA16Config(checkpoint["bits"], checkpoint["group_size"], PackedMinFormat()),
                   requantize)

    def linear_method(self, use_triton: bool) -> LinearMethod:
        if self.requantize is None:
            return self.packed.linear_method(use_triton)
        return DequantizedMethod(self.packed, self.requantize.linear_method(use_triton))

    def lm_head_method(self, use_triton: bool) -> LinearMethod | None:
        return None if self.requantize is None else self.requantize.lm_head_method(use_triton)


class DequantizedMethod(LinearMethod):
    """Loads the packed layout, dequantizes it to the model dtype and lets `inner` (a method
    that quantizes a weight at load) take it from there."""

    def __init__(self, packed: WNA16Config, inner: LinearMethod):
        self.packed = packed
        self.inner = inner
        self.dtype = torch.get_default_dtype()

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        self.packed.fmt.create(layer, self.packed, out_features, in_features)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, mins = self.packed.fmt.packed(layer, self.packed)
        layer.weight = nn.Parameter(dequantize(qweight, scales, mins, self.packed.bits,
                                               self.dtype), requires_grad=False)
        self.inner.process_weights_after_loading(layer)

    def gemv_weight_scale(self, layer: nn.Module) -> torch.Tensor | None:
        return self.inner.gemv_weight_scale(layer)

    def gemv(self, layer: nn.Module, x: torch.Tensor, *, norm: RMSNorm | None = None,
             gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        # The inner method's: an int4 one keeps no `weight` on the GPU, only its codes.
        return self.inner.gemv(layer, x, norm=norm, gated=gated, residual=residual)

    def split_k_launch(self, layer: nn.Module, sms: int) -> tuple[int, int] | None:
        return self.inner.split_k_launch(layer, sms)

    def gemm(self, layer: nn.Module, x: Any, residual: torch.Tensor | None) -> torch.Tensor:
        return self.inner.gemm(layer, x, residual)

    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> Any:
        return self.inner.gemm_normed(layer, x, norm, act)
