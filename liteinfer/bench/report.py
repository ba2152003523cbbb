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
    SpecLine,
    SpecTable,
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


SPEC_INTRO = ("`liteinfer-bench spec`: tok/s with speculation, over the same run's tok/s "
              "without it (x off) and over vLLM's speculating the same way on the same machine "
              "and prompts (x vLLM). Forced rows: the benchmark-only reference proposer at a set "
              "mean accepted length (dummy weights); always drafting: a draft model's cost, its "
              "drafts never accepted (dummy weights); measured: real drafts on real weights. "
              "Mean length: tokens kept per verification, the drafts accepted and one more.")


SPEC_COLUMNS = ("width", "drafts", "off tok/s", "tok/s", "x off", "mean length", "vLLM tok/s",
                "x vLLM")


def spec_cells(line: SpecLine) -> list[str]:
    """One SPEC_COLUMNS line, as text (Markdown and HTML alike)."""
    r = line.row
    return [str(line.width), line.setting, fmt(line.off["tok_s"] if line.off else None),
            fmt(r["tok_s"]), _times(line.vs_off), _two(r.get("spec_mean_acceptance_length")),
            fmt(line.vllm["tok_s"] if line.vllm else None), _times(line.vs_vllm)]


def _spec(t: SpecTable) -> list[str]:
    out = [f"## {t.title}", "", SPEC_INTRO, "", f"Builds: {', '.join(t.builds)}.", ""]
    out.append(_row(list(SPEC_COLUMNS)))
    out.append(_row(["---:", "---"] + ["---:"] * (len(SPEC_COLUMNS) - 2)))
    out += [_row(spec_cells(line)) for line in t.lines]
    return out + [""]


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _two(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def render_markdown(page: Page) -> str:
    out = ["# liteinfer benchmarks", "", INTRO, ""]
    out += [f"- **{key}** {value}" for key, value in page.header] + [""]
    for t in page.tables:
        out += _table(t)
    for p in page.pivots:
        out += _pivot(p)
    for s in page.serving:
        out += _serving(s)
    for t in page.spec:
        out += _spec(t)
    if page.timelines:
        out += ["## run timelines", ""]
        for t in page.timelines:
            out += ["```", format_account(t), "```", ""]
    return "\n".join(out).rstrip() + "\n"
