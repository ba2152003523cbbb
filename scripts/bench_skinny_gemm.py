"""Tile sweep for liteinfer.kernels.skinny_gemm against cuBLAS at the Llama-3.2-1B decode shapes
(bf16, M = 1..64 token rows), plus its fused prologues/epilogues against the kernel sequences
they replace.

Every time is one op's share of a CUDA graph that replays it back to back (>= 20 launches, as
in the engine's decode graph), median over replays. Small weights rotate over enough copies
(> 256 MB) that L2 (50 MB) never holds the one being read. Each config's output is checked
against cuBLAS before it is timed. Kernels are compiled up front in parallel worker processes
(they fill Triton's disk cache); a time budget shrinks the search for the remaining rows if
compilation or timing run long.

Prints one line per (layer, M) and a speedup table; --out writes JSON (rewritten after each
layer, so a killed run keeps what it measured): per (layer, M) cuBLAS and best-config us and
GB/s, the speedup, the top 5 configs, the default config's time and the failures; per fused
variant the fused, unfused-with-cuBLAS and unfused-with-skinny times; device and versions.
About 390 kernels (~30 s on 12 workers) and ~2,900 graph timings: under 3 minutes on an H200.

    python scripts/bench_skinny_gemm.py [--out skinny.json] [--quick] [--dry-run]
        [--layers qkv,o] [--rows 1,16] [--jobs N] [--budget-s S]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch
import torch.nn.functional as F
import triton

from liteinfer.kernels.activation import silu_and_mul
from liteinfer.kernels.norm import rms_norm
from liteinfer.kernels.skinny_gemm import (
    SkinnyConfig,
    block_m_for,
    skinny_config,
    skinny_linear,
)

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384),
          "down": (8192, 2048), "lm_head": (2048, 128256)}  # layer: (K, N)
ROWS = (1, 2, 4, 8, 16, 32, 64)
FUSED = [("qkv", "norm"), ("gate_up", "norm"), ("o", "residual"), ("down", "silu"),
         ("down", "silu+residual")]
BLOCK_N, BLOCK_K, WARPS, STAGES = (16, 32, 64, 128), (64, 128, 256, 512), (2, 4, 8), (2, 3, 4, 5, 6)
DEVICE, DTYPE, ITEMSIZE, EPS = "cuda", torch.bfloat16, 2, 1e-5
SMEM_LIMIT = 227 << 10  # per block on H100/H200
ROTATE_BYTES, LAUNCHES, REPLAYS = 256e6, 20, 5
TOP_AFTER_BUDGET = 4
NUM_LAYERS = 16
DRY_RUN_SMS = 132


def log(msg: str) -> None:
    print(msg, flush=True)


def plan_configs(m: int, n: int, k: int, num_sms: int, quick: bool = False) -> list[SkinnyConfig]:
    """The config grid less the hopeless: fewer programs than ~0.7 waves when a narrower
    BLOCK_N would give them, pipelines that overflow shared memory (Triton 3.x buffers up to
    num_stages weight and x tiles), under 16 B or over 512 B of weight tile per thread, or
    under 16 KiB of weight in flight per program (too little to cover HBM latency)."""
    bm = block_m_for(m)
    min_programs = min(triton.cdiv(n, 16), int(0.7 * num_sms))
    grid = itertools.product(BLOCK_N, BLOCK_K, (4, 8) if quick else WARPS,
                             (3, 4, 5) if quick else STAGES)
    configs = []
    for bn, bk, warps, stages in grid:
        tile = bn * bk * ITEMSIZE
        if (triton.cdiv(n, bn) < min_programs or bk > k
                or stages * (bn + bm) * bk * ITEMSIZE > SMEM_LIMIT
                or not 16 <= tile // (32 * warps) <= 512 or (stages - 1) * tile < 16 << 10):
            continue
        configs.append(SkinnyConfig(bn, bk, warps, stages))
    default = skinny_config(m, n, k, ITEMSIZE)
    return configs + ([default] if default not in configs else [])


class Inputs:
    """One (layer, M) problem: `copies` weights plus activations for every variant."""

    def __init__(self, layer: str, m: int, copies: int = 1, empty_weights: bool = False):
        k, n = SHAPES[layer]
        make = torch.empty if empty_weights else torch.randn
        self.weights = make(copies, n, k, dtype=DTYPE, device=DEVICE).mul_(k ** -0.5)
        self.x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
        self.xg = 2 * torch.randn(m, 2 * k, dtype=DTYPE, device=DEVICE)
        self.norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(DTYPE)
        self.res = torch.randn(m, n, dtype=DTYPE, device=DEVICE)
        self.out = torch.empty(m, n, dtype=DTYPE, device=DEVICE)

    def fused(self, variant: str, i: int, cfg: SkinnyConfig | None) -> torch.Tensor:
        w = self.weights[i % len(self.weights)]
        if variant == "plain":
            return skinny_linear(self.x, w, out=self.out, config=cfg)
        if variant == "norm":
            return skinny_linear(self.x, w, norm_weight=self.norm_w, eps=EPS, out=self.out,
                                 config=cfg)
        if variant == "residual":
            return skinny_linear(self.x, w, residual=self.res, out=self.out, config=cfg)
        return skinny_linear(self.xg, w, silu_mul=True, out=self.out, config=cfg,
                             residual=self.res if variant == "silu+residual" else None)

    def unfused(self, variant: str, i: int, cfg: SkinnyConfig | None) -> torch.Tensor:
        """The kernel sequence a variant replaces; cfg None: cuBLAS, else skinny_linear."""
        w = self.weights[i % len(self.weights)]

        def linear(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, w) if cfg is None else skinny_linear(x, w, config=cfg)
        if variant == "plain":
            return linear(self.x)
        if variant == "norm":
            return linear(rms_norm(self.x, self.norm_w, EPS))
        if variant == "residual":
            return torch.add(linear(self.x), self.res, out=self.out)
        y = linear(silu_and_mul(self.xg))
        return torch.add(y, self.res, out=self.out) if variant == "silu+residual" else y


def graph_us(call: Callable[[int], object], launches: int) -> float:
    """Median microseconds per call of a CUDA graph holding `launches` calls call(0..)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and cuBLAS setup outside the capture
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            call(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    del graph
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to max(1, max|ref|); inf when out has non-finite values."""
    diff = (out.float() - ref.float()).abs().max().item()
    return diff / max(1.0, ref.float().abs().max().item()) if math.isfinite(diff) else math.inf


def _error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


_WORKER_INPUTS: dict[tuple[str, int], Inputs] = {}


Job = tuple[str, int, SkinnyConfig, str]  # (layer, M, config, variant)


def _compile_job(job: Job) -> str | None:
    """Worker: one launch compiles the kernel into Triton's disk cache (M is not specialized,
    so one BLOCK_M's compile serves all its M)."""
    layer, m, cfg, variant = job
    try:
        if (layer, m) not in _WORKER_INPUTS:
            _WORKER_INPUTS.clear()
            _WORKER_INPUTS[(layer, m)] = Inputs(layer, m, empty_weights=True)
        _WORKER_INPUTS[(layer, m)].fused(variant, 0, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
        return _error_line(e)


class Compiler:
    """Compiles kernels in spawned worker processes, which fill Triton's disk cache for the
    main process (serial compiles would take most of the time budget). Jobs go out in batches
    of two per worker: a worker that dies (a compiler crash) fails only its batch, which the
    main process then never runs, and the next batch gets a fresh pool."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None

    def run(self, jobs: list[Job]) -> dict[tuple, str]:
        """Compiles one job per (BLOCK_M, config, variant) key; returns the failures' error
        lines by key."""
        unique = {(block_m_for(m), cfg, v): (layer, m, cfg, v) for layer, m, cfg, v in jobs}
        # Grouped by (layer, M) so that workers mostly reuse their inputs.
        todo = sorted(unique.items(), key=lambda item: item[1][:2])
        failed: dict[tuple, str] = {}
        if self.workers <= 0 or not todo:
            return failed
        start, crashes, batch = time.time(), 0, 2 * self.workers
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            if crashes >= 3:
                failed.update({key: "skipped after 3 compile worker crashes" for key, _ in chunk})
                continue
            try:
                if self.pool is None:
                    self.pool = ProcessPoolExecutor(self.workers, mp.get_context("spawn"))
                futures = [(key, self.pool.submit(_compile_job, job)) for key, job in chunk]
            except Exception as e:  # noqa: BLE001 - no workers: compile on first use
                log(f"# no compile workers ({_error_line(e)}); compiling on first use")
                return failed
            broken = False
            for key, future in futures:
                try:
                    err = future.result()
                except BrokenProcessPool:
                    err, broken = "compile worker died", True
                if err is not None:
                    failed[key] = err
            if broken:
                crashes += 1
                log(f"# a compile worker died; {len(chunk)} kernels of its batch skipped")
                self.close()
        log(f"# compiled {len(todo)} kernels in {self.workers} processes, "
            f"{time.time() - start:.0f} s, {len(failed)} failed")
        return failed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def _cfg_dict(cfg: SkinnyConfig) -> dict:
    return dataclasses.asdict(cfg)


def _label(cfg: SkinnyConfig) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def sweep_layer(layer: str, rows: list[int], num_sms: int, args: argparse.Namespace,
                failed: dict, t0: float) -> list[dict]:
    """Times cuBLAS and every planned config at each M; returns one result row per M, each
    with a `ranking` of the configs that ran, fastest first."""
    k, n = SHAPES[layer]
    wbytes = n * k * ITEMSIZE
    copies = max(1, math.ceil(ROTATE_BYTES / wbytes))
    launches = max(LAUNCHES, copies)
    results: list[dict] = []
    ranking: list[SkinnyConfig] = []
    for m in rows:
        inp = Inputs(layer, m, copies)
        gbytes = (wbytes + (m * k + m * n) * ITEMSIZE) / 1e9
        ref = F.linear(inp.x, inp.weights[0])
        cublas_us = graph_us(lambda i, inp=inp: F.linear(inp.x, inp.weights[i % copies]),
                             launches)
        candidates = plan_configs(m, n, k, num_sms, args.quick)
        if time.time() - t0 > args.budget_s and ranking:  # over budget: the last M's best
            default = skinny_config(m, n, k, ITEMSIZE)  # last in the plan
            candidates = [c for c in ranking[:TOP_AFTER_BUDGET] if c in candidates
                          and c != default] + [default]
        timed: list[tuple[float, SkinnyConfig, float]] = []
        errors: dict[str, str] = {}
        for cfg in candidates:
            known = failed.get((block_m_for(m), cfg, "plain"))
            if known:
                errors[_label(cfg)] = known
                continue
            try:
                err = rel_err(skinny_linear(inp.x, inp.weights[0], config=cfg), ref)
                if err > 2e-2:
                    raise AssertionError(f"output differs from cuBLAS by {err:.3g}")
                us = graph_us(lambda i, inp=inp, cfg=cfg: inp.fused("plain", i, cfg), launches)
                timed.append((us, cfg, err))
            except Exception as e:  # noqa: BLE001 - compile/launch failures skip the config
                errors[_label(cfg)] = _error_line(e)
        timed.sort(key=lambda t: t[0])
        ranking = [cfg for _, cfg, _ in timed]
        default = skinny_config(m, n, k, ITEMSIZE)
        row = {"layer": layer, "m": m, "n": n, "k": k, "weight_bytes": wbytes,
               "cublas_us": cublas_us, "cublas_gbs": gbytes / (cublas_us * 1e-6),
               "configs_planned": len(candidates), "configs_timed": len(timed),
               "failures": errors, "ranking": ranking}
        if not timed:
            log(f"{layer:>8} M={m:<3} cuBLAS {cublas_us:7.2f} us | no config ran: "
                f"{next(iter(errors.values()), '?')}")
            results.append(row)
            continue
        best_us, best, err = timed[0]
        default_us = next((us for us, cfg, _ in timed if cfg == default), math.nan)
        abs_err = (inp.fused("plain", 0, best).float() - ref.float()).abs().max().item()
        row.update({"best": _cfg_dict(best), "best_us": best_us,
                    "best_gbs": gbytes / (best_us * 1e-6), "speedup": cublas_us / best_us,
                    "max_abs_err_vs_cublas": abs_err, "max_rel_err_vs_cublas": err,
                    "default": _cfg_dict(default),
                    "default_us": default_us if math.isfinite(default_us) else None,
                    "top": [{"us": us, **_cfg_dict(cfg)} for us, cfg, _ in timed[:5]]})
        log(f"{layer:>8} M={m:<3} cuBLAS {cublas_us:7.2f} us {row['cublas_gbs']:5.0f} GB/s | "
            f"best {best_us:7.2f} us {row['best_gbs']:5.0f} GB/s x{row['speedup']:.2f} "
            f"({_label(best)}) | default {default_us:7.2f} us | {len(timed)} timed, "
            f"{len(errors)} failed, max abs err {abs_err:.2g} | {time.time() - t0:.0f} s")
        results.append(row)
    return results


def time_fused(layer: str, variant: str, m: int, ranking: list[SkinnyConfig],
               failed: dict) -> dict:
    """The fused variant at the best plain config that runs it (the prologues need more
    shared memory), against its unfused kernel sequence with cuBLAS and with skinny_linear."""
    k, n = SHAPES[layer]
    copies = max(1, math.ceil(ROTATE_BYTES / (n * k * ITEMSIZE)))
    launches = max(LAUNCHES, copies)
    inp = Inputs(layer, m, copies)
    row: dict = {"layer": layer, "variant": variant, "m": m}
    ref_cublas = inp.unfused(variant, 0, None).clone()
    for cfg in ranking[:8]:
        if (block_m_for(m), cfg, variant) in failed:
            continue
        try:
            ref_skinny = inp.unfused(variant, 0, cfg).clone()
            fused = inp.fused(variant, 0, cfg).clone()
            row.update({
                "config": _cfg_dict(cfg),
                "fused_us": graph_us(lambda i, c=cfg: inp.fused(variant, i, c), launches),
                "unfused_cublas_us": graph_us(lambda i: inp.unfused(variant, i, None), launches),
                "unfused_skinny_us": graph_us(lambda i, c=cfg: inp.unfused(variant, i, c),
                                              launches),
                "max_abs_err_vs_unfused_skinny":
                    (fused.float() - ref_skinny.float()).abs().max().item(),
                "max_rel_err_vs_unfused_cublas": rel_err(fused, ref_cublas)})
            log(f"{layer:>8} {variant:<14} M={m:<3} fused {row['fused_us']:7.2f} us | unfused "
                f"with cuBLAS {row['unfused_cublas_us']:7.2f} us, with skinny "
                f"{row['unfused_skinny_us']:7.2f} us ({_label(cfg)}) | "
                f"err {row['max_rel_err_vs_unfused_cublas']:.1e}")
            return row
        except Exception as e:  # noqa: BLE001 - try the next config
            row.setdefault("failures", {})[_label(cfg)] = _error_line(e)
    log(f"{layer:>8} {variant:<14} M={m:<3} no config ran: {row.get('failures')}")
    return row


def summarize(report: dict, layers: list[str], rows: list[int]) -> None:
    """Speedup table, and with every layer the GEMM time of one decode step of the model."""
    best = {(r["layer"], r["m"]): r for r in report["gemm"] if "best_us" in r}
    log("\n# skinny_linear speedup over cuBLAS (best config)")
    log(" " * 8 + "".join(f"{f'M={m}':>8}" for m in rows))
    for layer in layers:
        cells = [f"{best[(layer, m)]['speedup']:8.2f}" if (layer, m) in best else f"{'-':>8}"
                 for m in rows]
        log(f"{layer:>8}" + "".join(cells))
    if set(layers) == set(SHAPES):
        step = {}
        for m in rows:
            if all((layer, m) in best for layer in SHAPES):
                per_layer = {layer: best[(layer, m)] for layer in SHAPES}
                step[m] = {key: NUM_LAYERS * sum(per_layer[x][key] for x in SHAPES
                                                 if x != "lm_head")
                           + per_layer["lm_head"][key] for key in ("cublas_us", "best_us")}
                log(f"# decode step GEMMs ({NUM_LAYERS} layers + lm_head), M={m}: cuBLAS "
                    f"{step[m]['cublas_us']:.0f} us, skinny {step[m]['best_us']:.0f} us")
        report["step_gemm_us"] = step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (rewritten after every layer)")
    parser.add_argument("--quick", action="store_true", help="num_warps 4/8, num_stages 3-5")
    parser.add_argument("--dry-run", action="store_true",
                        help="only list the planned configs (no GPU needed)")
    parser.add_argument("--layers", default=",".join(SHAPES), help="comma-separated subset")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values")
    parser.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                        help="compile worker processes (0: compile on first use)")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="past this, each M times only the previous M's best configs")
    args = parser.parse_args()
    layers = [name for name in args.layers.split(",") if name]
    rows = [int(m) for m in args.rows.split(",") if m]
    if not set(layers) <= set(SHAPES) or not all(1 <= m <= 64 for m in rows):
        parser.error(f"layers must be among {list(SHAPES)}, rows within 1..64")

    num_sms = DRY_RUN_SMS if args.dry_run else \
        torch.cuda.get_device_properties(0).multi_processor_count
    jobs = []
    for layer in layers:
        k, n = SHAPES[layer]
        plans = {m: plan_configs(m, n, k, num_sms, args.quick) for m in rows}
        log(f"{layer:>8} K={k:<5} N={n:<6} planned configs per M: "
            f"{ {m: len(p) for m, p in plans.items()} }")
        jobs += [(layer, m, cfg, "plain") for m, p in plans.items() for cfg in p]
    kernels = len({(block_m_for(m), cfg) for _, m, cfg, _ in jobs})
    log(f"# {len(jobs)} (layer, M, config) timings, {kernels} distinct kernels to compile"
        + (f" (assuming {num_sms} SMs)" if args.dry_run else ""))
    if args.dry_run:
        return

    t0 = time.time()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report: dict = {"device": props.name, "num_sms": num_sms, "torch": torch.__version__,
                    "triton": triton.__version__, "cuda": torch.version.cuda,
                    "dtype": str(DTYPE), "quick": args.quick, "gemm": [], "fused": []}

    def save() -> None:
        report["elapsed_s"] = time.time() - t0
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    compiler = Compiler(args.jobs)
    failed = compiler.run(jobs)
    rankings: dict[tuple[str, int], list[SkinnyConfig]] = {}
    for layer in layers:
        for row in sweep_layer(layer, rows, num_sms, args, failed, t0):
            rankings[(layer, row["m"])] = row.pop("ranking")
            report["gemm"].append(row)
        save()
    fused = [(layer, variant, m) for layer, variant in FUSED for m in rows
             if layer in layers and rankings.get((layer, m))]
    failed.update(compiler.run([(layer, m, rankings[(layer, m)][0], variant)
                                for layer, variant, m in fused]))
    compiler.close()
    for layer, variant, m in fused:
        report["fused"].append(time_fused(layer, variant, m, rankings[(layer, m)], failed))
        save()
    summarize(report, layers, rows)
    log(f"# {props.name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{time.time() - t0:.0f} s" + (f", wrote {args.out}" if args.out else ""))
    save()


if __name__ == "__main__":
    main()
