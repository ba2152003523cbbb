"""Ratios, `~` marks, lineage resolution and the loading of result and reference rows."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
from bench_support import LINEAGE, REPO

from liteinfer.bench import registry
from liteinfer.bench.lineage import load_lineage
from liteinfer.bench.serve import offline_row
from liteinfer.bench.store import append_row, engine_commit, latest, load_rows, results_file
from liteinfer.bench.tables import SPANS_ENGINES, build_page, ratio, spec_tables
from liteinfer.bench.workloads import fingerprint, make_prompts


def row(config, kind="latency", isl=128, osl=256, width=1, **extra):
    base = {"config": config, "kind": kind, "isl": isl, "osl": osl, "width": width, "prompts": 50,
            "model": "m", "engine": "liteinfer", "fingerprint": "f" * 64, "gpu": "G",
            "host": "h", "commit": "c" * 40, "timestamp": "2026-01-01T00:00:00+00:00",
            "itl_p50": 10.0, "tok_s": 100.0}
    return {**base, **extra}


def table(page, kind, isl=128, osl=256):
    return next(t for t in page.tables
                if t.kind == kind and (t.shape.isl, t.shape.osl) == (isl, osl))


def line(t, label):
    return next(x for x in t.lines if x.label == label)


def texts(x):
    return [c.text for c in x.ratios]


def test_ratio_direction_above_one_is_better():
    assert ratio("latency", {"itl_p50": 5.0}, {"itl_p50": 10.0}) == pytest.approx(2.0)
    assert ratio("throughput", {"tok_s": 300.0}, {"tok_s": 100.0}) == pytest.approx(3.0)
    assert ratio("latency", {"itl_p50": None}, {"itl_p50": 10.0}) is None


def test_lineage_walks_through_removed_configs():
    assert LINEAGE.ancestors("continuous") == ["paged-b4", "paged", "native-eager", "eager",
                                               "nocache"]
    assert LINEAGE.ancestors("splitk")[:4] == ["graphs", "paged-attn", "sdpa", "continuous"]
    assert LINEAGE.ancestors("packed") == ["graphs-mixed"]
    assert LINEAGE.ancestors(registry.DEFAULT)[:2] == ["mixed", "gemv"]
    # The configurations that run are the registry's, with the lineage's bases; the rest are
    # history.
    for c in LINEAGE.configs:
        if c.name in registry.BY_NAME:
            assert c == dataclasses.replace(registry.get(c.name), base=c.base)
        else:
            assert c.status == registry.REMOVED and not c.runs()
    assert LINEAGE.get("paged-b4").width == 4 and LINEAGE.get("continuous").width == 32


def write_lineage(tmp_path, text):
    path = tmp_path / "lineage.toml"
    path.write_text(text)
    return path


RUNNING = "".join(f'[[config]]\nname = "{c.name}"\n' for c in registry.CONFIGS)


def test_the_report_reads_its_lineage_from_the_data(tmp_path):
    """A history written as data orders the page, names each row's base and marks it removed;
    rows stored under a renamed configuration's old name are read as the new one's."""
    lineage = load_lineage(write_lineage(tmp_path, f"""
[renamed]
old-default = "default"

[[config]]
name = "first-try"
description = "A step of the history"
width = 4

{RUNNING}

