"""Where a speculating engine's steps go: the grounded prompts of benchmarks/workloads/
(SmolLM2's token ids) run one at a time (or `--width` of them in flight) without speculation
and with prompt lookup, each run's decode steps counted by kind (plain or verifying, eager or which
graph) with the median host time of each phase, device time and interval between steps
(EngineCore.recording), the draft-length policy's state and the counters after the run (its
warm-up request included), and whether greedy output equals the output without speculation.
The counts of steps do not depend on the device, so the CPU gives them too; the times are the
device's own only on CUDA.

    python scripts/profile_spec_steps.py SmolLM2-135M-Instruct.Q4_1.gguf [--prompts 8]
        [--max-tokens 256] [--retry-intervals 8 1] [--num-speculative-tokens 4] [--width 1]
        [--kernels]

--retry-intervals: one speculating run per value of the policy's `retry_interval` (steps
after one in which the proposers found nothing before they are asked again). --kernels: each
run's first prompt again under torch's profiler, its device kernels by total time (CUDA only).
--width 8 or 32: that width's 2W prompts of the benchmark's workload submitted together, at
most W in flight (--prompts is then ignored).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from liteinfer import LLM, SamplingParams
from liteinfer.engine.instrumentation import StepRecord

PROMPTS = (Path(__file__).resolve().parent.parent / "benchmarks" / "workloads"
           / "grounded-tokens-smollm2.json")
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def summarize(steps: list[StepRecord]) -> None:
    """Decode steps by (mode, verifying): count, median ms of each phase, tokens per step."""
    groups: dict[tuple[str, bool], dict[str, list[float]]] = {}
    previous = None
    for r in steps:
        interval = None if previous is None or r.ready is None else (r.ready - previous) * 1e3
        previous = r.ready
        if r.prompt_tokens:
            continue
        g = groups.setdefault((r.mode, r.draft_tokens > 0), {
            "schedule": [], "launch": [], "update": [], "gpu": [], "gpu_idle": [],
            "interval": [], "tokens": []})
        g["schedule"].append(r.schedule_s * 1e3)
        g["launch"].append(r.launch_s * 1e3)
        for key, value in (("update", None if r.update_s is None else r.update_s * 1e3),
                           ("gpu", r.gpu_ms), ("gpu_idle", r.gpu_idle_ms),
                           ("interval", interval)):
            if value is not None:
                g[key].append(value)
        g["tokens"].append(r.output_tokens)
    for (mode, verifying), g in sorted(groups.items()):
        medians = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in g.items()
                            if v and k != "tokens")
        print(f"  {mode:12s} {'verifying' if verifying else 'plain':9s} "
              f"{len(g['tokens']):5d} steps, {statistics.mean(g['tokens']):.2f} tokens each; "
              f"median ms: {medians}")


def print_kernels(llm: LLM, prompt: list[int], params: SamplingParams) -> None:
    """One prompt's device kernels under torch's profiler, by total time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                    max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--retry-intervals", type=int, nargs="+", default=[8])
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--width", type=int, choices=(1, 8, 32), default=1)
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    prompts = json.loads(PROMPTS.read_text())[str(args.width)]
    if args.width == 1:
        prompts = prompts[:args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ngram = {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens}
    runs = [("off", None, None)] + [(f"ngram k={args.num_speculative_tokens}, retry every {n}",
                                     ngram, n) for n in args.retry_intervals]
    outputs: dict[str, list[list[int]]] = {}
    for name, spec, retry in runs:
        llm = LLM(args.model, max_model_len=4096, max_num_seqs=args.width if args.width > 1 else 32,
                  speculative_config=spec)
        core = llm.engine.core
        speculator = core.scheduler.speculator
        if speculator is not None:
            speculator.policy.retry_interval = retry
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        with core.recording() as steps:
            batches = [[p] for p in prompts] if args.width == 1 else [prompts]
            outputs[name] = [list(o.outputs[0].token_ids) for batch in batches
                             for o in llm.generate([{"prompt_token_ids": p} for p in batch],
                                                   params, use_tqdm=False)]
        wall = time.perf_counter() - start
        tokens = sum(map(len, outputs[name]))
        print(f"{name}: {tokens} tokens in {wall:.3f} s ({tokens / wall:.1f} tok/s), "
              f"{len(steps)} steps")
        summarize(steps)
        if args.kernels:
            print_kernels(llm, prompts[0], params)
        if speculator is not None:
            policy = speculator.policy
            overheads = {f"{1 << c - 1}-{(1 << c) - 1}": round(t.verify / t.plain, 2)
                         for c, t in sorted(policy.times.items()) if t.plain and t.verify}
            print(f"  policy: acceptance {policy.acceptance:.3f}, drafts found for "
                  f"{policy.hit_rate:.2f} of a verifying step's asked sequences, a verifying "
                  f"step in plain steps by sequences in flight {overheads}; {speculator.stats}")
            same = sum(a == b for a, b in zip(outputs["off"], outputs[name]))
            print(f"  greedy output equals the output without speculation: {same} of "
                  f"{len(prompts)} prompts")
        del llm


if __name__ == "__main__":
    main()
