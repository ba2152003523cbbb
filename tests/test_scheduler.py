"""The scheduler alone, driven the way the engine drives it (no model)."""
from __future__ import annotations

import itertools

from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.scheduler import ScheduledBatch, Scheduler
from liteinfer.engine.sequence import Sequence
from liteinfer.sampling_params import SamplingParams

_ids = itertools.count()


def request(prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{next(_ids)}", [1] * prompt_len, params, arrival_time=0.0)


def run_step(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does after the model: count computed tokens, append samples, finish."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(2)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                scheduler.finish(seq)


def test_a_chunked_prompt_waits_for_room_instead_of_preempting_itself():
    # 16 blocks of 16 tokens. Two sequences decode in 8 blocks; a 200-token prompt (13 blocks)
    # cannot fit until they finish, whatever the 64-token prefill budget would allow per step.
    bm = BlockManager(16, 16)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
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
    # The long prompt ran in ceil(200 / 64) = 4 chunks once the decoders were done.
    assert kinds.count("prefill") == 2 + 4


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm = BlockManager(6, 4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    old, new = request(8, 20), request(8, 20)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())   # both prefilled: 2 + 2 blocks of 6
    for _ in range(4):                           # both grow into a third block: 6 of 6
        run_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()                 # old needs a 4th block: new is preempted
    assert batch.seqs == [old] and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [new] and new.block_table == []
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 5
