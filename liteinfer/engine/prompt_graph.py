"""Prompt and mixed steps replayed from CUDA graphs.

An eager step of a few hundred prompt tokens spends several times its GPU time launching ~200
kernels, so steps of up to `mixed_prompt_tokens` prompt tokens are captured too: one graph per
(decoding rows, prompt tokens) bucket, the decoding rows a power of two and the prompt tokens
each bringing the step's rows to a power of two (`prompt_piece_sizes`, which the scheduler
trims mixed steps to). A step is padded to its bucket:
decoding rows first, padded with rows of context 0, then the prompt tokens, padded with tokens
that write no KV; no tile-map entry covers a padding row. Prefill attention reads its programs'
work (the splits of decoding rows and verifications, prompt query tiles) from a tile map, so
one grid serves any mix of context and prompt lengths. The LM head runs after the replay on the
rows that sample only.

All inputs live in one flat int32 device buffer at fixed offsets (`PromptStepLayout`), filled
from a pinned host mirror with one copy per step (`StagedInputs`, as in captured decode).
"""
from __future__ import annotations

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.config import EngineConfig
from liteinfer.engine.cuda_graph import CUDAGraphRunner, StagedInputs, capture_graph
from liteinfer.engine.scheduler import padded_decodes, prompt_piece_sizes
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_inputs import StepInputs, build_step_inputs
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens, split_entries


