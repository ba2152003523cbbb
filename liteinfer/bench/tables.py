"""The benchmark page as data: tables per (kind, shape) with lineage ratios and their caveats,
across-shapes pivots and the header. report.py and report_html.py only render this."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from liteinfer.bench import registry
from liteinfer.bench.floor import floor_share
from liteinfer.bench.lineage import Lineage
from liteinfer.bench.registry import LITEINFER, REMOVED, VLLM, BenchConfig
from liteinfer.bench.store import DEFAULT_PRECISION, Row, build_of, latest, precision_of, shape_of
from liteinfer.bench.timeline import Timeline
from liteinfer.bench.workloads import HEADLINE, MODEL, Shape

KINDS = ("latency", "throughput")
SERVE = "serve"  # rows of `liteinfer-bench serve`: a server under streaming load
COLUMNS = {"latency": (("ITL p50", "itl_p50"), ("ITL p95", "itl_p95"), ("TTFT p50", "ttft_p50"),
                       ("TTFT p95", "ttft_p95"), ("E2E p50", "e2e_p50")),
           "throughput": (("tok/s", "tok_s"), ("req/s", "req_s"), ("wall (s)", "wall_s"))}
HEADLINE_METRIC = {"latency": "itl_p50", "throughput": "tok_s"}
RATIOS = ("vs base", "vs first", "vs vLLM")
FLOOR = "of floor"  # the row's share of its physical floor (bench/floor.py)
INTRO = ("Each config is scored against the one it improves on (vs base), against the start of "
         "its lineage (vs first), and against vLLM at the same batch width measured on the same "
         "machine (vs vLLM: a vLLM row of another GPU, host or boot is never divided). Above 1.00x "
         "is better. Each row names the config it improves on; vLLM rows are references, not "
         "competitors. Bars show standing on the headline metric of each table. A ratio marked ~ "
         "compares rows not measured under the same conditions; the note under its table says why. "
         "Of floor: the time one decode step must take to read its bytes (the weights it "
         "multiplies by and every row's KV cache at the run's mean context) at the GPU's measured "
         "copy bandwidth, over the row's ITL p50.")
MIXED_PROMPTS = "These runs did not all use the same prompts."
SPANS_ENGINES = "which is no longer runnable, so this delta spans two engines"


def ratio(kind: str, this: Row, other: Row) -> float | None:
    """Above 1 means `this` is better: lower ITL for latency, more tok/s for throughput."""
    key = HEADLINE_METRIC[kind]
    a, b = this.get(key), other.get(key)
    if not a or not b:
        return None
    return b / a if kind == "latency" else a / b


def standing(kind: str, value: float, values: list[float]) -> float:
    """value against the best of `values` (1 = the best): lowest ITL, or most tok/s."""
    return min(values) / value if kind == "latency" else value / max(values)


def short_build(build: str) -> str:
    head, dirty, _ = build.partition("-dirty")
    return (head[:10] if len(head) == 40 else head) + (dirty and "-dirty")


def same_machine(a: Row, b: Row) -> bool:
    """Whether two rows were measured on one machine: the same GPU and host, and the same boot
    where either row recorded one (every lease of a rented GPU may have the same hostname).
    Rows from before hosts were recorded cannot tell, and count as measured apart."""
    return a.get("gpu") == b.get("gpu") and a.get("host") is not None and (
        a.get("host") == b.get("host")) and a.get("boot") == b.get("boot")


def vllm_counterpart(row: Row, candidates: list[Row]) -> Row | None:
    """The newest of the vLLM rows `candidates` (same config and width as `row`'s vLLM
    reference) measured on `row`'s machine."""
    same = [r for r in candidates if same_machine(row, r)]
    return max(same, key=lambda r: r["timestamp"]) if same else None


