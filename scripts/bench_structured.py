"""Structured outputs' cost on the GPU: Llama-3.2-1B-Instruct (dummy weights, the Llama-3
tokenizer of benchmarks/models/), 128-token prompts, 256 output tokens, 32 in flight, greedy.
Run A: every request unconstrained. Run B: every other request held to a simple JSON schema.
Each half's tok/s (its tokens over the time until its last request finished) is compared
with the same half of run A; targets: unconstrained -5% at most, constrained -20% at most.
Each half's mean inter-token latency is recorded too: a constrained output that reaches its
grammar's end stops early, which tok/s alone would not show. A and B alternate --repeats times
(each run is well under a second); the losses are those of the medians.

    python scripts/bench_structured.py [--requests 64] [--repeats 3] [--out $OUT] [--profile]

--profile also splits each run's engine steps into the host time of their phases (schedule,
launch, update: EngineCore.recording) and lists the costliest host functions (cProfile), the waits
for the device and for the grammar process's bitmasks among them.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import statistics
import time
from pathlib import Path

from liteinfer import LLM, SamplingParams
from liteinfer.sampling_params import RequestOutputKind
from liteinfer.structured_output import StructuredOutputsParams

MODEL_DIR = Path(__file__).resolve().parent.parent / "benchmarks/models/llama-3.2-1b-instruct"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "score": {"type": "integer"}},
          "required": ["answer", "score"]}
ISL, OSL, WIDTH = 128, 256, 32


def run(llm: LLM, prompts: list[list[int]], constrain_odd: bool) -> dict[str, float]:
    """Runs every prompt (at most WIDTH in flight), the odd ones held to SCHEMA if
    `constrain_odd`; each half's tok/s: its tokens over the time until its last one ended."""
    engine = llm.engine
    # Outputs of new tokens only, as the benchmark driver takes them (no per-token copies), and
    # token ids, as WORKLOADS.md measures: served, the front end detokenizes, not the core.
    free = SamplingParams(temperature=0.0, max_tokens=OSL, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)
    held = dataclasses.replace(free, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine.reset_prefix_cache()  # every run computes its prompts (the runs share them)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, held if constrain_odd and i % 2 else free)
    tokens = {"even": 0, "odd": 0}
    last = dict.fromkeys(tokens, start)
    itl: dict[str, list[float]] = {"even": [], "odd": []}
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    stops = 0
    # The longest wait for one step, and how many took over 10 ms: a stall shows here, not in
    # the mean inter-token latency.
    gaps: list[float] = []
    before = time.perf_counter()
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        gaps.append(now - before)
        before = now
        for out in step_outputs:
            rid = out.request_id
            first.setdefault(rid, now)
            count[rid] = count.get(rid, 0) + len(out.outputs[0].token_ids)
            if out.finished:
                half = "odd" if int(rid[1:]) % 2 else "even"
                n = count[rid]
                tokens[half] += n
                last[half] = now
                if n > 1:
                    itl[half].append((now - first[rid]) / (n - 1) * 1e3)
                stops += out.outputs[0].finish_reason == "stop"
    return {**{f"tok_s_{h}": tokens[h] / (last[h] - start) for h in tokens},
            **{f"itl_ms_{h}": sum(v) / len(v) for h, v in itl.items() if v},
            **{f"tokens_{h}": tokens[h] for h in tokens},
            "grammar_stops": stops, "seconds": max(last.values()) - start,
            "max_step_ms": max(gaps) * 1e3, "steps_over_10ms": sum(g > 0.01 for g in gaps)}


def split_steps(llm: LLM, prompts: list[list[int]], constrain_odd: bool) -> dict[str, float]:
    """`run` twice with the engine's steps recorded (EngineCore.recording): each phase's host
    time per step; the second run under cProfile too, whose cumulative list has the waits for
    the device (SampledTokens.result) and for bitmasks (grammar_bitmask)."""
    with llm.engine.core.recording() as steps:
        run(llm, prompts, constrain_odd)
        profiler = cProfile.Profile()
        profiler.enable()
        run(llm, prompts, constrain_odd)
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    print(text.getvalue())
    done = [s for s in steps if s.ready is not None]
    runs = 2
    return {"steps": len(steps) / runs,
            **{f"{phase}_ms_per_step": sum(getattr(s, f"{phase}_s") for s in done) / len(done)
               * 1e3 for phase in ("schedule", "launch", "update")}}


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(str(MODEL_DIR), load_format="dummy", dtype="bfloat16", max_num_seqs=WIDTH)
    rng = random.Random(0)
    vocab = 128000  # the Llama-3 vocabulary's ordinary tokens
    prompts = [[rng.randrange(vocab) for _ in range(ISL)] for _ in range(args.requests)]
    # Warm-up: graphs and kernels of every step shape both runs meet, the tokenizer info, the
    # grammar.
    run(llm, prompts, True)
    run(llm, prompts, False)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for constrain_odd in (False, True):
            runs[constrain_odd].append(run(llm, prompts, constrain_odd))
    base, mixed = (median_run(runs[False]), median_run(runs[True]))
    result = {
        "model": "llama-3.2-1b-instruct (dummy)", "isl": ISL, "osl": OSL, "width": WIDTH,
        "requests": args.requests, "schema": SCHEMA, "repeats": args.repeats,
        "all_unconstrained": base, "odd_constrained": mixed,
        "runs_all_unconstrained": runs[False], "runs_odd_constrained": runs[True],
        "unconstrained_loss": 1 - mixed["tok_s_even"] / base["tok_s_even"],
        "constrained_loss": 1 - mixed["tok_s_odd"] / base["tok_s_odd"],
        "constrained_itl_increase": mixed["itl_ms_odd"] / base["itl_ms_odd"] - 1,
        "targets": {"unconstrained_loss": 0.05, "constrained_loss": 0.20},
    }
    if args.profile:
        result["steps_unconstrained"] = split_steps(llm, prompts, False)
        result["steps_odd_constrained"] = split_steps(llm, prompts, True)
    out = Path(args.out) / "structured-outputs.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
