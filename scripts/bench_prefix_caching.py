"""The default configuration with prefix caching off, then on, on one machine in one process:
the five shapes where its default costs most if it costs anything (prompt-heavy W=32 shapes,
whose prompts fill and hash the most blocks, and W=128 128/256). Rows go to the results
store with the setting in their engine args; the harness empties the cache before each run.

    python3 scripts/bench_prefix_caching.py [--out benchmarks/results/]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from liteinfer.bench import cli, registry
from liteinfer.bench.store import environment, now_iso, results_file
from liteinfer.bench.workloads import MIXED, Shape

MODEL = "benchmarks/models/llama-3.2-1b-instruct"
RUNS = [(Shape(1024, 256), 32), (Shape(2048, 128), 32), (Shape(MIXED, 16), 32),
        (Shape(MIXED, 128), 32), (Shape(128, 256), 128)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", type=Path, default=None, help="a .jsonl file or a directory")
    args = ap.parse_args()
    config = registry.get(registry.DEFAULT)
    runs = [config.run("throughput", shape, width) for shape, width in RUNS]
    for enabled in (False, True):
        print(f"enable_prefix_caching={enabled}", flush=True)
        cli._measure_group(config, runs, args.model, {"enable_prefix_caching": enabled},
                           results_file(args.out, environment()["gpu"], now_iso()))


if __name__ == "__main__":
    main()
