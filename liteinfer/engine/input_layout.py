"""A step's model inputs in one flat int32 buffer, one per model (the target's and a draft
model's): eager steps, captured decode steps and captured prompt steps all fill it here.

Each step shape (tokens, sequence rows, tile-map entries; a captured step's is its padded
size) has its regions end to end, the block tables last, so a step sends only the prefix it
uses, in one copy from a pinned host mirror (`StepInputBuffer`). An eager step takes views of
the device buffer as its tensors; a graph captured for a shape reads that shape's views, so
every captured graph shares the one buffer. Regions of different shapes overlap: each fill
writes every element its shape's views read, padding included (a padding row reads no KV and
writes none), and a shape is reset before it is captured (`reset`).

Decode steps are filled from the request states directly (`fill_decode`, and `fill_verify`
for steps of verifications): a one-sequence 1B decode step is the shortest on the GPU, and all
of its host work must hide under it. Other steps are filled from `StepInputs`
(step_inputs.py), numpy arrays computed for all tokens at once.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from liteinfer.config import EngineConfig
from liteinfer.engine.pending_tokens import NOT_PENDING, PendingRequest, last_token_inputs
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.kernels.decode_splits import DecodeSplits
from liteinfer.kernels.prefill_tiles import split_entries


class StepInputBuffer:
    """The flat int32 device buffer, sent from two host mirrors in turn, so that one is filled
    while the copy from the other may still be in flight (pinned on CUDA). On the CPU the
    mirrors are copied at once."""

    def __init__(self, size: int, device: torch.device):
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._step = 0

    def host(self) -> np.ndarray:
        """The next host mirror to fill (waits until its previous copy has finished)."""
        copied = self._copied[self._step % 2]
        if copied is not None:
            copied.synchronize()
        return self._hosts[self._step % 2].numpy()

    def send(self, used: int) -> None:
        """Copies the first `used` elements of the mirror just filled to the device buffer."""
        which = self._step % 2
        self.dev[:used].copy_(self._hosts[which][:used], non_blocking=True)
        if self._copied[which] is not None:
            self._copied[which].record()
        self._step += 1

    def free(self) -> None:
        """Drops the device buffer and its pinned mirrors; nothing is sent after it."""
        self.dev = self.dev.new_empty(0)
        self._hosts, self._copied = [], []


@dataclass(frozen=True)
class StepShape:
    """A step's size as its inputs are laid out: tokens, sequence rows (a captured step's
    padding rows included) and prefill attention's tile-map entries (0 for decode steps)."""

    tokens: int
    rows: int
    tiles: int = 0

    @classmethod
    def decode(cls, rows: int, query_len: int = 1) -> StepShape:
        """A decode step of `rows` sequences, `query_len` query tokens each (a verification's
        next token and drafts where above 1)."""
        return cls(rows * query_len, rows)


@dataclass
class StepViews:
    """One shape's regions of a buffer (tensors or host arrays)."""

    ids: Any           # [tokens]; 0 where the id is pending
    pending: Any       # [tokens]: row in the newest samples, NOT_PENDING = id known
    positions: Any     # [tokens]
    slots: Any         # [tokens]: KV pool slot, -1 = padding (not written)
    sample_rows: Any   # [tokens]: token rows whose logits are sampled (a prefix is used)
    context_lens: Any  # [rows]: KV tokens including this step's, 0 for padding rows
    cu_seqlens: Any    # [rows + 1]: where each row's tokens start
    tiles: Any         # [tiles, 2]: prefill attention's tile map
    block_tables: Any  # [rows, table_width]


_TOKEN_REGIONS = ("ids", "pending", "positions", "slots", "sample_rows")


@functools.lru_cache(maxsize=1024)  # captured shapes, and the eager steps' recent ones
def _offsets(shape: StepShape, table_width: int) -> dict[str, int]:
    t, r = shape.tokens, shape.rows
    sizes = {name: t for name in _TOKEN_REGIONS}
    sizes.update(context_lens=r, cu_seqlens=r + 1, tiles=2 * shape.tiles,
                 block_tables=r * table_width)
    offsets, at = {}, 0
    for name, n in sizes.items():
        offsets[name] = at
        at += n
    offsets["end"] = at
    return offsets


