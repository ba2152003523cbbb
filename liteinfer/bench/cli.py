"""`liteinfer-bench run` (measure and append rows), `liteinfer-bench serve` (the same against a
running server), `liteinfer-bench report` (render the page), `liteinfer-bench timeline` (where a
recorded run's time went) and `liteinfer-bench quality` (what each quantization costs); also
`python -m liteinfer.bench`."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from liteinfer.bench import registry, runner
from liteinfer.bench.lineage import LINEAGE_FILE, load_lineage
from liteinfer.bench.quality import add_quality_parser
from liteinfer.bench.registry import LITEINFER, TRANSFORMERS, Run
from liteinfer.bench.report import fmt, render_markdown
from liteinfer.bench.report_html import render_html, render_timelines_html
from liteinfer.bench.serve import add_serve_parser
from liteinfer.bench.spec import add_spec_parser
from liteinfer.bench.store import (
    REFERENCE_DIR,
    RESULTS_DIR,
    SPEC_DIR,
    Row,
    append_row,
    environment,
    load_rows,
    now_iso,
    results_file,
    row_key,
    stored_rows,
)
from liteinfer.bench.tables import build_page, mismatches, ratio, spec_tables, vllm_counterpart
from liteinfer.bench.timeline import format_account, format_comparison, read_timeline
from liteinfer.bench.workloads import HEADLINE, MODEL, Shape
from liteinfer.config import EngineConfig, parse_overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="liteinfer-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    add_serve_parser(sub)
    add_spec_parser(sub)
    add_report_parser(sub)
    add_timeline_parser(sub)
    add_quality_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"error: {e}")


def add_run_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run", help="measure latency or throughput and append result rows",
        description="Measure registry configs on the workloads of benchmarks/WORKLOADS.md "
                    "(dummy weights, greedy, forced length) and append one JSON row per run.")
    p.add_argument("kind", nargs="?", choices=("latency", "throughput"),
                   help="latency: one request at a time; throughput: at most --width in flight "
                        "(with --quick or --all: omit to run both)")
    runnable = ", ".join(c.name for c in registry.CONFIGS if c.runnable)
    p.add_argument("--config", nargs="+", metavar="NAME",
                   help=f"registry configs (default: {registry.DEFAULT}; with --all: every "
                        f"runnable one): {runnable}")
    p.add_argument("--isl", help="prompt length, or 'mixed2048' (default 128; with --quick/--all: "
                                 "replaces each run's)")
    p.add_argument("--osl", type=int, help="output length (default 256; with --quick/--all: "
                                           "replaces each run's)")
    p.add_argument("--width", type=int, help="throughput: requests in flight (default: the "
                                             "config's width)")
    p.add_argument("--prompts", type=int, help="measured requests (default: WORKLOADS.md's count)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="latency 128/256 with 20 prompts and throughput 128/256 at the "
                           "config's width")
    mode.add_argument("--all", action="store_true",
                      help="every run of the report's tables for the configs")
    p.add_argument("--model", default=MODEL, help="model name or HF directory (dummy weights)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an engine argument of every liteinfer config, recorded in the "
                        "rows (e.g. --set gpu_memory_utilization=0.9)")
    p.add_argument("--out", type=Path,
                   help="results .jsonl file to append to, or a directory for <date>-<gpu>.jsonl "
                        "(default: benchmarks/results/). Rows record the engine's git commit; "
                        "set LITEINFER_COMMIT where the tree has no .git")
    p.add_argument("--timeline", type=Path, metavar="PATH",
                   help="record each measured run step by step (bench/timeline.py): a .jsonl "
                        "file for one run, or a directory for one file per run; prints where "
                        "each run's wall time went")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs, run nothing")
    p.set_defaults(func=cmd_run)


def add_report_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="render the benchmark page from the result rows")
    p.add_argument("--results", type=Path, default=RESULTS_DIR,
                   help="directory (or file) of result rows (default: %(default)s)")
    p.add_argument("--reference", type=Path, default=REFERENCE_DIR,
                   help="directory of vLLM / transformers reference rows (default: %(default)s)")
    p.add_argument("--lineage", type=Path, default=LINEAGE_FILE,
                   help="the configurations' order, bases, history and renames "
                        "(default: %(default)s)")
    p.add_argument("--md", type=Path, default=Path("BENCHMARKS.md"), help="default: %(default)s")
    p.add_argument("--html", type=Path, default=Path("benchmarks/report.html"),
                   help="default: %(default)s")
    p.add_argument("--model", help="model whose rows to show (default: the newest row's)")
    p.add_argument("--spec", type=Path, default=SPEC_DIR,
                   help="directory (or file) of speculative decoding rows, every model's "
                        "(default: %(default)s)")
    p.add_argument("--timeline", type=Path, action="append", default=[], metavar="PATH",
                   help="a run timeline (run --timeline, scripts/bench_vllm.py --timeline) to "
                        "show step by step; repeat it to set runs side by side")
    p.set_defaults(func=cmd_report)


def add_timeline_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "timeline", help="where a recorded run's wall time went, or two runs side by side",
        description="Accounts a run timeline's wall time by kind of step (full-width decode, "
                    "mixed, prompt-only, below full width, tail, host gaps); with two, sets "
                    "them side by side (e.g. liteinfer's run against vLLM's of the workload).")
    p.add_argument("timelines", type=Path, nargs="+", metavar="PATH", help="one or two files")
    p.add_argument("--html", type=Path, help="also write their plots and accounts to this page")
    p.set_defaults(func=cmd_timeline)


def plan(args: argparse.Namespace) -> list[Run]:
    for name in args.config or []:
        _check_runnable(name)
    if args.quick or args.all:
        runs = registry.quick_runs(args.config) if args.quick else registry.full_matrix(args.config)
        runs = [dataclasses.replace(
            r, shape=Shape.parse(args.isl or r.shape.isl, args.osl or r.shape.osl),
            width=r.width if r.kind == "latency" else args.width or r.width,
            prompts=args.prompts or r.prompts) for r in runs if args.kind in (None, r.kind)]
    elif args.kind is None:
        raise ValueError("name a kind (latency or throughput), or use --quick or --all")
    else:
        shape = Shape.parse(args.isl or HEADLINE.isl, args.osl or HEADLINE.osl)
        configs = [registry.get(n) for n in args.config or [registry.DEFAULT]]
        runs = [c.run(args.kind, shape, args.width or c.width, args.prompts) for c in configs]
    return list(dict.fromkeys(runs))


def _check_runnable(name: str) -> None:
    """A ValueError unless `name` runs: it stands for vLLM's reference rows, was renamed, is a
    step of the engine's history (benchmarks/lineage.toml), or is unknown."""
    if name in registry.BY_NAME:
        if registry.get(name).status == registry.REFERENCE:
            raise ValueError(f"{name} is a reference point, measured outside liteinfer: its "
                             f"rows are in {REFERENCE_DIR}/")
        return
    lineage = load_lineage() if LINEAGE_FILE.exists() else None
    if lineage is not None and name in lineage.renamed:
        raise ValueError(f"{name} is called {lineage.renamed[name]} now")
    if lineage is None or name not in lineage.by_name:
        raise ValueError(f"unknown benchmark config {name!r}; those that run: "
                         f"{', '.join(registry.BY_NAME)}")
    stored = stored_rows(name)
    where = "; ".join(f"{path}: {len(rows)} row(s), the newest of commit "
                      f"{max(rows, key=lambda r: r['timestamp'])['commit'][:7]}"
                      for path, rows in stored.items())
    raise ValueError(f"{name} is {registry.REMOVED}: the code it measured is gone, and "
                     f"`liteinfer-bench report` renders its stored rows ("
                     f"{where or f'none under {RESULTS_DIR}/'})")


