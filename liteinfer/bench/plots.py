"""Inline SVG for the HTML report: line charts (log-log, or linear over a run's steps) and the
standing bars of the tables."""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

# One colour per configuration of the registry, so a config looks the same in every chart.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#ad494a", "#637939", "#843c39",
           "#e7ba52", "#6b6ecf", "#d6616b", "#31a354")
REFERENCE_COLOR = "#222222"
_W, _H = 680, 340
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 190, 34, 48


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (x, y), x ascending
    color: str
    dashed: bool = False


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks across [lo, hi]; just the decades when those are too many."""
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    if len(inside) > 8:
        inside = [t for t in inside if math.log10(t).is_integer()]
    return inside or [lo, hi]


def _linear_ticks(lo: float, hi: float) -> list[float]:
    """At most about 8 ticks across [lo, hi] at a 1-2-5 step."""
    raw = (hi - lo) / 8
    step = min(m * 10.0 ** math.ceil(math.log10(raw / m)) for m in (1, 2, 5))
    return [i * step for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:,.3g}"


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = 1.25 if hi > lo else 2.0  # breathing room; a single value still gets an axis
    return lo / pad, hi * pad


@dataclass
class _Axis:
    """A log axis padded around its values, or a linear one from 0 to just above the largest."""

    lo: float
    hi: float
    log: bool

    @classmethod
    def over(cls, values: list[float], log: bool) -> _Axis:
        if log:
            return cls(*_span(values), log=True)
        return cls(0.0, max(max(values) * 1.05, 1e-9), log=False)

    def fraction(self, v: float) -> float:
        if self.log:
            return math.log(v / self.lo) / math.log(self.hi / self.lo)
        return (v - self.lo) / (self.hi - self.lo)

    def ticks(self) -> list[float]:
        return _log_ticks(self.lo, self.hi) if self.log else _linear_ticks(self.lo, self.hi)


def line_chart(title: str, x_label: str, y_label: str, series: list[Series],
               log: bool = True) -> str:
    """Log-log with a marker per point and a grid line per x value (few points, such as batch
    widths); `log=False`: linear axes from 0, lines only (many points, such as a run's steps)."""
    xs = sorted({x for s in series for x, _ in s.points})
    x_axis = _Axis.over(xs, log)
    y_axis = _Axis.over([y for s in series for _, y in s.points], log)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + plot_w * x_axis.fraction(x)

    def py(y: float) -> float:
        return _TOP + plot_h * (1 - y_axis.fraction(y))

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" '
           f'role="img" aria-label="{escape(title)}">',
           f'<text class="title" x="{_LEFT}" y="20">{escape(title)}</text>',
           f'<rect class="frame" x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}"/>']
    for y in y_axis.ticks():
        out.append(f'<line class="grid" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{py(y):.1f}" '
                   f'y2="{py(y):.1f}"/><text class="tick" x="{_LEFT - 6}" y="{py(y) + 4:.1f}" '
                   f'text-anchor="end">{_num(y)}</text>')
    for x in xs if log else x_axis.ticks():
        out.append(f'<line class="grid" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{_TOP}" '
                   f'y2="{_TOP + plot_h}"/><text class="tick" x="{px(x):.1f}" '
                   f'y="{_TOP + plot_h + 16}" text-anchor="middle">{_num(x)}</text>')
    out.append(f'<text class="axis" x="{_LEFT + plot_w / 2}" y="{_H - 8}" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="axis" transform="translate(16 {_TOP + plot_h / 2}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text>')
    for i, s in enumerate(series):
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<g class="series" data-name="{escape(s.name)}">')
        if len(s.points) > 1:
            out.append(f'<polyline points="{coords}" stroke="{s.color}"{dash}/>')
        for x, y in s.points if log else []:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{s.color}">'
                       f'<title>{escape(s.name)}: {_num(x)} → {_num(y)}</title></circle>')
        ly = _TOP + 6 + 16 * i
        lx = _LEFT + plot_w + 14
        out.append(f'<line x1="{lx}" x2="{lx + 18}" y1="{ly}" y2="{ly}" stroke="{s.color}"{dash}/>'
                   f'<text class="legend" x="{lx + 24}" y="{ly + 4}">{escape(s.name)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def bar(fraction: float, width: int = 90) -> str:
    """A horizontal bar filled to `fraction` of its length."""
    return (f'<svg class="bar" width="{width}" height="8" viewBox="0 0 {width} 8">'
            f'<rect class="track" width="{width}" height="8"/>'
            f'<rect class="fill" width="{fraction * width:.1f}" height="8"/></svg>')
