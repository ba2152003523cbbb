"""Speculative decoding: greedy output equal, token for token, to plain decoding and to
transformers whatever share of the drafts is accepted; sampling that keeps the target's
distribution; the proposers and the draft-length policy; counters, KV blocks, tensor
parallelism and the server with the official client."""
from __future__ import annotations

import math
import random
from itertools import product

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import ENGINES, build_llm, greedy_completion_texts, make_tiny_llama_dir, serve
from liteinfer import SamplingParams
from liteinfer.config import EngineConfig, SpeculativeConfig
from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.spec_decode import Speculator
from liteinfer.spec_decode.draft_length import (
    PLAIN_PROBE_FIRST,
    PLAIN_PROBE_INTERVAL,
    PLAIN_PROBE_STEPS,
    PROBE_INTERVAL,
    RETRY_INTERVAL,
    DraftLengthPolicy,
    StepTimes,
    width_class,
)
from liteinfer.spec_decode.ngram import NgramProposer
from liteinfer.spec_decode.suffix import SuffixProposer
from liteinfer.structured_output import StructuredOutputsParams
from reference import hf_greedy, random_prompts
from test_model_families import make_tiny_family_dir
from test_server import scrape
from test_structured_output import Order

ENGINE = dict(dtype="float32", device="cpu", max_model_len=256)
MAX_NEW = 24


def greedy(n: int = MAX_NEW, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def reference_config(prompts: list[list[int]], outputs: list[list[int]], corrupt: float,
                     k: int = 4) -> dict:
    return {"method": "reference", "num_speculative_tokens": k,
            "corrupt_probability": corrupt,
            "reference_outputs": [[p, o] for p, o in zip(prompts, outputs)]}


def spec_stats(llm):
    return llm.engine.core.scheduler.stats().spec_decoding


def release(*llms) -> None:
    for llm in llms:
        ENGINES.remove(llm)
        llm.shutdown()


# ---- exactness under greedy decoding --------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_family(request, tmp_path_factory, tiny_llama_dir):
    """(model directory, prompts, transformers' greedy continuations)."""
    directory = (tiny_llama_dir if request.param == "llama" else
                 make_tiny_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3"))
    prompts = random_prompts(6, 384, 3, 70, seed=5)
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    return directory, prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.mark.parametrize("corrupt", [0.0, 0.4, 1.0])
def test_greedy_equals_transformers_whatever_is_accepted(tiny_family, corrupt):
    """Drafts that are all right, some right and all wrong: the same tokens as transformers,
    in a batch of several prompts chunked over small steps (prefix caching on)."""
    directory, prompts, ref = tiny_family
    llm = build_llm(str(directory), **ENGINE, max_num_batched_tokens=32, max_num_seqs=4,
                    speculative_config=reference_config(prompts, ref, corrupt))
    try:
        assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == ref
        stats = spec_stats(llm)
        assert stats.num_drafts > 0
        if corrupt == 0.0:  # all accepted, but at the very end (max_tokens cuts drafts short)
            assert stats.num_accepted_tokens == stats.num_draft_tokens
            assert stats.mean_acceptance_length > 3
        elif corrupt == 1.0:
            assert stats.num_accepted_tokens == 0
        else:
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    finally:
        release(llm)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-captured"])
def test_verifications_run_as_decode_steps(tiny_llama_dir, backend, monkeypatch):
    """A step of decodes and verifications only runs as a decode step of 1 + k query tokens a
    sequence (input_layout.fill_verify), drafts of any length padded: the same tokens as
    transformers, through the torch backend and the Triton kernels, eager and in the graphs
    captured per (batch size, k) (stood in for on the CPU)."""
    from liteinfer.engine.input_layout import InputLayout
    from test_draft_model import replay_captures_eagerly
    replays = replay_captures_eagerly(monkeypatch) if backend.endswith("captured") else []
    widths = []
    fill = InputLayout.fill_verify
    monkeypatch.setattr(InputLayout, "fill_verify", lambda self, host, seqs, drafts, rows, q: (
        widths.append((len(seqs), q)) or fill(self, host, seqs, drafts, rows, q)))
    prompts = random_prompts(3, 384, 3, 40, seed=7)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    ref = hf_greedy(model, prompts, 12)
    llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_seqs=3,
                    attention_backend=backend.split("-")[0],
                    speculative_config=reference_config(prompts, ref, 0.3))
    try:
        if backend.endswith("captured"):
            llm.engine.core.runner.capture_verify_graphs(None)
            replays.clear()
        assert token_ids(llm.generate(prompts, greedy(12), use_tqdm=False)) == ref
        assert any(n > 1 for n, _ in widths) and any(q > 1 for _, q in widths)
        assert bool(replays) == backend.endswith("captured")
    finally:
        release(llm)


@pytest.mark.parametrize("corrupt", [0.0, 0.5, 1.0])
def test_forced_acceptance_keeps_the_drafts_before_the_first_corrupted_one(
        tiny_llama_dir, corrupt):
    """The benchmark-only forced acceptance: continuations the target would never choose
    (random tokens) are kept up to the first corrupted draft, so the acceptance is the
    corruption's whatever the weights say, and every output still ends with the target's own
    sample after the kept drafts."""
    prompts = random_prompts(3, 384, 4, 20, seed=11)
    made_up = random_prompts(3, 384, MAX_NEW, MAX_NEW, seed=12)
    config = {**reference_config(prompts, made_up, corrupt, k=3), "force_acceptance": True}
    llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_seqs=4, speculative_config=config)
    try:
        outputs = token_ids(llm.generate(prompts, greedy(), use_tqdm=False))
        stats = spec_stats(llm)
        assert stats.num_drafts > 0
        rate = stats.num_accepted_tokens / stats.num_draft_tokens
        if corrupt == 0.0:
            # The prompt's step samples the first token; each later step keeps its 3 drafts
            # (the made-up tokens at their positions) and the target's sample after them.
            assert rate == 1.0
            assert all(out[1:4] == ref[1:4] and out[5:8] == ref[5:8]
                       for out, ref in zip(outputs, made_up))
        elif corrupt == 1.0:
            assert stats.num_accepted_tokens == 0
        else:
            assert 0.1 < rate < 0.6
    finally:
        release(llm)


