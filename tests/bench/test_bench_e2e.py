"""END-TO-END: `liteinfer-bench run latency|throughput --quick` through the real engine on CPU
with a tiny dummy-weight model, then `liteinfer-bench report` over what it wrote."""
from __future__ import annotations

import pytest
from bench_support import cli

from liteinfer.bench import registry
from liteinfer.bench.store import read_jsonl

pytestmark = pytest.mark.slow

# The quick runs shrunk to CPU size, eager with the torch attention backend.
CPU_QUICK = ("--quick", "--isl", "16", "--osl", "8", "--prompts", "4",
             "--set", "attention_backend=torch", "--set", "enforce_eager=true")


def test_quick_bench_end_to_end_on_cpu(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "results" / "cpu.jsonl"
    cli("run", "latency", *CPU_QUICK, "--model", tiny_llama_dir, "--out", out)
    cli("run", "throughput", *CPU_QUICK, "--width", "3", "--model", tiny_llama_dir, "--out", out)
    latency, throughput = read_jsonl(out)
    for row in (latency, throughput):
        assert row["config"] == registry.DEFAULT and row["engine"] == "liteinfer"
        assert row["model"] == "tiny-llama" and (row["isl"], row["osl"]) == (16, 8)
        assert row["prompts"] == row["requests"] == 4 and row["out_tokens"] == 32
        assert row["all_forced"] and row["vocab_fold"] == 384
        assert row["engine_args"] == {"dtype": "bfloat16", "attention_backend": "torch",
                                      "enforce_eager": True}
        assert row["ttft_p50"] > 0 and row["itl_p50"] > 0 and row["tok_s"] > 0
    assert (latency["kind"], latency["width"]) == ("latency", 1)
    assert (throughput["kind"], throughput["width"]) == ("throughput", 3)
    assert latency["fingerprint"] == throughput["fingerprint"]
    assert "row(s) appended" in capsys.readouterr().out

    md, html = tmp_path / "BENCHMARKS.md", tmp_path / "report.html"
    cli("report", "--results", out.parent, "--reference", tmp_path / "none", "--md", md,
        "--html", html)
    text = md.read_text()
    assert "## latency · tiny-llama · ISL=16 OSL=8" in text
    assert "## throughput · tiny-llama · ISL=16 OSL=8" in text
    assert f"liteinfer-{registry.DEFAULT} · W=3" in text
    assert html.read_text().count('class="chart"') == 3
