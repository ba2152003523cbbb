"""Metrics on synthetic timestamps with known answers, and the prompt generator of WORKLOADS.md
checked against the prompts the stored rows measured."""
from __future__ import annotations

from pathlib import Path

import pytest

from liteinfer.bench.metrics import Trace, percentile, summarize
from liteinfer.bench.store import read_jsonl
from liteinfer.bench.workloads import (
    MIXED,
    Shape,
    default_prompts,
    fingerprint,
    fold_into_vocab,
    make_prompts,
)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_percentile_is_numpy_linear():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None


def test_summarize_known_answers():
    traces = [Trace(0.000, [0.010, 0.020, 0.035]), Trace(0.005, [0.030, 0.040, 0.060])]
    m = summarize(traces, osl=3)
    assert m["ttft_p50"] == pytest.approx(17.5)  # 10 and 25 ms
    assert m["ttft_p95"] == pytest.approx(24.25)
    assert m["itl_p50"] == pytest.approx(12.5)  # gaps pooled: 10, 15, 10, 20 ms
    assert m["itl_p95"] == pytest.approx(19.25)
    assert m["e2e_p50"] == pytest.approx(45.0)  # 35 and 55 ms
    assert m["wall_s"] == pytest.approx(0.060)  # first submit to last token
    assert m["tok_s"] == pytest.approx(100.0)  # 6 tokens / 0.06 s
    assert m["req_s"] == pytest.approx(2 / 0.060)
    assert m["out_tokens"] == 6 and m["requests"] == 2 and m["all_forced"]
    assert not summarize(traces, osl=4)["all_forced"]


def test_tokens_of_one_step_share_a_timestamp():
    m = summarize([Trace(0.0, [0.01, 0.01, 0.03])], osl=3)
    assert m["itl_p50"] == pytest.approx(10.0)  # gaps 0 and 20 ms


def test_prompts_are_the_ones_the_stored_rows_measured():
    """Every stored H200 row recorded the fingerprint of the prompts it ran; drawing them again
    must give the same prompts, or new rows would not compare with the stored ones."""
    rows = [r for f in sorted(RESULTS.glob("*.jsonl")) for r in read_jsonl(f)]
    workloads = {(r["isl"], r["prompts"], r["seed"], r["fingerprint"]) for r in rows
                 if r.get("vocab_fold") is None}
    assert {isl for isl, *_ in workloads} >= {128, 1024, 2048, 3584, 15360, MIXED}
    for isl, n, seed, recorded in workloads:
        assert fingerprint(make_prompts(isl, n, seed)) == recorded, (isl, n, seed)


def test_prompts_follow_the_workloads_rules():
    mixed = make_prompts(MIXED, 300)
    lengths = [len(p) for p in mixed]
    assert min(lengths) >= 64 and max(lengths) <= 2048 and len(set(lengths)) > 200
    assert all(128 <= t < 128000 for p in mixed for t in p)
    assert [len(p) for p in make_prompts(128, 3)] == [128] * 3
    assert make_prompts(128, 3, seed=4321) != make_prompts(128, 3)
    assert make_prompts(128, 5)[:3] == make_prompts(128, 3)  # a prefix of a longer draw


def test_fingerprint_sees_content_and_boundaries():
    a = make_prompts(128, 4)
    assert fingerprint(a) == fingerprint(make_prompts(128, 4))
    assert fingerprint(a) != fingerprint(a[:3])
    assert fingerprint([[1, 2], [3]]) != fingerprint([[1], [2, 3]])


def test_fold_into_a_small_vocabulary():
    prompts = make_prompts(64, 2)
    folded, modulus = fold_into_vocab(prompts, 512)
    assert modulus == 512 and all(0 <= t < 512 for p in folded for t in p)
    assert fold_into_vocab(prompts, 128256) == (prompts, None)


def test_shapes_and_prompt_counts():
    assert Shape.parse("mixed2048", "16") == Shape(MIXED, 16)
    assert Shape(MIXED, 16).label == "mix2048 / 16"
    assert Shape(MIXED, 128).title == "ISL=mixed, up to 2048 OSL=128"
    assert Shape(3584, 128).title == "ISL=3584 OSL=128"
    with pytest.raises(ValueError):
        Shape("mixed", 16)
    assert [default_prompts("latency", Shape(i, 128)) for i in (128, 3584, 15360)] == [50, 20, 10]
    assert default_prompts("throughput", Shape(MIXED, 16)) == 200