@pytest.mark.parametrize("corrupt", [0.0, 0.5])
def test_constrained_drafts_are_checked_by_the_grammar(tiny_llama_dir, corrupt):
    """Drafts for requests under a JSON schema: each verified row allows what may follow the
    drafts before it, so right drafts are all kept (corrupt 0: every one accepted, which a
    row masked for the wrong state would spoil), drafts the grammar forbids are rejected, and
    the output is the constrained output without speculation, token for token."""
    constraint = StructuredOutputsParams(json=Order.model_json_schema(),
                                         disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint)
    prompts = random_prompts(3, 384, 4, 20, seed=21)
    plain_llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_seqs=4)
    plain = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    release(plain_llm)
    llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_seqs=4,
                    speculative_config=reference_config(prompts, plain, corrupt, k=3))
    try:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == plain
        stats = spec_stats(llm)
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
        if corrupt == 0.0:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        release(llm)


GROUNDED_PROMPTS = [
    [{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps "
                                 "over the lazy dog near the bank of the river."}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    "
                                 "return a - b\n\nRewrite both functions with type hints."}],
    [{"role": "user", "content": "Summarize: The engine keeps a cache of keys and values for "
                                 "every token, so that each new token reads the cache instead "
                                 "of recomputing the prefix."}],
]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_real_model_greedy_equals_plain_decoding(smollm2_llm, smollm2_path, method):
    """SmolLM2 on input-grounded prompts: the same tokens with and without speculation, and
    drafts accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in
             smollm2_llm.chat(GROUNDED_PROMPTS, params, use_tqdm=False)]
    llm = build_llm(str(smollm2_path), dtype="float32", device="cpu", max_model_len=1024,
                    speculative_config={"method": method, "num_speculative_tokens": 4})
    try:
        assert [o.outputs[0].token_ids for o in
                llm.chat(GROUNDED_PROMPTS, params, use_tqdm=False)] == plain
        stats = spec_stats(llm)
        assert stats.num_accepted_tokens > 10
    finally:
        release(llm)


def test_logprobs_stops_n_and_penalties_match_plain_decoding(tiny_llm, tiny_llama_dir):
    """Logprobs of accepted tokens, stop tokens inside accepted drafts, n choices and requests
    that draft nothing (penalties, min_tokens) beside ones that do."""
    prompts = random_prompts(4, 384, 5, 40, seed=9)
    plain_ref = token_ids(tiny_llm.generate(prompts, greedy(), use_tqdm=False))
    llm = build_llm(str(tiny_llama_dir), **ENGINE,
                    speculative_config=reference_config(prompts, plain_ref, 0.2))
    try:
        for params in (greedy(logprobs=2), greedy(n=2), greedy(repetition_penalty=1.3),
                       greedy(min_tokens=10),
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                      stop_token_ids=[plain_ref[0][7]])):
            got = llm.generate(prompts, params, use_tqdm=False)
            ref = tiny_llm.generate(prompts, params, use_tqdm=False)
            for g, r in zip(got, ref):
                for a, b in zip(g.outputs, r.outputs, strict=True):
                    assert a.token_ids == b.token_ids
                    assert a.finish_reason == b.finish_reason
                    if params.logprobs:
                        for x, y in zip(a.logprobs, b.logprobs, strict=True):
                            assert list(x) == list(y)
                            assert [e.rank for e in x.values()] == [e.rank for e in y.values()]
                            assert [e.logprob for e in x.values()] == pytest.approx(
                                [e.logprob for e in y.values()], abs=1e-4)
        assert spec_stats(llm).num_accepted_tokens > 0
    finally:
        release(llm)


@pytest.mark.parametrize("method", ["reference", "draft_model"])
def test_preempted_sequences_stay_exact(tiny_llm, tiny_llama_dir, method):
    """A pool so small that sequences verifying drafts are preempted and recomputed (a draft
    model's KV too, and its room ahead)."""
    prompts = random_prompts(6, 384, 20, 40, seed=11)
    ref = token_ids(tiny_llm.generate(prompts, greedy(48), use_tqdm=False))
    spec = (reference_config(prompts, ref, 0.3) if method == "reference" else
            {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 4})
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
                    num_kv_blocks=14, speculative_config=spec)
    try:
        assert token_ids(llm.generate(prompts, greedy(48), use_tqdm=False)) == ref
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert spec_stats(llm).num_accepted_tokens > 0
    finally:
        release(llm)