def mismatches(a: Row, b: Row, same_engine: bool) -> list[str]:
    """Why two rows were not measured under the same conditions; [] when they were."""
    why = []
    if a.get("fingerprint") != b.get("fingerprint"):
        why.append(f"different prompts ({a['prompts']} prompts #{str(a.get('fingerprint'))[:8]} "
                   f"vs {b['prompts']} prompts #{str(b.get('fingerprint'))[:8]})")
    if a.get("gpu") != b.get("gpu"):
        why.append(f"different GPUs ({a.get('gpu')} vs {b.get('gpu')})")
    if same_engine and build_of(a) != build_of(b):
        why.append(f"different engine builds ({short_build(build_of(a))} "
                   f"vs {short_build(build_of(b))})")
    return why


@dataclass
class Cell:
    value: float | None
    note: int | None = None  # footnote number; set when the two rows' conditions differ

    @property
    def text(self) -> str:
        if self.value is None:
            return "—"
        return f"{self.value:.2f}x" + ("~" if self.note else "")


@dataclass
class Line:
    config: BenchConfig
    row: Row
    label: str
    notes: list[str]
    ratios: list[Cell]
    floor_share: float | None = None  # floor step time over the ITL p50 (bench/floor.py)
    standing: float = 0.0  # headline metric relative to the table's best, in (0, 1]

    @property
    def floor_text(self) -> str:
        return "—" if self.floor_share is None else f"{self.floor_share:.0%}"


@dataclass
class Table:
    kind: str
    shape: Shape
    model: str
    lines: list[Line]
    footnotes: list[str] = field(default_factory=list)
    precision: str = DEFAULT_PRECISION  # store.precision_of: a table holds rows of one

    @property
    def title(self) -> str:
        precision = "" if self.precision == DEFAULT_PRECISION else f" · {self.precision}"
        return f"{self.kind} · {self.model}{precision} · {self.shape.title}"

    @property
    def columns(self) -> tuple[tuple[str, str], ...]:
        return COLUMNS[self.kind]

    @property
    def mixed_prompts(self) -> bool:
        return len({line.row.get("fingerprint") for line in self.lines}) > 1


@dataclass
class Pivot:
    kind: str
    shapes: list[Shape]
    rows: list[tuple[str, list[float | None]]]

    @property
    def title(self) -> str:
        return f"{self.kind} across shapes"

    @property
    def unit(self) -> str:
        return "tok/s" if self.kind == "throughput" else "ITL p50 (ms)"


SERVING_COLUMNS = (("streams", "width"), ("tok/s", "tok_s"), ("TTFT p50", "ttft_p50"),
                   ("TTFT p99", "ttft_p99"), ("TPOT p50", "tpot_p50"), ("TPOT p99", "tpot_p99"),
                   ("ITL p50", "itl_p50"), ("errors", "errors"))


@dataclass
class ServingLine:
    row: Row
    vs_vllm: float | None  # tok/s over vLLM serve's in the same run, same shape and load


@dataclass
class ServingTable:
    model: str
    shape: Shape
    lines: list[ServingLine]

    @property
    def title(self) -> str:
        return f"serving · {self.model} · {self.shape.title}"


def serve_key(row: Row) -> tuple[Any, ...]:
    """What a serving row measures: (engine, config, shape, streams, request rate)."""
    return (row["engine"], row["config"], str(row["isl"]), row["osl"], row["width"],
            row.get("request_rate"))


def vllm_serve_row(row: Row, rows: list[Row]) -> Row | None:
    """The vLLM serve row of the same run (run_id, GPU), shape and load, if any."""
    same = [r for r in rows if r["engine"] == VLLM and r.get("run_id") == row.get("run_id")
            and r.get("gpu") == row.get("gpu") and serve_key(r)[2:] == serve_key(row)[2:]]
    return max(same, key=lambda r: r["timestamp"]) if same else None


def serving_tables(rows: list[Row], model: str) -> list[ServingTable]:
    """The newest serve row per (engine, config, shape, load) of `model`, a table per shape;
    liteinfer rows scored against vLLM serve's tok/s of the same run. Runs that measured vLLM
    serve too come first: a later run without it does not push a compared row out."""
    rows = [r for r in rows if r["kind"] == SERVE and r.get("model") == model]
    compared = {r.get("run_id") for r in rows if r["engine"] == VLLM}
    newest = latest([r for r in rows if r.get("run_id") in compared] or rows, serve_key)
    tables = []
    for shape in sorted({shape_of(r) for r in newest}, key=lambda s: s.sort_key):
        of_shape = sorted((r for r in newest if shape_of(r) == shape),
                          key=lambda r: (r["width"], r.get("request_rate") or 0,
                                         r["engine"] != LITEINFER, r["config"]))
        lines = []
        for r in of_shape:
            vllm = vllm_serve_row(r, rows) if r["engine"] != VLLM else None
            vs = r["tok_s"] / vllm["tok_s"] if vllm and vllm.get("tok_s") else None
            lines.append(ServingLine(r, vs))
        tables.append(ServingTable(model, shape, lines))
    return tables


