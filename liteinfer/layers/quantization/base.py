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

    `layer` is the linear module (layers/linear.py): it owns the parameters this method
    registers, `use_gemv`, and `weight_loader` for checkpoint tensors. A layer's input may be
    what the method's `apply_normed` returned for the layer before (an FP8 method hands an
    already-quantized activation from gate/up to down)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        """Registers the layer's parameters for this rank's [out_features, in_features]."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turns the loaded (or dummy-initialized) parameters into the form `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: Any,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T; with residual, adds it to residual in place and returns residual."""

    @abstractmethod
    def apply_normed(self, layer: nn.Module, x: torch.Tensor, norm: RMSNorm,
                     act: SiluAndMul | None) -> Any:
        """act(norm(x) W^T), in the form the next layer's `apply` takes."""