class InputLayout:
    """Where each shape's inputs sit (`views`) and the fills. `max_shape` bounds every shape
    (each of its fields at least any step's)."""

    def __init__(self, table_width: int, block_size: int, max_shape: StepShape):
        self.width = table_width
        self.block_size = block_size
        self.total = _offsets(max_shape, table_width)["end"]
        # Decode shapes by their rows: looked up on every captured decode step's host path.
        self._decode_offsets: dict[int, dict[str, int]] = {}

    def offsets(self, shape: StepShape) -> dict[str, int]:
        """Each region's start, and "end": where the shape's block tables end."""
        offsets = _offsets(shape, self.width)
        if offsets["end"] > self.total:
            raise ValueError(f"a step of {shape} does not fit the input layout "
                             f"({self.total} elements)")
        return offsets

    def views(self, buffer: torch.Tensor | np.ndarray, shape: StepShape) -> StepViews:
        o = self.offsets(shape)
        t, r = shape.tokens, shape.rows
        def region(name: str, n: int):
            return buffer[o[name]:o[name] + n]
        return StepViews(
            *(region(name, t) for name in _TOKEN_REGIONS),
            context_lens=region("context_lens", r), cu_seqlens=region("cu_seqlens", r + 1),
            tiles=region("tiles", 2 * shape.tiles).reshape(-1, 2),
            block_tables=region("block_tables", r * self.width).reshape(r, self.width))

    def used(self, shape: StepShape, table_rows: int) -> int:
        """The prefix a step of `shape` sends: up to its first `table_rows` block tables (a
        prompt step's others are padding rows', which no prefill kernel reads)."""
        return self.offsets(shape)["block_tables"] + table_rows * self.width

    def reset(self, buffer: torch.Tensor, shape: StepShape) -> None:
        """Inputs of an empty step: no KV written or read, no query tile mapped."""
        o = self.offsets(shape)
        buffer[:o["end"]].zero_()
        v = self.views(buffer, shape)
        for region in (v.pending, v.slots, v.tiles):
            region.fill_(-1)

    def fill_decode(self, host: np.ndarray, seqs: Sequence[PendingRequest], rows: int,
                    table_tails: bool = True) -> tuple[np.ndarray, int]:
        """Writes a decode step of `seqs` padded to `rows` (each decodes its newest token) into
        a host mirror in shape (rows, rows); returns the context lengths and the length to
        send. Sample rows are not written: every decoding row samples. `table_tails`: zero each
        real row's block table past its blocks, which the torch backends' gathers read; the
        Triton kernels read a row's blocks only, and a captured step skips that memset."""
        n = len(seqs)
        o = self._decode_offsets.get(rows)
        if o is None:
            o = self._decode_offsets[rows] = self.offsets(StepShape.decode(rows))
        block_size = self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        pos = lens - 1
        last_blocks = np.fromiter(
            (s.block_table[p // block_size] for s, p in zip(seqs, pos.tolist())),
            dtype=np.int64, count=n)
        ids, pending = last_token_inputs(seqs)
        host[o["ids"]:o["ids"] + n] = ids
        host[o["pending"]:o["pending"] + n] = pending
        host[o["positions"]:o["positions"] + n] = pos
        host[o["slots"]:o["slots"] + n] = last_blocks * block_size + pos % block_size
        host[o["context_lens"]:o["context_lens"] + n] = lens
        if rows > n:  # padding rows: no KV read or written, RoPE at position 0
            for name, pad in (("ids", 0), ("pending", NOT_PENDING), ("positions", 0),
                              ("slots", -1), ("context_lens", 0)):
                host[o[name] + n:o[name] + rows] = pad
        at = o["block_tables"]
        tables = host[at:at + rows * self.width].reshape(rows, self.width)
        if table_tails:
            tables[:n] = 0
        # Padding rows' tables are zeroed and sent: their region may hold another shape's
        # arrays, and the batch-invariant kernel reads a padding row's first block id.
        tables[n:] = 0
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        return lens, at + rows * self.width

    def fill_verify(self, host: np.ndarray, seqs: Sequence[PendingRequest],
                    drafts: Sequence[Sequence[int]], rows: int, query_len: int
                    ) -> tuple[np.ndarray, int, int]:
        """Writes a decode step of verifications into a host mirror in shape (rows * query_len,
        rows): sequence i's newest token (pending or known) and then its drafts (none for a
        sequence that only decodes) at token rows i * query_len on, padded to query_len with
        tokens that write no KV. Its context length counts query_len tokens from its newest
        token's position, so that its token t sees the keys up to its own
        (kernels/decode_attention.py), and its block table is zero past its blocks, where its
        padding tokens read. Sample rows: each sequence's real tokens. Returns the context
        lengths, the length to send and the number of sample rows."""
        n, q, block_size = len(seqs), query_len, self.block_size
        shape = StepShape.decode(rows, q)
        v = self.views(host, shape)
        v.ids[:], v.pending[:], v.slots[:] = 0, NOT_PENDING, -1
        v.positions[:], v.context_lens[:], v.block_tables[:] = 0, 0, 0
        last_ids, last_pending = last_token_inputs(seqs)
        samples = 0
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            first, real = i * q, 1 + len(draft)
            start = len(seq) - 1
            pos = np.arange(start, start + real)
            table = seq.block_table
            v.ids[first] = last_ids[i]
            v.pending[first] = last_pending[i]
            v.ids[first + 1:first + real] = draft
            v.positions[first:first + real] = pos
            v.positions[first + real:first + q] = start + real - 1  # any valid RoPE row
            v.slots[first:first + real] = (np.asarray(table)[pos // block_size] * block_size
                                           + pos % block_size)
            v.context_lens[i] = start + q
            v.block_tables[i, :len(table)] = table
            v.sample_rows[samples:samples + real] = np.arange(first, first + real)
            samples += real
        return v.context_lens[:n].copy(), self.used(shape, rows), samples

    def fill(self, host: np.ndarray, step: StepInputs, shape: StepShape, d_size: int,
             tile_map: np.ndarray | None = None) -> int:
        """Writes a prompt or mixed step into a host mirror in `shape`, its `num_decodes`
        decoding rows padded to `d_size` rows and its prompt tokens and rows after them padded
        to the shape (an eager step: no padding); returns the length to send. `tile_map`:
        prefill attention's, of `shape.tiles` entries (None: the step has none)."""
        v = self.views(host, shape)
        d, n_seqs = step.num_decodes, len(step.query_lens)
        p = len(step.input_ids) - d
        # Token arrays: decoding rows, their padding, prompt tokens, their padding.
        for out, data, pad in ((v.ids, step.input_ids, 0), (v.pending, step.pending_rows, -1),
                               (v.positions, step.positions, 0), (v.slots, step.slots, -1)):
            out[:] = pad
            out[:d] = data[:d]
            out[d_size:d_size + p] = data[d:]
        # Sequence arrays: decoding sequences, padding rows (context 0), prompt sequences.
        rows = shape.rows
        v.context_lens[:] = 0
        v.context_lens[:d] = step.context_lens[:d]
        v.context_lens[d_size:d_size + n_seqs - d] = step.context_lens[d:]
        query_lens = np.zeros(rows, dtype=np.int64)
        query_lens[:d_size] = 1
        query_lens[d_size:d_size + n_seqs - d] = step.query_lens[d:]
        v.cu_seqlens[0] = 0
        np.cumsum(query_lens, out=v.cu_seqlens[1:])
        v.block_tables[:d] = step.block_tables[:d]
        v.block_tables[d_size:d_size + n_seqs - d] = step.block_tables[d:]
        samples = step.sample_rows
        v.sample_rows[:len(samples)] = np.where(samples < d, samples, samples - d + d_size)
        if tile_map is not None:
            v.tiles[:] = tile_map.reshape(-1, 2)
        return self.used(shape, d_size + n_seqs - d)


def step_input_layout(config: EngineConfig, table_width: int,
                      splits: DecodeSplits | None) -> InputLayout:
    """A layout with room for any step of a model run with `config`: an eager step's tokens (a
    prompt budget's, a verification step's of every sequence with its drafts), a captured
    prompt step's with its padding (its padded decoding rows and up to max_num_seqs prompt
    rows), and their tile maps (a split row's programs, at most the split-K workspace's splits,
    the entries a captured step reserves for them, a query tile a token at most and a partial a
    row)."""
    max_decode_splits = 1 if splits is None else splits.max_splits
    tokens = max(config.max_num_batched_tokens, config.max_sampled_rows,
                 config.max_num_seqs + config.mixed_prompt_tokens)
    rows = 2 * config.max_num_seqs
    seqs = config.max_num_seqs
    tiles = rows * max_decode_splits + split_entries(seqs) + tokens + rows
    return InputLayout(table_width, config.block_size, StepShape(tokens, rows, tiles))
