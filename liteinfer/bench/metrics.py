"""Benchmark metrics from per-request timestamps, as defined in benchmarks/WORKLOADS.md."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    """perf_counter seconds: when a request was submitted, and when each of its tokens arrived."""

    submit: float
    tokens: list[float] = field(default_factory=list)


def percentile(samples: list[float], q: float) -> float | None:
    """numpy's default ('linear') interpolation; None without samples."""
    return float(np.percentile(samples, q)) if samples else None


def summarize(traces: list[Trace], osl: int) -> dict[str, float | int | bool | None]:
    """Latencies in ms, rates per second; all_forced: every request produced exactly osl tokens."""
    done = [t for t in traces if t.tokens]
    if not done:
        raise ValueError("no request produced a token")
    ttft = [(t.tokens[0] - t.submit) * 1e3 for t in done]
    e2e = [(t.tokens[-1] - t.submit) * 1e3 for t in done]
    itl = [float(g) * 1e3 for t in done for g in np.diff(t.tokens)]
    wall = max(t.tokens[-1] for t in done) - min(t.submit for t in traces)
    out_tokens = sum(len(t.tokens) for t in traces)
    return {
        "itl_p50": percentile(itl, 50), "itl_p95": percentile(itl, 95),
        "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
        "e2e_p50": percentile(e2e, 50), "e2e_p95": percentile(e2e, 95),
        "tok_s": out_tokens / wall, "req_s": len(traces) / wall, "wall_s": wall,
        "out_tokens": out_tokens, "requests": len(traces),
        "all_forced": all(len(t.tokens) == osl for t in traces),
    }
