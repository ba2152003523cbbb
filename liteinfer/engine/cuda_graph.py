"""Decode steps replayed from CUDA graphs captured once per batch size.

All inputs of a captured step live in one flat int32 device buffer at fixed offsets; each step
fills a pinned host mirror of it and sends the used prefix in one copy, so a step costs one
host-to-device copy and one graph launch. Batches are padded to the next captured size; padding
rows have context length 0 and slot -1, so they neither read nor write the KV pool.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from liteinfer.engine.model_runner import ModelRunner


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


class CUDAGraphRunner:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sizes = capture_sizes(runner.config.max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.width = runner.max_blocks_per_seq
        n = self.max_bs
        # Layout: ids | positions | slots | context lens | block tables [max_bs, width].
        self.host = torch.zeros(4 * n + n * self.width, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros_like(self.host, device=runner.device)
        self.input_ids, self.positions, self.slots, self.context_lens = self.dev[:4 * n].view(4, n)
        self.block_tables = self.dev[4 * n:].view(n, self.width)
        self.slots.fill_(-1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(bs)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(is_prefill=False, slot_mapping=self.slots[:bs],
                                 context_lens=self.context_lens[:bs],
                                 block_tables=self.block_tables[:bs], cu_seqlens_q=None)
        self.runner.set_split_k(meta, bs)  # the split counts are computed inside the graph
        model = self.runner.model
        return model.compute_logits(model(self.input_ids[:bs], self.positions[:bs], meta))

    def _capture(self, bs: int) -> None:
        self._forward(bs)  # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = (graph, logits)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs = batch.seqs
        n = len(seqs)
        bs = next(s for s in self.sizes if s >= n)
        block_size = self.runner.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        pos = lens - 1
        last_blocks = np.fromiter((s.block_table[p // block_size] for s, p in zip(seqs, pos)),
                                  dtype=np.int64, count=n)
        m = self.max_bs
        h = self.host_np
        h[:n] = [s.token_ids[-1] for s in seqs]
        h[m:m + n] = pos
        h[2 * m:2 * m + n] = last_blocks * block_size + pos % block_size
        h[2 * m + n:2 * m + bs] = -1
        h[3 * m:3 * m + n] = lens
        h[3 * m + n:3 * m + bs] = 0
        tables = h[4 * m:].reshape(m, self.width)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        used = 4 * m + n * self.width
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]