[[config]]
name = "second-try"
base = "first-try"
description = "Its successor"
"""))
    names = [c.name for c in lineage.configs]
    assert (names[0], names[-1]) == ("first-try", "second-try")
    assert lineage.get("first-try").width == 4 and lineage.get("second-try").width == 32
    rows = [row("second-try", itl_p50=5.0), row("first-try", itl_p50=10.0),
            row("old-default", itl_p50=2.0)]
    t = table(build_page(rows, lineage), "latency")
    assert [x.label for x in t.lines] == [
        "liteinfer-first-try", "liteinfer-default", "liteinfer-second-try"]
    second = line(t, "liteinfer-second-try")
    assert texts(second)[:2] == ["2.00x", "2.00x"]
    assert second.notes == ["Its successor", "improves on liteinfer-first-try",
                            registry.REMOVED, SPANS_ENGINES]
    assert line(t, "liteinfer-default").row["itl_p50"] == 2.0
    # A configuration the data does not hold is left off the page.
    assert "liteinfer-paged" not in [x.label for x in t.lines]
    assert [x.label for x in table(build_page([row("paged")] + rows, lineage),
                                   "latency").lines] == [x.label for x in t.lines]


@pytest.mark.parametrize("text, error", [
    ('[[config]]\nname = "x"\n', "needs a description"),
    (f'{RUNNING}[[config]]\nname = "x"\ndescription = "d"\nbase = "y"\n', "names 'y'"),
    (f'{RUNNING}[[config]]\nname = "x"\ndescription = "d"\nbase = "z"\n'
     f'[[config]]\nname = "z"\ndescription = "d"\nbase = "x"\n', "loops"),
    (f'{RUNNING}[[config]]\nname = "default"\n', "named twice"),
    ('[[config]]\nname = "default"\n', "leaves out the configurations that run"),
    (f'{RUNNING}[[config]]\nname = "x"\ndescription = "d"\ncolour = 1\n', "unknown keys"),
    ('[[config]]\nname = "default"\nwidth = 4\n' + RUNNING, "only its base belongs here"),
    (f'{RUNNING}[renamed]\nx = "nowhere"\n', "renames 'x' to 'nowhere'"),
])
def test_a_lineage_that_does_not_hold_together_is_refused(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        load_lineage(write_lineage(tmp_path, text))


def test_the_committed_lineage_reads_every_stored_row():
    """Every row under benchmarks/results names a configuration of the lineage, under its name
    now or a name it had."""
    rows = load_rows(REPO / "benchmarks" / "results", None)
    assert rows
    unknown = {r["config"] for r in map(LINEAGE.current, rows)
               if r["kind"] != "serve" and r["config"] not in LINEAGE.by_name}
    assert not unknown
    assert "prompt-graphs" in {r["config"] for r in rows}  # stored rows keep their old name
    assert LINEAGE.current({"config": "prompt-graphs"}) == {"config": registry.DEFAULT}


def test_vs_base_vs_first_and_removed_bases():
    rows = [row("nocache", itl_p50=20.0, engine="transformers"),
            row("eager", itl_p50=16.0, engine="transformers"),
            row("native-eager", itl_p50=15.0, commit="0" * 40),
            row("continuous", itl_p50=10.0), row("sdpa", itl_p50=8.0)]
    t = table(build_page(rows, LINEAGE), "latency")
    eager, native, cont, sdpa = (line(t, f"liteinfer-{n}")
                                 for n in ("eager", "native-eager", "continuous", "sdpa"))
    assert texts(line(t, "liteinfer-nocache"))[:2] == ["—", "—"]
    assert texts(eager)[:2] == ["1.25x", "1.25x"]
    assert "removed from the codebase" in native.notes
    assert native.ratios[0].text == "1.07x~"  # another build of the engine
    assert t.footnotes[native.ratios[0].note - 1] == (
        "liteinfer-native-eager vs liteinfer-eager: different engine builds "
        "(0000000000 vs cccccccccc)")
    # continuous improves on paged-b4, which is removed and has no row here
    assert SPANS_ENGINES in cont.notes and "removed from the codebase" in cont.notes
    assert cont.ratios[0].text == "—"
    assert cont.ratios[1].value == pytest.approx(2.0) and cont.ratios[1].note is None
    assert texts(sdpa)[:2] == ["1.25x", "2.50x"]
    assert "improves on liteinfer-continuous" in sdpa.notes
    assert not t.mixed_prompts


def test_vs_first_is_the_earliest_ancestor_with_a_row():
    t = table(build_page([row("paged-attn", itl_p50=12.0), row("graphs", itl_p50=6.0),
                          row("splitk", itl_p50=4.0)], LINEAGE), "latency")
    assert texts(line(t, "liteinfer-paged-attn"))[:2] == ["—", "—"]
    assert texts(line(t, "liteinfer-splitk"))[:2] == ["1.50x", "3.00x"]


def test_approximate_ratios_say_why():
    rows = [row("graphs", itl_p50=6.0, fingerprint="a" * 64, prompts=20),
            row("splitk", itl_p50=5.0),
            row("vllm", itl_p50=2.0, engine="vllm", commit=None, version="0.26.0"),
            row("graphs-16k", isl=15360, osl=128, gpu="H"),
            row("vllm", isl=15360, osl=128, engine="vllm", commit=None, version="0.26.0")]
    page = build_page(rows, LINEAGE)
    t = table(page, "latency")
    splitk = line(t, "liteinfer-splitk")
    assert texts(splitk) == ["1.20x~", "1.20x~", "0.40x"]  # vs vLLM: other engine, same prompts
    assert texts(line(t, "liteinfer-graphs"))[2] == "0.33x~"
    assert t.footnotes == [
        "liteinfer-graphs vs vllm: different prompts (20 prompts #aaaaaaaa vs 50 prompts "
        "#ffffffff)",
        "liteinfer-splitk vs liteinfer-graphs: different prompts (50 prompts #ffffffff vs 20 "
        "prompts #aaaaaaaa)"]
    assert splitk.ratios[0].note == splitk.ratios[1].note == 2  # one note serves both ratios
    assert t.mixed_prompts
    long = table(page, "latency", 15360, 128)
    assert texts(line(long, "liteinfer-graphs-16k")) == ["—", "—", "—"]
    assert line(long, "liteinfer-graphs-16k").ratios[2].note == 1
    assert long.footnotes == ["no vs vLLM ratio: no vLLM row of W=1 was measured on this row's "
                              "machine (the same GPU and host; vLLM's rows: G)"]


def test_vs_vllm_divides_only_rows_of_one_machine():
    """A vLLM row is the reference of liteinfer's rows on its own machine (GPU and host) only:
    the newest vLLM row of another machine never is, nor a row that recorded no host."""
    vllm = {"engine": "vllm", "commit": None, "version": "0.26.0"}
    rows = [row(registry.DEFAULT, "throughput", width=32, tok_s=1200.0, host="a",
                timestamp="2026-03-01T00:00:00+00:00"),
            row("vllm-continuous", "throughput", width=32, tok_s=1000.0, host="a", **vllm),
            row("vllm-continuous", "throughput", width=32, tok_s=400.0, host="b", **vllm,
                timestamp="2026-04-01T00:00:00+00:00"),
            row(registry.DEFAULT, "throughput", width=128, tok_s=3000.0, host=None),
            row("vllm-b128", "throughput", width=128, tok_s=2000.0, host="a", **vllm)]
    t = table(build_page(rows, LINEAGE), "throughput")
    assert texts(line(t, "liteinfer-default"))[2] == "1.20x"  # host a's, not b's
    assert line(t, "vllm-continuous").row["host"] == "b"  # the table shows the newest row
    w128 = line(t, "liteinfer-default · W=128")
    assert texts(w128)[2] == "—" and t.footnotes[w128.ratios[2].note - 1].startswith(
        "no vs vLLM ratio: no vLLM row of W=128")


def test_throughput_widths():
    rows = [row("eager", "throughput", tok_s=50.0, engine="transformers"),
            row("eager-b4", "throughput", width=4, tok_s=150.0, engine="transformers"),
            row("graphs", "throughput", width=32, tok_s=1000.0),
            row("splitk", "throughput", width=32, tok_s=1100.0),
            row("splitk", "throughput", width=4, tok_s=300.0),
            row("graphs-b128", "throughput", width=128, tok_s=3000.0),
            row("vllm-b4", "throughput", width=4, tok_s=600.0, engine="vllm", commit=None),
            row("vllm-b128", "throughput", width=128, tok_s=6000.0, engine="vllm", commit=None)]
    t = table(build_page(rows, LINEAGE), "throughput")
    assert [x.label for x in t.lines] == [
        "liteinfer-eager", "liteinfer-eager-b4", "liteinfer-graphs", "liteinfer-splitk · W=4",
        "liteinfer-splitk", "liteinfer-graphs-b128", "vllm-b4", "vllm-b128"]
    assert texts(line(t, "liteinfer-eager-b4")) == ["3.00x", "3.00x", "0.25x"]  # W=4 vs W=1 base
    assert texts(line(t, "liteinfer-splitk · W=4")) == ["—", "—", "0.50x"]  # graphs has no W=4
    assert texts(line(t, "liteinfer-splitk"))[0] == "1.10x"
    assert texts(line(t, "liteinfer-graphs-b128")) == ["—", "—", "0.50x"]
    assert line(t, "vllm-b128").standing == 1.0
    assert line(t, "liteinfer-eager").standing == pytest.approx(50 / 6000)
    pivot = next(p for p in build_page(rows, LINEAGE).pivots if p.kind == "throughput")
    assert ("liteinfer-splitk · W=4", [300.0]) in pivot.rows


def test_latest_row_wins(tmp_path):
    old = row("splitk", itl_p50=9.0, timestamp="2026-01-01T00:00:00+00:00")
    new = row("splitk", itl_p50=5.0, timestamp="2026-02-01T00:00:00+00:00")
    other_model = row("splitk", itl_p50=1.0, model="tiny", timestamp="2026-03-01T00:00:00+00:00")
    for r in (new, old, other_model):
        append_row(r, tmp_path / "a.jsonl")
    rows = latest(load_rows(tmp_path, None))
    assert sorted(r["itl_p50"] for r in rows) == [1.0, 5.0]
    page = build_page(rows, LINEAGE, model="m")
    assert [x.row["itl_p50"] for x in page.tables[0].lines] == [5.0]


def test_a_serving_runs_offline_baseline_stays_out_of_the_offline_tables():
    """bench_serving.sh's offline rows (fewer prompts, tagged with the run's id) are newer than
    the page's row but do not replace it; the serving summary pairs a serve row with them."""
    page_row = row("splitk", itl_p50=5.0, timestamp="2026-01-01T00:00:00+00:00")
    baseline = row("splitk", itl_p50=9.0, prompts=16, run_id="serving-1",
                   timestamp="2026-02-01T00:00:00+00:00")
    page = build_page([page_row, baseline], LINEAGE, model="m")
    assert [x.row["itl_p50"] for x in page.tables[0].lines] == [5.0]
    served = row("splitk", kind="serve", run_id="serving-1", timestamp="2026-02-01T00:01:00+00:00")
    newer = row("splitk", itl_p50=7.0, timestamp="2026-03-01T00:00:00+00:00")
    assert offline_row(served, [page_row, baseline, newer]) is baseline
    assert offline_row({**served, "run_id": "other"}, [page_row, baseline, newer]) is newer


