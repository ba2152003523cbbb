"""The scheduler alone, driven the way the engine drives it (no model)."""
from __future__ import annotations

import itertools

import pytest
import torch

from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.prompt_buckets import PromptBuckets, padded_decodes, prompt_piece_sizes
from liteinfer.engine.request_state import RequestStates
from liteinfer.engine.runner_output import ModelRunnerOutput
from liteinfer.engine.sampler import SampledTokens
from liteinfer.engine.scheduler import ScheduledStep, Scheduler
from liteinfer.engine.sequence import Sequence
from liteinfer.sampling_params import SamplingParams

_ids = itertools.count()


def request(prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{next(_ids)}", [1] * prompt_len, params)


def scheduler_of(bm: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, mixed_prompt_tokens: int = 2048,
                 captured: bool = False) -> Scheduler:
    """`captured`: as beside a model runner that captures prompt steps (their buckets)."""
    buckets = PromptBuckets(max_num_seqs, mixed_prompt_tokens) if captured else None
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len,
                     mixed_prompt_tokens, eos_token_ids=[], prompt_buckets=buckets)


def run_step(scheduler: Scheduler, batch: ScheduledStep) -> None:
    """What the engine core does around the model: launch, then token 2 for every sampling
    sequence."""
    scheduler.mark_launched(batch)
    seqs = batch.sampling_seqs
    tokens = torch.full((len(seqs),), 2)
    sampled = SampledTokens(tokens, tokens, [s.sampling_params for s in seqs], None)
    scheduler.update_from_output(batch, ModelRunnerOutput(sampled if seqs else None))


def test_a_chunked_prompt_waits_for_room_instead_of_preempting_itself():
    # 16 blocks of 16 tokens. Two sequences decode in 8 blocks; a 200-token prompt (13 blocks)
    # cannot fit until they finish, whatever the 64-token prefill budget would allow per step.
    bm = BlockManager(16, 16)
    scheduler = scheduler_of(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                             captured=True)
    decoding = [request(60, 40), request(60, 40)]
    for seq in decoding:
        scheduler.add(seq)
    long = request(200, 4)
    kinds = []
    for step in range(200):
        if step == 2:
            scheduler.add(long)
        batch = scheduler.schedule()
        if batch is None:
            break
        kinds.append("prefill" if batch.is_prefill else "decode")
        run_step(scheduler, batch)
    assert all(s.is_finished for s in decoding) and long.is_finished
    assert scheduler.num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks
    # The second prompt ran beside the first one's decode in two pieces of captured sizes
    # (31 + 25 tokens), and the long prompt in ceil(200 / 64) = 4 chunks once the decoders were
    # done.
    assert kinds.count("prefill") == 3 + 4


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm = BlockManager(6, 4)
    scheduler = scheduler_of(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    old, new = request(8, 20), request(8, 20)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())   # both prefilled: 2 + 2 blocks of 6
    for _ in range(4):                           # both grow into a third block: 6 of 6
        run_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()                 # old needs a 4th block: new is preempted
    # new's recomputation needs 4 blocks and 2 are free: a plain decode step, new first in line.
    assert not batch.is_prefill and batch.seqs == [old] and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [new] and new.block_table == []
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 5


def test_mixed_steps_decode_beside_prompt_chunks():
    bm = BlockManager(64, 16)
    scheduler = scheduler_of(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    a, b = request(10, 30), request(10, 30)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler, scheduler.schedule())  # both prompts, one step
    long = request(150, 3)
    scheduler.add(long)
    steps = []
    while (batch := scheduler.schedule()) is not None:
        steps.append((batch.is_prefill, [batch.seqs.index(s) if s in batch.seqs else None
                                         for s in (a, b, long)], batch.num_tokens))
        run_step(scheduler, batch)
    # The decoders take one token each from the 64-token budget and never sit a step out; the
    # long prompt fills the rest in chunks of 62, 62 and 26, then decodes beside them.
    assert steps[:3] == [(True, [0, 1, 2], [1, 1, 62])] * 2 + [(True, [0, 1, 2], [1, 1, 26])]
    assert steps[3] == (False, [0, 1, 2], [1, 1, 1])
    assert all(not prefill for prefill, _, _ in steps[3:])
    assert len(steps) == 29 and a.is_finished and b.is_finished and long.is_finished
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_piece_sizes_bring_steps_to_powers_of_two():
    assert prompt_piece_sizes(0, 64) == [16, 32, 64]
    assert prompt_piece_sizes(32, 2048) == [32, 96, 224, 480, 992, 2016]
    assert prompt_piece_sizes(12, 64) == [20, 52]
    assert prompt_piece_sizes(128, 64) == [64]  # no power of two fits: the cap alone
    assert [padded_decodes(d, 12) for d in (0, 1, 3, 8, 9, 11)] == [0, 1, 4, 8, 12, 12]


