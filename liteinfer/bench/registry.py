"""The benchmark configurations that run (the engine's default, the transformers baselines) or
stand as reference points (vLLM's rows), and their runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liteinfer.bench.workloads import (
    HEADLINE,
    LATENCY_SHAPES,
    THROUGHPUT_SHAPES,
    Shape,
    default_prompts,
)

RUNNABLE = "runnable"
REFERENCE = "reference point"
REMOVED = "removed from the codebase"

LITEINFER, TRANSFORMERS, VLLM = "liteinfer", "transformers", "vllm"


@dataclass(frozen=True)
class Run:
    config: str
    kind: str  # latency | throughput
    shape: Shape
    width: int
    prompts: int


@dataclass(frozen=True)
class BenchConfig:
    name: str
    description: str
    status: str
    engine: str  # who runs it: LITEINFER (engine_args are EngineConfig fields), TRANSFORMERS, VLLM
    engine_args: dict[str, Any] = field(default_factory=dict)
    width: int = 32  # its throughput width; latency always runs at width 1
    latency: tuple[Shape, ...] = ()
    throughput: tuple[tuple[Shape, int], ...] = ()  # (shape, width) of the full matrix
    # Slow baselines run fewer prompts, as on the original page: {kind: cap}. Their rows are
    # marked in the report as not having used the same prompts.
    max_prompts: dict[str, int] = field(default_factory=dict)
    base: str | None = None  # the configuration it improves on: the lineage's (bench/lineage.py)

    @property
    def label(self) -> str:
        return self.name if self.engine == VLLM else f"liteinfer-{self.name}"

    @property
    def runnable(self) -> bool:
        return self.status == RUNNABLE

    def runs(self) -> list[Run]:
        planned = [("latency", s, 1) for s in self.latency]
        planned += [("throughput", s, w) for s, w in self.throughput]
        return [self.run(kind, shape, width) for kind, shape, width in planned]

    def run(self, kind: str, shape: Shape, width: int, prompts: int | None = None) -> Run:
        n = prompts or default_prompts(kind, shape)
        if prompts is None and kind in self.max_prompts:
            n = min(n, self.max_prompts[kind])
        return Run(self.name, kind, shape, 1 if kind == "latency" else width, n)


_ALL_SHAPES = dict(latency=LATENCY_SHAPES, throughput=tuple((s, 32) for s in THROUGHPUT_SHAPES)
                   + ((HEADLINE, 1), (HEADLINE, 4), (HEADLINE, 128)))


def _caps(n: int) -> dict[str, int]:
    return {"latency": n, "throughput": n}


# The configurations that run. The lineage they belong to, with the configurations of the
# engine's history and which one each improves on, is data: benchmarks/lineage.toml
# (bench/lineage.py reads it for the report).
CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("nocache", "No KV cache: every step re-feeds the whole sequence "
                "(transformers generate)", RUNNABLE, TRANSFORMERS, {"use_cache": False},
                width=1, latency=(HEADLINE,), throughput=((HEADLINE, 1),), max_prompts=_caps(3)),
    BenchConfig("eager", "KV cache via transformers DynamicCache", RUNNABLE, TRANSFORMERS,
                {"use_cache": True}, width=1, latency=(HEADLINE,), throughput=((HEADLINE, 1),),
                max_prompts=_caps(10)),
    BenchConfig("eager-b4", "Static batching, B=4, eager cache (transformers generate)",
                RUNNABLE, TRANSFORMERS, {"use_cache": True}, width=4,
                throughput=((HEADLINE, 4),), max_prompts=_caps(24)),
    # The engine as it is, with its defaults; it runs every shape a vLLM reference row has.
    BenchConfig("default", "The engine with its default arguments", RUNNABLE, LITEINFER,
                **_ALL_SHAPES),
    BenchConfig("vllm", "vLLM, one sequence at a time", REFERENCE, VLLM, width=1),
    BenchConfig("vllm-b4", "vLLM, up to 4 concurrent sequences", REFERENCE, VLLM, width=4),
    BenchConfig("vllm-continuous", "vLLM, up to 32 concurrent sequences", REFERENCE, VLLM),
    BenchConfig("vllm-b128", "vLLM, up to 128 concurrent sequences", REFERENCE, VLLM, width=128),
)
BY_NAME = {c.name: c for c in CONFIGS}
DEFAULT = "default"


def get(name: str) -> BenchConfig:
    if name not in BY_NAME:
        raise ValueError(f"unknown benchmark config {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def vllm_config_for(width: int) -> str | None:
    """The vLLM reference configuration measured at this width."""
    return next((c.name for c in CONFIGS if c.engine == VLLM and c.width == width), None)


def full_matrix(names: list[str] | None = None) -> list[Run]:
    """Every run of the original page's tables, for the named (default: all runnable) configs."""
    configs = [get(n) for n in names] if names else [c for c in CONFIGS if c.runnable]
    return [r for c in configs for r in c.runs()]


def quick_runs(names: list[str] | None = None) -> list[Run]:
    """A short check (default: of the default config); a few minutes on a GPU."""
    configs = [get(n) for n in names or [DEFAULT]]
    return [r for c in configs for r in (c.run("latency", HEADLINE, 1, prompts=20),
                                         c.run("throughput", HEADLINE, c.width))]
