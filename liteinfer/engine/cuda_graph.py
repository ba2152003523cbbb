"""Decode steps replayed from CUDA graphs captured once per batch size (and, for steps of
verifications, per query tokens a sequence: its newest token and its drafts).

A captured step's inputs are its batch size's views of the step model's input buffer
(engine/input_layout.py); each step fills a pinned host mirror of it and sends the used prefix
in one copy, so a step costs one host-to-device copy and one graph launch. Tokens the host has
not read yet (overlapped steps) are gathered inside the graph from the runner's sampled tokens
(engine/pending_tokens.py). Batches are padded to the next captured size; padding rows have
context length 0 and slot -1, so they neither read nor write the KV pool.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.input_layout import StepShape
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels.decode_splits import DecodeSplits

T = TypeVar("T")


def capture_graph(forward: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Runs `forward` once eagerly (compiling its kernels outside the capture), then captures
    it into a graph allocating from `pool`; returns the graph and the captured call's output."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


@dataclass(frozen=True)
class StagedDecode:
    """A decode step whose inputs are on their way to the device: which graph replays it (of
    verifications of `query_len` tokens a sequence, where above 1), and the rows sampled."""

    batch_size: int
    may_split: bool
    num_rows: int
    query_len: int = 1


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


class GraphsBySize(Generic[T]):
    """A step captured once per batch size up to max_num_seqs (`capture_sizes`) and, where
    the split-K grid width depends on it, per whether a row may split (`splits.width`; None:
    no split-K); a step of n rows replays the smallest size >= n. `forward(batch_size,
    may_split)` reads its inputs from buffers that outlive the capture."""

    def __init__(self, forward: Callable[[int, bool], T], splits: DecodeSplits | None,
                 max_num_seqs: int, pool, reset: Callable[[int], None] | None = None):
        """`reset(batch_size)`: writes an empty step into the inputs before its capture."""
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, T]] = {}
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            if reset is not None:
                reset(bs)
            self.graphs[bs, True] = capture_graph(lambda bs=bs: forward(bs, True), pool)
            same_width = splits is None or splits.width(bs, False) == splits.width(bs, True)
            self.graphs[bs, False] = self.graphs[bs, True] if same_width else capture_graph(
                lambda bs=bs: forward(bs, False), pool)

    def size_for(self, num_rows: int) -> int:
        """The captured batch size a step of `num_rows` sequences replays."""
        return next(s for s in self.sizes if s >= num_rows)

    def replay(self, batch_size: int, may_split: bool) -> T:
        """Launches the graph of (batch_size, may_split); returns its captured output."""
        graph, out = self.graphs[batch_size, may_split]
        graph.replay()
        return out


class CUDAGraphRunner:
    """Captures decode steps of every batch size up to max_num_seqs (pool: the graph memory
    pool shared with captured prompt steps) and replays the step's size. `logits`: whether
    the step ends with the LM head (a draft model's catch-up does not). `query_len` > 1: decode
    steps of verifications, that many query tokens a sequence (input_layout.fill_verify)."""

    def __init__(self, step_model: StepModel, max_num_seqs: int, pool, logits: bool = True,
                 query_len: int = 1):
        self.step_model = step_model
        self.splits = step_model.splits
        self.logits = logits
        self.query_len = query_len
        layout, buffer = step_model.layout, step_model.inputs.dev
        self.graphs = GraphsBySize(self._forward, self.splits, max_num_seqs, pool,
                                   lambda bs: layout.reset(buffer, self._shape(bs)))

    def _shape(self, bs: int) -> StepShape:
        return StepShape.decode(bs, self.query_len)

    def _forward(self, bs: int, may_split: bool) -> torch.Tensor:
        sm = self.step_model
        v = sm.layout.views(sm.inputs.dev, self._shape(bs))
        meta = AttentionMetadata(is_prefill=False, slot_mapping=v.slots,
                                 context_lens=v.context_lens, block_tables=v.block_tables,
                                 cu_seqlens_q=None, query_len=self.query_len)
        sm.set_split_k(meta, bs, may_split)  # split counts are chosen in the graph
        hidden = sm.model(sm.pending.read(v.ids, v.pending), v.positions, meta)
        return sm.model.compute_logits(hidden) if self.logits else hidden

    def size_for(self, num_rows: int) -> int:
        """The captured batch size a step of `num_rows` sequences replays."""
        return self.graphs.size_for(num_rows)

    def stage(self, batch: StepBatch) -> StagedDecode:
        """Sends the step's inputs to the device buffer (behind the work already queued, which
        may still read the previous step's); `replay` launches it."""
        n = len(batch.seqs)
        bs = self.size_for(n)
        sm = self.step_model
        if self.query_len > 1:
            lens, used, n = sm.layout.fill_verify(sm.inputs.host(), batch.seqs,
                                                  batch.draft_token_ids, bs, self.query_len)
        else:
            lens, used = sm.layout.fill_decode(sm.inputs.host(), batch.seqs, bs,
                                               table_tails=False)
        sm.inputs.send(used)
        return StagedDecode(bs, self.splits is not None and self.splits.may_split(lens), n,
                            self.query_len)

    def replay(self, staged: StagedDecode) -> torch.Tensor:
        """The staged step's logits (its final hidden states without `logits`), once
        launched: [rows, vocab], a verification's sampled rows gathered in order."""
        out = self.graphs.replay(staged.batch_size, staged.may_split)
        if self.query_len == 1:
            return out[:staged.num_rows]
        sm = self.step_model
        rows = sm.layout.views(sm.inputs.dev, self._shape(staged.batch_size)).sample_rows
        return out[rows[:staged.num_rows]]
