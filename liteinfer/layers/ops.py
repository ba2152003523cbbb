"""How a model's layers are built and run, chosen once by the model runner and handed to every
layer: the kernels, the weights' format, this rank's share of a tensor-parallel model, and the
runner's scratch buffers that the layers' kernels write through."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from liteinfer.kernels.decode_splits import DecodeSplits
    from liteinfer.kernels.gemm_splits import SplitKWorkspace
    from liteinfer.layers.batch_invariant import BatchInvariantConfig
    from liteinfer.layers.quantization import QuantConfig


@dataclass
class StepScratch:
    """A model runner's scratch buffers, which every step reuses: split-K decode attention's
    partials with their sizing (`decode`, whose workspace and widths the step model puts in the
    attention metadata) and the few-row GEMMs' K splits (`split_k`, which linear layers read
    from their LayerOps). The runner allocates them, sized from its configuration and its
    loaded models, before it captures its graphs, and frees them with those
    (`ModelRunner.release`); None: no such kernel runs."""

    decode: DecodeSplits | None = None
    split_k: SplitKWorkspace | None = None

    def free(self) -> None:
        self.decode = self.split_k = None


@dataclass(frozen=True)
class LayerOps:
    """`triton`: Triton kernels for RMSNorm, SiLU-and-mul, the router and the experts, and for
    a quantized linear's norm, SwiGLU and quantization passes (else plain torch); `gemv`:
    one-token projections through the fused GEMV kernel (kernels/gemv.py), norms and SwiGLU
    included; `quant`: the decoder layers' linears, experts and LM head (as
    `QuantConfig.lm_head_method` says; a BatchInvariantConfig in batch-invariant mode);
    `invariant`: the batch-invariant torch norms and SwiGLU (layers/batch_invariant.py);
    `tp_rank` of `tp_size`: the slice of each split layer this rank holds; `scratch`: the
    runner's buffers, filled in once the model is loaded."""

    triton: bool = False
    gemv: bool = False
    quant: QuantConfig | BatchInvariantConfig | None = None
    invariant: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    scratch: StepScratch = field(default_factory=StepScratch, compare=False)
