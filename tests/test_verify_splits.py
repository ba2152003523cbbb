"""Verifications split along their keys in the prefill launch (kernels/prefill_attention.py),
through the engine: the Triton kernels under the interpreter, eager and in the captured step
layouts, give transformers' greedy tokens whatever share of the drafts is accepted."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from fixtures import build_llm
from reference import assert_same_greedy_outputs, hf_greedy, random_prompts
from test_draft_model import replay_captures_eagerly
from test_spec_decode import (
    ENGINE,
    MAX_NEW,
    greedy,
    reference_config,
    release,
    spec_stats,
    token_ids,
)


# A captured prompt step's padding tokens (no query tile maps them) take whatever memory the
# attention output held, which may overflow in the interpreted kernels; no real row reads them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_split_verifications_equal_transformers(tiny_llm, tiny_llama_dir, monkeypatch,
                                                captured):
    """Contexts of 40-140 tokens split once the least split is 16 tokens (64-key tiles: up to
    three ranges, the last crossing the diagonal), several verifications a step, beside plain
    decodes and prompt chunks; logprobs as plain decoding's with the torch backend. Every
    verification takes the prefill launch here, as those beside prompt chunks and a draft
    model's do (others run as decode steps: test_spec_decode.py)."""
    import liteinfer.engine.step_inputs as step_inputs
    from liteinfer.engine.prompt_graph import capture_step_graphs
    from liteinfer.engine.step_batch import StepBatch
    from liteinfer.kernels import prefill_tiles

    monkeypatch.setattr(prefill_tiles, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(StepBatch, "verification_width", lambda self: 0)
    split_queries, split_rows = [], []
    tile_map = step_inputs.prefill_tile_map

    def spy(query_lens, context_lens, tile_tokens, first_seq, num_tiles, decode_splits,
            prompt_splits):
        split = np.asarray(prompt_splits) > 1
        split_queries.extend(np.asarray(query_lens)[split].tolist())
        split_rows.append(int(split.sum()))
        return tile_map(query_lens, context_lens, tile_tokens, first_seq, num_tiles,
                        decode_splits, prompt_splits)

    monkeypatch.setattr(step_inputs, "prefill_tile_map", spy)
    replays = replay_captures_eagerly(monkeypatch) if captured else []
    prompts = random_prompts(4, 384, 40, 110, seed=7)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ref = hf_greedy(model, prompts, MAX_NEW)
    plain = tiny_llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    llm = build_llm(str(tiny_llama_dir), **ENGINE, attention_backend="triton", max_num_seqs=4,
                    max_num_batched_tokens=64, mixed_prompt_tokens=32,
                    speculative_config=reference_config(prompts, ref, 0.4, k=3))
    try:
        runner = llm.engine.core.runner
        if captured:
            runner.graphs, runner.prompt_graphs = capture_step_graphs(
                runner.step_model, runner.config, None)
            llm.engine.core.scheduler.prompt_buckets = runner.prompt_buckets  # as on CUDA
            prompt_graphs = {id(g) for g in runner.prompt_graphs.graphs.values()}
            replays.clear()
        outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
        assert token_ids(outputs) == ref
        # A few keys too many or too few rarely flip a tiny model's greedy token: its
        # logprobs (from the verification steps' logits) show them.
        assert_same_greedy_outputs(outputs, plain, 1e-4)
        stats = spec_stats(llm)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        release(llm)
    assert 4 in split_queries and max(split_rows) > 1  # verifications of 1 + 3 split
    if captured:
        assert {id(r) for r in replays} & prompt_graphs  # read before `release` frees them
