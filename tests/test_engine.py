"""The engine against transformers on a tiny random Llama (GQA, Llama-3 RoPE scaling), on CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import build_llm, through_prompt_layout
from liteinfer import SamplingParams
from liteinfer.sampling_params import SEED_MAX, choice_seed
from reference import hf_greedy, random_prompts

MAX_NEW = 24


def greedy(n: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    vocab = tiny_llm.engine.model_config.vocab_size
    return random_prompts(10, vocab, 1, 70, seed=1)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return hf_greedy(hf_model, prompts, MAX_NEW)


def test_tiny_model_has_gqa_and_llama3_rope(tiny_llm):
    cfg = tiny_llm.engine.model_config
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    assert cfg.rope_scaling["rope_type"] == "llama3"


def test_greedy_batch_matches_transformers(tiny_llm, prompts, reference):
    assert len({len(p) for p in prompts}) >= 8
    assert token_ids(tiny_llm.generate(prompts, greedy(), use_tqdm=False)) == reference


@pytest.mark.parametrize("engine_args", [
    {"attention_backend": "sdpa"},
    {"max_num_batched_tokens": 16},          # prompts prefilled in chunks
    {"block_size": 32},
    {"max_num_seqs": 3},
    {"attention_backend": "triton", "num_kv_blocks": 40},   # Triton kernels, interpreted on CPU
    {"attention_backend": "triton", "max_num_batched_tokens": 40},
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_engine_variants_match_transformers(tiny_llama_dir, prompts, reference, engine_args):
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    **engine_args)
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference


def test_batch_invariance(tiny_llm):
    prompts = random_prompts(32, tiny_llm.engine.model_config.vocab_size, 1, 60, seed=2)
    batched = token_ids(tiny_llm.generate(prompts, greedy(16), use_tqdm=False))
    alone = [token_ids(tiny_llm.generate([p], greedy(16), use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_preemption_keeps_outputs(tiny_llama_dir, prompts, reference):
    # 12 blocks of 16 tokens cannot hold ten sequences of up to 94 tokens at once.
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
                    num_kv_blocks=12)
    outputs = token_ids(llm.generate(prompts, greedy(), use_tqdm=False))
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert outputs == reference


def test_seeded_sampling_is_reproducible(tiny_llm, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = token_ids(tiny_llm.generate([prompts[0]], params, use_tqdm=False))[0]
    mixed = [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5
    batch = token_ids(tiny_llm.generate(prompts[:6], mixed, use_tqdm=False))[0]
    again = token_ids(tiny_llm.generate([prompts[0]], params, use_tqdm=False))[0]
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True)
    different = token_ids(tiny_llm.generate([prompts[0]], other, use_tqdm=False))[0]
    assert alone == batch == again
    assert different != alone


@pytest.mark.parametrize("seed", [7, SEED_MAX])
def test_seeded_choices_draw_from_consecutive_seeds(tiny_llm, prompts, seed):
    """Choice i of a seeded request samples as a lone request seeded seed + i, wrapped to a
    64-bit integer past SEED_MAX (as the server's choices are)."""
    params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
    [out] = tiny_llm.generate([prompts[0]], params, use_tqdm=False)
    alone = [token_ids(tiny_llm.generate(
        [prompts[0]], dataclasses.replace(params, n=1, seed=choice_seed(seed, i)),
        use_tqdm=False))[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone
    assert choice_seed(SEED_MAX, 1) == 0  # 2**64 wraps to 0


def test_choices_tokenize_their_prompt_once(tiny_llm, monkeypatch):
    """A text prompt's n choices are tokenized once for them all, and each gets the ids."""
    processor = tiny_llm.engine.processor
    calls = []
    tokenize = processor.tokenize
    monkeypatch.setattr(processor, "tokenize", lambda text: calls.append(text) or tokenize(text))
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4)
    [out] = tiny_llm.generate(["The quick brown fox"], params, use_tqdm=False)
    assert calls == ["The quick brown fox"] and len(out.outputs) == 3
    assert out.prompt_token_ids == tokenize("The quick brown fox")


def test_stop_token_ids_and_min_tokens(tiny_llm, prompts, reference):
    ref = reference[3]
    stop = ref[5]
    first = ref.index(stop)
    out = tiny_llm.generate([prompts[3]], greedy(stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[:first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    later = tiny_llm.generate([prompts[3]], greedy(stop_token_ids=[stop], min_tokens=first + 1),
                              use_tqdm=False)[0].outputs[0].token_ids
    # The stop id is masked while fewer than min_tokens tokens exist, so generation goes on.
    assert later[:first] == ref[:first] and later[first] != stop and len(later) > first + 1


def test_max_tokens_finish_reason(tiny_llm, prompts):
    out = tiny_llm.generate([prompts[0]], greedy(5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time


def test_detokenize_false_gives_the_same_tokens_without_text(tiny_llm, prompts):
    params = dataclasses.replace(greedy(6), logprobs=2)
    with_text = tiny_llm.generate(prompts[:2], params, use_tqdm=False)
    ids_only = tiny_llm.generate(prompts[:2], dataclasses.replace(params, detokenize=False),
                                 use_tqdm=False)
    for a, b in zip(with_text, ids_only):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and a.outputs[0].text
        assert b.outputs[0].text == ""
        assert [list(p) for p in b.outputs[0].logprobs] == [list(p) for p in a.outputs[0].logprobs]
        assert all(lp.decoded_token is None for p in b.outputs[0].logprobs for lp in p.values())


def test_logprobs_match_transformers(tiny_llm, hf_model, prompts):
    out = tiny_llm.generate([prompts[2]], greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    seq = prompts[2] + out.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([seq])).logits[0].log_softmax(-1)
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompts[2]) - 1 + i]
        assert set(row.topk(3).indices.tolist()) | {tok} == set(lps)
        assert next(iter(lps)) == tok  # the sampled token comes first
        for t, lp in lps.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert lp.rank == int((row > row[t]).sum()) + 1
            assert lp.decoded_token == tiny_llm.tokenizer.decode([t])


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},  # prompts scored a chunk at a time, beside decodes
    {"num_kv_blocks": 12, "enable_prefix_caching": True},  # preemption, cache lookups
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, prompts, reference,
                                            engine_args):
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
                    **engine_args)
    # Half the requests score their prompts (top 2, or only the prompt token), half do not.
    params = [greedy(prompt_logprobs=(2, None, 0, None)[i % 4]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == reference
    if "num_kv_blocks" in engine_args:
        assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for t in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[t], ref[t - 1]
            top = set(row.topk(p.prompt_logprobs).indices.tolist()) if p.prompt_logprobs else set()
            assert set(entry) == top | {prompt[t]}
            for tok, lp in entry.items():
                assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)


def test_streaming_yields_tokens_as_produced(tiny_llm, prompts, reference):
    chunks = list(tiny_llm.stream(prompts[1], greedy()))
    assert [t for c in chunks for t in c.new_token_ids] == reference[1]
    assert len(chunks) == MAX_NEW and chunks[-1].finished and not chunks[0].finished


def test_abort_returns_blocks(tiny_llm, prompts):
    engine = tiny_llm.engine
    engine.add_request("to-abort", prompts[0], greedy(50))
    engine.step()
    engine.step()
    assert engine.core.block_manager.num_free_blocks < engine.core.block_manager.num_blocks
    assert engine.abort("to-abort")
    assert not engine.abort("to-abort")


@pytest.mark.parametrize("prompt, params, message", [
    ([], greedy(), "empty"),
    ([1, 2, 3], greedy(300), "max_model_len"),
    ([1, 10**6], greedy(), "vocabulary"),
    ([1, -1], greedy(), "vocabulary"),
    ([0] * 256, greedy(1), "max_model_len"),
    ([1, 2], greedy(logprobs=10**6), "vocabulary size"),
    ([1, 2], greedy(prompt_logprobs=10**6), "vocabulary size"),
])
def test_bad_requests_raise_and_leave_others_alone(tiny_llm, prompts, reference, prompt, params,
                                                   message):
    engine = tiny_llm.engine
    engine.add_request("good", prompts[4], greedy())
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", prompts[0], greedy())
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == reference[4]


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 2.0},
    {"max_tokens": 0}, {"repetition_penalty": 0.0}, {"presence_penalty": 3.0},
    {"min_tokens": 5, "max_tokens": 2}, {"logprobs": -1}, {"prompt_logprobs": -1},
    {"stop": [""]}, {"stop": ["x"], "detokenize": False},
])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_queues_nothing(tiny_llm, prompts):
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm.generate([prompts[0], [10**7]], greedy(), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_unknown_engine_argument(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown engine arguments"):
        build_llm(str(tiny_llama_dir), max_num_sequences=4)


@pytest.mark.parametrize("engine_args, message", [
    ({"mixed_prompt_tokens": 100}, "mixed_prompt_tokens must be a power of two"),
    ({"mixed_prompt_tokens": 8}, "mixed_prompt_tokens must be a power of two"),
    ({"mixed_prompt_tokens": 0}, "mixed_prompt_tokens must be a power of two"),
    ({"block_size": 24}, "block_size must be a power of two"),
    ({"quantization": "int3"}, "quantization must be one of"),
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
])
def test_bad_engine_arguments(tiny_llama_dir, engine_args, message):
    with pytest.raises(ValueError, match=message):
        build_llm(str(tiny_llama_dir), **engine_args)


def test_repetition_penalty_matches_transformers(tiny_llm, hf_model, prompts):
    with torch.no_grad():
        ref = []
        for p in prompts[:4]:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                    min_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                                    pad_token_id=0)
            ref.append(gen[0, len(p):].tolist())
    out = tiny_llm.generate(prompts[:4], greedy(12, repetition_penalty=1.5), use_tqdm=False)
    assert token_ids(out) == ref


def test_requests_batched_give_what_they_give_alone(tiny_llm, prompts):
    """Batched with others, with steps launched ahead of the host reading the previous
    tokens (and penalties reading them back first), every request gives what it gives alone."""
    mixed = [greedy(20), SamplingParams(temperature=0.8, seed=3, max_tokens=9),
             greedy(5, logprobs=2), SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=30),
             greedy(1), greedy(17, stop_token_ids=[7, 8, 9]), greedy(12, presence_penalty=1.0),
             SamplingParams(temperature=0.5, min_p=0.2, seed=5, max_tokens=14, min_tokens=3)]
    a = [tiny_llm.generate([p], params, use_tqdm=False)[0] for p, params in zip(prompts, mixed)]
    b = tiny_llm.generate(prompts[:8], mixed, use_tqdm=False)
    for alone, batched in zip(a, b):
        x, y = alone.outputs[0], batched.outputs[0]
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        if x.logprobs is not None:  # batched matmuls round differently
            assert [list(e) for e in x.logprobs] == [list(e) for e in y.logprobs]
            assert [lp.logprob for e in x.logprobs for lp in e.values()] == pytest.approx(
                [lp.logprob for e in y.logprobs for lp in e.values()], abs=1e-5)


