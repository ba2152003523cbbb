"""Where a checkpoint tensor goes: the fused parameters a model keeps in place of the
checkpoint's separate projections, and the copy into a parameter."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Llama's q/k/v and gate/up projections, each group one matmul here: checkpoint name ->
# (fused name, shard); the table a model class names as its `packed_modules_mapping`.
PACKED_MODULES_MAPPING: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def packed_param(name: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """The parameter a checkpoint tensor fills, and its shard there (None: all of it)."""
    for ckpt, (fused, shard) in mapping.items():
        if f".{ckpt}." in name:
            return name.replace(ckpt, fused), shard
    return name, None


@torch.no_grad()
def load_tensor(param: nn.Parameter, tensor: torch.Tensor, shard: Any, name: str) -> None:
    """One checkpoint tensor into its parameter: through the parameter's loader (a shard of a
    fused or split layer), else copied whole."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor.to(param.dtype), shard)
        return
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                         f"{tuple(param.shape)}")
    param.copy_(tensor)
