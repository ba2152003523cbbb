"""Prompt and mixed steps replayed from CUDA graphs.

An eager step of a few hundred prompt tokens spends several times its GPU time launching ~200
kernels, so steps of up to `mixed_prompt_tokens` prompt tokens are captured too: one graph per
(decoding rows, prompt tokens) bucket, the decoding rows a power of two and the prompt tokens
each bringing the step's rows to a power of two (`PromptBuckets`, engine/prompt_buckets.py,
which the scheduler trims mixed steps to). A step is padded to its bucket:
decoding rows first, padded with rows of context 0, then the prompt tokens, padded with tokens
that write no KV; no tile-map entry covers a padding row. Prefill attention reads its programs'
work (the splits of decoding rows and verifications, prompt query tiles) from a tile map, so
one grid serves any mix of context and prompt lengths. The LM head runs after the replay on the
rows that sample only.

A bucket's inputs are its shape's views of the step model's input buffer (`PromptStepLayout`
over engine/input_layout.py), filled from a pinned host mirror with one copy per step, as in
captured decode and eager steps.
"""
from __future__ import annotations

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.config import EngineConfig
from liteinfer.engine.cuda_graph import CUDAGraphRunner, capture_graph
from liteinfer.engine.input_layout import InputLayout, StepShape
from liteinfer.engine.prompt_buckets import PromptBuckets
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_inputs import StepInputs, build_step_inputs
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels.decode_splits import DecodeSplits
from liteinfer.kernels.invariant_tiles import tile_tokens as invariant_tile_tokens
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens, split_entries


class PromptStepLayout:
    """The buckets, and each bucket's shape in the step model's input layout (`inputs`).
    Device-agnostic: the CUDA runner below fills a pinned mirror of its device buffer, and the
    layout runs as well on a CPU buffer."""

    def __init__(self, buckets: PromptBuckets, inputs: InputLayout, query_group_size: int,
                 splits: DecodeSplits | None, batch_invariant: bool = False):
        self.prompt_buckets = buckets
        # Batch-invariant attention maps every row's query tiles (kernels/invariant_attention.py)
        # instead of prefill attention's split rows and tiles.
        self.batch_invariant = batch_invariant
        self.max_num_seqs = buckets.max_num_seqs
        self.query_group_size = query_group_size
        # The split rows' bounds in the tile map (no split rows without split-K).
        self.max_decode_splits = 1 if splits is None else splits.max_splits
        self.split_rows = 0 if splits is None else splits.rows
        self.input_layout = inputs
        self.buckets = buckets.all()
        for d, p in self.buckets:
            inputs.offsets(self.shape(d, p))  # a ValueError for one the buffer cannot hold
        self.max_tokens = max(d + p for d, p in self.buckets)

    def shape(self, d: int, p: int) -> StepShape:
        """Bucket (d, p)'s shape: its tokens, rows and tile-map entries."""
        return StepShape(d + p, d + self._prompt_seqs(p), self._tiles(d, p))

    def _prompt_seqs(self, prompt_size: int) -> int:
        return min(prompt_size, self.max_num_seqs)

    def _tiles(self, decodes: int, prompt_size: int) -> int:
        """Tile-map entries of bucket (decodes, prompt_size): the split rows' beyond their own
        tiles, and the query tiles of any `prompt_size` tokens (each sequence adds at most one
        partial)."""
        row_entries = decodes if self.batch_invariant else split_entries(decodes)
        return (row_entries + prompt_size // self._tile_tokens(prompt_size)
                + self._prompt_seqs(prompt_size))

    def _tile_tokens(self, prompt_size: int) -> int:
        if self.batch_invariant:
            return invariant_tile_tokens(self.query_group_size)
        return prefill_tile_tokens(prompt_size, self.query_group_size)

    def fits(self, batch: StepBatch) -> bool:
        d = batch.num_decodes
        return batch.is_prefill and self.prompt_buckets.fits(d, sum(batch.num_tokens) - d)

    def bucket(self, batch: StepBatch) -> tuple[int, int]:
        """The step's bucket: (decoding rows, prompt tokens), each padded."""
        d = batch.num_decodes
        return self.prompt_buckets.bucket(d, sum(batch.num_tokens) - d)

    def build(self, batch: StepBatch) -> tuple[StepInputs, int, int]:
        """The step's inputs and its bucket (decoding rows, prompt tokens)."""
        inputs = self.input_layout
        return (build_step_inputs(batch, inputs.block_size, inputs.width), *self.bucket(batch))

    def reset(self, buffer: torch.Tensor, d: int, p: int) -> None:
        """Inputs of an empty step in bucket (d, p): no KV written or read, no tile mapped."""
        self.input_layout.reset(buffer, self.shape(d, p))

    def inputs(self, buffer: torch.Tensor, d: int, p: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of bucket (d, p)'s token ids, pending rows, positions and metadata."""
        v = self.input_layout.views(buffer, self.shape(d, p))
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=v.slots, context_lens=v.context_lens,
            block_tables=v.block_tables, cu_seqlens_q=v.cu_seqlens, num_decodes=d,
            tile_map=v.tiles, tile_tokens=self._tile_tokens(p))
        return v.ids, v.pending, v.positions, meta

    def sample_rows(self, buffer: torch.Tensor, step: StepInputs, d: int, p: int
                    ) -> torch.Tensor:
        """The rows of bucket (d, p)'s hidden states that `step` samples in."""
        return self.input_layout.views(buffer, self.shape(d, p)).sample_rows[
            :len(step.sample_rows)]

    def fill(self, host: np.ndarray, step: StepInputs, d_size: int, p_size: int) -> int:
        """Writes the step into a host buffer in its bucket's layout; returns the used length."""
        shape = self.shape(d_size, p_size)
        if self.batch_invariant:
            tile_map = step.invariant_tile_map(self.query_group_size, d_size, shape.rows,
                                               shape.tiles)
        else:
            tile_map = step.attention_tile_map(self._tile_tokens(p_size), d_size,
                                               self.max_decode_splits, self.split_rows,
                                               shape.tiles)
        return self.input_layout.fill(host, step, shape, d_size, tile_map)


