"""The model classes, by family (config.MODEL_FAMILIES): a family is its config's switches and
a class here."""
from __future__ import annotations

from liteinfer.config import ModelConfig
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODELS[cfg.model_type]


__all__ = ["MODELS", "model_class"]
