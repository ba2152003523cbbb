"""The Markdown and HTML pages rendered from a fixed result set, compared with golden files
(regenerate with LITEINFER_UPDATE_GOLDEN=1), and the HTML page opened in headless Chromium."""
from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from bench_support import LINEAGE

from liteinfer.bench.report import render_markdown
from liteinfer.bench.report_html import render_html
from liteinfer.bench.store import load_rows
from liteinfer.bench.tables import build_page

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "data" / "results.jsonl"  # synthetic rows, not measurements
REFERENCE = HERE.parents[1] / "benchmarks" / "reference"
GOLDEN = HERE / "golden"


@pytest.fixture(scope="module")
def page():
    return build_page(load_rows(RESULTS, REFERENCE), LINEAGE)


@pytest.mark.parametrize("name, render", [("BENCHMARKS.md", render_markdown),
                                          ("report.html", render_html)])
def test_matches_golden(page, name, render):
    text = render(page)
    golden = GOLDEN / name
    if os.environ.get("LITEINFER_UPDATE_GOLDEN") == "1":
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8"), (
        f"{name} differs from {golden}; if the change is intended, rerun with "
        "LITEINFER_UPDATE_GOLDEN=1 and review the diff")


def test_html_is_self_contained(page):
    html = render_html(page)
    for needle in ("<script", "<link", "src=", "url(", "https:"):
        assert needle not in html
    assert html.count("http://") == html.count('xmlns="http://www.w3.org/2000/svg"')


class _Elements(HTMLParser):
    """Counts tags, and (tag, class) pairs, of a DOM dump."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def handle_starttag(self, tag, attrs):
        self.counts[tag] += 1
        for cls in (dict(attrs).get("class") or "").split():
            self.counts[f"{tag}.{cls}"] += 1


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return exe


def test_html_renders_in_headless_chromium(page, tmp_path):
    html = tmp_path / "report.html"
    html.write_text(render_html(page), encoding="utf-8")
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(browser + ["--dump-dom", html.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    parser = _Elements()
    parser.feed(dom)
    n = parser.counts
    assert n["table"] == len(page.tables) + len(page.pivots)
    assert n["svg.chart"] == 3 and n["polyline"] >= 3 and n["circle"] >= 20
    lines = sum(len(t.lines) for t in page.tables)
    pivot_cells = sum(v is not None for p in page.pivots for _, vs in p.rows for v in vs)
    assert n["svg.bar"] == lines + pivot_cells
    assert n["rect.fill"] == n["svg.bar"]
    assert n["a.approx"] > 0 and n["p.warn"] == sum(t.mixed_prompts for t in page.tables)

    shot = tmp_path / "shot.png"
    subprocess.run(browser + ["--window-size=1280,2000", f"--screenshot={shot}", html.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 50_000  # a blank page of this size compresses to a few KB
