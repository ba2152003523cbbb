"""Host time of one eager prefill step: how long the host takes to launch a step of SEQS prompts
of TOKENS tokens (no synchronization inside the loop, so a step costs its host time whenever
that exceeds its GPU time), then the Python functions that spend it (cProfile, by own time).
Llama-3.2-1B, dummy weights, the default engine configuration.

    python scripts/profile_host.py [--seqs 1] [--tokens 256] [--steps 20]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from liteinfer import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    llm = LLM("llama-3.2-1b-instruct", load_format="dummy", max_model_len=4096,
              max_num_batched_tokens=max(4096, args.seqs * args.tokens))
    engine, runner = llm.engine, llm.engine.runner
    for i in range(args.seqs):
        engine.add_request(str(i), [100 + (7 * i + j) % 900 for j in range(args.tokens)],
                           SamplingParams(max_tokens=1, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert batch is not None and sum(batch.num_tokens) == args.seqs * args.tokens
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            runner.execute(batch)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"per step: host {1e3 * host / args.steps:.2f} ms, "
              f"wall {1e3 * wall / args.steps:.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            runner.execute(batch)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
