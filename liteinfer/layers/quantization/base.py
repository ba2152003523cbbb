"""The interface between a linear layer and how its weight is stored and multiplied."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm, SiluAndMul


class LinearMethod(ABC):
    """Creates a linear layer's parameters and computes y = x W^T with them.

    `layer` is the linear module (layers/linear.py) or the LM head: it owns the parameters this
    method registers (`weight` among them) and `weight_loader` for checkpoint tensors. A
    layer's input may be what the method's `gemm_normed` returned for the layer before (an FP8
    method hands an already-quantized activation from gate/up to down).

    The layer chooses the path (layers/linear.py's `matmul`): `gemv` for one row when its
    LayerOps say so, with the norm, SwiGLU or residual add fused in (kernels/gemv.py's kernel,
    unless the method keeps a weight that kernel does not read); `gemm` / `gemm_normed` for
    every other input."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        """Registers the layer's parameters for this rank's [out_features, in_features]."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns the loaded (or dummy-initialized) parameters into the form `gemm` reads."""

    def gemv_weight_scale(self, layer: nn.Module) -> torch.Tensor | None:
        """fp32 scales, one per row, of an e4m3 `weight`; None: the weight is in the model
        dtype."""
        return None

    def split_k_launch(self, layer: nn.Module, sms: int) -> tuple[int, int] | None:
        """(features, splits) of the layer's few-row launches cut along K on a GPU of `sms`
        SMs, whose partials go through the runner's SplitKWorkspace (`layer.scratch.split_k`,
        sized from every layer's); None: the layer never cuts K."""
        return None

    def gemv(self, layer: nn.Module, x: torch.Tensor, *, norm: RMSNorm | None = None,
             gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """One row: f(x) W^T with f the norm when given, SwiGLU'd when gated, or added to
        residual in place; kernels/gemv.py's kernel over `weight`."""
        from liteinfer.kernels.gemv import gemv
        return gemv(x, layer.weight, norm_weight=None if norm is None else norm.weight,
                    eps=0.0 if norm is None else norm.eps, gated=gated, residual=residual,
                    weight_scale=self.gemv_weight_scale(layer))

    @abstractmethod
    def gemm(self, layer: nn.Module, x: Any, residual: torch.Tensor | None) -> torch.Tensor:
        """x W^T; with residual, adds it to residual in place and returns residual."""

    @abstractmethod
    def gemm_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                    act: SiluAndMul | None) -> Any:
        """act(norm(x) W^T), in the form the next layer's `gemm` takes."""


class MoEMethod(ABC):
    """How a mixture-of-experts layer's stacked expert weights (layers/fused_moe.py's FusedMoE)
    are stored and applied: `w13_weight` [E, 2I, H] (each expert's gate rows, then up rows) and
    `w2_weight` [E, H, I], this rank's I channels of each expert."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,
                       intermediate: int) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate),
                                       requires_grad=False)
        for param in (layer.w13_weight, layer.w2_weight):
            param.weight_loader = layer.weight_loader

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns the loaded (or dummy-initialized) experts into the form `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's sum over each token's chosen experts, weighted: [T, H] in x's dtype; given
        the residual stream [T, H], added to it in place and returned."""
