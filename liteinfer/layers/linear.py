"""Linear layers that know how checkpoint tensors map onto them.

Fused projections (q/k/v, gate/up) are one matmul each; their `weight_loader` copies each
checkpoint shard into its rows. The tensor-parallel split (column or row) is a constructor
argument so sharded serving reuses these classes; with tp_size 1 they are plain linears.

Llama's residual stream flows through them: a pre-norm projection (`forward_normed`) reads
norm(stream), and an output projection (`forward_add`) adds its result to the stream in place,
inside the GEMM (cuBLAS with beta = 1), so no separate kernel adds the two.

With `use_gemv`, a one-token input (a decode step of one sequence) goes through the fused GEMV
kernel (kernels/gemv.py), which also absorbs the RMSNorm in front of a projection, the SwiGLU
behind gate/up and the residual add behind an output projection.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul


class _ShardedLinear(nn.Module):
    """y = x W^T with W split along `dim` across tensor-parallel ranks (0: output rows,
    1: input columns); each rank holds and loads its own slice."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int, tp_size: int,
                 dim: int, use_gemv: bool):
        super().__init__()
        shape = [out_features, in_features]
        if shape[dim] % tp_size:
            raise ValueError(f"{shape[dim]} {('output', 'input')[dim]} features do not split "
                             f"over {tp_size} ranks")
        shape[dim] //= tp_size
        self.tp_rank, self.tp_size, self.dim = tp_rank, tp_size, dim
        self.use_gemv = use_gemv
        self.weight = nn.Parameter(torch.empty(shape))
        self.weight.weight_loader = self.weight_loader

    def _one_token(self, x: torch.Tensor) -> bool:
        return self.use_gemv and x.shape[0] == 1

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_token(x):
            from liteinfer.kernels.gemv import gemv
            return gemv(x, self.weight)
        return nn.functional.linear(x, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        size = param.shape[self.dim]
        param.data.copy_(loaded.narrow(self.dim, self.tp_rank * size, size))


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W's output rows split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1,
                 use_gemv: bool = False, bias: bool = False):
        super().__init__(in_features, out_features, tp_rank, tp_size, dim=0, use_gemv=use_gemv)
        # Split like the weight's rows (Qwen2's q/k/v biases).
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0])) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(self._matmul(x))

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm,
                       act: SiluAndMul | None = None) -> torch.Tensor:
        """act(norm(x) W^T + b): the pre-norm projection of a Llama block. act, when given, is
        the SwiGLU over this layer's [gate; up] output."""
        if self._one_token(x):
            from liteinfer.kernels.gemv import gemv
            fuse_act = act is not None and self.bias is None
            y = gemv(x, self.weight, norm_weight=norm.weight, eps=norm.eps, gated=fuse_act)
            if fuse_act:
                return y
        else:
            y = self._matmul(norm(x))
        y = self._add_bias(y)
        return y if act is None else act(y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked into one matmul (gate and up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], tp_rank: int = 0,
                 tp_size: int = 1, use_gemv: bool = False, bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), tp_rank, tp_size, use_gemv,
                         bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size // tp_size)
            start += size // tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        start, rows = self.offsets[shard]
        param.data[start:start + rows].copy_(loaded[self.tp_rank * rows:(self.tp_rank + 1) * rows])


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp_rank: int = 0, tp_size: int = 1, use_gemv: bool = False,
                 bias: bool = False):
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, tp_rank, tp_size,
                         use_gemv, bias)


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1,
                 use_gemv: bool = False):
        super().__init__(in_features, out_features, tp_rank, tp_size, dim=1, use_gemv=use_gemv)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """residual += x W^T, in place (under tensor parallelism, the all-reduced sum)."""
        if self.tp_size > 1:
            y = self._matmul(x)
            dist.all_reduce(y)
            residual.add_(y)
        elif self._one_token(x):
            from liteinfer.kernels.gemv import gemv
            gemv(x, self.weight, residual=residual)
        else:
            residual.addmm_(x, self.weight.t())
