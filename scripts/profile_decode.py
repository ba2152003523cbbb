"""Where a decode step's time goes, with dummy weights: the engine's time per step at each batch
size (captured graphs, as served), and a per-kernel breakdown of the same steps run eagerly
under torch.profiler (each kernel's GPU time per step, and its launches per step).

    python scripts/profile_decode.py [--model llama-3.2-1b-instruct] [--batch 1 32 128]
                                     [--ctx 128] [--set KEY=VALUE ...] [--eager-only]
`--eager-only` skips the captured runs (and building their graphs): the breakdown alone.
`--tiles` instead times the captured step at each batch size under several kernel tiles, its
graphs captured again for each: at one row the one-row GEMV's (`GemvTile`s with `--set
quantization=int4`, else the chunked GEMV's settings), above it the 4-bit few-row GEMM's tile
rules (NOTES.md, "4-bit weights").
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
from liteinfer.engine.cuda_graph import CUDAGraphRunner
from liteinfer.kernels import gemv, num_sms, wna16
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.layers.quantization import split_k_launches
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


# One-row GEMV tiles, the tile in use first: the loop pipelined 2-4 deep, more or fewer
# programs (rows each), longer steps.
GEMV_TILES = [wna16.GemvTile(**change) for change in (
    {}, {"num_stages": 2}, {"num_stages": 3}, {"num_stages": 4}, {"rows": 16},
    {"min_programs_per_sm": 3}, {"codes": 32768, "num_warps": 8, "num_stages": 2})]
# The unquantized GEMV's chunked kernel, the setting in use first: (rows longer than which take
# it, its tile), its pipeline's depth (1: not pipelined), and every row chunked.
CHUNKED_SETTINGS = [(gemv.CHUNKED_MIN_K, gemv.CHUNKED_TILE), (gemv.CHUNKED_MIN_K, (8, 1024, 4, 1)),
                    (gemv.CHUNKED_MIN_K, (8, 1024, 4, 2)), (gemv.CHUNKED_MIN_K, (8, 1024, 4, 4)),
                    (0, gemv.CHUNKED_TILE), (0, (8, 512, 4, 4)), (0, (4, 1024, 4, 3))]
# Few-row tile rules, the rule in use first: (features, packed bytes a row a step, programs an
# SM that K is cut towards, rows up to which a program has four warps).
FEWROW_RULES = [(64, 128, 4, 32), (64, 128, 8, 32), (32, 128, 4, 32), (64, 64, 4, 32),
                (64, 128, 4, 16), (128, 64, 4, 32)]


def _set_fewrow_rule(rule: tuple[int, int, int, int]) -> None:
    (wna16.FEWROW_BLOCK_N, wna16.FEWROW_BLOCK_K_BYTES, wna16.SPLIT_MAX_WAVES,
     wna16.FOUR_WARPS_MAX_ROWS) = rule
    wna16.fuses_swiglu.cache_clear()


def _set_chunked(setting: tuple[int, tuple[int, int, int, int]]) -> None:
    gemv.CHUNKED_MIN_K, gemv.CHUNKED_TILE = setting


def tile_times(llm: LLM, bs: int, ctx: int, int4: bool) -> dict[str, float]:
    """The captured step's ms at each one-row tile (bs 1: the 4-bit GEMV's when `int4`, else the
    chunked GEMV's) or 4-bit few-row rule (bs > 1), the decode graphs captured again under each
    (the module's tiles are read at capture)."""
    runner = llm.engine.core.runner
    pool = torch.cuda.graph_pool_handle()
    default_tile = wna16.GEMV_TILE
    default_chunked = (gemv.CHUNKED_MIN_K, gemv.CHUNKED_TILE)
    default_rule = (wna16.FEWROW_BLOCK_N, wna16.FEWROW_BLOCK_K_BYTES, wna16.SPLIT_MAX_WAVES,
                    wna16.FOUR_WARPS_MAX_ROWS)
    if bs > 1:
        variants = [(f"n{r[0]} kb{r[1]} waves{r[2]} 4warps<={r[3]}",
                     lambda r=r: _set_fewrow_rule(r)) for r in FEWROW_RULES]
    elif int4:
        variants = [(str(t), lambda t=t: setattr(wna16, "GEMV_TILE", t)) for t in GEMV_TILES]
    else:
        variants = [(f"chunked past K {c[0]}, tile {c[1]}", lambda c=c: _set_chunked(c))
                    for c in CHUNKED_SETTINGS]
    times = {}
    try:
        # the split-K workspace, sized for the default rule's splits, made room for every rule's
        launches = []
        for _, apply in variants:
            apply()
            launches += split_k_launches(runner.model, num_sms(runner.device))
        runner.scratch.split_k = SplitKWorkspace.allocate(launches, runner.device)
        for label, apply in variants:
            apply()
            runner.graphs = None
            gc.collect()
            runner.graphs = CUDAGraphRunner(runner.step_model, llm.engine.core.config.max_num_seqs,
                                            pool)
            times[label] = round(step_ms(llm, bs, ctx), 4)
            print(bs, label, times[label], "ms", flush=True)
    finally:
        wna16.GEMV_TILE = default_tile
        _set_chunked(default_chunked)
        _set_fewrow_rule(default_rule)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine arguments, as in `liteinfer-bench run --set`")
    ap.add_argument("--eager-only", action="store_true",
                    help="only the per-kernel breakdown, no captured step times")
    ap.add_argument("--tiles", action="store_true",
                    help="the captured step at each GEMV tile (4-bit ones under int4) instead")
    args = ap.parse_args()
    engine_args = {"dtype": "bfloat16", "max_num_seqs": max(args.batch),
                   "max_model_len": args.ctx + 10 * STEPS + 64, **parse_overrides(args.set)}
    report: dict[str, Any] = {"model": args.model, "engine_args": engine_args, "rows": {}}
    if args.tiles:
        llm = LLM(args.model, load_format="dummy", **engine_args)
        int4 = engine_args.get("quantization") == "int4"
        report["tiles"] = {bs: tile_times(llm, bs, args.ctx, int4) for bs in args.batch}
        del llm
    modes = () if args.tiles else (True,) if args.eager_only else (False, True)
    for eager in modes:
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
