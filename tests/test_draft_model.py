"""Speculative decoding with a draft model (`method: draft_model`): greedy output equal, token
for token, to plain decoding whether the draft is the target itself (nearly every draft
accepted) or an unrelated model (nearly none), with batches, chunked prompts, the prefix
cache and preemption; SmolLM2 drafting for itself; seeded sampling; the sampled distribution;
clear errors for drafts that cannot serve; the server with --speculative-config."""
from __future__ import annotations

import json

import pytest
import torch

from fixtures import build_llm, greedy_completion_texts, make_tiny_llama_dir, serve
from liteinfer import SamplingParams
from liteinfer.cli import build_parser, engine_kwargs
from liteinfer.config import EngineConfig, SpeculativeConfig
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.kernels.decode_splits import max_splits_for
from reference import random_prompts
from test_spec_decode import (
    ENGINE,
    GROUNDED_PROMPTS,
    check_target_distribution,
    greedy,
    peaked_llama_dir,  # noqa: F401 (a fixture)
    release,
    spec_stats,
    token_ids,
)


def draft_config(model, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A one-layer random Llama with the tiny Llama's tokenizer, unrelated to it: its greedy
    guesses are almost never the target's."""
    torch.manual_seed(7)
    return make_tiny_llama_dir(tmp_path_factory.mktemp("other-draft"), num_hidden_layers=1,
                               hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Prompts that share a 40-token prefix (prefix cache hits after the first), and others."""
    prefix = random_prompts(1, 384, 40, 40, seed=21)[0]
    tails = random_prompts(4, 384, 3, 30, seed=22)
    return [prefix + t for t in tails] + random_prompts(3, 384, 3, 70, seed=23)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_equals_plain_decoding(tiny_llm, tiny_llama_dir, other_draft_dir,
                                      shared_prefix_prompts, draft):
    """Batched, chunked prompts over small steps, the prefix cache hit: the same tokens as
    without speculation. The target drafting for itself has its drafts accepted (but where
    float rounding of a different step shape flips a near tie); an unrelated draft almost
    never."""
    prompts = shared_prefix_prompts
    ref = token_ids(tiny_llm.generate(prompts, greedy(), use_tqdm=False))
    model = tiny_llama_dir if draft == "self" else other_draft_dir
    llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_batched_tokens=32, max_num_seqs=4,
                    speculative_config=draft_config(model))
    try:
        for _ in range(2):  # the second run reads its prompts from the prefix cache
            assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == ref
        assert llm.engine.core.block_manager.prefix_hits > 0
        stats = spec_stats(llm)
        assert stats.num_drafts > 0
        rate = stats.num_accepted_tokens / stats.num_draft_tokens
        assert rate > 0.95 if draft == "self" else rate < 0.1
    finally:
        release(llm)


def test_smollm2_drafting_for_itself(smollm2_llm, smollm2_path):
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = [o.outputs[0].token_ids for o in
             smollm2_llm.chat(GROUNDED_PROMPTS, params, use_tqdm=False)]
    llm = build_llm(str(smollm2_path), dtype="float32", device="cpu", max_model_len=1024,
                    speculative_config=draft_config(smollm2_path, k=3))
    try:
        assert [o.outputs[0].token_ids for o in
                llm.chat(GROUNDED_PROMPTS, params, use_tqdm=False)] == plain
        stats = spec_stats(llm)
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens
    finally:
        release(llm)


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    """Two engines, the same seeded requests: the same tokens. (A seeded request draws once
    per sampled row, drafts' rows included, so its tokens depend on the draft lengths, which
    follow the acceptance an engine has measured: hence fresh engines.)"""
    prompts = random_prompts(3, 384, 5, 30, seed=2)
    params = SamplingParams(temperature=0.7, seed=123, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = build_llm(str(tiny_llama_dir), **ENGINE,
                        speculative_config=draft_config(tiny_llama_dir, k=3))
        try:
            runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
            assert spec_stats(llm).num_accepted_tokens > 0
        finally:
            release(llm)
    assert runs[0] == runs[1]


def test_a_fault_in_the_drafters_passes_loses_no_output(tiny_llm, tiny_llama_dir,
                                                       monkeypatch):
    """The drafter's passes run after a step's sampling, so a fault in them (on CUDA, a kernel
    error) shows only when the drafts are read, after the step's tokens: the request the step
    finished keeps its output, the one still running fails, and the engine goes on. (A
    request the step finished used to lose its last output, and `generate` stepped an empty
    engine for it forever.)"""
    from liteinfer.engine.runner_output import ProposedDrafts

    prompts = random_prompts(3, 384, 5, 20, seed=1)
    ref = token_ids(tiny_llm.generate(prompts, greedy(5), use_tqdm=False))
    llm = build_llm(str(tiny_llama_dir), **ENGINE, speculative_config=draft_config(tiny_llama_dir))
    read = ProposedDrafts.result
    reads = []

    def faulty(drafts: ProposedDrafts) -> dict[int, list[int]]:
        reads.append(drafts)
        if len(reads) == 1:  # the first step's, which samples both prompts' first tokens
            raise RuntimeError("a fault in the drafter's passes")
        return read(drafts)

    monkeypatch.setattr(ProposedDrafts, "result", faulty)
    engine = llm.engine
    for i, n in enumerate((1, 5)):
        engine.add_request(str(i), prompts[i], greedy(n))
    finished = {}
    for _ in range(20):  # bounded: the lost output left the front end waiting for ever
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: (o.outputs[0].finish_reason, o.outputs[0].token_ids)
                         for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests()
    assert finished == {"0": ("length", ref[0][:1]), "1": ("error", ref[1][:1])}
    assert token_ids(llm.generate(prompts[2:], greedy(5), use_tqdm=False)) == ref[2:]
    assert len(reads) > 1


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(peaked_llama_dir):  # noqa: F811
    """The chi-square test of test_spec_decode.py, with the drafts proposed by the target
    drafting for itself (its greedy path) instead of a reference. Slow (11 minutes on two
    shared CPU cores): its 3,000 requests each run the draft model's passes too."""
    check_target_distribution(peaked_llama_dir,
                              lambda prompt, path: draft_config(peaked_llama_dir, k=2))


def test_bad_draft_configs_are_clear_errors(tiny_llama_dir, tmp_path):
    wide = make_tiny_llama_dir(tmp_path / "wide", vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary"):
        build_llm(str(tiny_llama_dir), **ENGINE, speculative_config=draft_config(wide))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported"):
        build_llm(str(tiny_llama_dir), **ENGINE, tensor_parallel_size=2,
                  speculative_config=draft_config(tiny_llama_dir))
    for config, match in (({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                          ({"method": "ngram", "model": "x", "num_speculative_tokens": 2},
                           "model")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=config).validate()
    with pytest.raises(ValueError, match="max_model_len"):
        build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=512,
                  speculative_config=draft_config(make_tiny_llama_dir(
                      tmp_path / "short", max_position_embeddings=256)))


def test_method_is_inferred_from_the_model_as_vllm_does():
    draft = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 2})
    head = SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                        "num_speculative_tokens": 2})
    assert (draft.method, head.method) == ("draft_model", "eagle3")


