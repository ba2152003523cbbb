"""How a model's layers are built and run, chosen once by the model runner and handed to every
layer: the kernels, the weights' format, and this rank's share of a tensor-parallel model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from liteinfer.layers.batch_invariant import BatchInvariantConfig
    from liteinfer.layers.quantization import QuantConfig


@dataclass(frozen=True)
class LayerOps:
    """`triton`: Triton kernels for RMSNorm, SiLU-and-mul, the router and the experts, and for
    a quantized linear's norm, SwiGLU and quantization passes (else plain torch); `gemv`:
    one-token projections through the fused GEMV kernel (kernels/gemv.py), norms and SwiGLU
    included; `quant`: the decoder layers' linears, experts and LM head (as
    `QuantConfig.lm_head_method` says; a BatchInvariantConfig in batch-invariant mode);
    `invariant`: the batch-invariant torch norms and SwiGLU (layers/batch_invariant.py);
    `tp_rank` of `tp_size`: the slice of each split layer this rank holds."""

    triton: bool = False
    gemv: bool = False
    quant: QuantConfig | BatchInvariantConfig | None = None
    invariant: bool = False
    tp_rank: int = 0
    tp_size: int = 1
