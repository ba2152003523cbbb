"""Named benchmark configurations: the lineage of the original page, and the runs of each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liteinfer.bench.workloads import (HEADLINE, LATENCY_SHAPES, MIXED, THROUGHPUT_SHAPES, Shape,
                                       default_prompts)

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


_FIXED_W32 = tuple((s, 32) for s in THROUGHPUT_SHAPES if s.isl != MIXED)
_MIXED_W32 = ((HEADLINE, 32),) + tuple((s, 32) for s in THROUGHPUT_SHAPES if s.isl == MIXED)
# Configs older than `packed` in the lineage pad their prefill.
# Configs older than `overlap` read each step's tokens before scheduling the next.
# Configs older than `gemv` run one-sequence steps through cuBLAS; older than `mixed`, a step
# either prefills or decodes; older than `prompt-graphs`, prompt steps run eagerly and take
# whatever the token budget allows.
_NEWER_OFF = {"gemv_decode": False, "mixed_steps": False, "mixed_prompt_tokens": 0}
_EAGER32 = {"max_num_seqs": 32, "enforce_eager": True, "packed_prefill": False,
            "overlap_scheduling": False, **_NEWER_OFF}
_GRAPHS = {"attention_backend": "triton", "enforce_eager": False, "decode_split_k": False,
           "max_num_seqs": 32, "packed_prefill": False, "overlap_scheduling": False,
           **_NEWER_OFF}
_SPLITK = {"attention_backend": "triton", "enforce_eager": False, "decode_split_k": True,
           "max_num_seqs": 128, "packed_prefill": True, "overlap_scheduling": False,
           **_NEWER_OFF}
_OVERLAP = {**_SPLITK, "overlap_scheduling": True}
_GEMV = {**_OVERLAP, "gemv_decode": True}
_MIXED = {**_GEMV, "mixed_steps": True}
_PROMPT_GRAPHS = {**_MIXED, "mixed_prompt_tokens": 2048}
_ALL_SHAPES = dict(latency=LATENCY_SHAPES, throughput=tuple((s, 32) for s in THROUGHPUT_SHAPES)
                   + ((HEADLINE, 1), (HEADLINE, 4), (HEADLINE, 128)))
_MIXED_BUDGET = {"max_model_len": 4096}  # holds 2048-token prompts plus 1024 generated


def _caps(latency: int, throughput: int | None = None) -> dict[str, int]:
    return {"latency": latency, "throughput": throughput or latency}


# Eager lineage configs: two full waves of 32 at W=32 (forced lengths keep waves whole).
_EAGER_CAPS = _caps(10, 64)

CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("nocache", "No KV cache: every step re-feeds the whole sequence "
                "(transformers generate)", None, RUNNABLE, TRANSFORMERS, {"use_cache": False},
                width=1, latency=(HEADLINE,), throughput=((HEADLINE, 1),), max_prompts=_caps(3)),
    BenchConfig("eager", "KV cache via transformers DynamicCache", "nocache", RUNNABLE,
                TRANSFORMERS, {"use_cache": True}, width=1, latency=(HEADLINE,),
                throughput=((HEADLINE, 1),), max_prompts=_caps(10)),
    BenchConfig("native-eager", "KV cache as plain tensors, no DynamicCache", "eager", REMOVED,
                LITEINFER, width=1),
    BenchConfig("paged", "Paged KV cache: fixed-size blocks from a pool", "native-eager", REMOVED,
                LITEINFER, width=1),
    BenchConfig("eager-b4", "Static batching, B=4, eager cache (transformers generate)", "eager",
                RUNNABLE, TRANSFORMERS, {"use_cache": True}, width=4,
                throughput=((HEADLINE, 4),), max_prompts=_caps(24)),
    BenchConfig("native-eager-b4", "Static batching, B=4, native eager cache", "native-eager",
                REMOVED, LITEINFER, width=4),
    BenchConfig("paged-b4", "Static batching, B=4, paged cache", "paged", REMOVED, LITEINFER,
                width=4),
    BenchConfig("continuous", "Continuous batching, up to 32 concurrent sequences", "paged-b4",
                RUNNABLE, LITEINFER, {"attention_backend": "torch", **_EAGER32},
                latency=(HEADLINE,), throughput=_FIXED_W32, max_prompts=_EAGER_CAPS),
    BenchConfig("sdpa", "Continuous batching, attention through PyTorch SDPA", "continuous",
                RUNNABLE, LITEINFER, {"attention_backend": "sdpa", **_EAGER32},
                latency=(HEADLINE,), throughput=_FIXED_W32, max_prompts=_EAGER_CAPS),
    BenchConfig("paged-attn", "Continuous batching, decode attention reads the KV pool in-kernel",
                "sdpa", RUNNABLE, LITEINFER,
                {"attention_backend": "triton", "decode_split_k": False, **_EAGER32},
                latency=LATENCY_SHAPES[:2], throughput=_FIXED_W32, max_prompts=_caps(20, 96)),
    BenchConfig("graphs", "Paged decode replayed from a CUDA graph instead of launched per kernel",
                "paged-attn", RUNNABLE, LITEINFER, _GRAPHS, latency=LATENCY_SHAPES[:2],
                throughput=_FIXED_W32),
    BenchConfig("splitk", "Captured decode, narrow batches splitting their key loop across "
                "programs", "graphs", RUNNABLE, LITEINFER, _SPLITK, latency=LATENCY_SHAPES[:2],
                throughput=_FIXED_W32),
    BenchConfig("overlap", "The host schedules step N+1 while the GPU runs step N; sampled "
                "tokens feed the next step on the GPU", "splitk", RUNNABLE, LITEINFER, _OVERLAP,
                **_ALL_SHAPES),
    # Measured slower than its base at a483c6f (NOTES.md), so not kept.
    BenchConfig("fused", "Few-token steps read weights through skinny GEMMs with RMSNorm, "
                "SiLU-and-mul and residual adds fused in", "overlap", REMOVED, LITEINFER),
    BenchConfig("gemv", "One-sequence steps stream weights through GEMV kernels with the norms "
                "and SwiGLU fused in, each launched while the previous kernel finishes (PDL)",
                "overlap", RUNNABLE, LITEINFER, _GEMV, **_ALL_SHAPES),
    BenchConfig("mixed", "Running sequences decode in the same step as arriving prompts' chunks "
                "instead of waiting for them", "gemv", RUNNABLE, LITEINFER, _MIXED,
                **_ALL_SHAPES),
    # The default configuration (throughput as `mixed` within 2%, TTFT 3-6x lower: NOTES 20;
    # steps of a power of two of rows: NOTES 22); it runs every shape a vLLM reference row has.
    BenchConfig("prompt-graphs", "Prompt and mixed steps of up to 2,048 prompt tokens replayed "
                "from CUDA graphs; while sequences decode, prompts join their steps in "
                "pieces that make each a power of two of rows", "mixed", RUNNABLE, LITEINFER,
                _PROMPT_GRAPHS, **_ALL_SHAPES),
    BenchConfig("graphs-b128", "Captured decode at 128 concurrent sequences", None, RUNNABLE,
                LITEINFER, {**_GRAPHS, "max_num_seqs": 128}, width=128,
                throughput=((HEADLINE, 128),)),
    BenchConfig("packed", "Prefill as one flat token run; measure it on a mixed-length dataset",
                "graphs-mixed", RUNNABLE, LITEINFER,
                {**_GRAPHS, **_MIXED_BUDGET, "packed_prefill": True}, throughput=_MIXED_W32),
    BenchConfig("graphs-mixed", "Captured decode with a padded prefill, at a mixed dataset's "
                "context budget", None, RUNNABLE, LITEINFER,
                {**_GRAPHS, **_MIXED_BUDGET, "packed_prefill": False}, throughput=_MIXED_W32),
    BenchConfig("graphs-16k", "Captured decode with a 16k context budget, one program per KV head",
                None, RUNNABLE, LITEINFER, {**_GRAPHS, "max_model_len": 16384},
                latency=LATENCY_SHAPES[2:]),
    BenchConfig("splitk-16k", "Split decode where attention is most of the step: long context, "
                "narrow batch", "graphs-16k", RUNNABLE, LITEINFER,
                {**_GRAPHS, "max_model_len": 16384, "decode_split_k": True},
                latency=LATENCY_SHAPES[2:]),
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
