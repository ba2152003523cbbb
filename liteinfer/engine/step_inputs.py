"""A scheduled step's model inputs as host arrays, before they go to the device.

The eager path turns them into tensors; captured prompt steps copy them into their graphs'
fixed buffers at fixed offsets. Everything is computed for all tokens at once with numpy: a
16k-token prefill would otherwise spend milliseconds of host time in per-token Python loops.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from liteinfer.engine.step_batch import StepBatch
from liteinfer.kernels.invariant_tiles import query_tiles
from liteinfer.kernels.prefill_tiles import prefill_tile_map, split_counts, split_entries
from liteinfer.utils import ragged_index


@dataclass
class StepInputs:
    """T tokens of B sequences laid end to end; the first `num_decodes` sequences decode one
    token each (decode and mixed steps)."""

    input_ids: np.ndarray     # int64 [T]; 0 where the id is pending
    pending_rows: np.ndarray  # int64 [T]: row in the runner's sampled tokens, -1 = id known
    positions: np.ndarray     # int64 [T]
    slots: np.ndarray         # int64 [T]: KV pool slot, -1 = padding (not written)
    query_lens: np.ndarray    # int64 [B]
    cu_seqlens: np.ndarray    # int64 [B+1]: where each sequence's tokens start
    context_lens: np.ndarray  # int64 [B]: KV tokens including this step's
    block_tables: np.ndarray  # int64 [B, table_width]
    sample_rows: np.ndarray   # int64: token rows whose logits are sampled, in sequence order
    prompt_rows: np.ndarray   # int64: rows of batch.prompt_logprob_spans, in their order
    num_decodes: int

    @property
    def has_pending(self) -> bool:
        return bool((self.pending_rows >= 0).any())

    def attention_tile_map(self, tile_tokens: int, first_seq: int, max_splits: int,
                           split_rows: int, num_tiles: int | None = None) -> np.ndarray:
        """Prefill attention's tile map (kernels/prefill_tiles.py), the prompt sequences numbered
        from `first_seq` (the decoding slots, one token each). Rows split along their keys (in
        at most max_splits programs, within the entries `split_entries` reserves): the decoding
        rows, and prompt sequences whose query fits one tile (a verification's 1 + k tokens)
        where their tokens have workspace rows (the first `split_rows` of the step's)."""
        d = self.num_decodes
        query_lens, context_lens = self.query_lens[d:], self.context_lens[d:]
        may_split = ((query_lens <= tile_tokens)
                     & (first_seq + np.cumsum(query_lens) <= split_rows))
        # A split query's ranges are placed by its first token's context.
        first_ctx = context_lens[may_split] - query_lens[may_split] + 1
        counts = split_counts(np.concatenate([self.context_lens[:d], first_ctx]),
                              split_entries(first_seq) + int(may_split.sum()), max_splits,
                              alone=bool(may_split.all()))
        prompt_splits = np.ones(len(query_lens), dtype=np.int64)
        prompt_splits[may_split] = counts[d:]
        return prefill_tile_map(query_lens, context_lens, tile_tokens, first_seq, num_tiles,
                                counts[:d], prompt_splits)

    def invariant_tile_map(self, group: int, first_seq: int, rows: int,
                           num_tiles: int | None = None) -> np.ndarray:
        """Batch-invariant attention's query tiles (kernels/invariant_tiles.py) of `rows`
        rows: the decoding rows at rows and tokens 0..d-1, then rows of no tokens up to
        `first_seq` (a captured step's padded decoding slots, mapped to none), the prompt
        sequences from row and token `first_seq` on."""
        d = self.num_decodes
        prompt_lens = self.query_lens[d:]
        prompts = slice(first_seq, first_seq + len(prompt_lens))
        lens = np.zeros(rows, dtype=np.int64)
        starts = np.arange(rows, dtype=np.int64)
        lens[:d] = 1
        lens[prompts] = prompt_lens
        starts[prompts] = first_seq + np.cumsum(prompt_lens) - prompt_lens
        return query_tiles(lens, starts, group, num_tiles)


def build_step_inputs(batch: StepBatch, block_size: int, table_width: int) -> StepInputs:
    """table_width: block table columns, the same every step (a model's longest sequence), so
    the kernels see one row stride and never compile a variant for another."""
    seqs = batch.seqs
    query_lens = np.array(batch.num_tokens)
    starts = np.array([seq.num_computed_tokens for seq in seqs])
    cu_seqlens = np.concatenate([[0], np.cumsum(query_lens)])
    context_lens = starts + query_lens
    input_ids: list[int] = []
    pending_rows: list[int] = []
    for i, (seq, n) in enumerate(zip(seqs, batch.num_tokens)):
        if seq.num_pending:  # decoding a token the host has not seen yet
            assert n == 1 and seq.num_computed_tokens == len(seq.token_ids), \
                "pending tokens are decoded alone"
            input_ids.append(0)
            pending_rows.append(seq.pending_row)
        else:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            if batch.num_drafts(i):  # its last token, then the drafts it verifies
                input_ids += batch.draft_token_ids[i]
            pending_rows += [-1] * n
    tables = np.zeros((len(seqs), table_width), dtype=np.int64)
    for row, seq in zip(tables, seqs):
        row[:len(seq.block_table)] = seq.block_table
    seq_of, offset = ragged_index(query_lens)
    positions = starts[seq_of] + offset
    slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
    sample_rows = np.array([row for i, n in enumerate(batch.num_tokens) if batch.samples(i)
                            for row in range(cu_seqlens[i] + n - 1 - batch.num_drafts(i),
                                             cu_seqlens[i] + n)], dtype=np.int64)
    prompt_rows = np.array([r for i, first, n in batch.prompt_logprob_spans
                            for r in range(cu_seqlens[i] + first, cu_seqlens[i] + first + n)],
                           dtype=np.int64)
    return StepInputs(np.array(input_ids, dtype=np.int64), np.array(pending_rows, dtype=np.int64),
                      positions, slots, query_lens, cu_seqlens, context_lens, tables, sample_rows,
                      prompt_rows, batch.num_decodes)
