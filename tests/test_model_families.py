"""Qwen2, Qwen3 and Mistral against transformers, token for token, on tiny random models (CPU,
fp32, greedy), through the engine variants test_engine.py runs Llama through."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import TINY_LLAMA, build_llm, make_tiny_model_dir
from liteinfer import SamplingParams
from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.core import EngineCore
from liteinfer.models import model_class
from reference import hf_greedy, random_prompts

MAX_NEW = 16
MAX_LEN = 256
# Each family's tiny config: Qwen2 with tied embeddings (as its small models), Qwen3 with a
# head_dim other than hidden_size / heads (as its real ones), Mistral with a sliding window
# longer than max_model_len (so full attention is what it computes).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=4096),
}


def make_tiny_family_dir(tmp_path: Path, family: str, **overrides: Any) -> Path:
    return make_tiny_model_dir(tmp_path, family, **{**FAMILIES[family], **overrides})


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    """(family, model directory, prompts, transformers' greedy continuations)."""
    name = request.param
    directory = make_tiny_family_dir(tmp_path_factory.mktemp(name), name)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = random_prompts(6, TINY_LLAMA["vocab_size"], 1, 70, seed=3)
    return name, directory, prompts, hf_greedy(hf_model, prompts, MAX_NEW)


def test_config_switches(family) -> None:
    name, directory, _, _ = family
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    assert cfg.model_type == name
    cls = model_class(cfg)
    assert (cls.qkv_bias, cls.qk_norm) == (name == "qwen2", name == "qwen3")
    assert cfg.head_dim == (32 if name == "qwen3" else 16)
    assert cfg.tie_word_embeddings == (name == "qwen2")
    assert cfg.sliding_window == (4096 if name == "mistral" else None)


@pytest.mark.parametrize("engine_args", [
    {},
    {"attention_backend": "sdpa", "enable_prefix_caching": False},
    {"max_num_batched_tokens": 16, "block_size": 32},   # prompts prefilled in chunks
    {"attention_backend": "triton", "num_kv_blocks": 40},   # Triton kernels, interpreted on CPU
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_family_matches_transformers(family, engine_args: dict[str, Any]) -> None:
    _, directory, prompts, reference = family
    llm = build_llm(str(directory), dtype="float32", device="cpu", max_model_len=MAX_LEN,
                    **engine_args)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
def test_bias_on_the_one_token_gemv_path(family) -> None:
    """One sequence decoding alone takes the projections' one-token path (the bias is added
    after the GEMV kernel)."""
    _, directory, prompts, reference = family
    llm = build_llm(str(directory), dtype="float32", device="cpu", max_model_len=MAX_LEN,
                    attention_backend="triton", num_kv_blocks=20)
    out = llm.generate([prompts[0]], greedy(6), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0][:6]


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path: Path) -> None:
    directory = make_tiny_family_dir(tmp_path, "mistral", sliding_window=128)
    with pytest.raises(ValueError, match=r"sliding window of 128 tokens.*max_model_len <= 128"):
        build_llm(str(directory), device="cpu", max_model_len=MAX_LEN)
    # Its default stays within the window, where full attention computes the same.
    llm = build_llm(str(directory), device="cpu")
    assert llm.engine.max_model_len == 128


def test_other_architectures_are_refused() -> None:
    cfg = {**TINY_LLAMA, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match=r"unsupported model.*Qwen3ForCausalLM"):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="attention biases"):
        ModelConfig.from_hf({**TINY_LLAMA, "model_type": "qwen3", "attention_bias": True})


# ---- max_model_len: the model's context, within the KV pool ----------------------------------

@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family_dir(tmp_path_factory.mktemp("long"), "qwen2",
                                max_position_embeddings=40000)


def test_max_model_len_defaults_to_the_models_context(long_context_dir: Path) -> None:
    llm = build_llm(str(long_context_dir), device="cpu")  # 2 GiB of KV holds 40,000 tokens
    assert llm.engine.max_model_len == 40000


def test_default_max_model_len_shrinks_to_the_kv_pool(long_context_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="liteinfer"):
        llm = build_llm(str(long_context_dir), device="cpu", num_kv_blocks=100)
    assert llm.engine.max_model_len == llm.engine.core.scheduler.max_model_len == 1600
    assert "exceeds the KV pool's 1600 tokens; serving at max_model_len=1600" in caplog.text
    prompt = random_prompts(1, TINY_LLAMA["vocab_size"], 1595, 1595, seed=5)[0]
    out = llm.generate([prompt], greedy(5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="exceeds max_model_len=1600"):
        llm.generate([prompt], greedy(6), use_tqdm=False)


def test_the_callers_config_is_never_changed(long_context_dir: Path) -> None:
    """The core resolves a copy (the 'auto' settings) and builds its own from what the model
    runner derived (max_model_len as the KV pool allows); the caller's object stays as given,
    and frozen."""
    config = EngineConfig(device="cpu", num_kv_blocks=100)
    given = dataclasses.replace(config)
    core = EngineCore(str(long_context_dir), config)
    assert config == given
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 10  # type: ignore[misc]
    built = core.config
    assert (built.device, built.dtype, built.attention_backend) == ("cpu", "float32", "torch")
    assert built.max_model_len == core.max_model_len == core.scheduler.max_model_len == 1600
    assert built.num_kv_blocks == core.block_manager.num_blocks == 100
    assert core.info.max_model_len == 1600
    assert dataclasses.replace(built, dtype="auto", attention_backend="auto",
                               max_model_len=None) == config


def test_explicit_max_model_len_beyond_the_kv_pool_is_an_error(long_context_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len=2000 does not fit in the KV pool "
                                         r"\(1600 tokens\)"):
        build_llm(str(long_context_dir), device="cpu", num_kv_blocks=100, max_model_len=2000)
    with pytest.raises(ValueError, match="max_model_len 50000 exceeds the model's 40000"):
        build_llm(str(long_context_dir), device="cpu", max_model_len=50000)
