"""Where a prefill step's time goes: wall time of one packed prefill step, its host time when
steps are launched back to back (no synchronization between them, so a step whose host time
exceeds its GPU time is host-bound), and its per-kernel GPU time by category (matmuls,
attention, norms, RoPE + KV write, SiLU, other), with the matmuls' achieved TFLOP/s, and its
kernel timeline's span, busy time and idle gaps (`--gaps N` prints the N kernel pairs with the
most idle time between them). `--cprofile N` also prints the N Python functions that spend
the host time (cProfile, own time). With `--decodes N`, N sequences of `--ctx` tokens decode
beside the prompts (a mixed step; its prompt tokens trimmed as the scheduler trims them).
Dummy weights (Llama-3.2-1B unless `--model`), the default engine configuration.

    python scripts/profile_prefill.py [--model NAME] [--shape 1x15360 8x2048] [--decodes N --ctx C]
                                      [--cprofile N] [--gaps N] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import pstats
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from liteinfer import LLM, SamplingParams
from liteinfer.config import parse_overrides

# Attention first: SDPA's kernels (flash, cuDNN, cutlass fmha) would otherwise count as matmuls.
CATEGORIES = (("attention", ("_prefill_kernel", "flash", "fmha", "sdpa", "attention")),
              ("rope+kv", ("rope", "store_kv")),
              ("norm", ("rms_norm",)), ("silu", ("silu",)),
              ("matmul", ("gemm", "nvjet", "sm90", "cutlass", "cublas")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """GPU milliseconds per call (CUDA events around `iters` calls, after one warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def host_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Host milliseconds per call, calls launched back to back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    ms = (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    return ms


def timeline(prof: profile, top: int) -> dict:
    """Span of the profiled kernels, their busy time and the idle time between them (ms); prints
    the `top` kernel pairs with the most idle time between them."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    idle: Counter[tuple[str, str]] = Counter()
    for a, b in itertools.pairwise(kernels):
        idle[(a.name[:40], b.name[:40])] += max(0, b.time_range.start - a.time_range.end)
    for (a, b), us in idle.most_common(top):
        print(f"  {us:7.1f} us idle between {a} -> {b}")
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round(sum(idle.values()) / 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b-instruct")
    ap.add_argument("--shape", nargs="+", default=["1x15360", "8x2048"],
                    help="SEQSxTOKENS prefilled in one step")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N functions with the most host time per shape")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="print the N kernel pairs with the most idle time between them")
    ap.add_argument("--decodes", type=int, default=0, help="sequences decoding beside them")
    ap.add_argument("--ctx", type=int, default=1024, help="context of the decoding sequences")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine arguments, as in `liteinfer-bench run --set`")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shape]
    budget = max(n * length for n, length in shapes) + args.decodes
    llm = LLM(args.model, load_format="dummy", max_model_len=16384,
              max_num_batched_tokens=budget, **parse_overrides(args.set))
    engine, runner, cfg = llm.engine, llm.engine.core.runner, llm.engine.model_config
    # Matmul FLOPs per prompt token (q/k/v/o, gate/up/down); the LM head runs on last tokens.
    per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * (
        (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        + cfg.num_attention_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    for i in range(args.decodes):
        engine.add_request(f"decode-{i}", [(3 * i + j) % 1000 + 100 for j in range(args.ctx)],
                           SamplingParams(max_tokens=10_000, ignore_eos=True))
    while engine.core.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.core.scheduler.running):
        engine.step()
    report = {}
    for nseq, length in shapes:
        for i in range(nseq):
            engine.add_request(f"{nseq}x{length}-{i}", [(7 * i + j) % 1000 + 100
                                                        for j in range(length)],
                               SamplingParams(max_tokens=1, ignore_eos=True))
        batch = engine.core.scheduler.schedule()
        assert batch is not None and batch.is_prefill and batch.num_decodes == args.decodes
        prompt_tokens = sum(batch.num_tokens) - batch.num_decodes
        staged = runner.stage(batch.output)  # applied once, launched as often as measured
        with torch.inference_mode():
            step_ms = cuda_ms(lambda s=staged: runner.execute(s), 5)
            launch_ms = host_ms(lambda s=staged: runner.execute(s))
            if args.cprofile:
                prof_host = cProfile.Profile()
                prof_host.runcall(host_ms, lambda s=staged: runner.execute(s))
                pstats.Stats(prof_host).sort_stats("tottime").print_stats(args.cprofile)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.execute(staged)
                torch.cuda.synchronize()
        by_cat: dict[str, float] = {}
        attention_kernels: set[str] = set()  # which implementation ran (SDPA picks its own)
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA":
                c = category(ev.key)
                by_cat[c] = by_cat.get(c, 0.0) + ev.device_time_total / 1e3
                if c == "attention":
                    attention_kernels.add(ev.key[:80])
        matmul_tflop = per_token * (prompt_tokens + batch.num_decodes) / 1e12
        attn_tflop = 4 * nseq * length * (length + 1) / 2 * cfg.num_attention_heads \
            * cfg.head_dim * cfg.num_hidden_layers / 1e12
        row = {"seqs": nseq, "tokens": length, "prompt_tokens": prompt_tokens,
               "decodes": batch.num_decodes, "step_ms": round(step_ms, 2),
               "host_ms": round(launch_ms, 2),
               "kernel_ms": {c: round(t, 2) for c, t in sorted(by_cat.items(),
                                                               key=lambda kv: -kv[1])},
               "matmul_tflops": round(matmul_tflop / by_cat.get("matmul", float("nan")) * 1e3),
               "attention_tflops": round(attn_tflop / by_cat.get("attention", float("nan")) * 1e3),
               "attention_kernels": sorted(attention_kernels), **timeline(prof, args.gaps)}
        report[f"{nseq}x{length}"] = row
        print(row, flush=True)
        for i in range(nseq):
            engine.abort(f"{nseq}x{length}-{i}")
    if os.environ.get("OUT"):
        name = f"profile-prefill-{args.model}-d{args.decodes}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
