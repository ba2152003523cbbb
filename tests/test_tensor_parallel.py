"""Tensor parallelism over two CPU processes (gloo): the same tokens as one rank, through
batching, preemption, prefix caching, seeded sampling and bad requests, and every rank in step
throughout; each rank holding its slice of every weight, the vocabulary's included; the workers
running rank 0's steps exactly from its SchedulerOutput deltas, and never scheduling."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import numpy as np
import pytest
import torch

from fixtures import ENGINES, TINY_LLAMA, build_llm, make_tiny_llama_dir
from liteinfer import LLM, SamplingParams
from liteinfer.attention import get_backend
from liteinfer.engine import worker
from liteinfer.engine.model_runner import ModelRunner
from liteinfer.engine.request_state import CachedRequestState
from liteinfer.engine.scheduler_output import SchedulerOutput
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.layers.linear import _ShardedLinear
from liteinfer.layers.norm_act import RMSNorm
from liteinfer.layers.ops import LayerOps
from liteinfer.layers.vocab_parallel_embedding import VocabParallelEmbedding
from liteinfer.loader import load_model_source
from liteinfer.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def tied_odd_vocab_dir(tmp_path_factory):
    """Tied embeddings (as SmolLM2's and Qwen2's small models) over a vocabulary that does not
    split evenly: 383 rows pad to 384, rank 1 holds 191 tokens and one zero row. Weights at ten
    times the usual scale, so that the layers decide the next token (at 0.02 a tied model's
    logits are its last token's embedding against the others, and it repeats that token)."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tied"), vocab_size=383,
                               tie_word_embeddings=True, initializer_range=0.2)


@contextmanager
def _one_and_two_ranks(directory) -> Iterator[tuple[LLM, LLM]]:
    """The model on one rank and on two (fp32, CPU), shut down after the block."""
    args = dict(dtype="float32", device="cpu", max_model_len=256)
    one = build_llm(str(directory), **args)
    two = build_llm(str(directory), tensor_parallel_size=2, **args)
    try:
        yield one, two
    finally:
        for llm in (one, two):
            ENGINES.remove(llm)
            llm.shutdown()


def _assert_same_tokens(one: LLM, two: LLM, prompts, params) -> None:
    got = two.generate(prompts, params, use_tqdm=False)
    ref = one.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_tied_embeddings_over_an_odd_vocabulary_match_one_rank(tied_odd_vocab_dir):
    with _one_and_two_ranks(tied_odd_vocab_dir) as (one, two):
        model = two.engine.core.runner.model
        assert model.embed_tokens.weight.shape == (192, TINY_LLAMA["hidden_size"])
        assert model.lm_head.weight is model.embed_tokens.weight
        rng = np.random.default_rng(1)
        # The last ids live on rank 1, next to its padding row.
        prompts = [rng.integers(3, 383, size=int(n)).tolist() + [382, 381, 191, 192]
                   for n in rng.integers(5, 60, size=4)]
        for p in (SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)):
            _assert_same_tokens(one, two, prompts, p)


# Before the tests that use `tp_llm`: one tensor-parallel engine runs in a process at a time, and
# that one lives until the module ends.
def test_moe_experts_split_by_channel_and_two_ranks_match_one(tmp_path):
    """Each rank holds every expert with half of its channels (gate and up rows, down
    columns) and the whole router; a Qwen3-MoE model with a dense layer generates the same
    tokens on two ranks as on one."""
    from fixtures import make_tiny_model_dir
    from liteinfer.models import model_class

    directory = make_tiny_model_dir(tmp_path, "qwen3_moe", num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])
    source = load_model_source(str(directory))
    cls = model_class(source.model_config)

    def rank_model(rank: int, size: int):
        model = cls(source.model_config, get_backend("torch"), LayerOps(tp_rank=rank,
                                                                        tp_size=size))
        model.load_weights(source.iter_weights())
        return model

    whole = rank_model(0, 1).layers[0].mlp
    n = 16
    for rank in range(2):
        part = rank_model(rank, 2).layers[0].mlp
        mine = slice(rank * n, (rank + 1) * n)
        assert torch.equal(part.experts.w13_weight[:, :n], whole.experts.w13_weight[:, mine])
        assert torch.equal(part.experts.w13_weight[:, n:],
                           whole.experts.w13_weight[:, 2 * n:][:, mine])
        assert torch.equal(part.experts.w2_weight, whole.experts.w2_weight[:, :, mine])
        assert torch.equal(part.gate.weight, whole.gate.weight)
    with _one_and_two_ranks(directory) as (one, two):
        prompts, params = _mixed_requests(n=5)  # a greedy row among seeded ones
        _assert_same_tokens(one, two, prompts, params)


