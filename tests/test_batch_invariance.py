"""batch_invariant=True on CPU: every request's tokens and logprobs are the same bits alone, in
batches of any size, with others arriving at any step, with its prompt chunked, with its prefix
from the cache and after preemption; greedy and seeded sampling alike."""
from __future__ import annotations

import random

import pytest
import torch

from fixtures import build_llm, make_tiny_model_dir, through_prompt_layout
from liteinfer import SamplingParams
from liteinfer.attention.batch_invariant import invariant_attention
from liteinfer.config import EngineConfig
from liteinfer.layers.batch_invariant import fold_sum, invariant_mm, rms_norm_invariant
from reference import random_prompts

MAX_NEW = 10
SHARED_PREFIX = 40  # tokens the prefix-sharing prompts have in common: two and a half blocks


def request_params(i: int, max_tokens: int = MAX_NEW) -> SamplingParams:
    """Even prompts greedy, odd ones sampled with their own seed; both with top-3 logprobs."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              logprobs=3)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=3)


def filler_params(i: int) -> SamplingParams:
    """Unseeded sampling of varied lengths: what else the steps hold changes run to run."""
    return SamplingParams(temperature=0.8, max_tokens=3 + 4 * (i % 4), ignore_eos=True)


def answer(out) -> tuple:
    """A request's tokens with every logprob, as exact floats."""
    c = out.outputs[0]
    return c.token_ids, [[(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in c.logprobs]


def make_prompts(vocab: int) -> list[list[int]]:
    """Four prompts of their own and three that share a 40-token prefix."""
    own = random_prompts(4, vocab, 1, 60, seed=11)
    prefix = random_prompts(1, vocab, SHARED_PREFIX, SHARED_PREFIX, seed=12)[0]
    tails = random_prompts(3, vocab, 3, 20, seed=13)
    return own + [prefix + t for t in tails]


def run_arriving(llm, prompts: list[list[int]], seed: int,
                 max_tokens: int = MAX_NEW) -> dict[int, tuple]:
    """The prompts and as many fillers, added one at a time at random steps of one engine;
    returns the prompts' answers by index, and checks that some prefix came from the cache."""
    engine = llm.engine
    rng = random.Random(seed)
    fillers = random_prompts(len(prompts), engine.model_config.vocab_size, 1, 50, seed=seed)
    queue = [(f"p{i}", p, request_params(i, max_tokens)) for i, p in enumerate(prompts)]
    queue += [(f"f{i}", p, filler_params(i)) for i, p in enumerate(fillers)]
    rng.shuffle(queue)
    done: dict[int, tuple] = {}
    cached = 0
    while queue or engine.has_unfinished_requests():
        while queue and (not engine.has_unfinished_requests() or rng.random() < 0.4):
            engine.add_request(*queue.pop())
        for out in engine.step():
            if out.finished and out.request_id.startswith("p"):
                done[int(out.request_id[1:])] = answer(out)
                cached += out.num_cached_tokens
    assert cached > 0, "no prompt found its prefix in the cache"
    return done


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    return make_prompts(384)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, dtype, prompts):
    """Each prompt run by itself, nothing cached."""
    llm = build_llm(str(tiny_llama_dir), dtype=dtype, device="cpu", max_model_len=256,
                    batch_invariant=True, enable_prefix_caching=False)
    return [answer(llm.generate([p], request_params(i), use_tqdm=False)[0])
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("sizes", [(2, 5), (7,), (3, 1, 3)], ids=str)
def test_batches_of_any_size_match_alone(tiny_llama_dir, dtype, prompts, alone, sizes):
    llm = build_llm(str(tiny_llama_dir), dtype=dtype, device="cpu", max_model_len=256,
                    batch_invariant=True)
    got, start = [], 0
    for size in sizes:
        batch = list(range(start, start + size))
        outs = llm.generate([prompts[i] for i in batch], [request_params(i) for i in batch],
                            use_tqdm=False)
        got += [answer(o) for o in outs]
        start += size
    assert got == alone


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},    # prompts prefilled in chunks beside decoding rows
    {"num_kv_blocks": 8, "max_model_len": 128},  # preempted and recomputed
    {"block_size": 32, "max_num_seqs": 3},
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_requests_arriving_at_random_steps_match_alone(tiny_llama_dir, dtype, prompts, alone,
                                                        engine_args):
    llm = build_llm(str(tiny_llama_dir), dtype=dtype, device="cpu",
                    **{"max_model_len": 256, "batch_invariant": True, **engine_args})
    done = run_arriving(llm, prompts, seed=len(engine_args))
    assert [done[i] for i in range(len(prompts))] == alone
    if "num_kv_blocks" in engine_args:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_triton_kernels_in_the_engine_match_alone(tiny_llama_dir, prompts):
    """The Triton path (interpreted on CPU): attention (kernels/invariant_attention.py), one
    kernel for decode, chunked prompts and mixed steps, and the GEMMs (kernels/invariant_gemm.py)
    with the norms and SwiGLU inside them."""
    def build(**args):
        return build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                         batch_invariant=True, attention_backend="triton", **args)

    prompts = prompts[3:]  # the interpreter is slow: one prompt of its own, the shared prefix's
    llm = build(enable_prefix_caching=False)
    alone = [answer(llm.generate([p], request_params(i), use_tqdm=False)[0])
             for i, p in enumerate(prompts)]
    done = run_arriving(build(max_num_batched_tokens=16), prompts, seed=5)
    assert [done[i] for i in range(len(prompts))] == alone
    # Prompt and mixed steps as captured ones run them (engine/prompt_graph.py): padded to a
    # bucket, their query tiles from the input buffer (no graph on the CPU: the same inputs
    # and model run through the bucket's views).
    llm = build(max_num_batched_tokens=16, max_num_seqs=4, mixed_prompt_tokens=16)
    buckets = through_prompt_layout(llm, batch_invariant=True)
    done = run_arriving(llm, prompts, seed=6)
    assert [done[i] for i in range(len(prompts))] == alone
    assert any(d == 0 for d, *_ in buckets) and any(d > 0 for d, *_ in buckets)
    assert any(d < d_size for d, d_size, *_ in buckets)
    assert any(p < p_size for *_, p, p_size in buckets)


