"""Named benchmark configurations: the lineage of the original page, the engine's own steps since,
and the runs of the ones that still run."""
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
    base: str | None
    status: str
    engine: str  # who runs it: LITEINFER (engine_args are EngineConfig fields), TRANSFORMERS, VLLM
    engine_args: dict[str, Any] = field(default_factory=dict)
    width: int = 32  # its throughput width; latency always runs at width 1
    latency: tuple[Shape, ...] = ()
    throughput: tuple[tuple[Shape, int], ...] = ()  # (shape, width) of the full matrix
    # Slow baselines run fewer prompts, as on the original page: {kind: cap}. Their rows are
    # marked in the report as not having used the same prompts.
    max_prompts: dict[str, int] = field(default_factory=dict)

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


def _stored(name: str, description: str, base: str | None, width: int = 32) -> BenchConfig:
    """A configuration of the engine's history: no longer runnable, its stored rows remain."""
    return BenchConfig(name, description, base, REMOVED, LITEINFER, width=width)


# The lineage of the original page, then the project's own steps to the default. Every liteinfer
# configuration but the default is a step of that history: the code it ran is gone, and the
# report renders it from its stored rows in benchmarks/results/.
CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("nocache", "No KV cache: every step re-feeds the whole sequence "
                "(transformers generate)", None, RUNNABLE, TRANSFORMERS, {"use_cache": False},
                width=1, latency=(HEADLINE,), throughput=((HEADLINE, 1),), max_prompts=_caps(3)),
    BenchConfig("eager", "KV cache via transformers DynamicCache", "nocache", RUNNABLE,
                TRANSFORMERS, {"use_cache": True}, width=1, latency=(HEADLINE,),
                throughput=((HEADLINE, 1),), max_prompts=_caps(10)),
    _stored("native-eager", "KV cache as plain tensors, no DynamicCache", "eager", width=1),
    _stored("paged", "Paged KV cache: fixed-size blocks from a pool", "native-eager", width=1),
    BenchConfig("eager-b4", "Static batching, B=4, eager cache (transformers generate)", "eager",
                RUNNABLE, TRANSFORMERS, {"use_cache": True}, width=4,
                throughput=((HEADLINE, 4),), max_prompts=_caps(24)),
    _stored("native-eager-b4", "Static batching, B=4, native eager cache", "native-eager",
            width=4),
    _stored("paged-b4", "Static batching, B=4, paged cache", "paged", width=4),
    _stored("continuous", "Continuous batching, up to 32 concurrent sequences", "paged-b4"),
    _stored("sdpa", "Continuous batching, attention through PyTorch SDPA", "continuous"),
    _stored("paged-attn", "Continuous batching, decode attention reads the KV pool in-kernel",
            "sdpa"),
    _stored("graphs", "Paged decode replayed from a CUDA graph instead of launched per kernel",
            "paged-attn"),
    _stored("splitk", "Captured decode, narrow batches splitting their key loop across programs",
            "graphs"),
    _stored("overlap", "The host schedules step N+1 while the GPU runs step N; sampled tokens "
            "feed the next step on the GPU", "splitk"),
    # Measured slower than its base at a483c6f (docs/notes/journal.md, item 8).
    _stored("fused", "Few-token steps read weights through skinny GEMMs with RMSNorm, "
            "SiLU-and-mul and residual adds fused in", "overlap"),
    _stored("gemv", "One-sequence steps stream weights through GEMV kernels with the norms and "
            "SwiGLU fused in, each launched while the previous kernel finishes (PDL)", "overlap"),
    _stored("mixed", "Running sequences decode in the same step as arriving prompts' chunks "
            "instead of waiting for them", "gemv"),
    # The engine as it is, with its defaults; it runs every shape a vLLM reference row has.
    BenchConfig("prompt-graphs", "Prompt and mixed steps of up to 2,048 prompt tokens replayed "
                "from CUDA graphs; while sequences decode, prompts join their steps in "
                "pieces that make each a power of two of rows", "mixed", RUNNABLE, LITEINFER,
                **_ALL_SHAPES),
    _stored("graphs-b128", "Captured decode at 128 concurrent sequences", None, width=128),
    _stored("packed", "Prefill as one flat token run; measure it on a mixed-length dataset",
            "graphs-mixed"),
    _stored("graphs-mixed", "Captured decode with a padded prefill, at a mixed dataset's context "
            "budget", None),
    _stored("graphs-16k", "Captured decode with a 16k context budget, one program per KV head",
            None),
    _stored("splitk-16k", "Split decode where attention is most of the step: long context, "
            "narrow batch", "graphs-16k"),
    BenchConfig("vllm", "vLLM, one sequence at a time", None, REFERENCE, VLLM, width=1),
    BenchConfig("vllm-b4", "vLLM, up to 4 concurrent sequences", None, REFERENCE, VLLM, width=4),
    BenchConfig("vllm-continuous", "vLLM, up to 32 concurrent sequences", None, REFERENCE, VLLM),
    BenchConfig("vllm-b128", "vLLM, up to 128 concurrent sequences", None, REFERENCE, VLLM,
                width=128),
)
BY_NAME = {c.name: c for c in CONFIGS}
ORDER = {c.name: i for i, c in enumerate(CONFIGS)}
DEFAULT = "prompt-graphs"


def get(name: str) -> BenchConfig:
    if name not in BY_NAME:
        raise ValueError(f"unknown benchmark config {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def vllm_config_for(width: int) -> str | None:
    """The vLLM reference configuration measured at this width."""
    return next((c.name for c in CONFIGS if c.engine == VLLM and c.width == width), None)


def lineage(name: str) -> list[str]:
    """Ancestors of a config, nearest first (its base, the base's base, ...)."""
    chain: list[str] = []
    base = BY_NAME[name].base if name in BY_NAME else None
    while base is not None:
        chain.append(base)
        base = BY_NAME[base].base
    return chain


def full_matrix(names: list[str] | None = None) -> list[Run]:
    """Every run of the original page's tables, for the named (default: all runnable) configs."""
    configs = [get(n) for n in names] if names else [c for c in CONFIGS if c.runnable]
    return [r for c in configs for r in c.runs()]


def quick_runs(names: list[str] | None = None) -> list[Run]:
    """A short check (default: of the default config); a few minutes on an H200."""
    configs = [get(n) for n in names or [DEFAULT]]
    return [r for c in configs for r in (c.run("latency", HEADLINE, 1, prompts=20),
                                         c.run("throughput", HEADLINE, c.width))]