def check_device(runs: list[Run], overrides: dict[str, Any]) -> None:
    """A ValueError naming the configs that need a GPU when none is visible: their Triton
    kernels have no CPU driver (Triton's interpreter, TRITON_INTERPRET=1, runs them slowly)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    triton = sorted({r.config for r in runs if registry.get(r.config).engine == LITEINFER and
                     runner.engine_args_for(r.config, overrides).get("attention_backend")
                     == "triton"})
    if triton:
        raise ValueError(f"{', '.join(triton)} with attention_backend=triton runs Triton "
                         f"kernels, which need a CUDA GPU, and none is visible; on CPU leave "
                         f"attention_backend to auto (torch there)")


def timeline_path(timeline: Path, run: Run, planned: int) -> Path:
    """`timeline` itself for a single run named as a .jsonl file, else a file per run in the
    directory `timeline`."""
    if timeline.suffix == ".jsonl":
        if planned > 1:
            raise ValueError(f"--timeline {timeline} names one file for {planned} runs; name a "
                             f"directory")
        return timeline
    return timeline / f"{run.config}-{run.kind}-{run.shape.isl}-{run.shape.osl}-w{run.width}.jsonl"


def _measure_group(config: registry.BenchConfig, runs: list[Run], model: str,
                   overrides: dict[str, Any], out: Path, run_id: str | None = None,
                   timelines: dict[Run, Path] | None = None) -> list[Row]:
    """Loads the model once for all runs of one config; each row is saved as soon as it exists
    (with `run_id`, the serving run it is the offline baseline of). `timelines`: where to
    record each run's steps."""
    rows = []
    timelines = timelines or {}
    if config.engine == TRANSFORMERS:
        from liteinfer.bench.hf_baseline import HFBaseline, measure_hf  # imports transformers

        handle, measure_one, args = HFBaseline(model), measure_hf, config.engine_args
    else:
        args = runner.engine_args_for(config.name, overrides)
        handle, measure_one = runner.make_llm(model, args), runner.measure
        if args.get("enable_prefix_caching", EngineConfig.enable_prefix_caching):
            print(f"{config.name}: the prefix cache is emptied before each measured run",
                  flush=True)
    try:
        for run in runs:
            if run in timelines:
                row = measure_one(handle, run, model, args, timelines[run])
                print(format_account(read_timeline(timelines[run])), flush=True)
            else:
                row = measure_one(handle, run, model, args)
            if run_id is not None:
                row["run_id"] = run_id
            append_row(row, out)
            rows.append(row)
            print(f"{run.config} {run.kind} {run.shape.label} W={run.width}: "
                  f"ITL p50 {fmt(row['itl_p50'])} ms, tok/s {fmt(row['tok_s'])}", flush=True)
    finally:
        handle.shutdown()
    return rows


