"""`liteinfer-bench spec` on CPU: controlled acceptance hits the mean accepted length it asks
for, and every row is written."""
from __future__ import annotations

import json

import pytest

from liteinfer.bench.cli import main
from liteinfer.bench.spec import corrupt_probability, prompts_at


def test_corrupt_probability_gives_the_mean_accepted_length():
    for k in (1, 4):
        for length in (1.0, 1.5, k + 0.5, k + 1.0):
            a = 1.0 - corrupt_probability(length, k)
            assert sum(a ** i for i in range(k + 1)) == pytest.approx(length, abs=1e-9)
    with pytest.raises(ValueError, match="mean accepted length"):
        corrupt_probability(6.0, 4)


def test_prompts_at_widths():
    prompts = [[1], [2], [3]]
    assert prompts_at(prompts, 1, 2) == [[1], [2]]
    assert prompts_at(prompts, 4, 2) == [[1], [2], [3], [1], [2], [3], [1], [2]]


def test_controlled_acceptance_rows(tiny_llama_dir, tmp_path):
    out = tmp_path / "rows.jsonl"
    main(["spec", "--model", str(tiny_llama_dir), "--method", "reference", "--widths", "1", "2",
          "--acceptance-lengths", "3.0", "--num-speculative-tokens", "3", "--isl", "16",
          "--osl", "24", "--latency-prompts", "2", "--dtype", "float32", "--max-model-len",
          "256", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"], r["width"]) for r in rows] == [
        ("spec-off", 1), ("spec-off", 2), ("spec-reference", 1), ("spec-reference", 2)]
    spec = rows[2]
    assert spec["spec_num_drafts"] > 0
    # Forced acceptance: the acceptance is what the corruption leaves (to within the few
    # drafts of a short run).
    assert 2.2 < spec["spec_mean_acceptance_length"] < 3.8
    assert all(r["all_forced"] for r in rows)
