"""Tensor parallelism over two CPU processes (gloo): the same tokens as one rank, through
batching, preemption, sampling and bad requests, and every rank in step throughout."""
from __future__ import annotations

import numpy as np
import pytest

from fixtures import ENGINES
from liteinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def tp_llm(tiny_llama_dir):
    # A small pool, so that the ranks preempt (and must agree on whom) as well as batch.
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", device="cpu",
              max_model_len=256, num_kv_blocks=24, max_num_seqs=8)
    ENGINES.append(llm)
    yield llm
    ENGINES.remove(llm)
    llm.shutdown()


def test_two_ranks_match_one(tp_llm, tiny_llm):
    assert tp_llm.engine.core.runner.num_kv_heads == tiny_llm.engine.core.runner.num_kv_heads // 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, size=int(n)).tolist() for n in rng.integers(5, 120, size=8)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)]
    for p in params:
        got = tp_llm.generate(prompts, p, use_tqdm=False)
        ref = tiny_llm.generate(prompts, p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert tp_llm.engine.core.scheduler.num_preemptions > 0


def test_a_bad_request_reaches_no_rank(tp_llm, tiny_llm):
    # The first is queued on every rank, then withdrawn from every rank with the batch.
    with pytest.raises(ValueError, match="max_model_len"):
        tp_llm.generate(["Hello world", "x"], [SamplingParams(max_tokens=5),
                                               SamplingParams(max_tokens=1000)], use_tqdm=False)
    chat = [{"role": "user", "content": "Hello!"}]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert tp_llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text == \
        tiny_llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text


def test_a_model_that_does_not_split_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="KV heads do not split over tensor_parallel_size=4"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4, device="cpu")
