"""The benchmark page as one self-contained HTML file: inline CSS and SVG, no scripts, no
network."""
from __future__ import annotations

import re
from html import escape

from liteinfer.bench.lineage import Lineage
from liteinfer.bench.plots import PALETTE, REFERENCE_COLOR, Series, bar, line_chart
from liteinfer.bench.registry import REMOVED, VLLM
from liteinfer.bench.report import SPEC_COLUMNS, SPEC_INTRO, fmt, spec_cells
from liteinfer.bench.store import DEFAULT_PRECISION
from liteinfer.bench.tables import (
    FLOOR,
    INTRO,
    MIXED_PROMPTS,
    RATIOS,
    Cell,
    Page,
    Pivot,
    SpecTable,
    Table,
    standing,
)
from liteinfer.bench.timeline import CATEGORIES, Timeline, account
from liteinfer.bench.workloads import MIXED

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1b1b;
       margin: 0; background: #fafafa; }
main { max-width: 1180px; margin: 0 auto; padding: 24px; }
h1 { margin: 0 0 8px; } h2 { font-size: 17px; margin: 32px 0 8px; }
.intro { color: #444; max-width: 900px; }
dl.header { display: flex; flex-wrap: wrap; gap: 6px 22px; margin: 14px 0; }
dl.header div { display: flex; gap: 6px; } dt { color: #666; } dd { margin: 0; font-weight: 600; }
table { border-collapse: collapse; background: #fff; width: 100%; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 5px 8px; vertical-align: top; }
thead th { text-align: right; font-weight: 600; color: #444; border-bottom: 2px solid #ccc; }
thead th:first-child, tbody th { text-align: left; }
tbody th { font-weight: normal; max-width: 430px; }
.name { font-weight: 600; display: block; } .notes { color: #666; font-size: 12px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.headline svg { margin-right: 6px; vertical-align: middle; }
svg.bar .track { fill: #eef1f5; } svg.bar .fill { fill: #4c78a8; }
tr.reference svg.bar .fill { fill: #9a9a9a; } tr.reference { background: #f6f6f6; }
tr.removed .name { color: #777; }
td.good { color: #16723a; } td.bad { color: #b3261e; } td.none { color: #aaa; }
a.approx { color: inherit; text-decoration: none; border-bottom: 1px dotted #888; }
.warn { color: #8a5a00; margin: 4px 0; }
ol.notes { color: #555; font-size: 12px; margin: 6px 0 0; padding-left: 22px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg.chart { background: #fff; border: 1px solid #e4e4e4; width: 560px; max-width: 100%;
            height: auto; }
svg.chart .title { font-weight: 600; font-size: 13px; }
svg.chart .frame { fill: none; stroke: #bbb; } svg.chart .grid { stroke: #eee; }
svg.chart .tick, svg.chart .legend { font-size: 11px; fill: #444; }
svg.chart .axis { font-size: 12px; fill: #333; }
svg.chart polyline { fill: none; stroke-width: 2; } svg.chart .series line { stroke-width: 2; }
"""


def _anchor(t: Table) -> str:
    precision = "" if t.precision == DEFAULT_PRECISION else f"-{t.precision}"
    return re.sub(r"[^a-z0-9]+", "-", f"{t.kind}{precision}-{t.shape.label}".lower()).strip("-")


def _ratio(cell: Cell, note_id: str) -> str:
    if cell.value is None:
        if cell.note:  # why there is no ratio (rows of other machines)
            return (f'<td class="num none"><a class="approx" href="#{note_id}-{cell.note}">—'
                    f"<sup>{cell.note}</sup></a></td>")
        return '<td class="num none">—</td>'
    tone = "good" if cell.value > 1.005 else "bad" if cell.value < 0.995 else ""
    text = f"{cell.value:.2f}x"
    if cell.note:
        text = (f'<a class="approx" href="#{note_id}-{cell.note}">{text}~'
                f"<sup>{cell.note}</sup></a>")
    return f'<td class="num {tone}">{text}</td>'


def _table(t: Table) -> str:
    anchor = _anchor(t)
    out = [f'<section class="table" id="{anchor}">', f"<h2>{escape(t.title)}</h2>"]
    if t.mixed_prompts:
        out.append(f'<p class="warn">{MIXED_PROMPTS}</p>')
    heads = ["config"] + [name for name, _ in t.columns] + [FLOOR, *RATIOS]
    out.append("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in heads)
               + "</tr></thead><tbody>")
    for line in t.lines:
        kind = ("reference" if line.config.base is None else
                "removed" if line.config.status == REMOVED else "lineage")
        cells = [f'<th scope="row"><span class="name">{escape(line.label)}</span>'
                 f'<span class="notes">{escape(" · ".join(line.notes))}</span></th>']
        for i, (_, key) in enumerate(t.columns):
            value = fmt(line.row.get(key))
            if i == 0:
                cells.append(f'<td class="num headline">{bar(line.standing)}{value}</td>')
            else:
                cells.append(f'<td class="num">{value}</td>')
        cells.append(f'<td class="num">{line.floor_text}</td>')
        cells += [_ratio(c, f"{anchor}-note") for c in line.ratios]
        out.append(f'<tr class="{kind}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if t.footnotes:
        out.append('<ol class="notes">' + "".join(
            f'<li id="{anchor}-note-{i}">{escape(n)}</li>' for i, n in enumerate(t.footnotes, 1))
            + "</ol>")
    return "\n".join(out + ["</section>"])


def _pivot(p: Pivot) -> str:
    out = [f'<section class="pivot"><h2>{escape(p.title)}</h2>',
           f'<p class="intro">{escape(p.unit)} of each config\'s row at each shape; '
           f"bars show standing within a column.</p>",
           "<table><thead><tr><th>config</th>"
           + "".join(f"<th>{escape(s.label)}</th>" for s in p.shapes) + "</tr></thead><tbody>"]
    best = [[v for _, vs in p.rows if (v := vs[i])] for i in range(len(p.shapes))]
    for label, values in p.rows:
        cells = []
        for i, v in enumerate(values):
            if not v:
                cells.append('<td class="num none">—</td>')
                continue
            cells.append(f'<td class="num headline">{bar(standing(p.kind, v, best[i]), 50)}'
                         f'{fmt(v)}</td>')
        out.append(f'<tr><th scope="row">{escape(label)}</th>' + "".join(cells) + "</tr>")
    return "\n".join(out + ["</tbody></table></section>"])


def _series(points: dict[str, list[tuple[float, float]]], lineage: Lineage) -> list[Series]:
    """One series per config, vLLM's widths joined into one dashed reference line."""
    out = []
    for name in sorted(points, key=lineage.order.__getitem__):
        ref = name == VLLM
        color = REFERENCE_COLOR if ref else PALETTE[lineage.order[name] % len(PALETTE)]
        label = name if ref else lineage.get(name).label
        out.append(Series(label, sorted(points[name]), color, dashed=ref))
    return out


def _charts(page: Page) -> str:
    by_width: dict[str, dict[str, list[tuple[float, float]]]] = {"tok_s": {}, "itl_p50": {}}
    by_isl: dict[str, list[tuple[float, float]]] = {}
    for t in page.tables:
        if t.precision != DEFAULT_PRECISION:  # the charts show the default precision's rows
            continue
        for line in t.lines:
            family = VLLM if line.config.engine == VLLM else line.config.name
            if t.kind == "throughput" and t.shape == page.headline:
                for key, points in by_width.items():
                    if line.row.get(key):
                        points.setdefault(family, []).append((line.row["width"], line.row[key]))
            elif t.kind == "latency" and t.shape.isl != MIXED and line.row.get("itl_p50"):
                by_isl.setdefault(family, []).append((t.shape.isl, line.row["itl_p50"]))
    shape = page.headline.title
    charts = []
    if by_width["tok_s"]:
        charts.append(line_chart(f"throughput by batch width · {shape}", "batch width (requests in "
                                 "flight)", "tok/s (higher is better)",
                                 _series(by_width["tok_s"], page.lineage)))
    if by_width["itl_p50"]:
        charts.append(line_chart(f"ITL p50 by batch width · {shape}", "batch width (requests in "
                                 "flight)", "ITL p50, ms (lower is better)",
                                 _series(by_width["itl_p50"], page.lineage)))
    if by_isl:
        charts.append(line_chart("latency: ITL p50 by prompt length, one request at a time",
                                 "prompt length (tokens)", "ITL p50, ms (lower is better)",
                                 _series(by_isl, page.lineage)))
    return '<section class="charts">' + "\n".join(charts) + "</section>" if charts else ""


def _timeline(timelines: list[Timeline]) -> str:
    """Batch width and tokens per step over each run's time, and where its wall time went."""
    colors = [REFERENCE_COLOR if t.header["engine"] == VLLM else PALETTE[i % len(PALETTE)]
              for i, t in enumerate(timelines)]
    charts = []
    for key, what in (("rows", "batch width (sequences in the step)"),
                      ("tokens", "tokens per step (prompt + decode + draft)")):
        series = []
        for t, color in zip(timelines, colors, strict=True):
            points = [(s["ready"], s["rows"] if key == "rows" else
                       sum(s[k] or 0 for k in ("prompt_tokens", "decode_tokens", "draft_tokens")))
                      for s in t.steps if s["ready"] is not None]
            if points:
                series.append(Series(t.label, points, color, dashed=t.header["engine"] == VLLM))
        if series:
            charts.append(line_chart(f"{what} over the run", "time since the first request (s)",
                                     what, series, log=False))
    head = "".join(f"<th>{escape(h)}</th>" for h in ("where the time went", *(
        f"{t.label}: s (share)" for t in timelines)))
    accounts = [account(t) for t in timelines]
    lines = []
    for name in CATEGORIES:
        cells = "".join(f'<td class="num">{a.buckets[name].seconds:.3f} '
                        f"({a.buckets[name].seconds / a.wall_s:.1%})</td>" for a in accounts)
        lines.append(f'<tr><th scope="row">{escape(name)}</th>{cells}</tr>')
    runs = "".join(f"<li>{escape(t.label)}: {escape(str(t.header['run']))}, wall "
                   f"{t.wall_s:.3f} s, {len(t.steps)} steps</li>" for t in timelines)
    return ('<section class="timeline"><h2>run timelines</h2>'
            f'<ul class="intro">{runs}</ul><div class="charts">{"".join(charts)}</div>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"
            "</section>")


def _document(title: str, body: list[str]) -> str:
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style>"
            "</head><body><main>\n" + "\n".join(b for b in body if b) + "\n</main></body></html>\n")


def _spec(t: SpecTable) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in SPEC_COLUMNS)
    body = "".join("<tr>" + "".join(f'<td class="num">{escape(c)}</td>' for c in spec_cells(line))
                   + "</tr>" for line in t.lines)
    return (f'<section class="table"><h2>{escape(t.title)}</h2><p>{escape(SPEC_INTRO)} Builds: '
            f'{escape(", ".join(t.builds))}.</p><table><thead><tr>{head}</tr></thead><tbody>'
            f"{body}</tbody></table></section>")


def render_html(page: Page) -> str:
    header = "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>"
                     for k, v in page.header)
    body = ["<h1>liteinfer benchmarks</h1>", f'<p class="intro">{escape(INTRO)}</p>',
            f'<dl class="header">{header}</dl>', _charts(page)]
    body += [_table(t) for t in page.tables] + [_pivot(p) for p in page.pivots]
    body += [_spec(t) for t in page.spec]
    if page.timelines:
        body.append(_timeline(page.timelines))
    return _document(f"liteinfer benchmarks · {page.model}", body)


def render_timelines_html(timelines: list[Timeline]) -> str:
    """A page of run timelines alone (`liteinfer-bench timeline --html`)."""
    return _document("liteinfer run timelines", ["<h1>run timelines</h1>", _timeline(timelines)])