def test_overlap_launches_a_step_every_call(tiny_llm, prompts):
    """Each step() launches the next step and reads back the previous one: n tokens, n+1 calls."""
    engine = tiny_llm.engine
    engine.add_request("solo", prompts[0], greedy(10))
    calls = tokens = 0
    while engine.has_unfinished_requests():
        calls += 1
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    assert (tokens, calls) == (10, 11)


def test_stop_string_on_the_last_allowed_token_is_a_stop(tiny_llm, prompts):
    text = tiny_llm.generate([prompts[5]], greedy(6), use_tqdm=False)[0].outputs[0].text
    assert text
    # The whole text is completed by the sixth token, which is also the max_tokens one.
    out = tiny_llm.generate([prompts[5]], greedy(6, stop=[text]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", text, "")


def test_stream_takes_one_prompt(tiny_llm, prompts):
    with pytest.raises(ValueError, match="one prompt"):
        next(tiny_llm.stream([prompts[0], prompts[1]], greedy()))
    assert not tiny_llm.engine.has_unfinished_requests()


def test_generation_config_supplies_default_sampling(tiny_llama_dir, tmp_path):
    import json
    import shutil
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = build_llm(str(model), dtype="float32", device="cpu", max_model_len=64)
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 0)


def test_lone_prompts_prefilled_through_sdpa_match_transformers(tiny_llama_dir, prompts,
                                                                 reference, monkeypatch):
    import liteinfer.attention.triton_backend as triton_backend
    calls = []
    sdpa = triton_backend._causal_sdpa
    monkeypatch.setattr(triton_backend, "_causal_sdpa", lambda *a: calls.append(1) or sdpa(*a))
    # One sequence a step, so every prompt is prefilled alone, with nothing cached.
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    attention_backend="triton", max_num_seqs=1)
    llm.engine.core.runner.backend.sdpa_min_tokens = 1
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    assert len(calls) == len(prompts) * llm.engine.model_config.num_hidden_layers


