"""Run timelines: the engine's step records of a real run on CPU (one per launched step, its
tokens adding up to the run's), the account of the wall time, the file, the plots, vLLM's side
(bench_vllm.py's step recording against vLLM's API names) and the comparison of two runs."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bench_support import cli

from fixtures import ENGINES, build_llm
from liteinfer import SamplingParams
from liteinfer.bench import registry, runner
from liteinfer.bench.cli import timeline_path
from liteinfer.bench.report_html import render_timelines_html
from liteinfer.bench.timeline import (
    AFTER,
    BELOW,
    FULL,
    HOST_GAPS,
    MIXED,
    PROMPT_ONLY,
    TAIL,
    OutputSteps,
    Timeline,
    account,
    format_account,
    format_comparison,
    read_timeline,
    step_dict,
    write_timeline,
)
from liteinfer.bench.workloads import SEED, Shape
from liteinfer.engine.cuda_graph import capture_sizes
from liteinfer.engine.instrumentation import EAGER
from reference import random_prompts
from scripts.bench_vllm import SchedulerStatsTap, VLLMEngine
from test_spec_decode import reference_config

ISL, OSL, WIDTH, PROMPTS = 12, 6, 3, 7


def release(llm) -> None:
    ENGINES.remove(llm)
    llm.shutdown()


def measured(model: str, tmp_path: Path, **overrides) -> tuple[dict, Timeline, list[list[int]],
                                                                 int]:
    """A throughput run of the tiny model with its timeline: (row, timeline, the measured
    prompts, the steps the runner launched while measuring)."""
    args = runner.engine_args_for(registry.DEFAULT, {
        "attention_backend": "torch", "enforce_eager": True, "enable_prefix_caching": False,
        **overrides})
    llm = runner.make_llm(model, args)
    ENGINES.append(llm)
    try:
        core = llm.engine.core
        launches = []
        execute = core.runner.execute
        core.runner.execute = lambda *a: launches.append(core.recorder) or execute(*a)
        run = registry.get(registry.DEFAULT).run("throughput", Shape.parse(ISL, OSL), WIDTH,
                                                 PROMPTS)
        row = runner.measure(llm, run, model, args, tmp_path / "t.jsonl")
        prompts, _ = runner.workload(run.shape, PROMPTS, SEED, core.model_config.vocab_size)
        assert core.recorder is None  # recording stops with the run
    finally:
        release(llm)
    return row, read_timeline(Path(row["timeline"])), prompts, sum(r is not None for r in
                                                                    launches)


@pytest.fixture(scope="module")
def tiny_run(tiny_llama_dir, tmp_path_factory):
    return measured(str(tiny_llama_dir), tmp_path_factory.mktemp("timeline"))


def test_a_tiny_runs_timeline_has_a_record_per_step_and_its_tokens(tiny_run):
    row, t, prompts, launched = tiny_run
    assert len(t.steps) == launched > 0
    assert [s["step"] for s in t.steps] == list(range(len(t.steps)))
    for s in t.steps:
        assert 0 <= s["start"] <= s["launch"] <= s["launched"] <= s["ready"] <= t.wall_s
        assert s["mode"] == EAGER and s["graph_size"] == [] and s["gpu_ms"] is None
        assert 1 <= s["rows"] <= WIDTH and s["draft_tokens"] == 0
    assert sum(s["prompt_tokens"] for s in t.steps) == sum(map(len, prompts)) == PROMPTS * ISL
    # A prompt's last step samples its first token; each later token is one decode token.
    assert sum(s["decode_tokens"] for s in t.steps) == PROMPTS * (OSL - 1)
    assert sum(s["output_tokens"] for s in t.steps) == row["out_tokens"] == PROMPTS * OSL
    assert t.wall_s == pytest.approx(row["wall_s"])
    assert t.header["run"] == {"config": registry.DEFAULT, "kind": "throughput", "isl": ISL,
                               "osl": OSL, "width": WIDTH, "prompts": PROMPTS}
    for key in ("gpu", "host", "commit", "torch", "date", "engine_args"):
        assert key in t.header


def test_the_account_sums_to_the_wall_time(tiny_run):
    _, t, _, _ = tiny_run
    acc = account(t)
    assert acc.accounted_s == pytest.approx(t.wall_s, abs=1e-9)
    assert sum(b.steps for b in acc.buckets.values()) == len(t.steps)
    assert acc.buckets[FULL].steps > 0 and acc.buckets[TAIL].steps > 0
    assert acc.buckets[HOST_GAPS].seconds == 0.0  # not measured without CUDA events
    assert list(acc.modes) == [EAGER]
    text = format_account(t)
    assert f"{len(t.steps)} steps" in text and "tail (decode after the last prompt)" in text


def test_the_file_round_trips_and_the_plot_renders(tiny_run, tmp_path):
    _, t, _, _ = tiny_run
    copy = tmp_path / "copy.jsonl"
    write_timeline(t, copy)
    assert read_timeline(copy) == t
    html = render_timelines_html([t])
    assert html.count('class="chart"') == 2 and html.count("<polyline") == 2
    assert "batch width" in html and "tokens per step" in html
    (tmp_path / "bad.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="not a timeline"):
        read_timeline(tmp_path / "bad.jsonl")


def test_recording_is_off_by_default(tiny_llm):
    core = tiny_llm.engine.core
    assert core.recorder is None
    tiny_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                      use_tqdm=False)
    assert core.recorder is None and core.inflight is None
    with pytest.raises(ValueError, match="not recording"):
        core.stop_recording()


def test_the_recording_hook_times_each_phase_and_names_it_for_the_profiler(tiny_llm):
    """`EngineCore.recording`, the hook the profiling scripts use: a record per step whose
    phases follow one another, and the torch profiler's ranges named after each phase."""
    core = tiny_llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with torch.profiler.profile() as prof, core.recording(profile_ranges=True) as steps:
        out = tiny_llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert core.recorder is None
    assert sum(len(o.outputs[0].token_ids) for o in out) == sum(s.output_tokens for s in steps)
    for s in steps:
        assert s.schedule_start <= s.launch_start <= s.launch_end <= s.update_start <= s.ready
        assert s.schedule_s >= 0 and s.launch_s > 0 and s.update_s >= 0
    names = {e.name for e in prof.events()}
    assert {f"liteinfer {phase} {i}" for phase in ("schedule", "launch", "update")
            for i in range(len(steps))} <= names