def _model(directory, tp_rank: int, tp_size: int, load_format: str):
    """A rank's shard of the model, built and filled in this process (no collective runs)."""
    source = load_model_source(str(directory), load_format)
    model = LlamaForCausalLM(source.model_config, get_backend("torch"),
                             LayerOps(tp_rank=tp_rank, tp_size=tp_size))
    if load_format == "dummy":
        model.init_dummy_weights(seed=7)
    else:
        model.load_weights(source.iter_weights())
    return model


def _assert_shard_of(shard: torch.nn.Module, whole: torch.nn.Module, rank: int) -> None:
    """Every parameter of rank `rank`'s model is its slice of the one-rank model's."""
    wholes = dict(whole.named_modules())
    for name, part in shard.named_modules():
        full = wholes[name]
        if isinstance(part, VocabParallelEmbedding):
            n, start = part.num_token_rows, part.vocab_start
            assert part.weight.shape[0] == part.rows_per_rank < full.weight.shape[0]
            assert torch.equal(part.weight[:n], full.weight[start:start + n]), name
            assert not part.weight[n:].any(), f"{name}: padding rows are not zero"
        elif isinstance(part, _ShardedLinear):
            for param_name, param in part.named_parameters():
                full_param = getattr(full, param_name)
                shards = {s: o for s, o in part.offsets.items() if s is not None}
                for s, (start, rows) in (shards or part.offsets).items():
                    full_start = full.offsets[s][0]
                    if part.dim == 0:
                        expected = full_param[full_start + rank * rows:][:rows]
                    else:
                        cols = param.shape[1]
                        expected = full_param[full_start:full_start + rows,
                                              rank * cols:(rank + 1) * cols]
                    assert torch.equal(param[start:start + rows], expected), f"{name}:{s}"
        elif isinstance(part, RMSNorm):
            assert torch.equal(part.weight, full.weight), name


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_holds_its_slice_of_the_one_rank_model(tiny_llama_dir, tied_odd_vocab_dir,
                                                         load_format):
    """Checkpoint loading gives each rank its slice of every tensor, and so do dummy weights
    (each tensor drawn whole): about vocab / 2 embedding and LM head rows, padding zero."""
    for directory in (tiny_llama_dir, tied_odd_vocab_dir):
        whole = _model(directory, 0, 1, load_format)
        for rank in range(2):
            shard = _model(directory, rank, 2, load_format)
            assert shard.lm_head.weight.shape[0] == 192
            _assert_shard_of(shard, whole, rank)


def test_a_rank_that_dies_stops_the_engine_in_bounded_time(tiny_llama_dir):
    """Rank 1 killed mid-generation: generate() raises RankDiedError within seconds (rank 0
    does not wait in a collective forever), and no rank process is left behind."""
    import threading
    import time

    from liteinfer.engine.tensor_parallel import RankDiedError

    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", device="cpu",
              max_model_len=256)
    procs = list(llm.engine.core.workers.procs)
    threading.Timer(1.0, procs[0].kill).start()
    start = time.monotonic()
    with pytest.raises(RankDiedError, match="tensor-parallel"):
        llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=200,
                                                     ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    assert all(p.exitcode is not None for p in procs)
    llm.shutdown()