# ---- sampling keeps the target distribution -------------------------------------------------
@pytest.fixture(scope="module")
def peaked_llama_dir(tmp_path_factory):
    """Weights at ten times the usual scale: next-token distributions peaked enough that a
    greedy draft is often accepted under sampling (at 0.02 they are nearly flat)."""
    torch.manual_seed(0)
    return make_tiny_llama_dir(tmp_path_factory.mktemp("peaked"), initializer_range=0.2)


def test_rejection_sampling_reproduces_the_target_distribution(peaked_llama_dir):
    """The drafts are the greedy continuation, so some are accepted and some rejected at
    every position."""
    check_target_distribution(peaked_llama_dir, lambda prompt, path: reference_config(
        [prompt], [path], 0.0, k=2))


def check_target_distribution(peaked_llama_dir, speculative_config) -> None:
    """The joint distribution of three sampled tokens (temperature 0.8, top-k 3) with drafts
    verified, against the exact one from transformers' logits: a chi-square test over the 27
    outcomes of 3,000 samples. `speculative_config(prompt, greedy path)`: the engine's."""
    prompt = random_prompts(1, 384, 12, 12, seed=3)[0]
    temperature, top_k, n = 0.8, 3, 3000
    model = AutoModelForCausalLM.from_pretrained(peaked_llama_dir, torch_dtype=torch.float64)

    @torch.no_grad()
    def next_dist(ids: list[int]) -> dict[int, float]:
        logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    exact: dict[tuple[int, ...], float] = {}
    for a, pa in next_dist(prompt).items():
        for b, pb in next_dist(prompt + [a]).items():
            for c, pc in next_dist(prompt + [a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    greedy_path = [max(d := next_dist(prompt), key=d.get)]
    for _ in range(2):
        d = next_dist(prompt + greedy_path)
        greedy_path.append(max(d, key=d.get))

    # A prompt or two a step beside the decodes: requests reach their second token (the one
    # step each may draft in) at different steps, not all in one wave whose drafts the
    # scheduler stops asking for once they have none left to propose.
    llm = build_llm(str(peaked_llama_dir), **ENGINE, max_num_seqs=16, max_num_batched_tokens=32,
                    speculative_config=speculative_config(prompt, greedy_path))
    # The policy keeps its prior acceptance, so that each request's chance to draft is taken
    # however rarely drafts are found and kept: this is a test of the sampling.
    llm.engine.core.scheduler.speculator.policy.record = lambda *_: None
    try:
        torch.manual_seed(0)  # unseeded requests draw from the default generator
        params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                                ignore_eos=True)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        stats = spec_stats(llm)
    finally:
        release(llm)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    assert 300 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Cells expected fewer than 5 times are pooled, as the test requires.
    small = [k for k, p in exact.items() if p * n < 5]
    cells = [([k], p) for k, p in exact.items() if p * n >= 5]
    cells.append((small, sum(exact[k] for k in small)))
    chi2 = sum((sum(counts.get(k, 0) for k in keys) - p * n) ** 2 / (p * n)
               for keys, p in cells if p > 0)
    dof = sum(1 for _, p in cells if p > 0) - 1
    # The chi-square quantile at p = 0.001 (Wilson-Hilferty).
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    prompts = random_prompts(3, 384, 5, 30, seed=2)
    llm = build_llm(str(tiny_llama_dir), **ENGINE,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1})
    try:
        params = SamplingParams(temperature=0.7, seed=123, max_tokens=MAX_NEW, ignore_eos=True)
        first = token_ids(llm.generate(prompts, params, use_tqdm=False))
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == first
    finally:
        release(llm)


