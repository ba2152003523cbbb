"""GPU benchmark of the few-row GEMM (liteinfer/kernels/skinny_gemm.py) against cuBLAS
(torch.mm) at the 1B Llama model's projections, bf16, for decode steps of 8..64 rows. Each op
is timed as one CUDA graph of a chain over 16 distinct weights (one per layer, so that they are
not L2-resident; the LM head has one), replayed: microseconds per call and the weight-read rate.
`layers` is what a decode step's projections cost: 16 layers of qkv, o, gate/up and down and
the LM head in one graph (microseconds per step). `--sweep` also times other tiles per op and
row count, reports the best, and adds a `layers` row with the best tiles of each op.
Prints JSON lines; `--json PATH` writes them all, with every sweep timing. About a minute;
with `--sweep` (about 110 more kernel compiles) under three.

    python scripts/bench_skinny_gemm.py [--rows 8 16 32 64] [--sweep] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable

import torch
from triton.runtime.errors import OutOfResources

from liteinfer.kernels.skinny_gemm import SkinnyTiles, skinny_gemm, skinny_tiles

# name: (out features, in features)
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}
LAYERS = 16
DTYPE, DEV = torch.bfloat16, torch.device("cuda")
STEP = [(name, i) for i in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")] \
    + [("lm_head", 0)]


def sweep_tiles(m: int, n: int, k: int) -> list[SkinnyTiles]:
    """The rule's tiles with one or two choices overridden (the rule fills in the rest)."""
    base = skinny_tiles(m, n, k, DTYPE, DEV)
    overrides = ([{"block_n": b} for b in (16, 32, 64, 128)]
                 + [{"splits": s} for s in (1, 2, 4, 8, 16)]
                 + [{"block_k": base.block_k * 2}, {"block_k": base.block_k // 2},
                    {"num_warps": 8}, {"num_stages": 1}])
    found = []
    for o in overrides:
        tiles = skinny_tiles(m, n, k, DTYPE, DEV, **o)
        if tiles.block_k >= 16 and tiles != base and tiles not in found:
            found.append(tiles)
    return found


def graph_us(fn: Callable[[], None], calls: int, iters: int = 10, rounds: int = 5) -> float:
    """Median microseconds per call of fn (calls launches) replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles, and allocates the split-K workspaces, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters / calls)
    return statistics.median(times)


class Bench:
    """Weights (16 per op, one LM head), inputs and outputs of one row count."""

    def __init__(self, weights: dict[str, list[torch.Tensor]], m: int):
        self.weights = weights
        self.x = {name: torch.randn(m, k, dtype=DTYPE, device=DEV)
                  for name, (_, k) in SHAPES.items()}
        self.out = {name: [torch.empty(m, n, dtype=DTYPE, device=DEV) for _ in weights[name]]
                    for name, (n, _) in SHAPES.items()}

    def chain(self, calls: list[tuple[str, int]],
              tiles: dict[str, SkinnyTiles] | None) -> Callable[[], None]:
        """cuBLAS over calls (name, layer) when tiles is None, else skinny_gemm with tiles."""
        def run() -> None:
            for name, i in calls:
                x, w, out = self.x[name], self.weights[name][i], self.out[name][i]
                if tiles is None:
                    torch.mm(x, w.t(), out=out)
                else:
                    skinny_gemm(x, w, out=out, tiles=tiles[name])
        return run

    def check(self, name: str, tiles: SkinnyTiles) -> None:
        x, w = self.x[name], self.weights[name][0]
        ref = torch.mm(x, w.t()).float()
        err = ((skinny_gemm(x, w, tiles=tiles).float() - ref).abs().max()
               / ref.abs().max()).item()
        if not err < 2e-2:
            raise AssertionError(f"{name} {tiles}: skinny_gemm disagrees with cuBLAS ({err:.3g})")


def bench_rows(weights: dict[str, list[torch.Tensor]], m: int, sweep: bool) -> list[dict]:
    bench, rows, best = Bench(weights, m), [], {}
    for name, (n, k) in SHAPES.items():
        calls = [(name, i) for i in range(len(weights[name]))]
        nbytes = n * k * DTYPE.itemsize
        tiles = skinny_tiles(m, n, k, DTYPE, DEV)
        bench.check(name, tiles)
        cublas = graph_us(bench.chain(calls, None), len(calls))
        mine = graph_us(bench.chain(calls, {name: tiles}), len(calls))
        row = {"op": name, "m": m, "cublas_us": cublas, "skinny_us": mine,
               "cublas_tbs": nbytes / cublas / 1e6, "weight_tbs": nbytes / mine / 1e6,
               "tiles": dataclasses.asdict(tiles)}
        best[name] = (mine, tiles)
        if sweep:
            row["sweep"] = []
            for cand in sweep_tiles(m, n, k):
                try:
                    bench.check(name, cand)
                    us = graph_us(bench.chain(calls, {name: cand}), len(calls))
                except OutOfResources as e:  # shared memory or registers: reported, skipped
                    row["sweep"].append({"tiles": dataclasses.asdict(cand), "error": str(e)})
                    continue
                row["sweep"].append({"tiles": dataclasses.asdict(cand), "us": us})
                best[name] = min(best[name], (us, cand), key=lambda b: b[0])
            row["best"] = {"us": best[name][0], "tbs": nbytes / best[name][0] / 1e6,
                           "tiles": dataclasses.asdict(best[name][1])}
        rows.append(row)
    step_bytes = sum(SHAPES[name][0] * SHAPES[name][1] * DTYPE.itemsize for name, _ in STEP)
    default = {name: skinny_tiles(m, n, k, DTYPE, DEV) for name, (n, k) in SHAPES.items()}
    layers = {"op": "layers", "m": m, "cublas_us": graph_us(bench.chain(STEP, None), 1),
              "skinny_us": graph_us(bench.chain(STEP, default), 1)}
    layers["weight_tbs"] = step_bytes / layers["skinny_us"] / 1e6
    if sweep:
        layers["skinny_best_us"] = graph_us(
            bench.chain(STEP, {name: b[1] for name, b in best.items()}), 1)
    rows.append(layers)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, dtype=DTYPE, device=DEV) * k ** -0.5
                      for _ in range(1 if name == "lm_head" else LAYERS)]
               for name, (n, k) in SHAPES.items()}
    rows = []
    for m in args.rows:
        for row in bench_rows(weights, m, args.sweep):
            rows.append(row)
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v
                              for key, v in row.items() if key != "sweep"}), flush=True)
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