def test_drafts_are_counted_apart_from_decodes(tiny_llama_dir):
    """Speculative decoding: a verifying sequence's next token is a decode token and its drafts
    are draft tokens; the steps' drafts are the speculator's, their outputs every token."""
    engine = dict(dtype="float32", device="cpu", max_model_len=256, enable_prefix_caching=False)
    prompts = random_prompts(4, 384, 3, 20, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = build_llm(str(tiny_llama_dir), **engine)
    try:
        ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        release(plain)
    llm = build_llm(str(tiny_llama_dir), **engine, max_num_seqs=4,
                    speculative_config=reference_config(prompts, ref, 0.4))
    try:
        core = llm.engine.core
        core.start_recording()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        steps = core.stop_recording()
        stats = core.scheduler.stats().spec_decoding
    finally:
        release(llm)
    assert out == ref
    assert stats.num_draft_tokens > 0
    assert sum(s.draft_tokens for s in steps) == stats.num_draft_tokens
    assert sum(s.prompt_tokens for s in steps) == sum(map(len, prompts))
    assert sum(s.output_tokens for s in steps) == 16 * len(prompts)
    # Every token but the prompts' first is decoded or accepted from a draft.
    assert sum(s.decode_tokens for s in steps) + stats.num_accepted_tokens == 15 * len(prompts)


def synthetic(engine: str, steps: list[tuple], width: int = 4, wall: float = 1.0,
              **header) -> Timeline:
    """steps: (ready s, rows, prompt tokens, decode tokens, gpu idle ms or None)."""
    return Timeline(
        {"type": "header", "engine": engine, "gpu": "G", "host": "h", "wall_s": wall,
         "run": {"kind": "throughput", "isl": 8, "osl": 4, "width": width, "prompts": 6},
         **header},
        [step_dict(step=i, ready=ready, rows=rows, prompt_tokens=p, decode_tokens=d,
                   output_tokens=rows, gpu_idle_ms=idle)
         for i, (ready, rows, p, d, idle) in enumerate(steps)])


OURS = synthetic("liteinfer", [(0.1, 4, 32, 0, None), (0.2, 4, 0, 4, 20.0), (0.3, 4, 16, 2, 0.0),
                               (0.4, 3, 0, 3, None), (0.6, 4, 8, 3, None), (0.7, 4, 0, 4, None),
                               (0.8, 2, 0, 2, None), (0.9, 1, 0, 1, None)], commit="a" * 40)


def test_the_account_of_a_synthetic_timeline():
    acc = account(OURS)
    seconds = {name: round(b.seconds, 6) for name, b in acc.buckets.items()}
    assert seconds == {PROMPT_ONLY: 0.1, FULL: 0.18, HOST_GAPS: 0.02, MIXED: 0.3, BELOW: 0.1,
                       TAIL: 0.2, AFTER: 0.1}
    assert [acc.buckets[c].steps for c in (PROMPT_ONLY, FULL, MIXED, BELOW, TAIL)] == [
        1, 2, 2, 1, 2]
    assert acc.buckets[TAIL].rows == 3 and acc.buckets[MIXED].prompt_tokens == 24


def test_comparing_two_timelines(tmp_path, capsys):
    vllm = synthetic("vllm", [(0.1, 4, 32, 0, None), (0.15, 4, 0, 4, None),
                              (0.5, 4, 24, 8, None)], wall=0.6, version="0.26.0")
    text = format_comparison(OURS, vllm)
    assert text.startswith("A: liteinfer aaaaaaaaaa · G") and "B: vllm 0.26.0 · G" in text
    assert "warning" not in text
    mixed = next(line for line in text.splitlines() if line.startswith(MIXED))
    assert mixed.split()[-1] == "-0.050" and mixed.split()[6:8] == ["2", "150.00"]
    total = text.splitlines()[-1].split()
    assert total == ["total", "1.000", "0.600", "+0.400"]
    elsewhere = dataclasses.replace(vllm, header={**vllm.header, "host": "other"})
    assert "different machines" in format_comparison(OURS, elsewhere)
    a, b, page = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "t.html"
    write_timeline(OURS, a)
    write_timeline(vllm, b)
    cli("timeline", a, b, "--html", page)
    assert capsys.readouterr().out.startswith("A: liteinfer")
    assert page.read_text().count('class="chart"') == 2
    with pytest.raises(ValueError, match="one timeline, or two"):
        cli("timeline", a, b, a)


def test_timeline_paths():
    run = registry.get(registry.DEFAULT).run("throughput", Shape.parse(128, 256), 32, 200)
    assert timeline_path(Path("t.jsonl"), run, 1) == Path("t.jsonl")
    assert timeline_path(Path("out"), run, 2) == Path(
        f"out/{registry.DEFAULT}-throughput-128-256-w32.jsonl")
    with pytest.raises(ValueError, match="name a directory"):
        timeline_path(Path("t.jsonl"), run, 2)


class FakeVLLMEngine:
    """vLLM's LLMEngine as bench_vllm.py calls it: `step()` returns RequestOutputs with
    cumulative token ids; `engine_core.get_output()` returns EngineCoreOutputs whose
    `scheduler_stats` has num_running_reqs and num_waiting_reqs."""

    def __init__(self, script: list[list[tuple[str, int, bool]]]):
        self.script, self.tokens = script, {}
        self.engine_core = SimpleNamespace(get_output=self._get_output)

    def _get_output(self):
        return SimpleNamespace(outputs=[], scheduler_stats=SimpleNamespace(
            num_running_reqs=len(self.script[0]), num_waiting_reqs=1))

    def add_request(self, rid, prompt, params):
        self.tokens[rid] = []

    def step(self):
        self.engine_core.get_output()
        outs = []
        for rid, n, finished in self.script.pop(0):
            self.tokens[rid] += [9] * n
            outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[
                SimpleNamespace(token_ids=list(self.tokens[rid]))]))
        return outs