def test_prompt_logprobs_match_whatever_the_chunking(tiny_llama_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    by_chunk = []
    for chunk in (16384, 16, 8):
        llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                        batch_invariant=True, max_num_batched_tokens=chunk)
        outs = llm.generate(prompts, params, use_tqdm=False)
        by_chunk.append([[None if e is None else sorted((t, lp.logprob) for t, lp in e.items())
                          for e in o.prompt_logprobs] for o in outs])
    assert by_chunk[0] == by_chunk[1] == by_chunk[2]


def test_smollm2_real_weights_match_alone(smollm2_path):
    llm = build_llm(str(smollm2_path), dtype="float32", device="cpu", max_model_len=512,
                    batch_invariant=True, max_num_batched_tokens=32)
    tok = llm.engine.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
    prompts = [tok.encode(t) for t in texts]
    alone = [answer(llm.generate([p], request_params(i, 4), use_tqdm=False)[0])
             for i, p in enumerate(prompts)]
    batched = llm.generate(prompts, [request_params(i, 4) for i in range(len(prompts))],
                           use_tqdm=False)
    assert [answer(o) for o in batched] == alone


def test_default_mode_is_not_batch_invariant(tiny_llama_dir, prompts):
    """The property is not free: by default on CPU an fp32 row multiplied alone (MKL's GEMV)
    rounds differently from one among others (its GEMM), and the logprobs show it."""
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256)
    params = [request_params(2 * i) for i in range(len(prompts))]  # greedy
    alone = [answer(llm.generate([p], params[i], use_tqdm=False)[0])
             for i, p in enumerate(prompts)]
    batched = [answer(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched != alone


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_invariant_mm_rows_agree_at_every_row_count(dt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=g).to(dt)
    w = (torch.randn(160, 96, generator=g) * 0.1).to(dt)
    full = invariant_mm(x, w)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(full.double(), ref, rtol=2e-2 if dt == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dt == torch.bfloat16 else 1e-5)
    for rows in (1, 2, 5, 16, 17, 33):
        for start in (0, 3):
            assert torch.equal(invariant_mm(x[start:start + rows], w), full[start:start + rows])


@pytest.mark.parametrize("hidden", [64, 40000])  # 40000: torch would split a lone row's sum
def test_rms_norm_invariant_rows_agree(hidden):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, hidden, generator=g)
    w = torch.rand(hidden, generator=g) + 0.5
    full = rms_norm_invariant(x, w, 1e-5)
    ref = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(full.double(), ref, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(rms_norm_invariant(x[i:i + 1], w, 1e-5), full[i:i + 1])
               for i in range(37))


def test_fold_sum_pads_to_a_power_of_two():
    x = torch.arange(6.0).expand(2, 6)
    assert fold_sum(x).tolist() == [15.0, 15.0]


def _reference_attention(q, keys, values, positions, scale):
    """float64 causal attention of each query over keys [L, Hkv, D] up to its position."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    future = torch.arange(keys.shape[0])[None, :] > positions[:, None]
    probs = scores.masked_fill(future[:, None], float("-inf")).softmax(-1)
    return torch.einsum("thl,lhd->thd", probs, v)


def test_invariant_attention_matches_float64_and_each_query_alone():
    g = torch.Generator().manual_seed(2)
    block, num_blocks, hkv, hq, d, length = 8, 6, 2, 4, 16, 45
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    table = torch.tensor([[3, 0, 5, 1, 4, 2]], dtype=torch.int32)
    keys = k_cache[table[0].long()].flatten(0, 1)[:length]
    values = v_cache[table[0].long()].flatten(0, 1)[:length]
    positions = torch.arange(length)
    q = torch.randn(length, hq, d, generator=g)
    tables = table.expand(length, -1)
    out = invariant_attention(q, positions, tables, k_cache, v_cache, 0.25)
    ref = _reference_attention(q, keys, values, positions, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for t in (0, 7, 8, 30, 44):  # each query decoding alone, and in a chunk of three
        alone = invariant_attention(q[t:t + 1], positions[t:t + 1], tables[:1], k_cache,
                                    v_cache, 0.25)
        assert torch.equal(alone, out[t:t + 1])
        lo = max(t - 2, 0)
        chunk = invariant_attention(q[lo:t + 1], positions[lo:t + 1], tables[lo:t + 1],
                                    k_cache, v_cache, 0.25)
        assert torch.equal(chunk[-1], out[t])


def test_batch_invariant_refuses_experts(tmp_path):
    directory = make_tiny_model_dir(tmp_path, "mixtral", num_local_experts=4,
                                    num_experts_per_tok=2, intermediate_size=48)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        build_llm(str(directory), dtype="float32", device="cpu", max_model_len=256,
                  batch_invariant=True)


@pytest.mark.parametrize("args, message", [
    ({"quantization": "fp8"}, "quantization"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
])
def test_batch_invariant_refuses_what_it_does_not_cover(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **args).validate()
