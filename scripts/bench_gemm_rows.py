"""cuBLAS time of the 1B model's projections against the number of rows (tokens in the step):
each projection runs over 16 distinct weights (one per layer, so the weights are not
L2-resident, as in a real step) inside one CUDA graph, replayed. Prints per-call
microseconds, TFLOP/s and the weight-read rate, and `--json PATH` writes them.

    python scripts/bench_gemm_rows.py [--rows 32 1024 2048 2080 4096 16384] [--json PATH]
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

# (name, out features, in features) of Llama-3.2-1B's projections; the LM head runs once a step.
SHAPES = (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
          ("down", 2048, 8192), ("lm_head", 128256, 2048))
LAYERS = 16


def graph_us(fn, calls: int) -> float:
    """Median microseconds per call of fn (which makes `calls` calls), replayed as a graph."""
    return 1000 * do_bench_cudagraph(fn, rep=50, return_mode="median") / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+",
                    default=[16, 32, 64, 1024, 1056, 2048, 2080, 4096, 4128, 8192, 16384])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, n, k in SHAPES:
        layers = 1 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
        for m in args.rows:
            if name == "lm_head" and m > 128:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            outs = [torch.empty(m, n, device=dev, dtype=dt) for _ in range(layers)]

            def chain(x=x, weights=weights, outs=outs) -> None:
                for w, out in zip(weights, outs, strict=True):
                    torch.matmul(x, w.t(), out=out)

            us = graph_us(chain, layers)
            row = {"op": name, "m": m, "n": n, "k": k, "us": round(us, 2),
                   "tflops": round(2 * m * n * k / us / 1e6, 1),
                   "weight_tbs": round(n * k * 2 / us / 1e6, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