# ---- proposers and the draft-length policy --------------------------------------------------
def test_ngram_proposes_after_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # "2 3" last seen before the end at index 5: 8 5 2 3 follow; "1 2 3" is not the suffix.
    assert ngram.propose("a", 2, tokens, 3) == [8, 5, 2]
    tokens += [4]  # "3 4" and "4" were never seen
    assert ngram.propose("a", 2, tokens, 3) == []
    tokens += [1, 2, 3]  # the longest match wins: "1 2 3" (at 4), not "3" alone
    assert ngram.propose("a", 2, tokens, 2) == [8, 5]
    ngram.finish("a")
    assert not ngram.indexes


def test_suffix_learns_across_requests_and_adapts_its_length():
    suffix = SuffixProposer(max_depth=4, min_probability=0.6, cached_requests=3)
    answer = [10, 11, 12, 13, 14, 15]
    assert suffix.propose("a", 3, [1, 2, 3] + answer, 4) == []  # nothing seen before
    suffix.finish("a")
    # A new request with the same prompt: the earlier answer is drafted, as far as asked.
    assert suffix.propose("b", 3, [1, 2, 3], 4) == answer[:4]
    suffix.finish("b")
    # Two earlier answers part after 12: the draft stops where its probability (1/2) falls
    # below the bound.
    suffix.propose("c", 3, [1, 2, 3, 10, 11, 12, 20, 21], 1)
    suffix.finish("c")
    assert suffix.propose("d", 3, [1, 2, 3], 6) == [10, 11, 12]
    suffix.finish("d")
    # Only the last 3 requests count: "a" is forgotten, and 13 no longer follows 12.
    assert len(suffix.finished) == 3
    assert suffix.propose("e", 3, [7, 10, 11], 6) == [12, 20, 21]
    assert all(n > 0 for counts in suffix.shared.next_tokens.values() for n in counts.values())