SPEC_OFF = "spec-off"


@dataclass
class SpecLine:
    width: int
    setting: str  # the forced acceptance level, or the method's draft count
    row: Row  # with speculation
    off: Row | None  # the same run's row without it
    vllm: Row | None  # vLLM speculating the same way on the same machine and prompts

    @property
    def vs_off(self) -> float | None:
        return self.row["tok_s"] / self.off["tok_s"] if self.off else None

    @property
    def vs_vllm(self) -> float | None:
        return self.row["tok_s"] / self.vllm["tok_s"] if self.vllm else None


@dataclass
class SpecTable:
    model: str
    gpu: str
    method: str
    builds: list[str]
    lines: list[SpecLine]

    @property
    def title(self) -> str:
        return f"speculative decoding · {self.model} · {self.method} · {self.gpu}"


def _spec_setting(row: Row) -> str:
    """Forced acceptance at a set level, drafting forced on whatever is accepted (a draft
    model's cost on dummy weights), or the drafts' own measured acceptance."""
    level = row.get("spec_target_acceptance_length")
    if level is not None:
        return f"forced {level:g}"
    return "always drafting" if row.get("spec_draft_forced") else "measured"


def _spec_off_row(row: Row, offs: list[Row]) -> Row | None:
    """The row without speculation that the same `liteinfer-bench spec` run measured first."""
    same = [r for r in offs if r["timestamp"] <= row["timestamp"] and all(
        r.get(k) == row.get(k) for k in ("model", "gpu", "host", "boot", "commit", "width",
                                         "isl"))]
    return max(same, key=lambda r: r["timestamp"]) if same else None


def _vllm_spec_row(row: Row, method: str, vllm: list[Row]) -> Row | None:
    same = [r for r in vllm if same_machine(row, r) and r["width"] == row["width"]
            and r["isl"] == row["isl"] and r["speculative_config"].get("method") == method]
    return max(same, key=lambda r: r["at"]) if same else None


def spec_tables(rows: list[Row]) -> list[SpecTable]:
    """The newest speculating row per (model, GPU, method, width, setting), each beside the
    same run's row without speculation and vLLM's speculating row of the same machine."""
    own = [r for r in rows if r.get("engine") == LITEINFER]
    vllm = [r for r in rows if r.get("engine") == VLLM and r.get("speculative_config")]
    offs = [r for r in own if r["config"] == SPEC_OFF]
    speculating = latest([r for r in own if r["config"] != SPEC_OFF], lambda r: (
        r["model"], r["gpu"], r["config"], r["width"], _spec_setting(r)))
    tables = []
    for key in sorted({(r["model"], r["gpu"], r["config"]) for r in speculating}):
        of_table = sorted((r for r in speculating if (r["model"], r["gpu"], r["config"]) == key),
                          key=lambda r: (r["width"], _spec_setting(r)))
        method = key[2].removeprefix("spec-")
        lines = [SpecLine(r["width"], _spec_setting(r), r, _spec_off_row(r, offs),
                          _vllm_spec_row(r, method, vllm)) for r in of_table]
        builds = sorted({short_build(build_of(r)) for r in of_table})
        tables.append(SpecTable(key[0], key[1], method, builds, lines))
    return tables


@dataclass
class Page:
    lineage: Lineage
    model: str
    headline: Shape  # the shape the header names and the HTML plots by batch width show
    header: list[tuple[str, str]]
    tables: list[Table]
    pivots: list[Pivot]
    serving: list[ServingTable] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)  # runs shown step by step
    spec: list[SpecTable] = field(default_factory=list)


