"""The harness driving an engine (a fake one with the engine's interface), the CLI around it,
and the transformers baselines on a tiny model."""
from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import FakeEngine, FakeLLM, cli

from liteinfer.bench import hf_baseline, registry, runner
from liteinfer.bench.hf_baseline import HFBaseline, measure_hf
from liteinfer.bench.registry import Run
from liteinfer.bench.store import read_jsonl
from liteinfer.bench.workloads import Shape, fingerprint, fold_into_vocab, make_prompts

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "benchmarks" / "reference"


class StepCountingEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.steps = 0
        self.added_at: list[int] = []

    def add_request(self, request_id, prompt_token_ids, params):
        super().add_request(request_id, prompt_token_ids, params)
        self.added_at.append(self.steps)

    def step(self):
        self.steps += 1
        return super().step()


def test_drive_admits_as_soon_as_one_finishes():
    engine = StepCountingEngine()
    traces = runner.drive(engine, [[1], [2], [3], [4]], [1, 4, 3, 1], width=2)
    assert engine.added_at == [0, 0, 1, 4]
    assert engine.max_in_flight == 2
    assert [len(t.tokens) for t in traces] == [1, 4, 3, 1]
    assert all(t.tokens[0] >= t.submit for t in traces)


def test_throughput_row_excludes_warmup():
    llm = FakeLLM()
    row = runner.run_throughput(llm, registry.DEFAULT, Shape(16, 5), width=3, prompts=7, model="m",
                                engine_args={"max_num_seqs": 3})
    added = llm.engine.added
    assert [n for _, _, n in added[:3]] == [1, 3, 5]  # warm-up: the batch shrinks 3, 2, 1
    assert len(added) == 3 + 7 and all(n == 5 for _, _, n in added[3:])
    assert llm.engine.max_in_flight == 3
    assert llm.engine.resets_at == [3]  # the prefix cache is emptied after the warm-up
    measured, _ = fold_into_vocab(make_prompts(16, 7), 512)
    assert [p for _, p, _ in added[3:]] == measured
    assert row["prompts"] == row["requests"] == 7 and row["out_tokens"] == 35 and row["all_forced"]
    assert row["fingerprint"] == fingerprint(measured) and row["vocab_fold"] == 512
    assert row["warmup_requests"] == 3 and row["width"] == 3 and row["kind"] == "throughput"
    assert row["engine_args"] == {"max_num_seqs": 3} and row["engine"] == "liteinfer"
    for key in ("commit", "gpu", "torch", "triton", "transformers", "timestamp", "itl_p50",
                "ttft_p95", "e2e_p50", "tok_s", "req_s", "wall_s"):
        assert key in row


def test_latency_is_one_request_at_a_time():
    llm = FakeLLM()
    row = runner.run_latency(llm, registry.DEFAULT, Shape(8, 4), prompts=3, model="m",
                             engine_args={})
    assert llm.engine.max_in_flight == 1
    assert len(llm.engine.added) == 2 + 3 and row["width"] == 1 and row["prompts"] == 3


@pytest.fixture
def fake_llms(monkeypatch):
    made: list[FakeLLM] = []

    def make_llm(model, engine_args):
        made.append(FakeLLM(**engine_args))
        return made[-1]

    monkeypatch.setattr(runner, "make_llm", make_llm)
    return made


