"""Linear layers that know how checkpoint tensors map onto them.

Fused projections (q/k/v, gate/up) are one matmul each; their `weight_loader` copies each
checkpoint shard into its rows. The tensor-parallel split (column or row) is a constructor
argument so sharded serving reuses these classes; with tp_size 1 they are plain linears. How the
weight is stored and multiplied is the layer's `LinearMethod` (unquantized here, FP8 in
layers/quantization/fp8.py), chosen by the quantization config of the layers' LayerOps.

Llama's residual stream flows through them: a pre-norm projection (`forward_normed`) reads
norm(stream), and an output projection (`forward_add`) adds its result to the stream in place,
inside the GEMM (cuBLAS with beta = 1), so no separate kernel adds the two.

With LayerOps.gemv, a one-token input (a decode step of one sequence) goes through the fused
GEMV kernel (kernels/gemv.py), which also absorbs the RMSNorm in front of a projection, the
SwiGLU behind gate/up and the residual add behind an output projection. LayerOps.triton is the
switch the model's RMSNorm and SiluAndMul take; a quantized method runs its own activation
passes (FP8: the fused norm, SwiGLU and quantization) by it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from liteinfer.layers.ops import LayerOps
from liteinfer.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul
    from liteinfer.layers.quantization import QuantConfig


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model dtype; cuBLAS, or the GEMV kernel for one token."""

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        layer.weight.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: the weight is used as loaded."""

    def gemm(self, layer: nn.Module, x: torch.Tensor,
             residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return nn.functional.linear(x, layer.weight)
        return residual.addmm_(x, layer.weight.t())

    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> torch.Tensor:
        y = nn.functional.linear(norm(x), layer.weight)
        return y if act is None else act(y)


def linear_method(quant_config: QuantConfig | None, use_triton: bool) -> LinearMethod:
    if quant_config is None:
        return UnquantizedLinearMethod()
    return quant_config.linear_method(use_triton)


def _gemv_row(layer: nn.Module, x: Any) -> bool:
    """x is one row for the GEMV kernel in a layer that takes it (LayerOps.gemv); an
    Fp8Activation (a multi-row gate/up's output) never is."""
    return layer.use_gemv and isinstance(x, torch.Tensor) and x.shape[0] == 1


def matmul(layer: nn.Module, x: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T of a linear layer or the LM head by its `quant_method`: the GEMV kernel for one
    row, the GEMM otherwise; with residual, added to it in place and returned."""
    if _gemv_row(layer, x):
        return layer.quant_method.gemv(layer, x, residual=residual)
    return layer.quant_method.gemm(layer, x, residual)


def matmul_normed(layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                  act: SiluAndMul | None = None) -> Any:
    """act(norm(x) W^T) as `matmul` computes it, the norm and SwiGLU fused into the GEMV."""
    if _gemv_row(layer, x):
        return layer.quant_method.gemv(layer, x, norm=norm, gated=act is not None)
    return layer.quant_method.gemm_normed(layer, x, norm, act)


class _ShardedLinear(nn.Module):
    """y = x W^T with W split along `dim` across tensor-parallel ranks (0: output rows,
    1: input columns); each rank holds and loads its own slice."""

    def __init__(self, in_features: int, out_features: int, dim: int, ops: LayerOps):
        super().__init__()
        tp_rank, tp_size = ops.tp_rank, ops.tp_size
        shape = [out_features, in_features]
        if shape[dim] % tp_size:
            raise ValueError(f"{shape[dim]} {('output', 'input')[dim]} features do not split "
                             f"over {tp_size} ranks")
        shape[dim] //= tp_size
        self.tp_rank, self.tp_size, self.dim = tp_rank, tp_size, dim
        self.use_gemv = ops.gemv
        self.scratch = ops.scratch  # the runner's buffers, for a quantized method's kernels
        # Checkpoint shard -> (first row, rows) of this rank's output rows.
        self.offsets: dict[str | None, tuple[int, int]] = {None: (0, shape[0])}
        self.quant_method = linear_method(ops.quant, ops.triton)
        self.quant_method.create_weights(self, *shape)

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[str | None, tuple[int, ...]]]:
        """The checkpoint tensors that fill param (a weight or bias) on all ranks together, as
        (shard, shape): what dummy weights draw, so that every tensor-parallel size holds
        shards of the one model."""
        shapes = []
        for shard in [s for s in self.offsets if s is not None] or [None]:
            shape = list(param.shape)
            shape[0] = self.offsets[shard][1]
            if self.dim == 0:
                shape[0] *= self.tp_size
            elif param.dim() == 2:
                shape[1] *= self.tp_size
            shapes.append((shard, tuple(shape)))
        return shapes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        """Copies this rank's part of a checkpoint tensor (a whole projection, or shard `shard`
        of a fused one) into param's output rows. A 1-D param (per-row scales) follows the
        output rows only."""
        start, rows = self.offsets[shard]
        if self.dim == 0:
            loaded = loaded.narrow(0, self.tp_rank * rows, rows)
        elif param.dim() == 2:
            cols = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * cols, cols)
        param.data[start:start + rows].copy_(loaded)


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W's output rows split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, ops: LayerOps,
                 bias: bool = False):
        super().__init__(in_features, out_features, 0, ops)
        # Added after the projection, split like its rows (Qwen2's q/k/v biases; no layer that
        # an activation follows has one).
        self.bias = nn.Parameter(torch.empty(self.offsets[None][1])) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: Any) -> torch.Tensor:
        return self._add_bias(matmul(self, x))

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm,
                       act: SiluAndMul | None = None) -> Any:
        """act(norm(x) W^T) or norm(x) W^T + b: the pre-norm projection of a Llama block. act,
        when given, is the SwiGLU over this layer's [gate; up] output."""
        y = matmul_normed(self, x, norm, act)
        return y if act is not None else self._add_bias(y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked into one matmul (gate and up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int],
                 ops: LayerOps, bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), ops, bias)
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size // ops.tp_size)
            start += size // ops.tp_size


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 ops: LayerOps, bias: bool = False):
        if num_kv_heads % ops.tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {ops.tp_size} ranks")
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, ops, bias)


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, ops: LayerOps):
        super().__init__(in_features, out_features, 1, ops)

    def forward_add(self, x: Any, residual: torch.Tensor) -> None:
        """residual += x W^T, in place (under tensor parallelism, the all-reduced sum)."""
        if self.tp_size > 1:
            y = matmul(self, x)
            dist.all_reduce(y)
            residual.add_(y)
        else:
            matmul(self, x, residual)
