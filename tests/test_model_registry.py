"""The family registry: every family whose config liteinfer reads has a model class, under the
architecture name its checkpoints give."""
from __future__ import annotations

from fixtures import TINY_LLAMA
from liteinfer.config import MODEL_FAMILIES, ModelConfig
from liteinfer.models import MODEL_REGISTRY, model_class
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.models.qwen2 import Qwen2ForCausalLM
from liteinfer.models.qwen3 import Qwen3ForCausalLM


def test_every_family_has_a_model_class() -> None:
    assert set(MODEL_FAMILIES.values()) == set(MODEL_REGISTRY)


def test_model_class_follows_the_config() -> None:
    expected = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
                "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    for model_type, cls in expected.items():
        cfg = ModelConfig.from_hf({**TINY_LLAMA, "model_type": model_type, "architectures": []})
        assert model_class(cfg) is cls
    # A config without model_type is placed by its architecture.
    cfg = ModelConfig.from_hf({**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"},
                               "architectures": ["Qwen3ForCausalLM"]})
    assert model_class(cfg) is Qwen3ForCausalLM