def test_reference_rows_map_onto_configs():
    rows = load_rows(None, REPO / "benchmarks" / "reference")
    seen = {(r["config"], r["kind"], r["width"]) for r in rows}
    assert {("vllm", "latency", 1), ("vllm", "throughput", 1), ("vllm-b4", "throughput", 4),
            ("vllm-continuous", "throughput", 32), ("vllm-b128", "throughput", 128),
            ("nocache", "latency", 1), ("eager", "latency", 1),
            ("eager-b4", "throughput", 4)} <= seen
    latency = [r for r in rows if r["config"] == "vllm" and r["kind"] == "latency"]
    assert {(r["isl"], r["prompts"]) for r in latency} >= {(128, 50), (3584, 20), (15360, 10)}
    for r in latency:  # measured on the prompts the workloads make
        assert r["fingerprint"] == fingerprint(make_prompts(r["isl"], r["prompts"]))
        assert r["timestamp"].endswith("+00:00")
    hf = next(r for r in rows if r["config"] == "nocache")
    assert hf["timestamp"] == "2026-11-30T00:00:00+00:00" and hf["prompts"] == 3


def test_default_config_covers_every_vllm_shape():
    refs = [r for r in load_rows(None, REPO / "benchmarks" / "reference") if r["engine"] == "vllm"]
    assert {r["kind"] for r in refs} == {"latency", "throughput"}  # the reference rows are there
    planned = {(r.kind, r.shape.isl, r.shape.osl, r.width)
               for r in registry.full_matrix([registry.DEFAULT])}
    missing = {(r["kind"], r["isl"], r["osl"], r["width"]) for r in refs} - planned
    assert not missing, f"vLLM reference rows the default config does not run: {missing}"


