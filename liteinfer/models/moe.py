"""Mixtures of experts on the Llama architecture: Qwen3-MoE (Qwen3's attention, softmax top-k
routing, renormalized with norm_topk_prob; dense MLPs in mlp_only_layers and off the
decoder_sparse_step) and Mixtral (Mistral's attention, every layer's MLP top-2 of 8 experts,
renormalized). The families differ in their config (config.MoeConfig) and in their checkpoint
names only."""
from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from liteinfer.config import MoeConfig
from liteinfer.layers.fused_moe import FusedMoE, MoeRouter
from liteinfer.layers.norm_act import RMSNorm
from liteinfer.layers.ops import LayerOps
from liteinfer.models.llama import LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    """The experts in place of a layer's MLP: the router picks each token's experts from the
    normed residual stream, their weighted sum is added back to it."""

    def __init__(self, hidden: int, moe: MoeConfig, ops: LayerOps):
        super().__init__()
        self.gate = MoeRouter(hidden, moe.num_experts, moe.top_k, moe.renormalize, ops)
        self.experts = FusedMoE(moe.num_experts, hidden, moe.intermediate_size, ops)
        self.tp_size = ops.tp_size

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> None:
        """Adds the experts of norm(x) to the residual stream x, in place."""
        topk_weights, topk_ids, h = self.gate.forward_normed(x, norm)
        if self.tp_size == 1:  # the experts' last kernel adds to x
            self.experts(h, topk_weights, topk_ids, residual=x)
            return
        y = self.experts(h, topk_weights, topk_ids)
        dist.all_reduce(y)
        x.add_(y)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama model whose sparse layers (config.moe.sparse_layers) have experts for an MLP.
    A family names its experts' checkpoint tensors `layers.N.{block}.gate.weight` (the router)
    and `layers.N.{block}.experts.E.{proj}.weight`, with its own `block` and `proj` names."""

    block: ClassVar[str]
    # The family's checkpoint name of each expert projection -> gate | up | down.
    expert_projs: ClassVar[dict[str, str]]

    def make_mlp(self, layer: int, ops: LayerOps) -> nn.Module:
        moe = self.config.moe
        if moe is None or layer not in moe.sparse_layers:
            return super().make_mlp(layer, ops)
        return SparseMoeBlock(self.config.hidden_size, moe, ops)

    def param_name(self, name: str) -> tuple[str, Any]:
        name = name.removeprefix("model.")
        projs = "|".join(self.expert_projs)
        expert = re.fullmatch(rf"layers\.(\d+)\.{self.block}\.experts\.(\d+)\.({projs})\.weight",
                              name)
        if expert is not None:
            layer, index, proj = expert.groups()
            kind = self.expert_projs[proj]
            param = "w2_weight" if kind == "down" else "w13_weight"
            return f"layers.{layer}.mlp.experts.{param}", (int(index), kind)
        return super().param_name(name.replace(f".{self.block}.gate.", ".mlp.gate."))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
    block = "mlp"
    expert_projs: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up",
                                              "down_proj": "down"}


class MixtralForCausalLM(MoeForCausalLM):
    block = "block_sparse_moe"
    expert_projs: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": "down"}