def test_draft_length_follows_batch_width_and_acceptance():
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    for _ in range(200):
        policy.record(4, 4)
    assert policy.draft_length(1) == 4
    assert policy.draft_length(128) == 0  # a full-width step gains nothing from drafts
    assert 0 < policy.draft_length(32) <= 4
    for _ in range(400):
        policy.record(4, 0)
    assert policy.draft_length(1) == 0
    for _ in range(PROBE_INTERVAL):
        policy.step_scheduled(1, asked=0, drafted=0)
    assert policy.draft_length(1) == 1  # measured again now and then


def test_steps_without_drafts_overlap_between_retries():
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    assert policy.wants_host_tokens(1)
    policy.step_scheduled(1, asked=1, drafted=0)  # nothing proposed: overlap again for a while
    wanted = []
    for _ in range(2 * RETRY_INTERVAL):
        wanted.append(policy.wants_host_tokens(1))
        # As the scheduler does: it asks only where the tokens are on the host.
        policy.step_scheduled(1, asked=int(wanted[-1]), drafted=0)
    assert wanted.count(True) == 2 and wanted[RETRY_INTERVAL - 1]
    policy.step_scheduled(1, asked=1, drafted=1)
    assert policy.wants_host_tokens(1) and not policy.wants_host_tokens(128)
    policy.step_scheduled(1, asked=0, drafted=0)  # all prefilling: nothing to retry yet
    assert policy.wants_host_tokens(1)


@pytest.mark.parametrize("batch", [1, 8])
def test_speculation_turned_off_comes_back_when_acceptance_rises(batch):
    """Low acceptance turns drafting off; the probes every PROBE_INTERVAL steps measure it
    again, and a higher acceptance turns it back on to full length."""
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    for _ in range(200):
        policy.record(4, 0)
    assert policy.draft_length(batch) == 0
    lengths = []
    for _ in range(20 * PROBE_INTERVAL):
        k = policy.draft_length(batch) if policy.wants_host_tokens(batch) else 0
        lengths.append(k)
        for _ in range(batch if k else 0):
            policy.record(k, k)  # every draft right now
        asked = batch if k else 0
        policy.step_scheduled(batch, asked=asked, drafted=asked)
    assert 0 not in lengths[-PROBE_INTERVAL:] and lengths[-1] == 4


def test_acceptance_estimate_is_the_geometric_rate():
    """Accepted counts drawn from the geometric law of a per-token rate give that rate back
    (an average of per-step ratios would say about half of it)."""
    rng = random.Random(0)
    for rate in (0.34, 0.63):
        policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
        estimates = []
        for i in range(4000):
            accepted = 0
            while accepted < 4 and rng.random() < rate:
                accepted += 1
            policy.record(4, accepted)
            if i >= 1000:
                estimates.append(policy.acceptance)
        assert sum(estimates) / len(estimates) == pytest.approx(rate, abs=0.04)


def test_measured_verification_cost_turns_speculation_off_where_it_loses():
    """At a per-token acceptance of 1/3, the model alone expects drafts to pay at 8 in flight;
    once verifying steps are measured at 1.7 times a plain step's time (a host round trip and
    the prompt-shaped kernels), they do not, and at a high acceptance they still do."""
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    for _ in range(300):
        policy.record(4, 1)
        policy.record(4, 0)
    assert policy.acceptance == pytest.approx(1 / 3, abs=0.02)
    assert policy.draft_length(8) == 4
    policy.record_step_time(8, 40, True, 10.0)  # a kind's first step (compilation) is left out
    for _ in range(40):
        policy.record_step_time(8, 8, False, 0.0060)
        policy.record_step_time(8, 40, True, 0.0103)
    assert policy.verify_overhead(8) == pytest.approx(0.0103 / 0.0060, rel=0.01)
    assert policy.draft_length(8) == 0
    policy.record_step_time(8, 40, True, 1.0)  # one slow moment moves the estimate a little
    assert policy.verify_overhead(8) < 2.0
    for _ in range(300):
        policy.record(4, 4)
    assert policy.draft_length(8) == 4


