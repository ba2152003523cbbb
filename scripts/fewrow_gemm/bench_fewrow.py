"""GPU benchmark (research, not engine code) of the transposed few-row GEMM in fewrow_gemm.py
(wgmma with the weight tile as the 64/128-row operand, split K with an in-launch reduction,
programmatic dependent launch) against cuBLAS (torch.matmul) at Llama-3.2-1B's projections,
bf16, for 1..64 rows.

Per op and row count: correctness of every candidate tile config against an fp32 torch
reference (twice, so the split-K workspace must be reset by the kernel), then a chain of 16
distinct weights (the LM head: one) in one CUDA graph, replayed (triton's do_bench_cudagraph,
median), for cuBLAS and for each config; the chain's outputs are checked again after timing
(races under PDL would show there). Then per row count the decode step's projections of 16
layers (qkv, o, gate_up, down back to back in one graph): cuBLAS, the best config per op, the
same without PDL, and a mix taking, per op, whichever of the two was faster alone.

    PYTHONPATH=$PWD python scripts/fewrow_gemm/bench_fewrow.py --json $OUT/fewrow.json

Options: --rows 1 8 16 28 32 64, --ops qkv o ..., --max-configs N, --rep MS, --procs N
(processes compiling the configs in parallel first; 0 compiles serially on first use).
Prints JSON lines; --json writes everything with meta.

--dry-run: the same flow on the CPU under TRITON_INTERPRET=1 (set it), with every op cut to
N = 256 output features (K and the tile configs as on the GPU), 2 layers, wall-clock "timings"
of one eager call: a check of the script's logic and of every config's correctness, nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import triton  # noqa: E402

from fewrow_gemm import FewRowTiles, block_m_for, fewrow_linear_tiles  # noqa: E402

# name: (out features N, in features K)
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}
STEP_OPS = ("qkv", "o", "gate_up", "down")
ROWS = (1, 8, 16, 28, 32, 64)
LAYERS = 16
DTYPE = torch.bfloat16
SMEM_LIMIT = 227 * 1024
TOL = 1e-2  # max |y - ref| / max |ref|; bf16 output rounding alone is <= 2^-9 of |y|


def smem_estimate(t: FewRowTiles, rows: int, k: int) -> int:
    """Shared memory the compiler allocates, roughly (compile_sm90.py reports the real one)."""
    bm, e = block_m_for(rows), 2
    cps = k // (t.splits * t.block_k)
    pre_w = t.pre * t.block_k * t.block_n * e
    pre_x = t.pre * t.block_k * bm * e
    loop = t.num_stages * t.block_k * (t.block_n + bm) * e if cps > t.pre else 0
    if t.pre and t.pre_last and cps > t.pre:
        return pre_w + max(loop, pre_x)
    return pre_w + pre_x + loop


def candidate_tiles(op: str, rows: int, sms: int = 132) -> list[FewRowTiles]:
    """A handful of configs per op (grid sizes chosen for 132 SMs). One-shot configs load the
    program's whole K range in one TMA before griddepcontrol.wait (no loop); loop configs load
    `pre` chunks before the wait and stream the rest through a TMA pipeline. Appended: the first
    config with the ordered split-K reduction (split ops), and with pointer loads instead of TMA
    (register-staged before the wait: ptxas interleaves the loads with the shared stores)."""
    T = FewRowTiles
    if op == "o":  # 2048 x 2048: 8 MiB, ~62 KiB an SM
        c = [T(128, 256, 8, pre=1, num_stages=1, num_warps=8, tma=True),   # 128 progs x 64 KiB
             T(128, 128, 16, pre=1, num_stages=1, num_warps=8, tma=True),  # 256 x 32 KiB
             T(64, 256, 8, pre=1, num_stages=1, num_warps=4, tma=True),    # 256 x 32 KiB, 1 wg
             T(128, 64, 8, pre=2, num_stages=2, num_warps=8, tma=True, pre_last=True)]
    elif op == "qkv":  # 3072 x 2048: 12 MiB, ~93 KiB an SM
        c = [T(128, 256, 8, pre=1, num_stages=1, num_warps=8, tma=True),   # 192 x 64 KiB
             T(128, 128, 16, pre=1, num_stages=1, num_warps=8, tma=True),  # 384 x 32 KiB
             T(128, 512, 4, pre=1, num_stages=1, num_warps=8, tma=True),   # 96 x 128 KiB
             T(128, 64, 8, pre=2, num_stages=2, num_warps=8, tma=True, pre_last=True)]
    elif op == "down":  # 2048 x 8192: 32 MiB, ~250 KiB an SM
        c = [T(128, 64, 8, pre=4, num_stages=3, num_warps=8, tma=True, pre_last=True),  # 128
             T(128, 64, 16, pre=4, num_stages=2, num_warps=8, tma=True, pre_last=True),  # 256
             T(64, 128, 8, pre=2, num_stages=3, num_warps=4, tma=True, pre_last=True),   # 256
             T(128, 64, 8, pre=0, num_stages=4, num_warps=8, tma=True),                  # 128
             T(128, 128, 8, pre=0, num_stages=3, num_warps=8, tma=True)]                 # 128
    elif op == "gate_up":  # 16384 x 2048: 64 MiB, ~500 KiB an SM
        c = [T(128, 64, 1, pre=4, num_stages=3, num_warps=8, tma=True, pre_last=True),  # 128
             T(128, 64, 2, pre=4, num_stages=2, num_warps=8, tma=True, pre_last=True),  # 256
             T(64, 128, 1, pre=2, num_stages=3, num_warps=4, tma=True, pre_last=True),  # 256
             T(128, 64, 1, pre=0, num_stages=4, num_warps=8, tma=True),                 # 128
             T(128, 128, 1, pre=0, num_stages=3, num_warps=8, tma=True)]                # 128
    elif op == "lm_head":  # 128256 x 2048: 1002 tiles of 128
        c = [T(128, 64, 1, pre=0, num_stages=4, num_warps=8, tma=True),
             T(128, 64, 1, pre=4, num_stages=3, num_warps=8, tma=True, pre_last=True),
             T(256, 64, 1, pre=0, num_stages=3, num_warps=8, tma=True),
             T(64, 128, 1, pre=0, num_stages=4, num_warps=4, tma=True),
             T(128, 128, 1, pre=0, num_stages=3, num_warps=8, tma=True)]
    else:
        raise KeyError(op)
    if op in ("qkv", "o", "down"):  # deterministic split-order reduction of the first config
        c.append(replace(c[0], reduce="ordered"))
    c.append(replace(c[0], tma=False))
    k = SHAPES[op][1]
    return [t for t in c if smem_estimate(t, rows, k) <= SMEM_LIMIT]


def meta() -> dict:
    m = {"torch": torch.__version__, "triton": triton.__version__,
         "cuda": torch.version.cuda, "argv": sys.argv,
         "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=torch.cuda.get_device_name(), sms=p.multi_processor_count,
                 capability=list(torch.cuda.get_device_capability()))
    try:
        import subprocess
        m["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True, cwd=HERE).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return m


# ---------------------------------------------------------------- parallel precompile
def _precompile_worker(jobs: list[tuple[str, int, dict, bool]]) -> list[tuple[str, float]]:
    """Compile (and run once) each (op, rows, tiles, pdl) in this process, filling triton's
    on-disk cache for the main process. Returns (job, error or '') with the seconds taken."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda")
    wcache, res = {}, []
    for op, rows, tiles, pdl in jobs:
        n, k = SHAPES[op]
        t0 = time.perf_counter()
        try:
            if (n, k) not in wcache:
                wcache[(n, k)] = torch.zeros(n, k, dtype=DTYPE, device=dev)
            x = torch.zeros(rows, k, dtype=DTYPE, device=dev)
            fewrow_linear_tiles(x, wcache[(n, k)], tiles=FewRowTiles(**tiles), pdl=pdl)
            torch.cuda.synchronize()
            err = ""
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e)[:200]}"
        res.append((f"{op} rows={rows} {FewRowTiles(**tiles).name()} pdl={pdl}", err,
                    time.perf_counter() - t0))
    return res