def test_vllm_steps_are_counted_from_its_outputs_and_scheduler_stats():
    fake = FakeVLLMEngine([[("a", 1, False)], [("a", 1, False), ("b", 1, False)],
                           [("a", 1, True), ("b", 2, True)]])
    engine = VLLMEngine(fake, lambda **kw: kw, lambda **kw: kw, SchedulerStatsTap(fake))
    engine.recording = OutputSteps()
    for rid, n in (("a", 5), ("b", 7)):
        engine.add_request(rid, list(range(n)), SamplingParams(max_tokens=3, ignore_eos=True))
    outs = [engine.step() for _ in range(3)]
    assert [[len(o.new_token_ids) for o in step] for step in outs] == [[1], [1, 1], [1, 2]]
    steps = engine.recording.steps
    assert [(s["rows"], s["waiting"], s["prompt_tokens"], s["decode_tokens"],
             s["output_tokens"]) for s in steps] == [(1, 1, 5, 0, 1), (2, 1, 7, 1, 2),
                                                     (2, 1, 0, 3, 3)]
    t = engine.recording.timeline(steps[0]["start"], steps[-1]["ready"],
                                  {"engine": "vllm", "run": {"width": 2}})
    assert t.steps[0]["start"] == 0.0 and account(t).accounted_s == pytest.approx(t.wall_s)
    # Without scheduler stats (vLLM's stat logging off) the rows are the requests with tokens.
    quiet = OutputSteps()
    quiet.add_request("c", 4)
    quiet.record(0.0, 0.1, [("c", 1)])
    assert (quiet.steps[0]["rows"], quiet.steps[0]["waiting"]) == (1, None)


@pytest.mark.gpu
def test_a_gpu_runs_timeline_times_every_step(tiny_llama_dir, tmp_path):
    """On CUDA every step has its device span and idle time, and runs as a captured graph of a
    captured size (decode) or bucket (prompt and mixed steps)."""
    assert torch.cuda.is_available()
    _, t, _, launched = measured(str(tiny_llama_dir), tmp_path, attention_backend="triton",
                                 enforce_eager=False, max_num_seqs=8)
    assert len(t.steps) == launched
    assert all(s["gpu_ms"] is not None and s["gpu_ms"] > 0 for s in t.steps)
    assert all(s["gpu_idle_ms"] is not None and s["gpu_idle_ms"] >= 0 for s in t.steps[1:])
    modes = {s["mode"] for s in t.steps}
    assert "decode-graph" in modes and modes <= {"decode-graph", "prompt-graph", EAGER}
    for s in t.steps:
        if s["mode"] == "decode-graph":
            assert s["graph_size"][0] in capture_sizes(8) and s["graph_size"][0] >= s["rows"]
    assert sum(s["gpu_ms"] for s in t.steps) / 1e3 <= t.wall_s
    assert re.search(r"decode-graph \d+", format_account(t))