def test_one_sequence_steps_through_fused_gemv_match_transformers(tiny_llama_dir, prompts,
                                                                   reference, monkeypatch):
    import liteinfer.kernels.gemv as gemv_kernels
    calls = []
    gemv = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    attention_backend="triton", max_num_seqs=1)
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    # Every decode step: qkv, o, gate/up and down of each layer, then the LM head.
    per_step = 4 * llm.engine.model_config.num_hidden_layers + 1
    assert len(calls) >= len(prompts) * (MAX_NEW - 1) * per_step


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_steps_match_transformers(tiny_llama_dir, prompts, reference, backend):
    # Three sequences at a time, finishing at different steps: each arriving prompt is
    # prefilled in the same step as the others' decodes.
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    attention_backend=backend, max_num_seqs=3)
    scheduler = llm.engine.core.scheduler
    mixed = []
    schedule = scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None and batch.is_prefill:
            decoding = [s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs]
            mixed.append(any(decoding) and not all(decoding))
        return batch

    scheduler.schedule = spy
    lengths = [MAX_NEW - 7 * (i % 3) for i in range(len(prompts))]
    outputs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outputs) == [ref[:n] for ref, n in zip(reference, lengths)]
    assert sum(mixed) >= 3


@pytest.mark.parametrize("decode_chunk", [None, 16], ids=["whole-rows", "split-rows"])
def test_prompt_steps_in_the_captured_layout_match_transformers(tiny_llama_dir, prompts,
                                                                reference, monkeypatch,
                                                                decode_chunk):
    """Prompt and mixed steps laid out as captured steps have them (decoding rows first and
    padded to their bucket, prompt tokens padded to theirs, prefill tiles from the padded tile
    map), run eagerly with the Triton kernels on the CPU: token for token. With 16-token
    chunks (beside prompt tiles, and the least split alone) the decoding rows split across
    programs in the prefill launch."""
    import liteinfer.engine.step_inputs as step_inputs
    from liteinfer.kernels import prefill_tiles

    split_counts = []
    if decode_chunk:
        monkeypatch.setattr(prefill_tiles, "DECODE_CHUNK_TOKENS", decode_chunk)
        monkeypatch.setattr(prefill_tiles, "MIN_SPLIT_TOKENS", decode_chunk)
    count = step_inputs.split_counts
    monkeypatch.setattr(step_inputs, "split_counts",
                        lambda *a, **k: split_counts.append(count(*a, **k)) or split_counts[-1])

    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=24,
                    mixed_prompt_tokens=32)
    # No prompt step is captured on the CPU, so the scheduler trims nothing; here it trims to
    # the layout's buckets, as beside captured prompt steps.
    assert llm.engine.core.scheduler.prompt_buckets is None
    buckets = through_prompt_layout(llm)
    lengths = [MAX_NEW - 7 * (i % 3) for i in range(len(prompts))]
    outputs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outputs) == [ref[:n] for ref, n in zip(reference, lengths)]
    # Prompt-only and mixed steps, padded decoding rows and padded prompt tokens all occurred.
    assert any(d == 0 for d, *_ in buckets) and any(d > 0 for d, *_ in buckets)
    assert any(d < d_size for d, d_size, *_ in buckets)
    assert any(p < p_size for *_, p, p_size in buckets)
    most = max(int(c.max()) for c in split_counts if len(c))
    assert most > 1 if decode_chunk else most == 1
    assert llm.engine.core.block_manager.num_free_blocks == llm.engine.core.block_manager.num_blocks
