"""The step input layout (engine/input_layout.py) alone: every kind of step written over a
buffer that holds another shape's inputs reads the same inputs as the step's own arrays
(engine/step_inputs.py), its padding rows reading and writing no KV."""
from __future__ import annotations

import numpy as np
import pytest

from liteinfer.engine.input_layout import InputLayout, StepShape
from liteinfer.engine.pending_tokens import NOT_PENDING
from liteinfer.engine.request_state import CachedRequestState
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.sampling_params import SamplingParams

BLOCK, WIDTH = 4, 12
rng = np.random.default_rng(7)


def state(i: int, length: int, computed: int, pending: int) -> CachedRequestState:
    s = CachedRequestState(f"r{i}", rng.integers(1, 1000, length).tolist(),
                           SamplingParams(max_tokens=8))
    s.num_computed_tokens, s.num_pending = computed, pending
    s.pending_row = i if pending else -1
    s.block_table = rng.permutation(100)[:-(-(length + pending) // BLOCK)].tolist()
    return s


def garbage(layout: InputLayout) -> np.ndarray:
    return rng.integers(-50, 5000, layout.total).astype(np.int32)


@pytest.mark.parametrize("rows", [5, 8])
def test_a_decode_step_reads_its_own_inputs_over_another_shapes(rows):
    layout = InputLayout(WIDTH, BLOCK, StepShape(64, 16, 32))
    seqs = [state(i, int(rng.integers(3, 40)), 0, i % 2) for i in range(5)]
    for s in seqs:
        s.num_computed_tokens = len(s) - 1
    batch = StepBatch(seqs, [1] * 5, False, 5)
    host = garbage(layout)
    lens, used = layout.fill_decode(host, seqs, rows)
    ref = build_step_inputs(batch, BLOCK, WIDTH)
    v = layout.views(host, StepShape(rows, rows))
    assert np.array_equal(lens, ref.context_lens)
    for got, want in ((v.ids, ref.input_ids), (v.pending, ref.pending_rows),
                      (v.positions, ref.positions), (v.slots, ref.slots),
                      (v.context_lens, ref.context_lens), (v.block_tables, ref.block_tables)):
        assert np.array_equal(got[:5], want)
    assert (v.ids[5:] == 0).all() and (v.pending[5:] == NOT_PENDING).all()
    assert (v.positions[5:] == 0).all() and (v.slots[5:] == -1).all()
    assert (v.context_lens[5:] == 0).all() and (v.block_tables[5:] == 0).all()
    assert used == layout.used(StepShape(rows, rows), rows) == (
        layout.offsets(StepShape(rows, rows))["block_tables"] + rows * WIDTH)


def test_a_mixed_step_padded_to_a_bucket_reads_its_own_inputs_over_another_shapes():
    """Two decoding rows padded to 4, a prompt chunk and a sequence verifying drafts after
    them padded to 24 tokens and 4 rows."""
    layout = InputLayout(WIDTH, BLOCK, StepShape(64, 16, 32))
    seqs = [state(0, 20, 20, 1), state(1, 9, 8, 0), state(2, 30, 10, 0), state(3, 12, 11, 0)]
    batch = StepBatch(seqs, [1, 1, 8, 3], True, 2, [[], [], [], [5, 6]])
    step = build_step_inputs(batch, BLOCK, WIDTH)
    shape, d_size = StepShape(4 + 24, 4 + 4, 3), 4
    tiles = np.arange(6, dtype=np.int32).reshape(3, 2)
    host = garbage(layout)
    used = layout.fill(host, step, shape, d_size, tiles)
    v = layout.views(host, shape)
    assert used == layout.offsets(shape)["block_tables"] + (d_size + 2) * WIDTH
    for got, want, pad in ((v.ids, step.input_ids, 0), (v.pending, step.pending_rows, -1),
                           (v.positions, step.positions, 0), (v.slots, step.slots, -1)):
        assert np.array_equal(got[:2], want[:2]) and (got[2:4] == pad).all()
        assert np.array_equal(got[4:4 + 11], want[2:]) and (got[4 + 11:] == pad).all()
    assert v.context_lens.tolist() == [21, 9, 0, 0, 18, 14, 0, 0]
    assert v.cu_seqlens.tolist() == [0, 1, 2, 3, 4, 12, 15, 15, 15]
    assert np.array_equal(v.block_tables[:2], step.block_tables[:2])
    assert np.array_equal(v.block_tables[4:6], step.block_tables[2:])
    # Rows 0 and 1 decode, the prompt's last token does not sample, the verifying sequence's
    # three do; in the bucket the last three move past the padding.
    assert step.sample_rows.tolist() == [0, 1, 10, 11, 12]
    assert v.sample_rows[:5].tolist() == [0, 1, 12, 13, 14]
    assert np.array_equal(v.tiles, tiles)


def test_a_shape_past_the_layout_is_an_error():
    layout = InputLayout(WIDTH, BLOCK, StepShape(64, 16, 32))
    with pytest.raises(ValueError, match="does not fit the input layout"):
        layout.offsets(StepShape(65, 16, 32))


@pytest.mark.parametrize("rows", [3, 4])
def test_a_step_of_verifications_reads_the_prompt_steps_tokens_padded_per_sequence(rows):
    """A decoding row (its token pending) and two sequences verifying 3 and 1 drafts, as a
    decode step of 4 query tokens a sequence over another shape's inputs: each sequence's real
    tokens are the prompt-shaped step's, its padding tokens write no KV, its context counts 4
    tokens from its newest token, and the sample rows are its real tokens in order."""
    layout = InputLayout(WIDTH, BLOCK, StepShape(64, 16, 32))
    seqs = [state(0, 20, 20, 1), state(1, 9, 8, 0), state(2, 14, 13, 0)]
    drafts = [[], [11, 12, 13], [14]]
    for s, d in zip(seqs[1:], drafts[1:]):  # room for the drafts' KV
        s.block_table = rng.permutation(100)[:-(-(len(s) + len(d)) // BLOCK)].tolist()
    batch = StepBatch(seqs, [1, 4, 2], True, 1, draft_token_ids=drafts)
    assert batch.verification_width() == 4
    host = garbage(layout)
    lens, used, samples = layout.fill_verify(host, seqs, drafts, rows, 4)
    ref = build_step_inputs(batch, BLOCK, WIDTH)
    v = layout.views(host, StepShape(rows * 4, rows))
    real = np.array([0, 4, 5, 6, 7, 8, 9])  # token rows of the real tokens, in step order
    for got, want in ((v.ids, ref.input_ids), (v.pending, ref.pending_rows),
                      (v.positions, ref.positions), (v.slots, ref.slots)):
        assert np.array_equal(got[real], want)
    padding = np.setdiff1d(np.arange(rows * 4), real)
    assert (v.slots[padding] == -1).all() and (v.ids[padding] == 0).all()
    assert np.array_equal(lens, [len(s) - 1 + 4 for s in seqs])
    assert (v.context_lens[3:] == 0).all() and (v.block_tables[3:] == 0).all()
    # Each table as the step's own, zero past its blocks, where its padding tokens read.
    assert np.array_equal(v.block_tables[:3], ref.block_tables)
    assert samples == len(ref.sample_rows) == 7 and np.array_equal(v.sample_rows[:7], real)
    assert used == layout.used(StepShape(rows * 4, rows), rows)