def precompile(jobs: list[tuple[str, int, dict, bool]], procs: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.perf_counter()
    shards = [jobs[i::procs] for i in range(procs)]
    try:
        with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
            results = [r for rs in ex.map(_precompile_worker, shards) for r in rs]
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"precompile": "failed, compiling on first use",
                          "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    errors = [(j, e) for j, e, _ in results if e]
    print(json.dumps({"precompile": len(jobs), "procs": procs,
                      "s": round(time.perf_counter() - t0, 1), "errors": len(errors)}),
          flush=True)
    for j, e in errors:
        print(json.dumps({"precompile_error": j, "error": e}), flush=True)


# ---------------------------------------------------------------- benchmark
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|; NaN (never < TOL) if y has any NaN."""
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


class Bench:
    def __init__(self, rep: int, dry: bool = False):
        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.rep = rep
        gen = torch.Generator(device=self.dev).manual_seed(0)
        self.weights = {
            op: [torch.randn(n, k, device=self.dev, dtype=DTYPE, generator=gen) * k ** -0.5
                 for _ in range(1 if op == "lm_head" else LAYERS)]
            for op, (n, k) in SHAPES.items()}
        self.gen = gen
        self.x, self.out, self.refs = {}, {}, {}

    def set_rows(self, rows: int) -> None:
        self.x = {op: torch.randn(rows, k, device=self.dev, dtype=DTYPE, generator=self.gen)
                  for op, (_, k) in SHAPES.items()}
        self.out = {op: [torch.empty(rows, n, device=self.dev, dtype=DTYPE)
                         for _ in self.weights[op]] for op, (n, _) in SHAPES.items()}
        self.refs = {}

    def ref(self, op: str, i: int) -> torch.Tensor:
        if (op, i) not in self.refs:
            self.refs[(op, i)] = self.x[op].float() @ self.weights[op][i].float().t()
        return self.refs[(op, i)]

    def call(self, op: str, i: int, how) -> None:
        x, w, out = self.x[op], self.weights[op][i], self.out[op][i]
        if how is None:
            torch.matmul(x, w.t(), out=out)
        else:
            tiles, pdl = how
            fewrow_linear_tiles(x, w, out, tiles=tiles, pdl=pdl)

    def chain(self, calls: list[tuple[str, int]], plan: dict):
        """plan: op -> None (cuBLAS) or (tiles, pdl)."""
        def run() -> None:
            for op, i in calls:
                self.call(op, i, plan[op])
        return run

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def us(self, fn, calls: int) -> float:
        if self.dry:  # one eager call, wall clock: logic check only
            t0 = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t0) / calls
        from triton.testing import do_bench_cudagraph
        return 1000 * do_bench_cudagraph(fn, rep=self.rep, return_mode="median") / calls

    def check(self, op: str, tiles: FewRowTiles, pdl: bool) -> float:
        """Two calls with different inputs (the second needs the workspace reset by the
        first); returns the larger relative error."""
        w = self.weights[op][0]
        errs = []
        for x in (self.x[op], torch.randn_like(self.x[op])):
            ref = x.float() @ w.float().t()
            y = fewrow_linear_tiles(x, w, tiles=tiles, pdl=pdl)
            self.sync()
            errs.append(rel_err(y, ref))
        return max(errs)

    def poison(self, ops) -> None:
        """NaN the chain's outputs, so a kernel that writes nothing fails the after-check."""
        for op in ops:
            for o in self.out[op]:
                o.fill_(float("nan"))

    def check_chain_outputs(self, calls: list[tuple[str, int]]) -> float:
        """Relative error of the outputs the last replay left (first and last layer per op)."""
        err = 0.0
        for op in dict.fromkeys(o for o, _ in calls):
            for i in {0, len(self.weights[op]) - 1}:
                err = max(err, rel_err(self.out[op][i], self.ref(op, i)))
        return err


def emit(row: dict, rows_out: list) -> None:
    rows_out.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)


