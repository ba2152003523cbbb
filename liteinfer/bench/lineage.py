"""The benchmark page's lineage, read from benchmarks/lineage.toml: the configurations in the
report's order, the one each improves on, the steps of the engine's history (their code gone,
their rows stored) and the names that stored rows carry for configurations renamed since."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from liteinfer.bench import registry
from liteinfer.bench.registry import LITEINFER, REMOVED, BenchConfig
from liteinfer.bench.store import Row

LINEAGE_FILE = Path("benchmarks/lineage.toml")
_KEYS = frozenset({"name", "base", "width", "description"})


@dataclass(frozen=True)
class Lineage:
    configs: tuple[BenchConfig, ...]  # in the report's order
    renamed: dict[str, str]  # a name stored rows carry -> the configuration's name now

    @cached_property
    def by_name(self) -> dict[str, BenchConfig]:
        return {c.name: c for c in self.configs}

    @cached_property
    def order(self) -> dict[str, int]:
        return {c.name: i for i, c in enumerate(self.configs)}

    def get(self, name: str) -> BenchConfig:
        if name not in self.by_name:
            raise ValueError(f"unknown benchmark config {name!r}; known: {', '.join(self.by_name)}")
        return self.by_name[name]

    def ancestors(self, name: str) -> list[str]:
        """The configurations `name` descends from, nearest first (its base, the base's base,
        ...)."""
        chain: list[str] = []
        base = self.get(name).base
        while base is not None:
            chain.append(base)
            base = self.by_name[base].base
        return chain

    def current(self, row: Row) -> Row:
        """`row` under its configuration's name now."""
        name = self.renamed.get(row["config"])
        return row if name is None else {**row, "config": name}


def _config(entry: dict[str, Any], where: Path) -> BenchConfig:
    name = entry.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{where}: a [[config]] without a name: {entry}")
    if unknown := set(entry) - _KEYS:
        raise ValueError(f"{where}: {name}: unknown keys {sorted(unknown)}")
    if name in registry.BY_NAME:
        if set(entry) - {"name", "base"}:
            raise ValueError(f"{where}: {name} runs, and liteinfer/bench/registry.py defines it: "
                             f"only its base belongs here")
        return dataclasses.replace(registry.BY_NAME[name], base=entry.get("base"))
    if "description" not in entry:
        raise ValueError(f"{where}: {name} is not a configuration of liteinfer/bench/registry.py, "
                         f"so it needs a description")
    return BenchConfig(name, entry["description"], REMOVED, LITEINFER,
                       width=entry.get("width", BenchConfig.width), base=entry.get("base"))


def load_lineage(path: Path = LINEAGE_FILE) -> Lineage:
    """The lineage in `path`; a ValueError where it names a configuration twice, leaves out one
    that runs, or names a base or a renamed configuration that it does not hold."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    configs = tuple(_config(entry, path) for entry in data.get("config", []))
    names = [c.name for c in configs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{path}: configurations named twice: {twice}")
    if missing := [c.name for c in registry.CONFIGS if c.name not in names]:
        raise ValueError(f"{path}: leaves out the configurations that run: {missing}")
    lineage = Lineage(configs, dict(data.get("renamed", {})))
    for c in configs:
        seen, base = {c.name}, c.base
        while base is not None:
            if base not in lineage.by_name:
                raise ValueError(f"{path}: {c.name}'s lineage names {base!r}, which it does not "
                                 f"hold")
            if base in seen:
                raise ValueError(f"{path}: {c.name}'s lineage loops through {base}")
            seen.add(base)
            base = lineage.by_name[base].base
    for old, new in lineage.renamed.items():
        if old in lineage.by_name or new not in lineage.by_name:
            raise ValueError(f"{path}: renames {old!r} to {new!r}; the old name must be gone and "
                             f"the new one held")
    return lineage