class PromptStepLayout:
    """The buckets, and where a bucket's inputs sit in one flat int32 buffer (a name's region
    starts at the same offset for every bucket). Device-agnostic: the CUDA runner below fills a
    pinned mirror of its device buffer, and the layout runs as well on a CPU buffer."""

    def __init__(self, max_num_seqs: int, mixed_prompt_tokens: int, table_width: int,
                 block_size: int, query_group_size: int, max_decode_splits: int,
                 split_rows: int):
        self.max_num_seqs = max_num_seqs
        self.query_group_size = query_group_size
        self.max_decode_splits = max_decode_splits
        self.split_rows = split_rows
        self.width = table_width
        self.block_size = block_size
        # A mixed step holds at least one prompt, so at most max_num_seqs - 1 decoding rows.
        decode_sizes = sorted({padded_decodes(d, max_num_seqs) for d in range(max_num_seqs)})
        self.prompt_sizes = {d: prompt_piece_sizes(d, mixed_prompt_tokens) for d in decode_sizes}
        self.buckets = [(d, p) for d in decode_sizes for p in self.prompt_sizes[d]]
        max_tokens = max(d + p for d, p in self.buckets)
        max_rows = max(d + self._prompt_seqs(p) for d, p in self.buckets)
        max_tiles = max(self._tiles(d, p) for d, p in self.buckets)
        self.sizes = {"ids": max_tokens, "pending": max_tokens, "positions": max_tokens,
                      "slots": max_tokens, "context_lens": max_rows, "cu_seqlens": max_rows + 1,
                      "sample_rows": max_tokens, "tiles": 2 * max_tiles,
                      "block_tables": max_rows * self.width}  # last: only used rows are copied
        self.offsets: dict[str, int] = {}
        self.total = 0
        for name, n in self.sizes.items():
            self.offsets[name] = self.total
            self.total += n
        self.max_tokens = max_tokens

    def _prompt_seqs(self, prompt_size: int) -> int:
        return min(prompt_size, self.max_num_seqs)

    def _tiles(self, decodes: int, prompt_size: int) -> int:
        """Tile-map entries of bucket (decodes, prompt_size): the split rows' beyond their own
        tiles, and the query tiles of any `prompt_size` tokens (each sequence adds at most one
        partial)."""
        return (split_entries(decodes) + prompt_size // self._tile_tokens(prompt_size)
                + self._prompt_seqs(prompt_size))

    def _tile_tokens(self, prompt_size: int) -> int:
        return prefill_tile_tokens(prompt_size, self.query_group_size)

    def fits(self, batch: StepBatch) -> bool:
        if not batch.is_prefill or batch.num_decodes >= self.max_num_seqs:
            return False
        prompt_tokens = sum(batch.num_tokens) - batch.num_decodes
        return prompt_tokens <= self._sizes_for(batch.num_decodes)[-1]

    def _sizes_for(self, num_decodes: int) -> list[int]:
        return self.prompt_sizes[padded_decodes(num_decodes, self.max_num_seqs)]

    def bucket(self, batch: StepBatch) -> tuple[int, int]:
        """The step's bucket: (decoding rows, prompt tokens), each padded."""
        d = batch.num_decodes
        p_size = next(s for s in self._sizes_for(d) if s >= sum(batch.num_tokens) - d)
        return padded_decodes(d, self.max_num_seqs), p_size

    def build(self, batch: StepBatch) -> tuple[StepInputs, int, int]:
        """The step's inputs and its bucket (decoding rows, prompt tokens)."""
        return (build_step_inputs(batch, self.block_size, self.width), *self.bucket(batch))

    def reset(self, buffer: torch.Tensor) -> None:
        """Inputs of an empty step: no KV written or read, no query tile mapped."""
        buffer.zero_()
        for name in ("pending", "slots", "tiles"):
            self._region(buffer, name, self.sizes[name]).fill_(-1)

    def _region(self, buffer: torch.Tensor | np.ndarray, name: str, n: int):
        return buffer[self.offsets[name]:self.offsets[name] + n]

    def inputs(self, buffer: torch.Tensor, d: int, p: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of bucket (d, p)'s token ids, pending rows, positions and metadata."""
        t, rows = d + p, d + self._prompt_seqs(p)
        def view(name, n):
            return self._region(buffer, name, n)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=view("slots", t), context_lens=view("context_lens", rows),
            block_tables=view("block_tables", rows * self.width).view(rows, self.width),
            cu_seqlens_q=view("cu_seqlens", rows + 1), num_decodes=d,
            tile_map=view("tiles", 2 * self._tiles(d, p)).view(-1, 2),
            tile_tokens=self._tile_tokens(p))
        return view("ids", t), view("pending", t), view("positions", t), meta

    def sample_rows(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        return self._region(buffer, "sample_rows", n)

    def fill(self, host: np.ndarray, step: StepInputs, d_size: int, p_size: int) -> int:
        """Writes the step into a host buffer in its bucket's layout; returns the used length."""
        def view(name, n):
            return self._region(host, name, n)
        d, n_seqs = step.num_decodes, len(step.query_lens)
        p = len(step.input_ids) - d
        t, rows = d_size + p_size, d_size + self._prompt_seqs(p_size)
        # Token arrays: decoding rows, their padding, prompt tokens, their padding.
        for name, data, pad in (("ids", step.input_ids, 0), ("pending", step.pending_rows, -1),
                                ("positions", step.positions, 0), ("slots", step.slots, -1)):
            out = view(name, t)
            out[:] = pad
            out[:d] = data[:d]
            out[d_size:d_size + p] = data[d:]
        # Sequence arrays: decoding sequences, padding rows (context 0), prompt sequences.
        ctx = view("context_lens", rows)
        ctx[:] = 0
        ctx[:d] = step.context_lens[:d]
        ctx[d_size:d_size + n_seqs - d] = step.context_lens[d:]
        query_lens = np.zeros(rows, dtype=np.int64)
        query_lens[:d_size] = 1
        query_lens[d_size:d_size + n_seqs - d] = step.query_lens[d:]
        view("cu_seqlens", rows + 1)[:] = np.concatenate([[0], np.cumsum(query_lens)])
        tables = view("block_tables", rows * self.width).reshape(rows, self.width)
        tables[:d] = step.block_tables[:d]
        tables[d_size:d_size + n_seqs - d] = step.block_tables[d:]
        samples = step.sample_rows
        view("sample_rows", len(samples))[:] = np.where(samples < d, samples,
                                                        samples - d + d_size)
        num_tiles = self._tiles(d_size, p_size)
        view("tiles", 2 * num_tiles)[:] = step.attention_tile_map(
            self._tile_tokens(p_size), d_size, self.max_decode_splits, self.split_rows,
            num_tiles).reshape(-1)
        return self.offsets["block_tables"] + (d_size + n_seqs - d) * self.width


def forward_bucket(step_model: StepModel, layout: PromptStepLayout, buffer: torch.Tensor,
                   d: int, p: int) -> torch.Tensor:
    """The model over bucket (d, p)'s inputs in `buffer` (what a captured step records)."""
    ids, pending, positions, meta = layout.inputs(buffer, d, p)
    meta.workspace = step_model.decode_workspace  # for the split rows (tile map)
    return step_model.model(step_model.with_pending(ids, pending), positions, meta)


class PromptGraphRunner:
    """Captures every bucket of `layout` at start-up (pool: the graph memory pool it shares
    with captured decode) and replays the step's bucket."""

    def __init__(self, step_model: StepModel, layout: PromptStepLayout, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, pool):
        self.step_model = step_model
        self.layout = layout
        self.inputs = StagedInputs(self.layout.total, device)
        self.out_hidden = torch.empty(self.layout.max_tokens, hidden_size, dtype=dtype,
                                      device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        for d, p in reversed(self.layout.buckets):  # largest first: smaller ones reuse memory
            self.layout.reset(self.inputs.dev)
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
        t = d_size + p_size
        rows = self.layout.sample_rows(self.inputs.dev, len(step.sample_rows))
        return self.out_hidden[:t], rows


def capture_step_graphs(step_model: StepModel, config: EngineConfig, table_width: int, pool,
                        logits: bool = True
                        ) -> tuple[CUDAGraphRunner, PromptGraphRunner | None]:
    """A model's captured decode steps and prompt steps (pool: shared by every graph, as they
    replay one at a time); `logits`: whether decode steps end with the LM head. Batch-invariant
    attention takes a prompt step's query tiles from the host, which a captured prompt step
    does not have: those steps run eagerly in that mode (None)."""
    prompt_graphs = None
    if not config.batch_invariant:
        layout = PromptStepLayout(config.max_num_seqs, config.mixed_prompt_tokens, table_width,
                                  config.block_size, step_model.query_group_size,
                                  step_model.max_decode_splits, step_model.split_rows)
        prompt_graphs = PromptGraphRunner(step_model, layout,
                                          step_model.model.config.hidden_size,
                                          config.torch_dtype, step_model.device, pool)
    graphs = CUDAGraphRunner(step_model, config.max_num_seqs, table_width, config.block_size,
                             step_model.device, pool, logits)
    return graphs, prompt_graphs
