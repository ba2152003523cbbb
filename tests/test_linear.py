"""Tensor-parallel slices of the linear layers: each rank loads its part of a checkpoint tensor."""
import pytest
import torch

from liteinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from liteinfer.layers.ops import LayerOps


def test_column_and_row_shards_tile_the_checkpoint_weight():
    weight = torch.randn(8, 6)
    rows = []
    cols = []
    for rank in range(2):
        column = ColumnParallelLinear(6, 8, LayerOps(tp_rank=rank, tp_size=2))
        column.weight.weight_loader(column.weight, weight)
        rows.append(column.weight.detach())
        row = RowParallelLinear(6, 8, LayerOps(tp_rank=rank, tp_size=2))
        row.weight.weight_loader(row.weight, weight)
        cols.append(row.weight.detach())
    assert torch.equal(torch.cat(rows, 0), weight) and torch.equal(torch.cat(cols, 1), weight)


def test_qkv_shards_take_their_heads_of_each_projection():
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)  # 4 q / 2 kv heads of 2
    for rank in range(2):
        qkv = QKVParallelLinear(4, 2, 4, 2, LayerOps(tp_rank=rank, tp_size=2))
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            qkv.weight.weight_loader(qkv.weight, tensor, name)
        expected = torch.cat([q[4 * rank:4 * rank + 4], k[2 * rank:2 * rank + 2],
                              v[2 * rank:2 * rank + 2]])
        assert torch.equal(qkv.weight.detach(), expected)


def test_features_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="5 output features do not split over 2 ranks"):
        ColumnParallelLinear(6, 5, LayerOps(tp_size=2))
    with pytest.raises(ValueError, match="5 input features do not split over 2 ranks"):
        RowParallelLinear(5, 6, LayerOps(tp_size=2))


def test_per_tensor_fp8_scales_cover_their_shards_rows_on_every_rank():
    """A per-tensor `weight_scale` (compressed-tensors' FP8 preset) spreads over its shard's rows
    of each rank's slice: the q, k and v scales of a fused projection, and a row-parallel one's
    over all its rows."""
    from liteinfer.layers.quantization import Fp8Config
    serialized = Fp8Config(serialized=True)
    for rank in range(2):
        qkv = QKVParallelLinear(4, 2, 4, 2, LayerOps(quant=serialized, tp_rank=rank, tp_size=2))
        for name, scale in (("q", 1.0), ("k", 2.0), ("v", 3.0)):
            qkv.weight_scale.weight_loader(qkv.weight_scale, torch.tensor([scale]), name)
        assert qkv.weight_scale.tolist() == [1.0] * 4 + [2.0] * 2 + [3.0] * 2
        row = RowParallelLinear(6, 8, LayerOps(quant=serialized, tp_rank=rank, tp_size=2))
        row.weight_scale.weight_loader(row.weight_scale, torch.tensor([5.0]))
        assert row.weight_scale.tolist() == [5.0] * 8
