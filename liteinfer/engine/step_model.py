"""The model as every step runs it, eager or captured: its inputs in one buffer that every kind
of step fills (engine/input_layout.py), token ids that are still pending on the device read
from the last step's sampled tokens (engine/pending_tokens.py), and narrow decode batches
split their attention over the KV length (split-K)."""
from __future__ import annotations

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.input_layout import InputLayout, StepInputBuffer, StepShape
from liteinfer.engine.pending_tokens import PendingTokens
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for, rows_may_split
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens
from liteinfer.layers.ops import StepScratch
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.utils import to_device


class StepModel:
    """The model, the step input buffer and its layout, the sampled tokens that feed the next
    step (`pending`: a draft model reads the target's) and the runner's scratch buffers, whose
    split-K decode workspace the attention metadata carries (None: no split-K, as on the torch
    backends)."""

    def __init__(self, model: LlamaForCausalLM, pending: PendingTokens, num_kv_heads: int,
                 head_dim: int, num_sms: int, scratch: StepScratch, device: torch.device,
                 layout: InputLayout):
        self.model = model
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_sms = num_sms
        self.scratch = scratch
        self.pending = pending
        self.layout = layout
        self.inputs = StepInputBuffer(layout.total, device)
        self.device = device
        cfg = model.config
        # Query heads per KV head: prefill attention's tiles hold all of a group's heads.
        self.query_group_size = cfg.num_attention_heads // cfg.num_key_value_heads

    def prepare(self, batch: StepBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                           torch.Tensor | None]:
        """An eager step's token ids, positions, attention metadata, the rows whose logits are
        sampled and the rows scoring prompt tokens (`prompt_logprob_spans`; None if there are
        none): views of the input buffer, filled and sent here."""
        layout, host = self.layout, self.inputs.host()
        triton = self.decode_workspace is not None
        prompt_rows = None
        if batch.is_prefill:
            step = build_step_inputs(batch, layout.block_size, layout.width)
            d = step.num_decodes
            tile_map, tile_tokens = None, 0
            if triton:
                tile_tokens = prefill_tile_tokens(int(step.query_lens[d:].max()),
                                                  self.query_group_size)
                tile_map = step.attention_tile_map(tile_tokens, d, self.max_decode_splits,
                                                   self.split_rows)
            shape = StepShape(len(step.input_ids), len(step.query_lens),
                              0 if tile_map is None else len(tile_map))
            self.inputs.send(layout.fill(host, step, shape, d, tile_map))
            context_lens, query_lens = step.context_lens, step.query_lens.tolist()
            num_samples, has_pending = len(step.sample_rows), step.has_pending
            # A device index: indexing with a host list would copy it synchronously and stall
            # the host until the whole step has run, instead of letting it prepare the next.
            if len(step.prompt_rows):
                prompt_rows = to_device(step.prompt_rows, torch.int64, self.device)
        else:
            d = num_samples = len(batch.seqs)
            shape = StepShape(d, d)
            context_lens, used = layout.fill_decode(host, batch.seqs, d)
            views = layout.views(host, shape)
            views.sample_rows[:] = np.arange(d)
            has_pending = bool((views.pending >= 0).any())
            query_lens = [1] * d
            self.inputs.send(used)
        v = layout.views(self.inputs.dev, shape)
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill, slot_mapping=v.slots, context_lens=v.context_lens,
            block_tables=v.block_tables,
            cu_seqlens_q=v.cu_seqlens if batch.is_prefill else None,
            num_decodes=d if batch.is_prefill else 0,
            query_lens_host=query_lens, context_lens_host=context_lens.tolist())
        if triton and batch.is_prefill:
            meta.tile_tokens, meta.tile_map = tile_tokens, v.tiles
            meta.workspace = self.decode_workspace
        elif triton:
            self.set_split_k(meta, d, self.rows_may_split(context_lens))
        ids = self.pending.read(v.ids, v.pending) if has_pending else v.ids
        return ids, v.positions, meta, v.sample_rows[:num_samples], prompt_rows

    @property
    def decode_workspace(self) -> DecodeWorkspace | None:
        return self.scratch.decode

    @property
    def max_decode_splits(self) -> int:
        """Most programs a decoding row splits into (1 without split-K)."""
        workspace = self.decode_workspace
        return 1 if workspace is None else workspace.max_splits

    @property
    def split_rows(self) -> int:
        """Workspace rows: a prompt step's split rows index them by token (0 without split-K)."""
        workspace = self.decode_workspace
        return 0 if workspace is None else workspace.partial_out.shape[0]

    def rows_may_split(self, context_lens) -> bool:
        """Whether a decoding row of these host-side lengths is long enough to split."""
        return rows_may_split(context_lens, self.head_dim)

    def split_width(self, num_decodes: int, may_split: bool) -> int:
        """The split-K grid width of `num_decodes` decoding rows (1: no split-K)."""
        if self.decode_workspace is None or num_decodes == 0:
            return 1
        return max_splits_for(num_decodes, self.num_kv_heads, self.num_sms, may_split)

    def set_split_k(self, meta: AttentionMetadata, num_decodes: int, may_split: bool) -> None:
        """Decode split-K for the step's first `num_decodes` sequences: the grid width is fixed
        per decode count and whether a row may split (`max_splits_for`); the decode kernel
        chooses each sequence's split count from the context lengths (kernels/decode_splits.py)."""
        meta.max_splits = self.split_width(num_decodes, may_split)
        if meta.max_splits > 1:
            meta.workspace = self.decode_workspace