@pytest.mark.parametrize("captured", [True, False], ids=["captured", "eager"])
def test_mixed_steps_carry_prompt_pieces_of_captured_sizes(captured):
    """Beside a runner that captures prompt steps, a mixed step's prompt chunks are trimmed to
    a bucket's prompt tokens; beside one that runs them eagerly they are only capped."""
    bm = BlockManager(64, 16)
    scheduler = scheduler_of(bm, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                             mixed_prompt_tokens=64, captured=captured)
    lone = request(150, 40)
    scheduler.add(lone)
    first = scheduler.schedule()
    assert first.num_tokens == [150] and first.num_decodes == 0  # nothing decodes: no cap
    run_step(scheduler, first)
    steps = []

    def step() -> ScheduledStep:
        batch = scheduler.schedule()
        steps.append((batch.num_decodes, batch.num_tokens))
        run_step(scheduler, batch)
        return batch

    long = request(150, 3)
    scheduler.add(long)
    while long.num_computed_tokens < 150:
        step()
    # Capped at 64 prompt tokens beside the decode, and where captured trimmed to 63 (a step
    # of 64 rows); the last 24 are fewer than the smallest piece (31) and stay whole.
    if captured:
        assert steps == [(1, [1, 63]), (1, [1, 63]), (1, [1, 24])]
    else:
        assert steps == [(1, [1, 64]), (1, [1, 64]), (1, [1, 22])]
    steps.clear()
    a, b = request(40, 3), request(5, 3)
    scheduler.add(a)
    scheduler.add(b)
    step()
    if captured:
        # Two decodes: pieces of 30 or 62. 45 prompt tokens trim to 30: b's chunk is cut to
        # nothing and leaves the step, admitted.
        assert steps == [(2, [1, 1, 30])] and b in scheduler.running
        assert b.num_computed_tokens == 0
        step()
        assert steps[1] == (2, [1, 1, 10, 5])
    else:
        assert steps == [(2, [1, 1, 40, 5])]
    while scheduler.has_unfinished():
        step()
    assert bm.num_free_blocks == bm.num_blocks


def test_the_runners_request_states_follow_the_scheduler_through_its_outputs():
    """Applied step by step, the SchedulerOutputs bring a runner's request states to what the
    scheduler's sequences hold before each step (tokens, block table, counters: so no token
    or block crosses twice), through overlapped steps, preemption with re-admission and
    finished requests; each prompt crosses once."""
    bm = BlockManager(12, 16)
    scheduler = scheduler_of(bm, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)
    seqs = [request(40, 30) for _ in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    states = RequestStates()
    outputs, launched = [], None
    while scheduler.has_unfinished() or launched is not None:
        batch = scheduler.schedule()
        if batch is not None:
            out = batch.output
            outputs.append(out)
            step = states.apply(out)
            assert [s.req_id for s in step.seqs] == [s.request_id for s in batch.seqs]
            for state, seq in zip(step.seqs, batch.seqs):
                assert state.token_ids == seq.token_ids and state.block_table == seq.block_table
                assert (state.num_computed_tokens, len(state)) == (seq.num_computed_tokens,
                                                                   len(seq))
            assert step.sample_mask == batch.sample_mask
            scheduler.mark_launched(batch)
        if launched is not None:  # overlapped: the step before is read after this launch
            seqs_, tokens = launched.sampling_seqs, torch.full((len(launched.sampling_seqs),), 2)
            sampled = SampledTokens(tokens, tokens, [s.sampling_params for s in seqs_], None)
            scheduler.update_from_output(launched, ModelRunnerOutput(sampled if seqs_ else None))
        launched = batch
    assert scheduler.num_preemptions > 0 and all(s.num_output_tokens == 30 for s in seqs)
    assert sorted(n.req_id for o in outputs for n in o.new_requests) == sorted(
        s.request_id for s in seqs)
    assert any(o.scheduled.resumed for o in outputs)
    # Each finished request leaves the runner once, with the next step after it finished.
    finished = [rid for o in outputs for rid in o.finished_req_ids]
    assert len(finished) == len(set(finished)) and not set(finished) & set(states.requests)
    assert set(finished) | set(states.requests) == {s.request_id for s in seqs}
    assert bm.num_free_blocks == bm.num_blocks
