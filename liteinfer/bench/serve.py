"""`liteinfer-bench serve`: an online load generator against any OpenAI-compatible server.

Streams /v1/completions with token-id prompts drawn as benchmarks/WORKLOADS.md prescribes (the
offline rows' prompts), greedy, `ignore_eos`, `max_tokens` = OSL, usage at the end of each
stream. At most --concurrency requests in flight (a new one as soon as one finishes), or Poisson
arrivals at --request-rate. Parsing server-sent events at tens of thousands per second is more
than one Python process can do, so the streams are spread over several client processes (each
its own asyncio loop and connections), whose raw timings are merged.

Per request, as vLLM's serving benchmark measures it (an event may carry several tokens when
the server falls behind, so tokens are counted from the usage at the end, not from events):
TTFT is submit to the first event with a choice, ITL the gaps between such events, TPOT
(E2E - TTFT) / (tokens - 1), E2E submit to the end of the stream. A request counts as an error
when its HTTP status is not 200, an error event arrives, the stream ends without usage, or
usage.completion_tokens differs from OSL.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from liteinfer.bench.http_client import StreamingClient
from liteinfer.bench.metrics import percentile
from liteinfer.bench.registry import LITEINFER, VLLM
from liteinfer.bench.runner import staggered_lengths, workload
from liteinfer.bench.store import Row, append_row, environment, now_iso, read_jsonl, results_file
from liteinfer.bench.tables import SERVE, serving_tables
from liteinfer.bench.workloads import MODEL, SEED, WARMUP_SEED, Shape, default_prompts, fingerprint
from liteinfer.utils import model_label

# Seconds a stream may stay silent before the request counts as failed.
READ_TIMEOUT_S = 300.0
ERROR_SAMPLES = 5  # distinct error messages a row keeps


@dataclass(frozen=True)
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the start when it may be sent


@dataclass
class Timing:
    """perf_counter seconds (CLOCK_MONOTONIC: comparable across the client processes)."""

    index: int
    submit: float
    events: list[float] = field(default_factory=list)  # arrivals of events carrying a choice
    end: float = 0.0
    completion_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str | None
    api_key: str | None = None


def request_body(target: Target, job: Job) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": job.prompt, "max_tokens": job.max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.model is not None:
        body["model"] = target.model
    return body


async def stream_one(client: StreamingClient, target: Target, job: Job) -> Timing:
    body = orjson.dumps(request_body(target, job))
    timing = Timing(job.index, time.perf_counter())
    try:
        async with client.post("/v1/completions", body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                timing.error = f"HTTP {resp.status}: {text[:200]}"
                return timing
            async for line in resp.lines():
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                data = line[6:].rstrip()
                if data == b"[DONE]":  # read on to the body's end: the connection is reused
                    timing.end = now
                    continue
                chunk = orjson.loads(data)
                if "error" in chunk:
                    timing.error = f"error event: {str(chunk['error'])[:200]}"
                    break
                if chunk.get("choices"):
                    timing.events.append(now)
                if chunk.get("usage"):
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # any failure of one stream is that request's error
        timing.error = f"{type(e).__name__}: {e}"[:200]
    timing.end = timing.end or time.perf_counter()
    if timing.error is None:
        if timing.completion_tokens is None:
            timing.error = "the stream ended without usage"
        elif timing.completion_tokens != job.max_tokens:
            timing.error = (f"{timing.completion_tokens} tokens generated, "
                            f"{job.max_tokens} asked for")
        elif not timing.events:
            timing.error = "no event carried a token"
    return timing


async def run_jobs(target: Target, jobs: list[Job], max_in_flight: int,
                   start_at: float) -> list[Timing]:
    """Sends `jobs` in order, each no earlier than `start_at + job.at`, at most `max_in_flight`
    at once (the semaphore is first come, first served)."""
    gate = asyncio.Semaphore(max_in_flight)
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    client = StreamingClient(target.base_url, headers, READ_TIMEOUT_S)

    async def one(job: Job) -> Timing:
        delay = start_at + job.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            return await stream_one(client, target, job)

    try:
        return await asyncio.gather(*(one(j) for j in jobs))
    finally:
        await client.close()


def client_process(conn: Connection, target: Target, jobs: list[Job],
                   max_in_flight: int) -> None:
    """One client process: reports ready, waits for the common start time, runs its share and
    sends its timings back."""
    import contextlib

    with contextlib.suppress(ImportError):  # as the servers do: uvloop where installed
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    conn.send("ready")
    start_at = conn.recv()
    conn.send(asyncio.run(run_jobs(target, jobs, max_in_flight, start_at)))
    conn.close()


def spread(jobs: list[Job], concurrency: int | None, processes: int
           ) -> list[tuple[list[Job], int]]:
    """Each client process's jobs and how many it may have in flight. With a concurrency cap,
    stream s of `concurrency` runs jobs s, s + concurrency, ... and belongs to process
    s % processes; without one (Poisson arrivals), jobs go round-robin."""
    if concurrency is None:
        shares = [jobs[p::processes] for p in range(processes)]
        return [(share, max(1, len(share))) for share in shares if share]
    processes = min(processes, concurrency)
    lanes = [p % processes for p in range(concurrency)]
    out: list[tuple[list[Job], int]] = [([], lanes.count(p)) for p in range(processes)]
    for job in jobs:
        out[lanes[job.index % concurrency]][0].append(job)
    return [share for share in out if share[0]]


def run_load(target: Target, jobs: list[Job], concurrency: int | None,
             processes: int) -> list[Timing]:
    """Runs the jobs over client processes that start together; timings in job order."""
    # fork: the children start at once (they need nothing this process has not imported yet;
    # it has touched no GPU and runs no threads).
    ctx = multiprocessing.get_context("fork")
    workers = []
    for share, in_flight in spread(jobs, concurrency, processes):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=client_process, args=(child, target, share, in_flight),
                           daemon=True)
        proc.start()
        child.close()
        workers.append((proc, parent))
    try:
        for proc, conn in workers:
            if conn.recv() != "ready":
                raise RuntimeError(f"client process {proc.pid} did not start")
        start_at = time.perf_counter() + 0.05
        for _, conn in workers:
            conn.send(start_at)
        timings = [t for _, conn in workers for t in conn.recv()]
    except EOFError:
        raise RuntimeError("a client process died; see its traceback above") from None
    finally:
        for proc, conn in workers:
            conn.close()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return sorted(timings, key=lambda t: t.index)


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests/s, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def _stats(prefix: str, samples_ms: list[float]) -> dict[str, float | None]:
    return {f"{prefix}_mean": float(np.mean(samples_ms)) if samples_ms else None,
            f"{prefix}_p50": percentile(samples_ms, 50),
            f"{prefix}_p99": percentile(samples_ms, 99)}


def summarize_timings(timings: list[Timing], osl: int) -> dict[str, Any]:
    """Latencies in ms over the requests that succeeded; rates per second of the whole run."""
    ok = [t for t in timings if t.error is None]
    ttft = [(t.events[0] - t.submit) * 1e3 for t in ok]
    e2e = [(t.end - t.submit) * 1e3 for t in ok]
    tpot = [(e - f) / (t.completion_tokens - 1) for t, e, f in zip(ok, e2e, ttft, strict=True)
            if t.completion_tokens and t.completion_tokens > 1]
    itl = [float(g) * 1e3 for t in ok for g in np.diff(t.events)]
    wall = (max(t.end for t in timings) - min(t.submit for t in timings)) if timings else 0.0
    out_tokens = sum(t.completion_tokens or 0 for t in ok)
    errors = [t.error for t in timings if t.error is not None]
    return {**_stats("ttft", ttft), **_stats("tpot", tpot), **_stats("itl", itl),
            **_stats("e2e", e2e), "tok_s": out_tokens / wall if wall else 0.0,
            "req_s": len(ok) / wall if wall else 0.0, "wall_s": wall, "out_tokens": out_tokens,
            "requests": len(timings), "errors": len(errors),
            "error_samples": list(dict.fromkeys(errors))[:ERROR_SAMPLES],
            "all_forced": not errors and all(t.completion_tokens == osl for t in timings)}


def server_version(base_url: str) -> str | None:
    """The server's version where it reports one (vLLM's /version)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/version", timeout=5) as r:
            return json.loads(r.read()).get("version")
    except Exception:  # a server without the route
        return None