def _timed(policy: DraftLengthPolicy, batch: int, plain_s: float, verify_s: float) -> None:
    """Plain steps of `batch` sequences taking plain_s and verifications of 4 drafts each
    taking verify_s, as the scheduler reports them (the first of each kind left out)."""
    for _ in range(3):
        policy.record_step_time(batch, batch, False, plain_s)
        policy.record_step_time(batch, 5 * batch, True, verify_s)


def test_verification_cost_is_measured_per_width():
    """A verification of one sequence (a captured decode step) measured at 1.5 plain steps
    and one of 32 (the prompt-shaped kernels) at 3.5 of its own width's: drafting pays alone
    and not at 32 in flight, each by its own measurement, and a width not yet measured keeps
    the modelled cost."""
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    policy.mean_accepted, policy.mean_trials = 9.0, 10.0  # acceptance 0.9
    assert policy.draft_length(1) == 4 and policy.draft_length(32) > 0
    _timed(policy, 1, 0.0005, 0.00075)
    _timed(policy, 32, 0.0009, 0.0009 * 1.25 * 3.5)  # 160 tokens: 1.25 knees
    assert policy.verify_overhead(1) == pytest.approx(1.5)
    assert policy.verify_overhead(3) == pytest.approx(1.1)  # 2-3 in flight: unmeasured
    assert policy.verify_overhead(40) == pytest.approx(3.5)  # 32-63 in flight
    assert policy.draft_length(1) == 4 and policy.draft_length(2) == 4
    assert policy.draft_length(32) == 0


def test_drafts_found_for_few_sequences_pay_less():
    """Where the proposers find drafts for a quarter of the sequences, a verifying step of 32
    keeps 1 + (a + ... + a^4) / 4 tokens a sequence: at twice a plain step's time that loses,
    where drafts for every sequence would gain; the rate follows what the scheduler reports."""
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1)
    policy.mean_accepted, policy.mean_trials = 9.0, 10.0
    _timed(policy, 32, 0.0009, 0.0009 * 1.25 * 2.0)
    assert policy.draft_length(32) > 0
    for _ in range(200):
        policy.step_scheduled(32, asked=32, drafted=8)
    assert policy.hit_rate == pytest.approx(0.25, abs=0.01)
    assert policy.draft_length(32) == 0
    assert policy.draft_length(1) == 4  # alone, drafting is still worth its modelled cost


@pytest.mark.parametrize("timed", [True, False])
def test_plain_steps_are_interleaved_to_time_them(timed):
    """While drafting pays, a timed policy still runs a few plain steps soon after drafting
    starts and then every PLAIN_PROBE_INTERVAL steps, so that it knows what drafting saves; an
    untimed one never does."""
    policy = DraftLengthPolicy(max_drafts=4, knee_tokens=128, sync_cost=0.1, timed=timed)
    lengths = []
    for step in range(PLAIN_PROBE_INTERVAL + 20):
        k = policy.draft_length(1)
        lengths.append(k)
        if k:
            policy.record(k, k)
        policy.step_scheduled(1, asked=int(k > 0), drafted=int(k > 0))
        if step == PLAIN_PROBE_FIRST + PLAIN_PROBE_STEPS:
            # As if both were timed by now.
            policy.times[width_class(1)] = StepTimes(plain=0.005, verify=0.005)
    plain = [i for i, k in enumerate(lengths) if k == 0]
    if not timed:
        assert plain == []
        return
    first = list(range(PLAIN_PROBE_FIRST, PLAIN_PROBE_FIRST + PLAIN_PROBE_STEPS))
    again = PLAIN_PROBE_FIRST + PLAIN_PROBE_STEPS + PLAIN_PROBE_INTERVAL
    assert plain == first + list(range(again, again + PLAIN_PROBE_STEPS))