def bench_rows(b: Bench, rows: int, ops: list[str], max_configs: int, out: list) -> None:
    b.set_rows(rows)
    best: dict[str, tuple[float, FewRowTiles]] = {}
    cublas: dict[str, float] = {}
    for op in ops:
        n, k = SHAPES[op]
        calls = [(op, i) for i in range(len(b.weights[op]))]
        nbytes = n * k * DTYPE.itemsize
        b.poison([op])
        cublas[op] = b.us(b.chain(calls, {op: None}), len(calls))
        cublas_err = b.check_chain_outputs(calls)
        row = {"op": op, "rows": rows, "n": n, "k": k, "cublas_us": round(cublas[op], 2),
               "cublas_tbs": round(nbytes / cublas[op] / 1e6, 2),
               "cublas_err": round(cublas_err, 5), "sweep": []}
        for t in candidate_tiles(op, rows)[:max_configs]:
            entry = {"tiles": t.name(), "cfg": asdict(t), "programs": (n // t.block_n) * t.splits}
            try:
                entry["err"] = round(b.check(op, t, True), 5)
                if not entry["err"] < TOL:
                    raise AssertionError(f"wrong result, rel err {entry['err']:.3g}")
                b.poison([op])
                us = b.us(b.chain(calls, {op: (t, True)}), len(calls))
                entry["after_err"] = round(b.check_chain_outputs(calls), 5)
                if not entry["after_err"] < TOL:
                    raise AssertionError(f"wrong after graph replay, {entry['after_err']:.3g}")
                entry.update(us=round(us, 2), tbs=round(nbytes / us / 1e6, 2),
                             vs_cublas=round(cublas[op] / us, 3))
                if op not in best or us < best[op][0]:
                    best[op] = (us, t)
            except Exception as e:  # noqa: BLE001  (compile failure, out of resources, wrong)
                entry["error"] = f"{type(e).__name__}: {str(e)[:240]}"
            row["sweep"].append(entry)
            print(json.dumps({"op": op, "rows": rows, **{k: v for k, v in entry.items()
                                                          if k != "cfg"}}), flush=True)
        if op in best:
            us, t = best[op]
            row.update(best_us=round(us, 2), best_tiles=t.name(), best_cfg=asdict(t),
                       best_tbs=round(nbytes / us / 1e6, 2),
                       speedup=round(cublas[op] / us, 3))
        emit(row, out)

    step_ops = [op for op in STEP_OPS if op in ops]
    if not step_ops:
        return
    calls = [(op, i) for i in range(LAYERS) for op in step_ops]
    step_bytes = sum(SHAPES[op][0] * SHAPES[op][1] * DTYPE.itemsize for op, _ in calls)
    layers = {"op": "layers", "rows": rows, "ops": step_ops, "layers": LAYERS,
              "cublas_us": round(b.us(b.chain(calls, {op: None for op in step_ops}), 1), 1)}
    if all(op in best for op in step_ops):
        plans = {
            "fewrow": {op: (best[op][1], True) for op in step_ops},
            "fewrow_nopdl": {op: (best[op][1], False) for op in step_ops},
            "mixed": {op: (best[op][1], True) if best[op][0] < cublas[op] else None
                      for op in step_ops},
        }
        layers["mixed_choice"] = {op: "fewrow" if plans["mixed"][op] else "cublas"
                                  for op in step_ops}
        layers["tiles"] = {op: best[op][1].name() for op in step_ops}
        for name, plan in plans.items():
            try:
                if name == "fewrow_nopdl":
                    for op in step_ops:  # compile + workspace outside the capture
                        b.check(op, best[op][1], False)
                b.poison(step_ops)
                us = b.us(b.chain(calls, plan), 1)
                err = b.check_chain_outputs(calls)
                layers[f"{name}_us"] = round(us, 1)
                layers[f"{name}_err"] = round(err, 5)
                if not err < TOL:
                    layers[f"{name}_error"] = "wrong after graph replay"
            except Exception as e:  # noqa: BLE001
                layers[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:240]}"
        if "fewrow_us" in layers:
            layers["speedup"] = round(layers["cublas_us"] / layers["fewrow_us"], 3)
            layers["fewrow_tbs"] = round(step_bytes / layers["fewrow_us"] / 1e6, 2)
    layers["cublas_tbs"] = round(step_bytes / layers["cublas_us"] / 1e6, 2)
    emit(layers, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--ops", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--max-configs", type=int, default=8)
    ap.add_argument("--rep", type=int, default=25, help="ms of graph replay per timing")
    ap.add_argument("--procs", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter logic check")
    args = ap.parse_args()
    global LAYERS
    if args.dry_run:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1"
        import fewrow_gemm
        fewrow_gemm.patch_interpreter_bf16_dot()
        for op, (n, k) in SHAPES.items():
            SHAPES[op] = (256, k)
        LAYERS = 2
        args.procs = 0
    t_start = time.perf_counter()
    info = meta()
    print(json.dumps({"meta": info}), flush=True)
    assert args.dry_run or torch.cuda.is_available(), "needs a CUDA GPU (sm_90)"

    if args.procs > 0:
        jobs = []
        for rows in sorted({block_m_for(r) for r in args.rows}):
            # one representative row count per BLOCK_M (M itself is not specialized)
            r = max(x for x in args.rows if block_m_for(x) == rows)
            for op in args.ops:
                cands = candidate_tiles(op, r)[:args.max_configs]
                jobs += [(op, r, asdict(t), True) for t in cands]
                if op in STEP_OPS:  # the no-PDL step may use any of them as the best
                    jobs += [(op, r, asdict(t), False) for t in cands]
        precompile(jobs, args.procs)

    b = Bench(args.rep, args.dry_run)
    out: list[dict] = []
    for rows in args.rows:
        bench_rows(b, rows, args.ops, args.max_configs, out)
        print(json.dumps({"elapsed_s": round(time.perf_counter() - t_start, 1)}), flush=True)
    info["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": info, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