def test_server_with_speculative_config_flag(tiny_llm, tiny_llama_dir):

    args = build_parser().parse_args([
        "serve", str(tiny_llama_dir), "--speculative-config",
        json.dumps(draft_config(tiny_llama_dir, k=3))])
    engine = AsyncLLM.from_args(str(tiny_llama_dir), **{**ENGINE, **engine_kwargs(args)})
    prompt = "The quick brown fox jumps over the lazy dog."
    ref = tiny_llm.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0].text
    try:
        with serve(engine, "tiny") as url:
            assert greedy_completion_texts(url, prompt, 30) == (ref, ref)
    finally:
        engine.shutdown()


def replay_captures_eagerly(monkeypatch) -> list:
    """CUDA graphs stood in for on the CPU: capturing a call runs it once, and each replay
    runs it again and writes its output where the capture's was, as a graph does (a step's
    inputs go through the step model's input buffer, as on CUDA). Returns the list each
    replayed stand-in is appended to."""
    import liteinfer.engine.cuda_graph as cuda_graph
    import liteinfer.engine.prompt_graph as prompt_graph

    replays = []

    class Replay:
        def __init__(self, forward, out):
            self.forward, self.out = forward, out

        def replay(self):
            replays.append(self)
            out = self.forward()
            if out is not None:
                self.out.copy_(out)

    def capture(forward, pool):
        out = forward()
        return Replay(forward, out), out

    for module in (cuda_graph, prompt_graph):
        monkeypatch.setattr(module, "capture_graph", capture)
    return replays


# A captured prompt step's padding tokens (no query tile maps them) take whatever memory the
# attention output held, which may overflow in the interpreted kernels; no real row reads them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_captured_draft_passes_replayed_eagerly(tiny_llm, tiny_llama_dir, monkeypatch):
    """The draft model's passes as its captured graphs run them (static buffers, batches
    padded to captured sizes, its catch-up in the target's captured step layouts), replayed
    on the CPU with the Triton kernels (`replay_captures_eagerly`): the same tokens as plain
    decoding, the drafts accepted, and its proposal and prompt-step graphs replayed. Shutting
    down frees both runners' split-K workspaces and input buffers."""
    replays = replay_captures_eagerly(monkeypatch)
    prompts = random_prompts(3, 384, 5, 40, seed=5)
    lengths = [24, 17, 9]  # sequences finish at different steps: 3, 2 and 1 of 4 rows
    ref = token_ids(tiny_llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False))
    llm = build_llm(str(tiny_llama_dir), **ENGINE, attention_backend="triton", max_num_seqs=4,
                    max_num_batched_tokens=32, mixed_prompt_tokens=16,
                    speculative_config=draft_config(tiny_llama_dir, k=3))
    runner = llm.engine.core.runner
    drafter = runner.drafter
    try:
        # Each runner's workspace: a row for each decoding sequence or verified token, each as
        # wide as one row's grid for its own KV heads.
        for r in (runner, drafter):
            splits = r.step_model.splits
            assert splits.rows == llm.engine.core.config.split_workspace_rows
            assert splits.max_splits == max_splits_for(1, splits.num_kv_heads, splits.num_sms)
        drafter.capture_graphs(None)
        replays.clear()
        outputs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
        assert token_ids(outputs) == ref
        stats = spec_stats(llm)
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens
        proposal_graphs = {id(g) for g, _ in drafter.proposals.graphs.graphs.values()}
        prompt_graphs = {id(g) for g in drafter.prompt_graphs.graphs.values()}
        replayed = {id(r) for r in replays}
        assert replayed & proposal_graphs and replayed & prompt_graphs
        # Three sequences proposed in the graphs of four rows: one row padded.
        assert replayed & {id(drafter.proposals.graphs.graphs[4, may_split][0])
                           for may_split in (True, False)}
    finally:
        release(llm)
    for r in (runner, drafter):
        assert r.step_model.splits is None and r.step_model.inputs.dev.numel() == 0
