"""Decode steps replayed from CUDA graphs captured once per batch size.

All inputs of a captured step live in one flat int32 device buffer at fixed offsets; each step
fills a pinned host mirror of it and sends the used prefix in one copy, so a step costs one
host-to-device copy and one graph launch. Tokens the host has not read yet (overlapped steps)
are gathered inside the graph from the runner's sampled-token buffer. Batches are padded to the
next captured size; padding rows have context length 0 and slot -1, so they neither read nor
write the KV pool.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_model import StepModel

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


class StagedInputs:
    """A captured step's inputs: one flat int32 device buffer, sent from two pinned host mirrors
    in turn, so that one is filled while the copy from the other may still be in flight."""

    def __init__(self, size: int, device: torch.device):
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)]
        self._step = 0

    def host(self) -> np.ndarray:
        """The next host mirror to fill (waits until its previous copy has finished)."""
        self._copied[self._step % 2].synchronize()
        return self._hosts[self._step % 2].numpy()

    def send(self, used: int) -> None:
        """Copies the first `used` elements of the mirror just filled to the device buffer."""
        which = self._step % 2
        self.dev[:used].copy_(self._hosts[which][:used], non_blocking=True)
        self._copied[which].record()
        self._step += 1


@dataclass(frozen=True)
class StagedDecode:
    """A decode step whose inputs are on their way to the device: which graph replays it."""

    batch_size: int
    may_split: bool
    num_rows: int


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


class GraphsBySize(Generic[T]):
    """A step captured once per batch size up to max_num_seqs (`capture_sizes`) and, where
    the split-K grid width depends on it, per whether a row may split
    (kernels/decode_splits.max_splits_for); a step of n rows replays the smallest size >= n.
    `forward(batch_size, may_split)` reads its inputs from buffers that outlive the capture."""

    def __init__(self, forward: Callable[[int, bool], T], step_model: StepModel,
                 max_num_seqs: int, pool):
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, T]] = {}
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self.graphs[bs, True] = capture_graph(lambda bs=bs: forward(bs, True), pool)
            same_width = step_model.split_width(bs, False) == step_model.split_width(bs, True)
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
    the step ends with the LM head (a draft model's catch-up does not)."""

    def __init__(self, step_model: StepModel, max_num_seqs: int, table_width: int,
                 block_size: int, device: torch.device, pool, logits: bool = True):
        self.step_model = step_model
        self.block_size = block_size
        self.logits = logits
        self.max_bs = capture_sizes(max_num_seqs)[-1]
        self.width = table_width
        n = self.max_bs
        # Layout: ids | pending rows | positions | slots | context lens | block tables.
        self.inputs = StagedInputs(5 * n + n * self.width, device)
        (self.input_ids, self.pending_rows, self.positions, self.slots,
         self.context_lens) = self.inputs.dev[:5 * n].view(5, n)
        self.block_tables = self.inputs.dev[5 * n:].view(n, self.width)
        self.pending_rows.fill_(-1)
        self.slots.fill_(-1)
        self.graphs = GraphsBySize(self._forward, step_model, max_num_seqs, pool)

    def _forward(self, bs: int, may_split: bool) -> torch.Tensor:
        meta = AttentionMetadata(is_prefill=False, slot_mapping=self.slots[:bs],
                                 context_lens=self.context_lens[:bs],
                                 block_tables=self.block_tables[:bs], cu_seqlens_q=None)
        sm = self.step_model
        sm.set_split_k(meta, bs, may_split)  # split counts are chosen in the graph
        ids = sm.with_pending(self.input_ids[:bs], self.pending_rows[:bs])
        hidden = sm.model(ids, self.positions[:bs], meta)
        return sm.model.compute_logits(hidden) if self.logits else hidden

    def size_for(self, num_rows: int) -> int:
        """The captured batch size a step of `num_rows` sequences replays."""
        return self.graphs.size_for(num_rows)

    def stage(self, batch: StepBatch) -> StagedDecode:
        """Sends the step's inputs to the device buffer (behind the work already queued, which
        may still read the previous step's); `replay` launches it."""
        # Fills the mirror directly rather than through build_step_inputs (step_inputs.py): a
        # one-sequence decode step is the shortest on the GPU, and all of its host work must
        # hide under it.
        seqs = batch.seqs
        n = len(seqs)
        bs = self.size_for(n)
        block_size = self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        pos = lens - 1
        last_blocks = np.fromiter((s.block_table[p // block_size] for s, p in zip(seqs, pos)),
                                  dtype=np.int64, count=n)
        m = self.max_bs
        h = self.inputs.host()
        h[:n] = [0 if s.num_pending else s.token_ids[-1] for s in seqs]
        h[m:m + n] = [s.pending_row if s.num_pending else -1 for s in seqs]
        h[m + n:m + bs] = -1
        h[2 * m:2 * m + n] = pos
        h[3 * m:3 * m + n] = last_blocks * block_size + pos % block_size
        h[3 * m + n:3 * m + bs] = -1
        h[4 * m:4 * m + n] = lens
        h[4 * m + n:4 * m + bs] = 0
        tables = h[5 * m:].reshape(m, self.width)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        self.inputs.send(5 * m + n * self.width)
        return StagedDecode(bs, self.step_model.rows_may_split(lens), n)

    def replay(self, staged: StagedDecode) -> torch.Tensor:
        """The staged step's logits (its final hidden states without `logits`), once
        launched: [rows, vocab]."""
        return self.graphs.replay(staged.batch_size, staged.may_split)[:staged.num_rows]
