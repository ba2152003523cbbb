"""Where a benchmark workload's wall time goes, step by step: the engine runs the workload as
`liteinfer-bench run` does (Llama-3.2-1B, dummy weights), and every step records its kind
(captured decode, captured prompt/mixed step, eager step), its decoding rows and prompt tokens,
its host time (the whole `step()` call) and its device span (CUDA events around the model and the
sampler, so an eager step's span includes device time spent waiting for launches). Then a
shorter run under the torch profiler splits device time by kernel category.

    python scripts/profile_workload.py --isl mixed2048 --osl 128 [--width 32] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from profile_prefill import category
from torch.profiler import ProfilerActivity, profile

from liteinfer.bench.registry import DEFAULT
from liteinfer.bench.runner import drive, engine_args_for, make_llm, staggered_lengths, workload
from liteinfer.bench.workloads import SEED, WARMUP_SEED, Shape
from liteinfer.config import parse_overrides


def instrument(engine) -> list[dict]:
    """Wraps the runner's execute so each step appends a record; returns the record list."""
    runner, steps = engine.core.runner, []
    execute = runner.execute

    def timed_execute(staged):
        batch = staged.batch
        prompt_tokens = sum(batch.num_tokens) - batch.num_decodes
        if not batch.is_prefill:
            kind = "decode-graph" if runner.graphs is not None else "decode-eager"
        elif runner.prompt_graphs is not None and runner.prompt_graphs.fits(batch):
            kind = "prompt-graph"
        else:
            kind = "prompt-eager"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = execute(staged)
        steps.append({"kind": kind, "decodes": batch.num_decodes, "prompt": prompt_tokens,
                      "events": (start, end)})
        return result

    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        if steps and "host_ms" not in steps[-1]:
            steps[-1]["events"][1].record()  # after the sampler's launches
            steps[-1]["host_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    runner.execute, engine.step = timed_execute, timed_step
    return steps


def summarize(steps: list[dict], wall_s: float) -> dict:
    torch.cuda.synchronize()
    by_kind: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for s in steps:
        agg = by_kind[s["kind"]]
        agg["steps"] += 1
        agg["host_ms"] += s.get("host_ms", 0.0)
        agg["device_ms"] += s["events"][0].elapsed_time(s["events"][1]) if "host_ms" in s else 0
        agg["prompt_tokens"] += s["prompt"]
        agg["decode_rows"] += s["decodes"]
    table = {k: {"steps": int(a["steps"]), "host_ms_total": round(a["host_ms"], 1),
                 "device_ms_total": round(a["device_ms"], 1),
                 "host_ms_mean": round(a["host_ms"] / a["steps"], 3),
                 "device_ms_mean": round(a["device_ms"] / a["steps"], 3),
                 "prompt_tokens_mean": round(a["prompt_tokens"] / a["steps"], 1),
                 "decode_rows_mean": round(a["decode_rows"] / a["steps"], 1)}
             for k, a in sorted(by_kind.items())}
    # Steps of one kind, prompt size and decoding rows (to the next multiple of 8) together: what
    # a step of each shape costs, against the pure-prefill rate of the largest prompt steps.
    by_shape: dict[tuple, list[float]] = defaultdict(list)
    for s in steps:
        if "host_ms" in s:
            key = (s["kind"], s["prompt"], -(-s["decodes"] // 8) * 8)
            by_shape[key].append(s["events"][0].elapsed_time(s["events"][1]))
    shapes = [{"kind": k, "prompt": p, "decodes_to": d, "steps": len(ms),
               "device_ms_mean": round(sum(ms) / len(ms), 3), "device_ms_total": round(sum(ms), 1)}
              for (k, p, d), ms in sorted(by_shape.items(), key=lambda kv: -sum(kv[1]))]
    return {"wall_s": round(wall_s, 3), "steps": len(steps), "by_kind": table,
            "by_shape": shapes[:25]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isl", default="mixed2048")
    p.add_argument("--osl", default="128")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--profile-prompts", type=int, default=48,
                   help="requests of the kernel-category run (0: skip it)")
    p.add_argument("--config", default=DEFAULT)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    shape = Shape.parse(args.isl, args.osl)
    engine_args = engine_args_for(args.config, parse_overrides(args.overrides))
    t0 = time.perf_counter()
    llm = make_llm("llama-3.2-1b-instruct", engine_args)
    result = {"shape": shape.label, "width": args.width, "engine_args": engine_args,
              "init_s": round(time.perf_counter() - t0, 1)}
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    warm, _ = workload(shape, args.width, WARMUP_SEED, vocab)
    drive(engine, warm, staggered_lengths(shape.osl, len(warm)), args.width)
    prompts, _ = workload(shape, args.prompts, SEED, vocab)
    steps = instrument(engine)
    t0 = time.perf_counter()
    drive(engine, prompts, [shape.osl] * len(prompts), args.width)
    wall = time.perf_counter() - t0
    result.update(summarize(steps, wall))
    result["tok_s"] = round(len(prompts) * shape.osl / wall)
    if args.profile_prompts:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            drive(engine, prompts[:args.profile_prompts], [shape.osl] * args.profile_prompts,
                  args.width)
            torch.cuda.synchronize()
        per_category: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            if e.device_time_total > 0:
                per_category[category(e.key)] += e.device_time_total / 1e3
        result["profiled_prompts"] = args.profile_prompts
        result["device_ms_by_category"] = {k: round(v, 1) for k, v in
                                           sorted(per_category.items(), key=lambda kv: -kv[1])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