def _mixed_requests(prefix_len: int = 40, n: int = 8, seed: int = 0):
    """Prompts sharing a `prefix_len`-token prefix (and some not), each with its own sampling:
    greedy, seeded (each its own seed), penalties (steps read back before the next), logprobs
    and prompt logprobs. Only seeded or greedy rows, whose tokens do not depend on the default
    generator's state."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 384, size=prefix_len).tolist()
    prompts = [(prefix if i % 3 else []) + rng.integers(3, 384, size=int(k)).tolist()
               for i, k in enumerate(rng.integers(5, 60, size=n))]
    base = dict(max_tokens=24, ignore_eos=True)
    kinds = [dict(temperature=0.0), dict(temperature=1.0, top_k=50),
             dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3),
             dict(temperature=1.0, logprobs=2), dict(temperature=0.7, prompt_logprobs=1)]
    params = [SamplingParams(seed=100 + i, **base, **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_on_two_ranks_matches_one(tiny_llama_dir, method):
    """Drafts verified on two ranks: the workers get each step's drafts with its deltas, and
    every request's tokens are one rank's, through preemption, the prefix cache, penalties,
    logprobs and seeds (prompts repeated so that the proposers find matches)."""
    prompts, params = _mixed_requests(n=12, seed=1)
    prompts = [p * 2 for p in prompts]
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    one = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    num_kv_blocks=24, max_num_seqs=8, speculative_config=spec)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    ENGINES.remove(one)
    one.shutdown()
    tp = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", device="cpu",
             max_model_len=256, num_kv_blocks=24, max_num_seqs=8, speculative_config=spec)
    ENGINES.append(tp)
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
        stats = tp.engine.core.scheduler.stats().spec_decoding
        assert got == ref
        assert stats.num_accepted_tokens > 0 and tp.engine.core.scheduler.num_preemptions > 0
    finally:
        ENGINES.remove(tp)
        tp.shutdown()


def test_a_worker_runs_rank_0s_step_from_its_scheduler_output(tiny_llama_dir):
    """Rank 0's SchedulerOutput, through its wire format, brings a second runner's request
    states (a worker's, in this process) to the step rank 0's runner runs from the object
    itself: the same model inputs, sampled rows and prompt-logprob rows every step, and the
    same sampled tokens, through preemption, re-admission with the prefix cache, and penalties.
    Both runners' states match the scheduler's sequences without being them; a decode step
    costs a few bytes a request, each prompt crosses once, and finished requests leave."""
    llm = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                    num_kv_blocks=20, max_num_seqs=6)
    core = llm.engine.core
    source = load_model_source(str(tiny_llama_dir))
    mirror = ModelRunner(core.model_config, core.config, source, source.load_format,
                         core.eos_token_ids)
    steps = []
    run_rank_0 = core.runner.execute

    def execute(staged):
        message = msgspec.msgpack.encode(staged_messages.pop(id(staged)))
        step = msgspec.msgpack.decode(message, type=SchedulerOutput)
        steps.append((step, len(message)))
        theirs = mirror.stage(step)
        ours, batch = staged.batch, theirs.batch
        assert mirror.requests.requests.keys() == core.runner.requests.requests.keys()
        assert batch.sample_mask == ours.sample_mask
        assert batch.prompt_logprob_spans == ours.prompt_logprob_spans
        a, b = (build_step_inputs(x, core.config.block_size, core.runner.max_blocks_per_seq)
                for x in (ours, batch))
        for name in ("input_ids", "pending_rows", "positions", "slots", "context_lens",
                     "block_tables", "sample_rows", "prompt_rows"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        for state in ours.seqs:  # not launched yet: the scheduler's sequences as sent
            seq = core.scheduler.requests[state.req_id]
            assert isinstance(state, CachedRequestState) and not isinstance(seq, type(state))
            assert (state.token_ids, state.block_table) == (seq.token_ids, seq.block_table)
            assert state.num_pending == seq.num_pending
        output = run_rank_0(staged)
        mirror.execute(theirs)
        rows = len(ours.sampling_seqs)
        assert torch.equal(core.runner.step_model.pending.sampled[:rows],
                           mirror.step_model.pending.sampled[:rows])
        return output

    staged_messages = {}
    stage_rank_0 = core.runner.stage

    def stage(out):
        staged = stage_rank_0(out)
        staged_messages[id(staged)] = out
        return staged

    core.runner.execute, core.runner.stage = execute, stage
    try:
        prompts, params = _mixed_requests()
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.runner.execute, core.runner.stage = run_rank_0, stage_rank_0
    assert core.scheduler.num_preemptions > 0 and core.block_manager.prefix_hits > 0
    assert any(step.scheduled.resumed for step, _ in steps)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    # Each prompt crosses once, however often its sequence is preempted.
    assert sum(len(step.new_requests) for step, _ in steps) == len(prompts)
    decode_sizes = [size / len(step.scheduled.req_ids) for step, size in steps
                    if not step.is_prefill and not step.new_requests]
    assert decode_sizes and max(decode_sizes) < 32
    # Every finished request leaves with the next step; the last steps' stay until another.
    finished = {rid for step, _ in steps for rid in step.finished_req_ids}
    assert len(finished) + len(mirror.requests.requests) == len(prompts)


def _worker_that_cannot_schedule(*args):
    """A worker's main function in a process where building a scheduler, a block manager, an
    engine core, structured outputs or a tokenizer fails (and the rank with it)."""
    from liteinfer.engine.block_manager import BlockManager
    from liteinfer.engine.core import EngineCore
    from liteinfer.engine.scheduler import Scheduler
    from liteinfer.loader import gguf_file, hf
    from liteinfer.structured_output.manager import StructuredOutputManager

    def refuse(*_args, **_kwargs):
        raise AssertionError("a tensor-parallel worker built what only rank 0 holds")

    for cls in (Scheduler, BlockManager, EngineCore, StructuredOutputManager):
        cls.__init__ = refuse
    hf.load_tokenizer = gguf_file.load_tokenizer = refuse
    worker.run_worker(*args)


def test_workers_hold_no_scheduler_and_no_tokenizer(tiny_llama_dir, tiny_llm, monkeypatch):
    """Rank 1 runs in a process where a Scheduler, BlockManager, EngineCore,
    StructuredOutputManager or tokenizer cannot be built: it still runs every step, and the
    ranks give one rank's tokens."""
    monkeypatch.setattr(worker, "run_worker", _worker_that_cannot_schedule)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", device="cpu",
              max_model_len=256)
    procs = llm.engine.core.workers.procs
    try:
        prompts, params = _mixed_requests(n=5)
        got = llm.generate(prompts, params, use_tqdm=False)
        ref = tiny_llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert all(p.exitcode is None for p in procs)
    finally:
        llm.shutdown()
    assert [p.exitcode for p in procs] == [0]


