"""Linear layers that know how checkpoint tensors map onto them.

Fused projections (q/k/v, gate/up) are one matmul each; their `weight_loader` copies each
checkpoint shard into its rows. The tensor-parallel split (column or row) is a constructor
argument so sharded serving reuses these classes; with tp_size 1 they are plain linears.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _ShardedLinear(nn.Module):
    """y = x W^T with W split along `dim` across tensor-parallel ranks (0: output rows,
    1: input columns); each rank holds and loads its own slice."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int, tp_size: int,
                 dim: int):
        super().__init__()
        shape = [out_features, in_features]
        if shape[dim] % tp_size:
            raise ValueError(f"{shape[dim]} {('output', 'input')[dim]} features do not split "
                             f"over {tp_size} ranks")
        shape[dim] //= tp_size
        self.tp_rank, self.tp_size, self.dim = tp_rank, tp_size, dim
        self.weight = nn.Parameter(torch.empty(shape))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        size = param.shape[self.dim]
        param.data.copy_(loaded.narrow(self.dim, self.tp_rank * size, size))


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W's output rows split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, out_features, tp_rank, tp_size, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked into one matmul (gate and up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__(in_features, sum(shard_sizes.values()), tp_rank, tp_size)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size // tp_size)
            start += size // tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        start, rows = self.offsets[shard]
        param.data[start:start + rows].copy_(loaded[self.tp_rank * rows:(self.tp_rank + 1) * rows])


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp_rank: int = 0, tp_size: int = 1):
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, tp_rank, tp_size)


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, out_features, tp_rank, tp_size, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