def summary(rows: list[Row], reference: Path = REFERENCE_DIR) -> str:
    """A fixed-width table of this invocation's rows, against the vLLM row of the same width
    measured on the same machine, if any."""
    refs: dict[tuple[Any, ...], list[Row]] = {}
    for r in load_rows(None, reference):
        refs.setdefault(row_key(r), []).append(r)
    head = ("config", "kind", "ISL/OSL", "W", "n", "ITL p50", "TTFT p50", "E2E p50", "tok/s",
            "vs vLLM")
    lines = [head]
    for r in rows:
        vllm = vllm_counterpart(r, refs.get((r["model"], registry.vllm_config_for(r["width"]),
                                             *row_key(r)[2:]), []))
        vs = "—"
        if vllm is not None and (v := ratio(r["kind"], r, vllm)) is not None:
            vs = f"{v:.2f}x" + ("~" if mismatches(r, vllm, same_engine=False) else "")
        lines.append((r["config"], r["kind"], Shape.parse(r["isl"], r["osl"]).label,
                      str(r["width"]), str(r["prompts"]), fmt(r["itl_p50"]), fmt(r["ttft_p50"]),
                      fmt(r["e2e_p50"]), fmt(r["tok_s"]), vs))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def cmd_run(args: argparse.Namespace) -> None:
    runs = plan(args)
    if args.dry_run:
        for r in runs:
            print(f"{r.config:14} {r.kind:10} {r.shape.label:14} W={r.width:<4} "
                  f"prompts={r.prompts}")
        return
    overrides = parse_overrides(args.overrides)
    check_device(runs, overrides)
    timelines = {}
    if args.timeline is not None:
        if hf := sorted({r.config for r in runs if registry.get(r.config).engine == TRANSFORMERS}):
            raise ValueError(f"{', '.join(hf)} runs transformers, which records no timeline")
        timelines = {r: timeline_path(args.timeline, r, len(runs)) for r in runs}
    out = results_file(args.out, environment()["gpu"], now_iso())
    rows: list[Row] = []
    failed: list[str] = []
    for name, group in itertools.groupby(runs, key=lambda r: r.config):
        try:
            rows += _measure_group(registry.get(name), list(group), args.model, overrides, out,
                                   timelines=timelines)
        except Exception:  # one broken config must not cost the rest of a long matrix
            traceback.print_exc()
            failed.append(name)
    if rows:
        print(f"\n{len(rows)} row(s) appended to {out}\n{summary(rows)}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


def cmd_report(args: argparse.Namespace) -> None:
    if not args.lineage.is_file():
        raise ValueError(f"no lineage file at {args.lineage}: run from the repository's root, "
                         f"or name it with --lineage")
    page = build_page(load_rows(args.results, args.reference), load_lineage(args.lineage),
                      args.model)
    page.timelines = [read_timeline(p) for p in args.timeline]
    page.spec = spec_tables(load_rows(args.spec, None))
    for path, text in ((args.md, render_markdown(page)), (args.html, render_html(page))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")


def cmd_timeline(args: argparse.Namespace) -> None:
    if len(args.timelines) > 2:
        raise ValueError("give one timeline, or two to compare")
    timelines = [read_timeline(p) for p in args.timelines]
    print(format_account(timelines[0]) if len(timelines) == 1 else
          format_comparison(*timelines))
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_timelines_html(timelines), encoding="utf-8")
        print(f"wrote {args.html}")