# Lives to the end of the module: the tests that start tensor-parallel engines of their own (a
# process is in one group at a time) come before the first test that uses it.
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


def test_two_ranks_match_one_through_preemption_and_the_prefix_cache(tp_llm, tiny_llm):
    """Shared prefixes found in rank 0's cache, preempted sequences recomputed (their prompts
    and outputs sent to the workers as host token ids), penalties, logprobs and a seed per
    request: the tokens, and the prompts' logprob tokens, of one rank."""
    core = tp_llm.engine.core
    preemptions, hits = core.scheduler.num_preemptions, core.block_manager.prefix_hits
    prompts, params = _mixed_requests(n=12, seed=1)
    got = tp_llm.generate(prompts, params, use_tqdm=False)
    ref = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for g, r in zip(got, ref):
        if r.prompt_logprobs is not None:
            assert [None if p is None else list(p) for p in g.prompt_logprobs] == \
                [None if p is None else list(p) for p in r.prompt_logprobs]
    assert core.scheduler.num_preemptions > preemptions
    assert core.block_manager.prefix_hits > hits


def test_a_bad_request_reaches_no_rank(tp_llm, tiny_llm):
    # The first is queued on rank 0, then withdrawn with the batch: no worker hears of either.
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


TORCHRUN_SCRIPT = """
import json, sys
from liteinfer import LLM, SamplingParams
model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model, tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=256)
params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True)]
outs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)
import torch.distributed as dist
with open(f"{out}.{dist.get_rank()}", "w") as f:
    json.dump([o.outputs[0].token_ids for o in outs], f)
llm.shutdown()
"""


def test_two_torchrun_nodes_match_one_process(tiny_llama_dir, tiny_llm, tmp_path):
    """Two single-rank "nodes" started by torchrun with the c10d rendezvous, as on two
    machines, each running the same program: both give one process's tokens for greedy
    requests, and the same sampled tokens as each other for unseeded ones."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    torchrun = Path(sys.executable).with_name("torchrun")
    # Torchrun takes the rendezvous's port as a number, not a bound socket: one free now.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(
        [str(torchrun), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "liteinfer-test", str(script), str(tiny_llama_dir), json.dumps(prompts),
         str(tmp_path / "tokens")]) for rank in range(2)]
    assert [node.wait(timeout=240) for node in nodes] == [0, 0]
    got = [json.loads((tmp_path / f"tokens.{r}").read_text()) for r in range(2)]
    assert got[0] == got[1]
    ref = tiny_llm.generate(prompts[::2], SamplingParams(temperature=0.0, max_tokens=16,
                                                         ignore_eos=True), use_tqdm=False)
    assert got[0][::2] == [o.outputs[0].token_ids for o in ref]
