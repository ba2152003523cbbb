"""AutoAWQ checkpoints (`quant_method: "awq"`, GEMM layout): `qweight` int32 [K, N / 8] and
`qzeros` int32 [K / G, N / 8], eight 4-bit codes a word in AWQ's interleaved order, `scales`
[K / G, N]; w = (q - z) s. Converted to the packed layout of wna16.py as they load."""
from __future__ import annotations

from typing import Any

import torch

from liteinfer.layers.quantization.wna16 import (
    WNA16Config,
    ZeroPointFormat,
    pack_codes,
    unpack_codes,
)

# The column a word's i-th nibble holds is AWQ_ORDER[i]; _COLUMNS undoes it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_COLUMNS = [AWQ_ORDER.index(c) for c in range(8)]


def unpack_awq(t: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> codes [R, C] in column order."""
    nibbles = unpack_codes(t, 4).reshape(t.shape[0], -1, 8)
    return nibbles[..., _COLUMNS].reshape(t.shape[0], -1)


class AWQFormat(ZeroPointFormat):
    names = ("qweight", "scales", "qzeros")

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return pack_codes(unpack_awq(t).t(), 4)

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.t()

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_awq(t).t().to(torch.int32)


def awq_config(checkpoint: dict[str, Any]) -> WNA16Config:
    bits = checkpoint.get("w_bit", checkpoint.get("bits"))
    version = str(checkpoint.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"AWQ checkpoint with {bits}-bit weights in the {version!r} layout is "
                         "not supported (4-bit GEMM)")
    if not checkpoint.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")
    return WNA16Config(4, int(checkpoint.get("q_group_size", checkpoint.get("group_size", 128))),
                       AWQFormat())
