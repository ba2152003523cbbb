"""Hugging Face model directories: config.json, safetensors shards, tokenizer files."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Add the classic `rope_theta` / `rope_scaling` / `torch_dtype` keys to a config written by
    transformers 5, which nests RoPE settings under `rope_parameters` and renames the dtype."""
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    return cfg


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in shard order; [] when it has none."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) missing from {directory}: {missing}")
        return files
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else []


def iter_safetensors(files: list[Path], tie_word_embeddings: bool
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Read tensors one at a time (safe_open memory-maps the shard; get_tensor copies only the
    requested tensor), so the caller can copy each into place and drop it."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                # Old exports carry RoPE buffers; tied checkpoints sometimes repeat the embedding.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if tie_word_embeddings and name == "lm_head.weight":
                    continue
                yield name, f.get_tensor(name)


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