def test_only_the_default_and_the_baselines_run():
    runnable = {c.name for c in registry.CONFIGS if c.runnable}
    assert runnable == {registry.DEFAULT, "nocache", "eager", "eager-b4"}
    assert registry.get(registry.DEFAULT).engine_args == {}  # the engine as configured by default
    for c in registry.CONFIGS:
        assert c.runnable == bool(c.runs()), c.name


def test_prompt_caps_apply_per_kind_and_yield_to_an_explicit_count():
    runs = registry.full_matrix(["eager", registry.DEFAULT])
    assert {(r.config, r.kind) for r in runs} == {
        ("eager", "latency"), ("eager", "throughput"),
        (registry.DEFAULT, "latency"), (registry.DEFAULT, "throughput")}
    assert {r.prompts for r in runs if r.config == "eager"} == {10}
    assert {r.prompts for r in runs if r.config == registry.DEFAULT and r.kind == "throughput"} == {
        200}
    assert {(r.shape.isl, r.prompts) for r in runs
            if r.config == registry.DEFAULT and r.kind == "latency"} == {
        (128, 50), (3584, 20), (15360, 10)}
    assert registry.get("eager").run("throughput", runs[0].shape, 1, prompts=200).prompts == 200


def test_results_file_and_commit(tmp_path, monkeypatch):
    when = "2026-11-30T06:00:00+00:00"
    assert results_file(tmp_path / "x.jsonl", "NVIDIA H200", when) == tmp_path / "x.jsonl"
    assert results_file(tmp_path / "new", "NVIDIA H200", when) == (
        tmp_path / "new" / "2026-11-30-nvidia-h200.jsonl")
    assert results_file(None, "cpu", when) == Path("benchmarks/results/2026-11-30-cpu.jsonl")
    engine_commit.cache_clear()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert re.fullmatch(rf"{head}(-dirty)?", engine_commit())
    monkeypatch.setenv("LITEINFER_COMMIT", "0123abc-dirty")
    engine_commit.cache_clear()
    assert engine_commit() == "0123abc-dirty"
    engine_commit.cache_clear()


