"""GPTQ checkpoints (`quant_method: "gptq"`, AutoGPTQ / GPTQModel): `qweight` int32 [K / 8, N],
eight 4-bit codes a word along K, `qzeros` int32 [K / G, N / 8] along N, `scales` [K / G, N] and
`g_idx` [K]; w = (q - z) s. The classic "gptq" checkpoint format stores each zero point minus
one ("gptq_v2" as it is). With `desc_act` the input features' groups follow the activation
order (g_idx permuted), which the grouped layout cannot hold: such checkpoints are refused."""
from __future__ import annotations

from typing import Any

import torch

from liteinfer.layers.quantization.wna16 import WNA16Config, ZeroPointFormat, unpack_codes


class GPTQFormat(ZeroPointFormat):
    names = ("qweight", "scales", "qzeros")
    extra = ("g_idx",)

    def __init__(self, group_size: int, zero_offset: int):
        self.group_size = group_size
        self.zero_offset = zero_offset

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return t.t()  # words along K, as the packed layout has them

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.t()

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        return (unpack_codes(t, 4) + self.zero_offset).t().to(torch.int32)

    def check_extra(self, name: str, t: torch.Tensor) -> None:
        groups = torch.arange(t.numel(), device=t.device) // self.group_size
        if not torch.equal(t.to(groups.dtype), groups):
            raise ValueError("GPTQ g_idx is not in input order (desc_act / act-order "
                             "checkpoint); only desc_act=false GPTQ checkpoints are supported")


def gptq_config(checkpoint: dict[str, Any]) -> WNA16Config:
    bits, group = checkpoint.get("bits"), checkpoint.get("group_size")
    if bits != 4 or not isinstance(group, int) or group <= 0:
        raise ValueError(f"GPTQ checkpoint with bits={bits}, group_size={group} is not supported "
                         "(4-bit, grouped)")
    if checkpoint.get("desc_act"):
        raise ValueError("GPTQ checkpoints with desc_act=true (activation order) are not "
                         "supported; re-quantize with desc_act=false")
    fmt = checkpoint.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return WNA16Config(4, group, GPTQFormat(group, 1 if fmt == "gptq" else 0))
