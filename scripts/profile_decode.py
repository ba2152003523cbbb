"""Where a decode step's time goes: GPU time of the captured graph, host time per engine step,
and the per-kernel breakdown of the same step run eagerly. Llama-3.2-1B, dummy weights.

    python scripts/profile_decode.py [--batch 1 32 128] [--ctx 128] [--config KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from liteinfer import LLM, SamplingParams
from liteinfer.config import parse_overrides


def cuda_ms(fn, iters: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: ctx + 512 (the KV pool is sized from it)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine arguments, as in `liteinfer-bench run --set`")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    llm = LLM("llama-3.2-1b-instruct", load_format="dummy", max_num_seqs=max(args.batch),
              max_model_len=args.max_model_len or args.ctx + 512, **overrides)
    engine, runner = llm.engine, llm.engine.core.runner
    report = {}
    for bs in args.batch:
        for i in range(bs):
            engine.add_request(f"p{bs}-{i}", [(7 * i + j) % 1000 + 100 for j in range(args.ctx)],
                               SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        scheduler = engine.core.scheduler
        while any(s.num_output_tokens == 0 for s in scheduler.running) or scheduler.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 50
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
        row = {"batch": bs, "ctx": args.ctx, "kv_blocks": engine.core.block_manager.num_blocks,
               "engine_step_ms": step_ms}
        batch = engine.core.scheduler.schedule()  # reserves each row's next slot
        assert batch is not None and not batch.is_prefill and len(batch.seqs) == bs
        if runner.graphs is not None:
            size = next(s for s in runner.graphs.sizes if s >= bs)
            graph = runner.graphs.graphs[size][0]
            row["graph_replay_ms"] = cuda_ms(graph.replay)
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.graphs.run(batch)
            row["graph_run_host_ms"] = (time.perf_counter() - t0) * 1e3 / steps
        ids, pos, meta, *_ = runner.prepare(batch)
        with torch.inference_mode():
            def forward() -> torch.Tensor:
                return runner.model.compute_logits(runner.model(ids, pos, meta))

            row["eager_forward_ms"] = cuda_ms(forward, 20)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                forward()
                torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA":
                kernels[ev.key[:60]] = (round(ev.device_time_total / 1e3, 4), ev.count)
        row["kernels_ms_count"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25])
        report[bs] = row
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
               if k != "kernels_ms_count"})
        print("  ", list(row["kernels_ms_count"].items())[:8])
        for i in range(bs):
            engine.abort(f"p{bs}-{i}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"profile-{args.ctx}-{len(report)}.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