def reset_prefix_cache(base_url: str) -> bool:
    """Empties the server's prefix cache where it offers that (vLLM with VLLM_SERVER_DEV_MODE=1),
    so that a measured run does not reuse the prompts of an earlier one."""
    import urllib.request

    request = urllib.request.Request(base_url.rstrip("/") + "/reset_prefix_cache", b"",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status == 200
    except Exception:  # a server without the route
        return False


@dataclass(frozen=True)
class ServeRun:
    shape: Shape
    prompts: int
    concurrency: int | None
    request_rate: float | None
    processes: int
    vocab_size: int | None
    warmup: bool = True


def _send_environment(conn: Any) -> None:
    conn.send(environment())


def client_environment() -> Row:
    """store.environment(), read in a fresh (spawned) process: it asks torch for the GPU's
    name, which initializes CUDA, which a forked process cannot do, and after which this
    process could no longer fork clients safely."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_environment, args=(child,))
    proc.start()
    try:
        return parent.recv()
    finally:
        proc.join()


def measure_serve(target: Target, run: ServeRun, engine: str, config: str, run_id: str,
                  env: Row, model: str = MODEL) -> Row:
    """Warms up on other prompts of the same shape (every batch size once, as offline), then
    measures `run`; returns its row, with the client's environment `env`."""
    width = run.concurrency or run.prompts
    warmup_requests = 0
    if run.warmup:
        warmup_requests = 2 if width == 1 else min(width, run.prompts)
        warm, _ = workload(run.shape, warmup_requests, WARMUP_SEED, run.vocab_size or 2**31)
        lengths = staggered_lengths(run.shape.osl, warmup_requests)
        run_load(target, [Job(i, p, n) for i, (p, n) in enumerate(zip(warm, lengths,
                                                                          strict=True))],
                 width, run.processes)
    prefix_cache_reset = reset_prefix_cache(target.base_url)
    prompts, fold = workload(run.shape, run.prompts, SEED, run.vocab_size or 2**31)
    offsets = (poisson_offsets(run.prompts, run.request_rate, SEED) if run.request_rate
               else [0.0] * run.prompts)
    jobs = [Job(i, p, run.shape.osl, at) for i, (p, at) in enumerate(zip(prompts, offsets,
                                                                         strict=True))]
    timings = run_load(target, jobs, run.concurrency, run.processes)
    version = server_version(target.base_url)
    return {"config": config, "engine": engine, "model": model, "kind": SERVE,
            "isl": run.shape.isl, "osl": run.shape.osl, "prompts": run.prompts, "width": width,
            "request_rate": run.request_rate, "seed": SEED,
            **summarize_timings(timings, run.shape.osl), "fingerprint": fingerprint(prompts),
            "vocab_fold": fold, "client_processes": min(run.processes, width),
            "warmup_requests": warmup_requests, "prefix_cache_reset": prefix_cache_reset,
            "run_id": run_id, "served_model": target.model,
            **({"version": version} if version else {}), **env,
            "timestamp": now_iso()}


def fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def describe(row: Row) -> str:
    return (f"{row['config']} {Shape.parse(row['isl'], row['osl']).label} streams={row['width']}"
            f": {row['tok_s']:,.0f} tok/s, TTFT p50 {fmt_ms(row['ttft_p50'])} ms, TPOT p50 "
            f"{fmt_ms(row['tpot_p50'])} ms, ITL p50 {fmt_ms(row['itl_p50'])} ms, "
            f"errors {row['errors']}/{row['requests']}")


def offline_row(row: Row, rows: list[Row]) -> Row | None:
    """The newest offline liteinfer row of the same GPU, model, shape and width: of the same
    run (scripts/bench_serving.sh gives its offline rows the run's id) where there is one."""
    same = [r for r in rows if r["kind"] in ("latency", "throughput")
            and r.get("engine") == LITEINFER and r.get("gpu") == row.get("gpu")
            and (r["model"], str(r["isl"]), r["osl"], r["width"])
            == (row["model"], str(row["isl"]), row["osl"], row["width"])]
    return max(same, key=lambda r: (r.get("run_id") == row.get("run_id"), r["timestamp"]),
               default=None)


def summary(rows: list[Row]) -> str:
    """A fixed-width table of the serving rows, each against vLLM serve of the same run and the
    offline engine at the same width (tok/s ratio; the offline ITL and TTFT p50)."""
    head = ("config", "ISL/OSL", "streams", "n", "tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "ITL p50", "errors", "full", "vs vLLM", "vs offline", "off ITL",
            "off TTFT")
    lines = [head]
    models = sorted({r["model"] for r in rows if r["kind"] == SERVE})
    for line in [ln for m in models for t in serving_tables(rows, m) for ln in t.lines]:
        r = line.row
        off = offline_row(r, rows)
        lines.append((
            r["config"], Shape.parse(r["isl"], r["osl"]).label,
            str(r["width"]) if r.get("request_rate") is None else f"{r['request_rate']:g}/s",
            str(r["requests"]), f"{r['tok_s']:,.0f}",
            *(fmt_ms(r.get(k)) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                                         "itl_p50")),
            str(r["errors"]), "yes" if r["all_forced"] else "NO",
            "—" if line.vs_vllm is None else f"{line.vs_vllm:.2f}x",
            f"{r['tok_s'] / off['tok_s']:.2f}x" if off and off.get("tok_s") else "—",
            fmt_ms(off.get("itl_p50") if off else None),
            fmt_ms(off.get("ttft_p50") if off else None)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="measure an OpenAI-compatible server under streaming load",
        description=__doc__.split("\n\n")[0] + " Appends one JSON row per run.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model's name (default: the server's only one)")
    p.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=[32], metavar="N",
                      help="requests in flight; several values run one after another "
                           "(default: 32)")
    load.add_argument("--request-rate", type=float,
                      help="Poisson arrivals at this many requests/s, all in flight at once")
    p.add_argument("--shape", default="128/256",
                   metavar="ISL/OSL", help="prompt and output length (default: %(default)s)")
    p.add_argument("--prompts", type=int, nargs="+", metavar="N",
                   help="measured requests, one per --concurrency value (default: WORKLOADS.md's "
                        "count: latency's at 1 stream, throughput's otherwise)")
    p.add_argument("--processes", type=int, default=4,
                   help="client processes the streams are spread over (default: %(default)s)")
    p.add_argument("--vocab-size", type=int,
                   help="fold prompt ids into a vocabulary smaller than WORKLOADS.md's ids")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--engine", choices=(LITEINFER, VLLM), default=LITEINFER,
                   help="which server this is, recorded in the rows (default: %(default)s)")
    p.add_argument("--config", help="the row's configuration label (default: '<engine>-serve')")
    p.add_argument("--run-id", help="rows of one run share it; 'vs vLLM serve' compares only "
                                    "those (default: now)")
    p.add_argument("--summary", type=Path, metavar="ROWS",
                   help="measure nothing: print the serving rows of this .jsonl file against "
                        "vLLM serve's and the offline rows in it")
    p.add_argument("--out", type=Path,
                   help="results .jsonl file to append to, or a directory for <date>-<gpu>.jsonl "
                        "(default: benchmarks/results/)")
    p.set_defaults(func=cmd_serve)


