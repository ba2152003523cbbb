"""The benchmark page as Markdown (BENCHMARKS.md)."""
from __future__ import annotations

from liteinfer.bench.tables import (
    FLOOR,
    INTRO,
    MIXED_PROMPTS,
    RATIOS,
    SERVING_COLUMNS,
    Page,
    Pivot,
    ServingTable,
    Table,
)
from liteinfer.bench.timeline import format_account

_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def mark(note: int) -> str:
    return str(note).translate(_SUPERSCRIPT)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(t: Table) -> list[str]:
    out = [f"## {t.title}", ""]
    if t.mixed_prompts:
        out += [MIXED_PROMPTS, ""]
    out.append(_row(["config"] + [name for name, _ in t.columns] + [FLOOR, *RATIOS]))
    out.append(_row(["---"] + ["---:"] * (len(t.columns) + 1 + len(RATIOS))))
    for line in t.lines:
        label = f"**{line.label}**<br><sub>{' · '.join(line.notes)}</sub>"
        values = [fmt(line.row.get(key)) for _, key in t.columns]
        ratios = [c.text + (mark(c.note) if c.note else "") for c in line.ratios]
        out.append(_row([label] + values + [line.floor_text] + ratios))
    if t.footnotes:
        out.append("")
        out += [f"- ~{mark(i)} {note}" for i, note in enumerate(t.footnotes, 1)]
    return out + [""]


def _pivot(p: Pivot) -> list[str]:
    out = [f"## {p.title}", "", f"{p.unit} of each config's row at each shape.", ""]
    out.append(_row(["config"] + [s.label for s in p.shapes]))
    out.append(_row(["---"] + ["---:"] * len(p.shapes)))
    out += [_row([label] + [fmt(v) for v in values]) for label, values in p.rows]
    return out + [""]


def _serving(t: ServingTable) -> list[str]:
    out = [f"## {t.title}", "", "Streaming /v1/completions; milliseconds but for tok/s. vs vLLM "
           "serve: tok/s over vLLM serve's in the same run, at the same load.", ""]
    out.append(_row(["config"] + [name for name, _ in SERVING_COLUMNS] + ["vs vLLM serve"]))
    out.append(_row(["---"] + ["---:"] * (len(SERVING_COLUMNS) + 1)))
    for line in t.lines:
        r = line.row
        load = str(r["width"]) if r.get("request_rate") is None else (
            f"{r['request_rate']:g} req/s")
        values = [load] + [fmt(r.get(key)) for _, key in SERVING_COLUMNS[1:-1]]
        vs = "—" if line.vs_vllm is None else f"{line.vs_vllm:.2f}x"
        out.append(_row([r["config"]] + values + [str(r["errors"]), vs]))
    return out + [""]


def render_markdown(page: Page) -> str:
    out = ["# liteinfer benchmarks", "", INTRO, ""]
    out += [f"- **{key}** {value}" for key, value in page.header] + [""]
    for t in page.tables:
        out += _table(t)
    for p in page.pivots:
        out += _pivot(p)
    for s in page.serving:
        out += _serving(s)
    if page.timelines:
        out += ["## run timelines", ""]
        for t in page.timelines:
            out += ["```", format_account(t), "```", ""]
    return "\n".join(out).rstrip() + "\n"