def test_decode_steps_are_timed_from_one_reading_to_the_next():
    """Only decode steps are timed, each from the previous step's reading (a step with prompts
    still starts the next one's time); a pause restarts the clock; untimed engines (CPU,
    torchrun) keep the modelled costs."""
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    speculator = Speculator(spec, 100, time_steps=True)
    policy = speculator.policy
    speculator.step_read(0.0, 8, 100, verified=False, decode_only=False)  # a prompt step
    for i in range(1, 4):  # the first of each kind is left out
        speculator.step_read(0.006 * i, 8, 8, verified=False, decode_only=True)
    assert policy.step_times(8).plain == pytest.approx(0.006)
    speculator.paused()
    speculator.step_read(5.0, 8, 40, verified=True, decode_only=True)  # after a pause: untimed
    speculator.step_read(5.009, 8, 40, verified=True, decode_only=True)  # first verifying step
    speculator.step_read(5.018, 8, 40, verified=True, decode_only=True)
    assert policy.verify_overhead(8) == pytest.approx(1.5)
    speculator.step_read(5.030, 8, 8, verified=False, decode_only=True)  # holds the round trip
    assert policy.step_times(8).plain == pytest.approx(0.006)
    untimed = Speculator(spec, 100, time_steps=False)
    for i in range(5):
        untimed.step_read(0.01 * i, 8, 8, verified=i % 2 == 1, decode_only=True)
    assert untimed.policy.times == {}


def test_bad_speculative_configs_are_clear_errors():
    for config, match in (({"method": "eagle7", "num_speculative_tokens": 2}, "method"),
                          ({"method": "ngram"}, "num_speculative_tokens"),
                          ({"method": "ngram", "num_speculative_tokens": 0}, "1..16"),
                          ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown"),
                          ({"method": "ngram", "num_speculative_tokens": 2,
                            "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
                          ({"method": "ngram", "num_speculative_tokens": 2,
                            "force_acceptance": True}, "benchmark-only")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=config).validate()
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)


# ---- tensor parallelism and the server ------------------------------------------------------
def test_drafting_models_under_tensor_parallelism_are_refused_clearly(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported"):
        build_llm(str(tiny_llama_dir), **ENGINE, tensor_parallel_size=2,
                  speculative_config={"method": "draft_model", "model": str(tiny_llama_dir),
                                      "num_speculative_tokens": 2})


def test_server_speculates_streamed_and_whole_and_counts(tiny_llm, tiny_llama_dir):

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = AsyncLLM.from_args(str(tiny_llama_dir), speculative_config=spec, **ENGINE)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    ref = tiny_llm.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0].text
    try:
        with serve(engine, "tiny") as url:
            assert greedy_completion_texts(url, prompt, 40) == (ref, ref)
            with httpx.Client(base_url=url) as c:
                metrics = scrape(c)
                text = c.get("/metrics").text
            assert metrics["liteinfer:spec_decode_num_drafts_total"] > 0
            assert metrics["liteinfer:spec_decode_num_accepted_tokens_total"] > 0
            assert 'liteinfer:spec_decode_num_accepted_tokens_per_pos_total{' in text
    finally:
        engine.shutdown()


def test_draft_combinations_cover_every_position():
    """The per-position counter counts position p only when drafts 0..p were accepted."""
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    speculator = Speculator(spec, vocab_size=10, time_steps=False)
    for drafted, accepted in product([1, 2, 3], repeat=2):
        if accepted <= drafted:
            speculator.record(drafted, accepted)
    stats = speculator.stats
    assert stats.num_accepted_tokens_per_pos == [6, 3, 1]
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