def _is_primary(kind: str, config: BenchConfig, width: int) -> bool:
    return kind == "latency" or width == config.width


def row_label(kind: str, config: BenchConfig, width: int) -> str:
    return config.label + ("" if _is_primary(kind, config, width) else f" · W={width}")


def _notes(config: BenchConfig, lineage: Lineage) -> list[str]:
    notes = [config.description]
    notes.append(f"improves on {lineage.get(config.base).label}" if config.base else
                 registry.REFERENCE)
    if config.status == REMOVED:
        notes.append(REMOVED)
    if config.base and lineage.get(config.base).status == REMOVED:
        notes.append(SPANS_ENGINES)
    return notes


class _TableBuilder:
    """`rows`: the newest row per (config, width); `vllm_rows`: every vLLM row of the table's
    kind, shape and precision, from which each line's own machine's is taken."""

    def __init__(self, lineage: Lineage, kind: str, shape: Shape, model: str, precision: str,
                 rows: list[Row], vllm_rows: list[Row]):
        self.lineage, self.kind = lineage, kind
        self.rows = {(r["config"], r["width"]): r for r in rows}
        self.vllm_rows = vllm_rows
        self.table = Table(kind, shape, model, [], precision=precision)

    def note(self, text: str) -> int:
        """The number of the table's footnote `text` (added if new)."""
        if text not in self.table.footnotes:
            self.table.footnotes.append(text)
        return self.table.footnotes.index(text) + 1

    def counterpart(self, name: str, config: BenchConfig, width: int) -> Row | None:
        """`name`'s row to compare with: a row at a config's own width meets the other config's
        own-width row (eager-b4 at W=4 against eager at W=1); other widths only the same width."""
        if self.kind == "latency":
            return self.rows.get((name, 1))
        if _is_primary(self.kind, config, width):
            return self.rows.get((name, self.lineage.get(name).width))
        return self.rows.get((name, width))

    def cell(self, line_label: str, row: Row, other: Row | None, same_engine: bool) -> Cell:
        if other is None:
            return Cell(None)
        cell = Cell(ratio(self.kind, row, other))
        why = mismatches(row, other, same_engine)
        if why and cell.value is not None:
            other_label = row_label(self.kind, self.lineage.get(other["config"]),
                                    other["width"])
            cell.note = self.note(f"{line_label} vs {other_label}: {'; '.join(why)}")
        return cell

    def vllm_cell(self, line_label: str, row: Row, vllm_name: str) -> Cell:
        """Against the vLLM row of the same width measured on the same machine; none (with a
        note) where vLLM's rows come from other machines."""
        candidates = [r for r in self.vllm_rows
                      if r["config"] == vllm_name and r["width"] == row["width"]]
        vllm = vllm_counterpart(row, candidates)
        if vllm is not None:
            return self.cell(line_label, row, vllm, False)
        if not candidates:
            return Cell(None)
        gpus = ", ".join(sorted({str(r.get("gpu")) for r in candidates}))
        return Cell(None, self.note(
            f"no vs vLLM ratio: no vLLM row of W={row['width']} was measured on this row's "
            f"machine (the same GPU and host; vLLM's rows: {gpus})"))

    def line(self, config: BenchConfig, row: Row) -> Line:
        width = row["width"]
        label = row_label(self.kind, config, width)
        base = self.counterpart(config.base, config, width) if config.base else None
        ancestors = reversed(self.lineage.ancestors(config.name))  # earliest first
        first = next((r for a in ancestors if (r := self.counterpart(a, config, width))), None)
        vllm_name = registry.vllm_config_for(width)
        vs_vllm = (self.vllm_cell(label, row, vllm_name)
                   if config.engine != VLLM and vllm_name is not None else Cell(None))
        ratios = [self.cell(label, row, base, True), self.cell(label, row, first, True), vs_vllm]
        return Line(config, row, label, _notes(config, self.lineage), ratios, floor_share(row))

    def build(self) -> Table:
        order = sorted(self.rows, key=lambda k: (self.lineage.order[k[0]], k[1]))
        lines = [self.line(self.lineage.get(name), self.rows[(name, w)]) for name, w in order]
        metric = HEADLINE_METRIC[self.kind]
        values = [line.row[metric] for line in lines if line.row.get(metric)]
        for line in lines:
            v = line.row.get(metric)
            if v:
                line.standing = standing(self.kind, v, values)
        self.table.lines = lines
        return self.table