def forward_bucket(step_model: StepModel, layout: PromptStepLayout, buffer: torch.Tensor,
                   d: int, p: int) -> torch.Tensor:
    """The model over bucket (d, p)'s inputs in `buffer` (what a captured step records)."""
    ids, pending, positions, meta = layout.inputs(buffer, d, p)
    splits = step_model.splits
    meta.workspace = None if splits is None else splits.workspace  # the split rows' (tile map)
    return step_model.model(step_model.pending.read(ids, pending), positions, meta)


class PromptGraphRunner:
    """Captures every bucket of `layout` at start-up (pool: the graph memory pool it shares
    with captured decode) and replays the step's bucket."""

    def __init__(self, step_model: StepModel, layout: PromptStepLayout, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, pool):
        self.step_model = step_model
        self.layout = layout
        self.inputs = step_model.inputs
        self.out_hidden = torch.empty(self.layout.max_tokens, hidden_size, dtype=dtype,
                                      device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        for d, p in reversed(self.layout.buckets):  # largest first: smaller ones reuse memory
            self.layout.reset(self.inputs.dev, d, p)
            self.graphs[(d, p)], _ = capture_graph(lambda d=d, p=p: self._forward(d, p), pool)

    def fits(self, batch: StepBatch) -> bool:
        return self.layout.fits(batch)

    def _forward(self, d: int, p: int) -> None:
        self.out_hidden[:d + p].copy_(forward_bucket(self.step_model, self.layout,
                                                     self.inputs.dev, d, p))

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the step's graph; returns its hidden states and the rows that sample."""
        step, d_size, p_size = self.layout.build(batch)
        self.inputs.send(self.layout.fill(self.inputs.host(), step, d_size, p_size))
        self.graphs[(d_size, p_size)].replay()
        rows = self.layout.sample_rows(self.inputs.dev, step, d_size, p_size)
        return self.out_hidden[:d_size + p_size], rows


def capture_step_graphs(step_model: StepModel, config: EngineConfig, pool, logits: bool = True
                        ) -> tuple[CUDAGraphRunner, PromptGraphRunner | None]:
    """A model's captured decode steps and prompt steps (pool: shared by every graph, as they
    replay one at a time); `logits`: whether decode steps end with the LM head."""
    layout = PromptStepLayout(PromptBuckets(config.max_num_seqs, config.mixed_prompt_tokens),
                              step_model.layout, step_model.query_group_size,
                              step_model.splits, config.batch_invariant)
    prompt_graphs = PromptGraphRunner(step_model, layout, step_model.model.config.hidden_size,
                                      config.torch_dtype, step_model.device, pool)
    graphs = CUDAGraphRunner(step_model, config.max_num_seqs, pool, logits)
    return graphs, prompt_graphs
