"""The model classes, by the Hugging Face architecture name a checkpoint's config gives.
A family is a model file and its entry here (and its config readings in
config.MODEL_FAMILIES); tests/test_model_registry.py holds the two tables together."""
from __future__ import annotations

from liteinfer.config import MODEL_FAMILIES, ModelConfig
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from liteinfer.models.qwen2 import Qwen2ForCausalLM
from liteinfer.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_REGISTRY[MODEL_FAMILIES[cfg.model_type]]


__all__ = ["MODEL_REGISTRY", "model_class"]