def _pivot(kind: str, tables: list[Table], lineage: Lineage) -> Pivot:
    """The default precision's rows across shapes."""
    tables = [t for t in tables if t.kind == kind and t.precision == DEFAULT_PRECISION]
    cells: dict[tuple[str, int], dict[Shape, float]] = {}
    for t in tables:
        for line in t.lines:
            key = (line.config.name, line.row["width"])
            cells.setdefault(key, {})[t.shape] = line.row.get(HEADLINE_METRIC[kind])
    keys = sorted(cells, key=lambda k: (lineage.order[k[0]], k[1]))
    lines = [(row_label(kind, lineage.get(n), w), [cells[(n, w)].get(t.shape) for t in tables])
             for n, w in keys]
    return Pivot(kind, [t.shape for t in tables], lines)


def _header(model: str, rows: list[Row], headline: Shape) -> list[tuple[str, str]]:
    own = [r for r in rows if r.get("engine") == LITEINFER] or rows
    counts = [Counter(r["prompts"] for r in own if r["kind"] == k and shape_of(r) == headline)
              for k in KINDS]
    prompts = " / ".join(str(c.most_common(1)[0][0]) if c else "—" for c in counts)
    builds = sorted({short_build(build_of(r)) for r in own})
    return [("model", model), ("ISL", str(headline.isl)), ("OSL", str(headline.osl)),
            ("prompts", prompts), ("decoding", "greedy, forced length"),
            ("GPU", ", ".join(sorted({str(r.get("gpu")) for r in own}))),
            ("builds", ", ".join(builds)), ("last run", max(r["timestamp"] for r in own))]


def build_page(rows: list[Row], lineage: Lineage, model: str | None = None) -> Page:
    """The newest row per (config, kind, shape, width) of one model, laid out as the page in
    `lineage`'s order (rows of a renamed configuration under its name now); the offline rows of
    a serving run (its baseline, on fewer prompts) only in its own table."""
    served = [r for r in rows if r["kind"] == SERVE]
    offline = [r for r in map(lineage.current, rows) if r["kind"] != SERVE
               and "run_id" not in r and r["config"] in lineage.by_name]
    rows = latest(offline)
    if model is None:
        own = [r for r in rows if r.get("engine") == LITEINFER]
        model = max(own, key=lambda r: r["timestamp"])["model"] if own else MODEL
    rows = [r for r in rows if r.get("model") == model]
    serving = serving_tables(served, model)
    if not rows and not serving:
        raise ValueError(f"no benchmark rows for model {model!r}")
    tables = []
    precisions = sorted({precision_of(r) for r in rows}, key=lambda p: (p != DEFAULT_PRECISION, p))
    for precision in precisions:  # one table set per precision, the default first
        for kind in KINDS:
            of_kind = [r for r in rows if r["kind"] == kind and precision_of(r) == precision]
            for shape in sorted({shape_of(r) for r in of_kind}, key=lambda s: s.sort_key):
                of_table = [r for r in of_kind if shape_of(r) == shape]
                vllm_rows = [r for r in offline if r["engine"] == VLLM and r["kind"] == kind
                             and r.get("model") == model and shape_of(r) == shape
                             and precision_of(r) == precision]
                tables.append(_TableBuilder(lineage, kind, shape, model, precision, of_table,
                                            vllm_rows).build())
    kinds = {t.kind for t in tables if t.precision == DEFAULT_PRECISION}
    pivots = [_pivot(k, tables, lineage) for k in ("throughput", "latency") if k in kinds]
    shapes = [t.shape for t in tables]
    headline = HEADLINE if HEADLINE in shapes or not shapes else shapes[0]
    header = _header(model, rows or served, headline)
    return Page(lineage, model, headline, header, tables, pivots, serving)