def test_each_precision_gets_its_own_tables_compared_with_vllm_at_that_precision():
    fp8 = {"engine_args": {"quantization": "fp8"}}
    fp8_kv = {"engine_args": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    vllm = {"engine": "vllm", "commit": None, "version": "0.26.0"}
    rows = [row("default", itl_p50=1.0), row("vllm", itl_p50=2.0, **vllm),
            # The same config at fp8 is not the bf16 row's newer measurement.
            row("default", itl_p50=0.5, timestamp="2026-02-01T00:00:00+00:00", **fp8),
            row("vllm", itl_p50=0.8, **vllm, **fp8),
            row("default", itl_p50=0.4, **fp8_kv)]
    page = build_page(rows, LINEAGE)
    assert [t.title for t in page.tables] == [
        "latency · m · ISL=128 OSL=256", "latency · m · fp8 · ISL=128 OSL=256",
        "latency · m · fp8 + fp8 KV · ISL=128 OSL=256"]
    bf16, at_fp8, at_fp8_kv = page.tables
    assert texts(line(bf16, "liteinfer-default")) == ["—", "—", "2.00x"]
    assert texts(line(at_fp8, "liteinfer-default")) == ["—", "—", "1.60x"]
    assert texts(line(at_fp8_kv, "liteinfer-default")) == ["—", "—", "—"]
    # The across-shapes pivots hold the default precision's rows only.
    (pivot,) = page.pivots
    assert dict(pivot.rows) == {"liteinfer-default": [1.0], "vllm": [2.0]}


def test_batch_invariant_rows_get_their_own_tables_beside_the_default():
    invariant = {"engine_args": {"batch_invariant": True}}
    rows = [row(registry.DEFAULT, itl_p50=1.0),
            row(registry.DEFAULT, itl_p50=1.02, timestamp="2026-02-01T00:00:00+00:00",
                **invariant)]
    page = build_page(rows, LINEAGE)
    assert [t.title for t in page.tables] == [
        "latency · m · ISL=128 OSL=256", "latency · m · bf16 + batch-invariant · ISL=128 OSL=256"]


def test_vllm_rows_of_another_model_and_precision_stay_theirs(tmp_path):
    """bench_vllm.py's rows name their model and quantization: an 8B fp8 vLLM row is set beside
    liteinfer's 8B fp8 row, not mapped onto the default model's bf16 tables."""
    raw = {"engine": "vllm", "version": "0.26.0", "gpu": "G", "host": "h",
           "model": "llama-3.1-8b-instruct",
           "engine_args": {"quantization": "fp8"}, "kind": "latency", "isl": 128, "osl": 256,
           "prompts": 50, "width": 1, "seed": 1234, "itl_p50": 3.5, "tok_s": 280.0, "at": 1.0e9}
    (tmp_path / "vllm-fp8.jsonl").write_text(json.dumps(raw) + "\n")
    ours = row("default", model="llama-3.1-8b-instruct", itl_p50=2.5,
               engine_args={"quantization": "fp8"}, fingerprint=fingerprint(make_prompts(128, 50)))
    (vllm,) = load_rows(None, tmp_path)
    assert (vllm["model"], vllm["config"]) == ("llama-3.1-8b-instruct", "vllm")
    page = build_page([ours, vllm], LINEAGE, "llama-3.1-8b-instruct")
    (t,) = page.tables
    assert t.title == "latency · llama-3.1-8b-instruct · fp8 · ISL=128 OSL=256"
    assert texts(line(t, "liteinfer-default"))[2] == "1.40x"


def _spec_row(config, width, tok_s, when, **extra):
    return {"engine": "liteinfer", "config": config, "model": "m", "gpu": "G", "host": "h",
            "commit": "abc1234", "width": width, "isl": 128, "tok_s": tok_s,
            "timestamp": f"2026-12-06T00:00:{when:02d}+00:00", **extra}


def test_speculation_rows_sit_beside_their_runs_off_row_and_vllms_of_one_machine():
    vllm = {"engine": "vllm", "model": "m-hf", "gpu": "G", "host": "h", "width": 8, "isl": 128,
            "tok_s": 50.0, "at": 1.0, "speculative_config": {"method": "ngram"}}
    rows = [_spec_row("spec-off", 8, 100.0, 1),
            _spec_row("spec-ngram", 8, 150.0, 2, spec_mean_acceptance_length=2.5),
            _spec_row("spec-off", 8, 80.0, 3),  # a later run: its own off row
            _spec_row("spec-ngram", 8, 200.0, 4),
            _spec_row("spec-ngram", 32, 300.0, 5),  # no off row and no vLLM row at 32
            vllm, {**vllm, "host": "other", "tok_s": 1.0, "at": 2.0}]
    (table,) = spec_tables(rows)
    assert (table.model, table.method) == ("m", "ngram")
    at8, at32 = table.lines
    assert at8.row["tok_s"] == 200.0 and at8.vs_off == 2.5 and at8.vs_vllm == 4.0
    assert at32.vs_off is None and at32.vs_vllm is None
    # Another lease of a GPU of the same name and hostname: its boot differs, nothing divides.
    leased = [{**r, "boot": "b2"} for r in rows if r["engine"] == "liteinfer"]
    (table,) = spec_tables(leased + [{**vllm, "boot": "b1"}, vllm])
    assert [line.vs_vllm for line in table.lines] == [None, None]
    (table,) = spec_tables(leased + [{**vllm, "boot": "b2", "tok_s": 40.0}])
    assert table.lines[0].vs_vllm == 5.0
    forced = _spec_row("spec-reference", 1, 10.0, 6, spec_target_acceptance_length=2.5)
    assert [t.lines[0].setting for t in spec_tables([forced])] == ["forced 2.5"]
    drafting = _spec_row("spec-draft_model", 1, 10.0, 7, spec_draft_forced=True)
    assert [t.lines[0].setting for t in spec_tables([drafting])] == ["always drafting"]
