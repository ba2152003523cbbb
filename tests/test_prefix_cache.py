"""Prefix caching: prompts that share cached prefixes give the same tokens as without the cache
(greedy), compute only what is new, and the pool stays consistent through sharing, eviction and
preemption."""
from __future__ import annotations

import numpy as np
import pytest

from fixtures import build_llm
from liteinfer import SamplingParams
from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.sequence import Sequence

BLOCK = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 384, size=n).tolist()


def run(llm, prompts: list[list[int]], n: int = 12):
    return llm.generate(prompts, greedy(n), use_tqdm=False)


@pytest.fixture(scope="module")
def cached_llm(tiny_llama_dir):
    return build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                     enable_prefix_caching=True)


def test_shared_prefix_is_reused(cached_llm, tiny_llm):
    rng = np.random.default_rng(0)
    system = tokens(rng, 50)
    prompts = [system + tokens(rng, int(k)) for k in rng.integers(5, 30, size=6)]
    first = run(cached_llm, prompts[:1])
    rest = run(cached_llm, prompts[1:])
    ref = run(tiny_llm, prompts)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in ref]
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [50 // BLOCK * BLOCK] * 5


def test_whole_prompt_cached_still_computes_its_last_token(cached_llm, tiny_llm):
    rng = np.random.default_rng(1)
    prompt = tokens(rng, 4 * BLOCK)
    once, again = run(cached_llm, [prompt]), run(cached_llm, [prompt])
    # The last block is computed again (into a new block) for the last token's logits.
    assert again[0].num_cached_tokens == 3 * BLOCK
    shorter = run(cached_llm, [prompt[:2 * BLOCK + 5]])
    assert shorter[0].num_cached_tokens == 2 * BLOCK
    ref = run(tiny_llm, [prompt, prompt[:2 * BLOCK + 5]])
    assert [o.outputs[0].token_ids for o in (once[0], again[0], shorter[0])] == [
        ref[0].outputs[0].token_ids, ref[0].outputs[0].token_ids, ref[1].outputs[0].token_ids]


def test_next_turn_reuses_generated_tokens(cached_llm, tiny_llm):
    rng = np.random.default_rng(2)
    prompt = tokens(rng, 40)
    (turn1,) = run(cached_llm, [prompt], n=30)
    follow_up = prompt + turn1.outputs[0].token_ids + tokens(rng, 9)
    (turn2,) = run(cached_llm, [follow_up])
    # 40 + 30 tokens, of which the last sampled one was never fed back: 69 computed, 4 blocks.
    assert turn2.num_cached_tokens == 4 * BLOCK
    assert turn2.outputs[0].token_ids == run(tiny_llm, [follow_up])[0].outputs[0].token_ids


def test_small_pool_evicts_and_preempts(tiny_llama_dir, tiny_llm):
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    enable_prefix_caching=True, num_kv_blocks=20, max_num_seqs=8)
    rng = np.random.default_rng(3)
    system = tokens(rng, 48)
    shared = [system + tokens(rng, int(k)) for k in rng.integers(4, 20, size=6)]
    # 6 x ~5 blocks each by the end: more than the pool, so the newest are preempted.
    out = run(llm, shared, n=40)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == [
        o.outputs[0].token_ids for o in run(tiny_llm, shared, n=40)]
    # Distinct prompts push the shared prefix out of the cache.
    run(llm, [tokens(rng, 100) for _ in range(4)], n=4)
    (again,) = run(llm, shared[:1], n=4)
    assert again.num_cached_tokens == 0


def test_block_manager_refcounts_and_eviction_order():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    prompt = list(range(10, 19))  # 9 tokens: blocks of 4, 4, 1

    def seq(name: str, ids: list[int]) -> Sequence:
        s = Sequence(name, ids, SamplingParams())
        assert bm.admit(s)
        return s

    a = seq("a", prompt)
    a.num_computed_tokens = len(prompt)
    bm.cache_computed_blocks(a)  # its two full blocks are registered
    b = seq("b", prompt)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert bm.num_free_blocks == 2
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1] and bm.num_free_blocks == 3
    head, tail = b.block_table[:2]
    bm.free(b)
    assert list(bm.evictable) == [tail, head] and bm.num_free_blocks == 6
    # New blocks come from the free list first, then evict the prefix tail before its head.
    c = seq("c", list(range(100, 117)))  # 5 blocks
    assert list(bm.evictable) == [head] and tail in c.block_table
    bm.free(c)
    d = seq("d", prompt[:5])
    assert d.num_cached_tokens == 4 and d.block_table[0] == head  # the head survived
    free = bm.num_free_blocks
    assert not bm.admit(Sequence("e", list(range(30)), SamplingParams()))  # 8 blocks
    assert bm.num_free_blocks == free
    bm.free(d)
    assert sorted(bm.unreferenced_blocks()) == list(range(6)) and not any(bm.ref_counts)
    bm.reset_prefix_cache()
    assert not bm.evictable and sorted(bm.free_blocks) == list(range(6))
    assert seq("f", prompt).num_cached_tokens == 0


@pytest.mark.parametrize("config", [{"attention_backend": "sdpa"}, {"block_size": 32},
                                    {"max_num_batched_tokens": 40}])
def test_cached_prefixes_in_other_configs(tiny_llama_dir, tiny_llm, config):
    """SDPA attention, padded prefill, no overlap, and prompts chunked over cached blocks."""
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    enable_prefix_caching=True, **config)
    rng = np.random.default_rng(4)
    system = tokens(rng, 70)
    prompts = [system + tokens(rng, int(k)) for k in rng.integers(3, 40, size=5)]
    out = run(llm, prompts[:2]) + run(llm, prompts[2:])
    assert [o.num_cached_tokens for o in out[2:]] == [64] * 3
    assert [o.outputs[0].token_ids for o in out] == [
        o.outputs[0].token_ids for o in run(tiny_llm, prompts)]
