"""Where a decode step's time goes, with dummy weights: the engine's time per step at each batch
size (captured graphs, as served), and a per-kernel breakdown of the same steps run eagerly
under torch.profiler (each kernel's GPU time per step, and its launches per step).

    python scripts/profile_decode.py [--model llama-3.2-1b-instruct] [--batch 1 32 128]
                                     [--ctx 128] [--set KEY=VALUE ...] [--eager-only]
`--eager-only` skips the captured runs (and building their graphs): the breakdown alone.
With $OUT set, writes $OUT/profile-decode-<model>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from liteinfer import LLM, SamplingParams
from liteinfer.config import parse_overrides
from liteinfer.utils import free_device_memory

STEPS = 50


def decoding(llm: LLM, bs: int, ctx: int) -> list[str]:
    """Adds bs requests of ctx prompt tokens and steps until all of them decode."""
    engine = llm.engine
    ids = [f"b{bs}-{i}" for i in range(bs)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [(7 * i + j) % 1000 + 100 for j in range(ctx)],
                           SamplingParams(temperature=0.0, max_tokens=10 * STEPS,
                                          ignore_eos=True, detokenize=False))
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    return ids


def step_ms(llm: LLM, bs: int, ctx: int) -> float:
    ids = decoding(llm, bs, ctx)
    start = time.perf_counter()
    for _ in range(STEPS):
        llm.engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / STEPS
    llm.engine.abort(ids)
    return ms


def kernels_per_step(llm: LLM, bs: int, ctx: int) -> dict[str, tuple[float, float]]:
    """kernel name -> (GPU ms per step, launches per step), largest first."""
    ids = decoding(llm, bs, ctx)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            llm.engine.step()
        torch.cuda.synchronize()
    llm.engine.abort(ids)
    rows = {ev.key[:80]: (round(ev.device_time_total / 1e3 / STEPS, 4), ev.count / STEPS)
            for ev in prof.key_averages() if ev.device_type.name == "CUDA"}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine arguments, as in `liteinfer-bench run --set`")
    ap.add_argument("--eager-only", action="store_true",
                    help="only the per-kernel breakdown, no captured step times")
    args = ap.parse_args()
    engine_args = {"dtype": "bfloat16", "max_num_seqs": max(args.batch),
                   "max_model_len": args.ctx + 10 * STEPS + 64, **parse_overrides(args.set)}
    report: dict[str, Any] = {"model": args.model, "engine_args": engine_args, "rows": {}}
    for eager in (True,) if args.eager_only else (False, True):
        llm = LLM(args.model, load_format="dummy", **engine_args, enforce_eager=eager)
        for bs in args.batch:
            row = report["rows"].setdefault(bs, {"batch": bs, "ctx": args.ctx})
            if eager:
                row["kernels_ms_per_step"] = kernels_per_step(llm, bs, args.ctx)
                total = sum(ms for ms, _ in row["kernels_ms_per_step"].values())
                row["eager_gpu_ms_per_step"] = round(total, 4)
                print(bs, "eager GPU ms/step", round(total, 3))
                for name, (ms, n) in list(row["kernels_ms_per_step"].items())[:12]:
                    print(f"   {ms:8.4f} ms  x{n:5.1f}  {name}")
            else:
                row["step_ms"] = round(step_ms(llm, bs, args.ctx), 4)
                print(bs, "step ms (graphs)", row["step_ms"], flush=True)
        del llm
        gc.collect()
        free_device_memory()
    if os.environ.get("OUT"):
        name = os.path.basename(args.model.rstrip("/"))
        with open(os.path.join(os.environ["OUT"], f"profile-decode-{name}.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
