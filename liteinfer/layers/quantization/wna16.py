"""Weight-only integer linear layers (W4A16, W8A16): weights kept as 4- or 8-bit codes with a
scale and a minimum per group of `group_size` input features, activations in the model dtype.

w[n, k] = q[n, k] * scales[n, g] - mins[n, g], g = k // group_size, q unsigned. Every format
this engine reads maps onto that without changing a value: AWQ, GPTQ and compressed-tensors
(min = zero_point * scale), quantizing at load (`quantization="int4"`, asymmetric round to
nearest in groups of 128), and llama.cpp's GGUF blocks (gguf.py), with scales and mins in fp32
so that every GGUF product d * sub-scale is exact.

Layout of a processed layer: `qweight` int32 [N, K * bits / 32] (codes along K, the first in the
low bits, as compressed-tensors packs them), `scales` and `mins` fp32 [N, K / group_size]. Each
checkpoint format registers its own tensors under its own names (`CheckpointFormat`) and is
converted into that layout as it loads; row-major [N, ...] everywhere, so the linear layer's
loader shards fused and tensor-parallel layers as it does a plain weight.

With the Triton layers (on CUDA; on the CPU under the interpreter, which tests the GPU's path)
the packed weight stays on the device and kernels/wna16.py multiplies it, dequantizing in
registers (one row through its GEMV, with the norm, SwiGLU and residual add fused in as
kernels/gemv.py does for bf16; a few rows on the tensor cores, with the residual add fused in,
and a small model's SwiGLU) or into a scratch weight (wide steps).
Without the Triton layers (the CPU's default) the weight is dequantized once loaded, as the FP8
layers do: CPU tests then check the exact weights the GPU multiplies, at the speed of an
unquantized model.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from liteinfer.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] (K a multiple of 32 / bits) as int32 words [N, K * bits / 32]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=codes.device) * bits
    words = (codes.to(torch.int64).reshape(codes.shape[0], -1, per_word) << shifts).sum(-1)
    # Words past 2^31 wrap to negative int32, the same bits.
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: int64 codes [N, K]."""
    shifts = torch.arange(32 // bits, dtype=torch.int64, device=qweight.device) * bits
    codes = (qweight.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(qweight.shape[0], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the packed layout holds, computed in fp32 (fp64 when asked)."""
    group = qweight.shape[1] * (32 // bits) // scales.shape[1]
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack_codes(qweight, bits).to(work)
    w = q * scales.to(work).repeat_interleave(group, 1) - mins.to(work).repeat_interleave(group, 1)
    return w.to(dtype)


def narrowest(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The same weight in the fewest bits and the widest groups that hold it exactly: 8-bit
    codes that all fit in 4 bits repacked, and each pair of neighbouring groups with equal
    scales and mins in every row made one group, while the groups pair up."""
    if bits == 8:
        # Repacked from the bytes (little-endian: code j is byte j of the row) rather than by
        # unpack_codes / pack_codes, whose int64 codes would take 8 bytes a code at load.
        codes = qweight.view(torch.uint8)
        if not (codes >= 16).any():
            pairs = codes.reshape(codes.shape[0], -1, 2)
            qweight = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)
            bits = 4
    while (scales.shape[1] % 2 == 0 and torch.equal(scales[:, 0::2], scales[:, 1::2])
           and torch.equal(mins[:, 0::2], mins[:, 1::2])):
        scales, mins = scales[:, 0::2].contiguous(), mins[:, 0::2].contiguous()
    return qweight, scales, mins, bits


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round to nearest per group: (qweight, scales, mins). The zero point is an
    integer code, as in AWQ and GPTQ, so an exact 0 stays exact."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} input features are not a multiple of the group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    top = (1 << bits) - 1
    scales = ((hi - lo) / top).clamp_min(1e-10)
    zeros = (-lo / scales).round().clamp(0, top)
    codes = (w / scales[..., None] + zeros[..., None]).round().clamp(0, top)
    return pack_codes(codes.reshape(n, k), bits), scales, zeros * scales


class CheckpointFormat:
    """How one format's tensors sit on a layer: `create` registers them (with loaders that
    convert to the packed layout where they can), `packed` returns the layer's (qweight, scales,
    mins) once loaded and removes what `create` registered. `narrows`: each layer is repacked
    to its `narrowest` layout once loaded."""

    narrows = False

    def create(self, layer: nn.Module, config: WNA16Config, out_features: int,
               in_features: int) -> None:
        raise NotImplementedError

    def packed(self, layer: nn.Module, config: WNA16Config
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def register(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """A parameter `name` filled by the layer's loader, after `convert` for a checkpoint tensor
    whose layout differs from the parameter's."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        layer.weight_loader(param, loaded if convert is None else convert(loaded), shard)
    param.weight_loader = load
    setattr(layer, name, param)


def take(layer: nn.Module, *names: str) -> list[torch.Tensor]:
    """The data of the layer's parameters `names`, which it no longer holds."""
    out = [getattr(layer, name).data for name in names]
    for name in names:
        delattr(layer, name)
    return out


class QuantizeAtLoad(CheckpointFormat):
    """`quantization="int4"` and dummy weights: a weight in the model dtype, quantized once
    loaded."""

    def create(self, layer, config, out_features, in_features):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def packed(self, layer, config):
        weight = take(layer, "weight")[0]
        # Rows that are not whole groups of group_size (SmolLM2's 576) take the largest power
        # of two that divides them (64 there) instead.
        group = math.gcd(config.group_size, weight.shape[1])
        return quantize_rtn(weight, config.bits, group)


class PackedMinFormat(CheckpointFormat):
    """The packed layout itself, codes unpacked: what the GGUF loader yields for each block
    tensor (codes [N, K] uint8, scales and mins [N, K / its group]). A file that mixes types
    creates every layer at its widest type's bits and finest group (a Q4_K_M file: Q6_K's 8
    bits in groups of 16, 12 bits a weight with the fp32 scales and mins); a layer whose tensors
    are all narrower (its Q4_K gate/up and o) is repacked to theirs (6 bits a weight)."""

    narrows = True

    def create(self, layer, config, out_features, in_features):
        groups = in_features // config.group_size
        # The checkpoint's groups along a whole row, before the row-parallel split.
        row_groups = groups * (layer.tp_size if layer.dim == 1 else 1)

        def regroup(t: torch.Tensor) -> torch.Tensor:  # a finer group size than the tensor's
            return t.repeat_interleave(row_groups // t.shape[1], 1)
        register(layer, "qweight", (out_features, in_features * config.bits // 32), torch.int32,
                 lambda codes: pack_codes(codes, config.bits))
        register(layer, "scales", (out_features, groups), torch.float32, regroup)
        register(layer, "mins", (out_features, groups), torch.float32, regroup)

    def packed(self, layer, config):
        return tuple(take(layer, "qweight", "scales", "mins"))


@dataclass(frozen=True)
class WNA16Config:
    """bits and group_size of every quantized linear; `fmt` how a checkpoint stores them."""

    bits: int = 4
    group_size: int = 128
    fmt: CheckpointFormat = field(default_factory=QuantizeAtLoad, compare=False)

    def linear_method(self, use_triton: bool) -> LinearMethod:
        return WNA16LinearMethod(self, use_triton)

    def lm_head_method(self, use_triton: bool) -> LinearMethod | None:
        """The LM head stays in the model dtype, as AWQ and GPTQ checkpoints leave it."""
        return None


class WNA16LinearMethod(LinearMethod):
    def __init__(self, config: WNA16Config, use_triton: bool):
        self.config = config
        self.use_triton = use_triton
        self.out_dtype = torch.get_default_dtype()  # the model dtype, as the layer is built

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        if (in_features % self.config.group_size
                and not isinstance(self.config.fmt, QuantizeAtLoad)):
            raise ValueError(f"{in_features} input features are not a multiple of the "
                             f"quantization group size {self.config.group_size}")
        self.config.fmt.create(layer, self.config, out_features, in_features)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, mins = self.config.fmt.packed(layer, self.config)
        layer.bits = self.config.bits  # this layer's, which the kernels are given
        if self.config.fmt.narrows:
            qweight, scales, mins, layer.bits = narrowest(qweight, scales, mins, layer.bits)
        layer.group_size = qweight.shape[1] * (32 // layer.bits) // scales.shape[1]
        if self.use_triton:
            layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
            layer.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
            layer.mins = nn.Parameter(mins.float().contiguous(), requires_grad=False)
            layer.weight = None
        else:  # dequantized once: no call pays for it
            w = dequantize(qweight, scales, mins, layer.bits, self.out_dtype)
            layer.weight = nn.Parameter(w, requires_grad=False)

    def _matmul(self, layer: nn.Module, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight is not None:
            y = nn.functional.linear(x, layer.weight)
            return y if residual is None else residual.add_(y)
        from liteinfer.kernels.wna16 import wna16_linear
        return wna16_linear(x, layer.qweight, layer.scales, layer.mins, layer.bits,
                            residual, workspace=layer.scratch.split_k)

    def split_k_launch(self, layer: nn.Module, sms: int) -> tuple[int, int] | None:
        if layer.weight is not None:
            return None
        from liteinfer.kernels.wna16 import wna16_tiles
        n, k = self._packed_shape(layer)
        # The split count depends on neither the rows nor their dtype; a gated launch (taken
        # for gate/up) may cut K differently, its partials in the same room of n features.
        splits = max(wna16_tiles(2, n, k, layer.bits, self.out_dtype.itemsize, sms,
                                  gated).splits for gated in (False, True))
        return (n, splits) if splits > 1 else None

    def gemv(self, layer: nn.Module, x: torch.Tensor, *, norm: RMSNorm | None = None,
             gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight is not None:
            return super().gemv(layer, x, norm=norm, gated=gated, residual=residual)
        from liteinfer.kernels.wna16 import wna16_gemv
        return wna16_gemv(x, layer.qweight, layer.scales, layer.mins, layer.bits,
                          norm_weight=None if norm is None else norm.weight,
                          eps=0.0 if norm is None else norm.eps, gated=gated, residual=residual)

    def gemm(self, layer: nn.Module, x: torch.Tensor,
             residual: torch.Tensor | None) -> torch.Tensor:
        return self._matmul(layer, x, residual)

    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> torch.Tensor:
        if act is not None and self._fuses_swiglu(layer, x):
            from liteinfer.kernels.wna16 import wna16_gemm
            return wna16_gemm(norm(x), layer.qweight, layer.scales, layer.mins,
                              layer.bits, gated=True, workspace=layer.scratch.split_k)
        y = self._matmul(layer, norm(x))
        return y if act is None else act(y)

    def _fuses_swiglu(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """A few rows of a narrow gate/up on the GPU: the few-row kernel applies the SwiGLU."""
        from liteinfer.kernels import num_sms
        from liteinfer.kernels.wna16 import FEWROW_MAX, fuses_swiglu
        return (layer.weight is None and x.shape[0] <= FEWROW_MAX
                and fuses_swiglu(*self._packed_shape(layer), layer.bits,
                                 num_sms(x.device)))

    def _packed_shape(self, layer: nn.Module) -> tuple[int, int]:
        """The packed weight's [N, K] in features and codes."""
        return layer.qweight.shape[0], layer.qweight.shape[1] * (32 // layer.bits)


class ZeroPointFormat(CheckpointFormat):
    """Codes, scales and integer zero points (w = (q - z) s), each under the checkpoint's own
    name and converted to [N, ...] as it loads; min = z s once all are in. Subclasses name the
    tensors and convert them; without a zero-point tensor (symmetric) z is `symmetric_zero`."""

    names: tuple[str, str, str | None]  # the checkpoint's codes, scales and zero points
    extra: tuple[str, ...] = ()  # tensors beside them, checked (check_extra) and dropped
    symmetric_zero = 8

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def check_extra(self, name: str, t: torch.Tensor) -> None:
        """Refuses an `extra` tensor that asks for what the packed layout cannot hold."""

    def create(self, layer, config, out_features, in_features):
        codes, scales, zeros = self.names
        groups = in_features // config.group_size
        register(layer, codes, (out_features, in_features * config.bits // 32), torch.int32,
                 self.convert_codes)
        register(layer, scales, (out_features, groups), torch.float32, self.convert_scales)
        if zeros is not None:
            register(layer, zeros, (out_features, groups), torch.int32, self.convert_zeros)
        for name in self.extra:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = lambda p, t, shard=None, name=name: self.check_extra(name, t)
            setattr(layer, name, param)

    def packed(self, layer, config):
        codes, scales, zeros = self.names
        qweight, scale = take(layer, codes, scales)
        zero = take(layer, zeros)[0] if zeros is not None else self.symmetric_zero
        take(layer, *self.extra)
        return qweight, scale, zero * scale