def test_cli_run_and_report(fake_llms, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "results" / "r.jsonl"
    cli("run", "throughput", "--isl", "16", "--osl", "4", "--prompts", "5", "--width", "2",
        "--model", tiny_llama_dir, "--out", out, "--set", "max_num_seqs=8",
        "--set", "attention_backend=triton")
    (row,) = read_jsonl(out)
    assert row["engine_args"] == {"dtype": "bfloat16", "max_num_seqs": 8,
                                  "attention_backend": "triton"}
    assert fake_llms[0].engine_args == row["engine_args"]
    assert (row["config"], row["model"], row["isl"], row["osl"], row["width"]) == (
        registry.DEFAULT, "tiny-llama", 16, 4, 2)
    assert fake_llms[0].shut
    printed = capsys.readouterr().out
    assert "vs vLLM" in printed and registry.DEFAULT in printed
    assert f"{registry.DEFAULT}: the prefix cache is emptied before each measured run" in printed
    md, html = tmp_path / "B.md", tmp_path / "r.html"
    cli("report", "--results", out.parent, "--reference", REFERENCE, "--md", md, "--html", html)
    assert "## throughput · tiny-llama · ISL=16 OSL=4" in md.read_text()
    assert "<svg" in html.read_text()
    with pytest.raises(ValueError, match=r"no lineage file at .*nowhere\.toml"):
        cli("report", "--results", out.parent, "--lineage", tmp_path / "nowhere.toml",
            "--md", md, "--html", html)


def test_cli_keeps_going_past_a_broken_config(fake_llms, monkeypatch, tmp_path):
    def broken(model):
        raise RuntimeError("this config is broken")

    monkeypatch.setattr(hf_baseline, "HFBaseline", broken)
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit, match="failed: eager"):
        cli("run", "--quick", "--config", "eager", registry.DEFAULT, "--isl", "8", "--osl", "2",
            "--prompts", "2", "--out", out)
    assert [(r["config"], r["kind"]) for r in read_jsonl(out)] == [
        (registry.DEFAULT, "latency"), (registry.DEFAULT, "throughput")]


def test_cli_plan_errors(monkeypatch):
    monkeypatch.chdir(REPO)  # the stored rows are found under benchmarks/results/
    with pytest.raises(ValueError, match="name a kind"):
        cli("run", "--dry-run")
    with pytest.raises(ValueError, match="vllm is a reference point"):
        cli("run", "latency", "--config", "vllm", "--dry-run")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        cli("run", "latency", "--set", "no_such_field=1")
    stored = [r for r in read_jsonl(REPO / "benchmarks/results/2026-11-30-h200.jsonl")
              if r["config"] == "overlap"]
    newest = max(stored, key=lambda r: r["timestamp"])["commit"][:7]
    with pytest.raises(ValueError, match=(
            r"overlap is removed from the codebase: .* renders its stored rows \("
            rf"benchmarks/results/2026-11-30-h200.jsonl: {len(stored)} row\(s\), the newest "
            rf"of commit {newest}\)")):
        cli("run", "--all", "--config", registry.DEFAULT, "overlap", "--dry-run")
    with pytest.raises(ValueError, match=r"paged-b4 is removed .*none under benchmarks/results/"):
        cli("run", "throughput", "--config", "paged-b4", "--dry-run")
    with pytest.raises(ValueError, match="prompt-graphs is called default now"):
        cli("run", "--quick", "--config", "prompt-graphs", "--dry-run")
    with pytest.raises(ValueError, match="unknown benchmark config 'nosuch'; those that run: "):
        cli("run", "--quick", "--config", "nosuch", "--dry-run")


def test_transformers_baseline_on_cpu(tiny_llama_dir):
    baseline = HFBaseline(str(tiny_llama_dir))
    try:
        row = measure_hf(baseline, Run("eager-b4", "throughput", Shape(8, 3), 2, 4),
                         str(tiny_llama_dir), {"use_cache": True})
        nocache = measure_hf(baseline, Run("nocache", "latency", Shape(8, 3), 1, 2),
                             str(tiny_llama_dir), {"use_cache": False})
    finally:
        baseline.shutdown()
    assert row["engine"] == "transformers" and row["out_tokens"] == 12 and row["all_forced"]
    assert row["width"] == 2 and row["prompts"] == 4 and row["vocab_fold"] == 384
    assert nocache["out_tokens"] == 6 and nocache["engine_args"] == {"use_cache": False}