def plan_serve(args: argparse.Namespace, shape: Shape) -> list[ServeRun]:
    levels: list[int | None] = [None] if args.request_rate else list(args.concurrency)
    counts = args.prompts or [default_prompts("latency" if c == 1 else "throughput", shape)
                              for c in levels]
    if len(counts) != len(levels):
        raise ValueError(f"--prompts gives {len(counts)} counts for {len(levels)} runs")
    if any(c is not None and c < 1 for c in levels) or min(counts) < 1 or args.processes < 1:
        raise ValueError("--concurrency, --prompts and --processes must be positive")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be positive")
    return [ServeRun(shape, n, c, args.request_rate, args.processes, args.vocab_size,
                     args.warmup) for c, n in zip(levels, counts, strict=True)]


def served_models(target: Target) -> list[str]:
    """The ids the server's /v1/models lists."""
    import urllib.request

    request = urllib.request.Request(target.base_url.rstrip("/") + "/v1/models", headers={
        "Authorization": f"Bearer {target.api_key}"} if target.api_key else {})
    with urllib.request.urlopen(request, timeout=30) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def cmd_serve(args: argparse.Namespace) -> None:
    if args.summary is not None:
        print(summary(read_jsonl(args.summary)))
        return
    shape = Shape.parse(*args.shape.split("/", 1)) if "/" in args.shape else None
    if shape is None:
        raise ValueError(f"--shape {args.shape!r}: expected ISL/OSL, e.g. 128/256")
    runs = plan_serve(args, shape)
    target = Target(args.base_url, args.model, args.api_key)
    if target.model is None:
        target = dataclasses.replace(target, model=served_models(target)[0])
    config = args.config or f"{args.engine}-serve"
    run_id = args.run_id or now_iso()
    env = client_environment()
    out = results_file(args.out, env["gpu"], now_iso())
    for run in runs:
        row = measure_serve(target, run, args.engine, config, run_id, env,
                            model_label(target.model))
        append_row(row, out)
        print(describe(row), flush=True)
    print(f"{len(runs)} row(s) appended to {out}")
