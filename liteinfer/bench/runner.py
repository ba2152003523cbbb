"""Drives the liteinfer engine over a benchmark workload and turns its timestamps into a row."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from liteinfer.bench.metrics import Trace, summarize
from liteinfer.bench.registry import LITEINFER, Run, get
from liteinfer.bench.store import Row, environment, now_iso
from liteinfer.bench.timeline import from_records, write_timeline
from liteinfer.bench.workloads import (
    SEED,
    WARMUP_SEED,
    Shape,
    fingerprint,
    fold_into_vocab,
    make_prompts,
)
from liteinfer.llm import LLM
from liteinfer.loader import load_model_source
from liteinfer.sampling_params import RequestOutputKind, SamplingParams
from liteinfer.utils import model_label

_request_ids: Iterator[int] = itertools.count()
BENCH_MAX_MODEL_LEN = 16384


def engine_args_for(config: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """What a row records and LLM receives: bf16 (WORKLOADS.md), the config's args, overrides."""
    return {"dtype": "bfloat16", **get(config).engine_args, **overrides}


def make_llm(model: str, engine_args: dict[str, Any]) -> LLM:
    """The engine at WORKLOADS.md's context (the vLLM rows' 16,384 tokens, or the model's own
    if shorter) unless the config sets max_model_len."""
    if "max_model_len" not in engine_args:
        context = load_model_source(model, "dummy").model_config.max_context
        engine_args = {**engine_args, "max_model_len": min(BENCH_MAX_MODEL_LEN, context)}
    return LLM(model=model, load_format="dummy", **engine_args)


def workload(shape: Shape, n: int, seed: int,
             vocab_size: int) -> tuple[list[list[int]], int | None]:
    return fold_into_vocab(make_prompts(shape.isl, n, seed), vocab_size)


def staggered_lengths(osl: int, n: int) -> list[int]:
    """Output lengths that end one request at a time, so the running batch shrinks through
    every size from n down to 1 and each captured graph size runs once."""
    return [max(1, osl * (i + 1) // n) for i in range(n)]


def drive(engine: Any, prompts: list[list[int]], max_tokens: list[int], width: int,
          bar: tqdm | None = None, ignore_eos: bool = True,
          token_ids: list[list[int]] | None = None) -> list[Trace]:
    """Keeps at most `width` requests in flight, admitting the next as soon as one finishes.
    A token counts as available when the step() that produced it returns. Outputs have their
    forced length unless `ignore_eos` is False (real weights, where the text's end matters).
    `token_ids`, if given, receives each request's output tokens."""
    traces: list[Trace] = []
    owner: dict[str, int] = {}

    def admit() -> None:
        i = len(traces)
        rid = f"bench-{next(_request_ids)}"
        owner[rid] = i
        # Token ids only, as in WORKLOADS.md and the vLLM rows (detokenize=False there too).
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=ignore_eos,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        traces.append(Trace(submit=time.perf_counter()))
        if token_ids is not None:
            token_ids.append([])
        engine.add_request(rid, prompts[i], params)

    in_flight = 0
    while in_flight < width and len(traces) < len(prompts):
        admit()
        in_flight += 1
    while in_flight:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the engine holds no requests while {in_flight} are unfinished")
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            trace = traces[owner[out.request_id]]
            trace.tokens.extend([now] * len(out.new_token_ids))
            if token_ids is not None:
                token_ids[owner[out.request_id]] += out.new_token_ids
            if out.finished:
                in_flight -= 1
                if bar is not None:
                    bar.update(1)
                if len(traces) < len(prompts):
                    admit()
                    in_flight += 1
    return traces


def make_row(run: Run, engine: str, traces: list[Trace], prompts: list[list[int]],
             fold: int | None, model: str, **extra: Any) -> Row:
    return {"config": run.config, "engine": engine, "model": model_label(model), "kind": run.kind,
            "isl": run.shape.isl, "osl": run.shape.osl, "prompts": len(prompts),
            "width": run.width, "seed": SEED, **summarize(traces, run.shape.osl),
            "fingerprint": fingerprint(prompts), "vocab_fold": fold, **extra, **environment(),
            "timestamp": now_iso()}


def progress(run: Run) -> tqdm:
    return tqdm(total=run.prompts, unit="req", leave=False, mininterval=1.0,
                desc=f"{run.config} {run.kind} {run.shape.label} W={run.width}")


def warm_up(engine: Any, shape: Shape, width: int, vocab_size: int) -> int:
    """Runs the shape on other prompts than the measured ones, ending one request at a time so
    every batch size runs (compilation, graphs, allocator); returns how many requests ran."""
    n_warm = 2 if width == 1 else width
    warm, _ = workload(shape, n_warm, WARMUP_SEED, vocab_size)
    drive(engine, warm, staggered_lengths(shape.osl, n_warm), width)
    return n_warm


def measure(llm: Any, run: Run, model: str, engine_args: dict[str, Any],
            timeline: Path | None = None) -> Row:
    """Warms up on other prompts of the same shape, then measures `run`; with `timeline`, the
    engine records the measured run's steps there (bench/timeline.py)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    n_warm = warm_up(engine, run.shape, run.width, vocab)
    prompts, fold = workload(run.shape, run.prompts, SEED, vocab)
    # No measured prompt finds the KV of an earlier run's prompts (or the warm-up's).
    engine.reset_prefix_cache()
    if timeline is not None:
        engine.core.start_recording()
    with progress(run) as bar:
        traces = drive(engine, prompts, [run.shape.osl] * len(prompts), run.width, bar)
    extra: dict[str, Any] = {}
    if timeline is not None:
        records = engine.core.stop_recording()
        # The row's wall: from the first submission to the last token (metrics.summarize).
        start, end = min(t.submit for t in traces), max(t.tokens[-1] for t in traces if t.tokens)
        header = {"engine": LITEINFER, **environment(), "date": now_iso(),
                  "model": model_label(model), "engine_args": engine_args,
                  "run": {"config": run.config, "kind": run.kind, "isl": run.shape.isl,
                          "osl": run.shape.osl, "width": run.width, "prompts": len(prompts)}}
        write_timeline(from_records(records, start, end, header), timeline)
        extra["timeline"] = str(timeline)
    return make_row(run, LITEINFER, traces, prompts, fold, model, engine_args=engine_args,
                    warmup_requests=n_warm, **extra)


def run_latency(llm: Any, config: str, shape: Shape, prompts: int, model: str,
                engine_args: dict[str, Any]) -> Row:
    """One request at a time."""
    return measure(llm, get(config).run("latency", shape, 1, prompts), model, engine_args)


def run_throughput(llm: Any, config: str, shape: Shape, width: int, prompts: int, model: str,
                   engine_args: dict[str, Any]) -> Row:
    """At most `width` requests in flight."""
    return measure(llm, get(config).run("throughput", shape, width, prompts), model, engine_args)
