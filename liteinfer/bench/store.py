"""Result rows as JSON lines: written by `liteinfer bench`, read back (with the reference rows)
by `liteinfer report`."""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
from collections.abc import Callable, Hashable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from liteinfer.bench import registry
from liteinfer.bench.workloads import MODEL, Shape, fingerprint, make_prompts

Row = dict[str, Any]

RESULTS_DIR = Path("benchmarks/results")
REFERENCE_DIR = Path("benchmarks/reference")
SPEC_DIR = Path("benchmarks/spec")  # `liteinfer-bench spec` rows, and vLLM's speculating rows
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=_PACKAGE_DIR, capture_output=True, text=True,
                         check=True, timeout=30)
    return out.stdout.strip()


@functools.cache
def engine_commit() -> str:
    """HEAD of the engine's checkout, '-dirty' when tracked code (results aside) has changed.
    LITEINFER_COMMIT overrides it, for copies of the tree that travel without their .git."""
    if os.environ.get("LITEINFER_COMMIT"):
        return os.environ["LITEINFER_COMMIT"]
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                     ":(top,exclude)benchmarks")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_boot() -> str | None:
    """This boot of this machine (Linux's boot id), None where there is none: rows of one lease
    of a rented GPU share it, where hostnames (a VM image's, the same on every machine) cannot
    tell leases apart."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@functools.cache
def environment() -> Row:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    # host and boot: the machine, so that the report divides only rows measured on the same one.
    return {"commit": engine_commit(), "gpu": gpu, "host": socket.gethostname(),
            "boot": machine_boot(), "torch": torch.__version__,
            "triton": _version("triton"), "transformers": _version("transformers")}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def results_file(out: Path | None, gpu: str, when: str) -> Path:
    """`out` when it names a .jsonl file; else <date>-<gpu>.jsonl in the directory `out`
    (default RESULTS_DIR)."""
    if out is not None and out.suffix == ".jsonl":
        return out
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return (out or RESULTS_DIR) / f"{when[:10]}-{slug}.jsonl"


def append_row(row: Row, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[Row]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_of(row: Row) -> str:
    """What produced a row: the liteinfer commit, or '<engine>-<version>' for another engine."""
    return row.get("commit") or f"{row['engine']}-{row.get('version', '?')}"


def shape_of(row: Row) -> Shape:
    return Shape.parse(row["isl"], row["osl"])


@functools.cache
def _workload_fingerprint(isl: int | str, prompts: int, seed: int) -> str:
    return fingerprint(make_prompts(isl, prompts, seed))


def reference_row(raw: Row, source: Path) -> Row | None:
    """A vLLM or transformers reference row under its configuration name; None if unmapped.
    Rows that name no model are of the default one (the reference files' first rows).

    Reference rows carry no fingerprint; they were drawn with WORKLOADS.md's generator from
    their (isl, prompts, seed), so the fingerprint is recomputed from those."""
    if raw["engine"] == "vllm":
        name = registry.vllm_config_for(raw["width"])
    else:
        name = raw.get("config", "").removeprefix("hf-")
    if name not in registry.BY_NAME:
        return None
    at = raw.get("at")
    if at is not None:
        stamp = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
    else:  # rows without a time of their own date from their file's name
        date = re.search(r"\d{4}-\d{2}-\d{2}", source.name)
        if date is None:
            raise ValueError(f"{source}: rows have no 'at' time and the file name no date")
        stamp = date[0] + "T00:00:00+00:00"
    return {**raw, "config": name, "model": raw.get("model", MODEL), "timestamp": stamp,
            "fingerprint": _workload_fingerprint(raw["isl"], raw["prompts"], raw["seed"])}


def load_rows(results: Path | None = RESULTS_DIR,
              reference: Path | None = REFERENCE_DIR) -> list[Row]:
    """Measured rows of every *.jsonl under `results` plus the mapped reference rows."""
    rows: list[Row] = []
    if results is not None and results.exists():
        files = sorted(results.glob("*.jsonl")) if results.is_dir() else [results]
        rows += [r for f in files for r in read_jsonl(f)]
    if reference is not None and reference.exists():
        for f in sorted(reference.glob("*.jsonl")):
            rows += [r for raw in read_jsonl(f) if (r := reference_row(raw, f)) is not None]
    return rows


def stored_rows(config: str, results: Path = RESULTS_DIR) -> dict[Path, list[Row]]:
    """The measured rows of one config, by the results file that holds them."""
    found = {f: [r for r in read_jsonl(f) if r["config"] == config]
             for f in sorted(results.glob("*.jsonl"))} if results.is_dir() else {}
    return {f: rows for f, rows in found.items() if rows}


DEFAULT_PRECISION = "bf16"


def precision_of(row: Row) -> str:
    """The weights' and the KV cache's precision a row ran at, from its engine args: 'bf16', or
    its quantization ('fp8', 'int4'), either with ' + fp8 KV' (kv_cache_dtype='fp8'), and
    ' + batch-invariant' for `--set batch_invariant=true` (its own tables beside the default's)."""
    args = row.get("engine_args") or {}
    weights = args.get("quantization") or DEFAULT_PRECISION
    return (weights + (" + fp8 KV" if args.get("kv_cache_dtype") == "fp8" else "")
            + (" + batch-invariant" if args.get("batch_invariant") else ""))


def row_key(row: Row) -> tuple[str, str, str, str, int, int, str]:
    """What a row measures: (model, config, kind, isl, osl, width, precision)."""
    return (row["model"], row["config"], row["kind"], str(row["isl"]), row["osl"], row["width"],
            precision_of(row))


def latest(rows: list[Row], key: Callable[[Row], Hashable] = row_key) -> list[Row]:
    """The newest row per `key` (by default what a row measures: `row_key`); of rows as new,
    the last."""
    best: dict[Hashable, Row] = {}
    for row in rows:
        k = key(row)
        if k not in best or row["timestamp"] >= best[k]["timestamp"]:
            best[k] = row
    return list(best.values())
