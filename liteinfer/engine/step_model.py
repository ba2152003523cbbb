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
from liteinfer.kernels.decode_splits import DecodeSplits
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens
from liteinfer.layers.ops import StepScratch
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.utils import to_device


class StepModel:
    """The model, the step input buffer and its layout, the sampled tokens that feed the next
    step (`pending`: a draft model reads the target's) and the runner's scratch buffers, whose
    split-K decode sizing (`splits`: kernels/decode_splits.DecodeSplits; None: no split-K, as
    on the torch backends) gives the attention metadata its grid width and workspace."""

    def __init__(self, model: LlamaForCausalLM, pending: PendingTokens, scratch: StepScratch,
                 device: torch.device, layout: InputLayout, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant  # prompt steps' tile maps are the invariant kernel's
        self.scratch = scratch
        self.pending = pending
        self.layout = layout
        self.inputs = StepInputBuffer(layout.total, device)
        self.device = device
        cfg = model.config
        # Query heads per KV head: prefill attention's tiles hold all of a group's heads.
        self.query_group_size = cfg.num_attention_heads // cfg.num_key_value_heads

    def prepare(self, batch: StepBatch, query_len: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                           torch.Tensor | None]:
        """An eager step's token ids, positions, attention metadata, the rows whose logits are
        sampled and the rows scoring prompt tokens (`prompt_logprob_spans`; None if there are
        none): views of the input buffer, filled and sent here. `query_len`: the step runs as a
        decode step of verifications of that many tokens a sequence (its
        `verification_width`; 0: as its kind)."""
        layout, host, splits = self.layout, self.inputs.host(), self.splits
        prompt_rows = None
        if query_len:
            d = len(batch.seqs)
            shape = StepShape.decode(d, query_len)
            context_lens, used, num_samples = layout.fill_verify(
                host, batch.seqs, batch.draft_token_ids, d, query_len)
            has_pending = bool((layout.views(host, shape).pending >= 0).any())
            query_lens = [query_len] * d
            self.inputs.send(used)
        elif batch.is_prefill:
            step = build_step_inputs(batch, layout.block_size, layout.width)
            d = step.num_decodes
            tile_map, tile_tokens = None, 0
            if splits is not None and self.batch_invariant:
                tile_map = step.invariant_tile_map(self.query_group_size, d,
                                                   len(step.query_lens))
            elif splits is not None:
                tile_tokens = prefill_tile_tokens(int(step.query_lens[d:].max()),
                                                  self.query_group_size)
                tile_map = step.attention_tile_map(tile_tokens, d, splits.max_splits,
                                                   splits.rows)
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
            shape = StepShape.decode(d)
            context_lens, used = layout.fill_decode(host, batch.seqs, d)
            views = layout.views(host, shape)
            views.sample_rows[:] = np.arange(d)
            has_pending = bool((views.pending >= 0).any())
            query_lens = [1] * d
            self.inputs.send(used)
        v = layout.views(self.inputs.dev, shape)
        prefill = batch.is_prefill and not query_len
        meta = AttentionMetadata(
            is_prefill=prefill, slot_mapping=v.slots, context_lens=v.context_lens,
            block_tables=v.block_tables, cu_seqlens_q=v.cu_seqlens if prefill else None,
            num_decodes=d if prefill else 0, query_len=query_len or 1,
            query_lens_host=query_lens, context_lens_host=context_lens.tolist())
        if splits is not None and prefill:
            meta.tile_tokens, meta.tile_map = tile_tokens, v.tiles
            meta.workspace = splits.workspace
        elif splits is not None:
            self.set_split_k(meta, d, splits.may_split(context_lens))
        ids = self.pending.read(v.ids, v.pending) if has_pending else v.ids
        return ids, v.positions, meta, v.sample_rows[:num_samples], prompt_rows

    @property
    def splits(self) -> DecodeSplits | None:
        """The split-K decode sizing and workspace (the runner's scratch; None without
        split-K)."""
        return self.scratch.decode

    def set_split_k(self, meta: AttentionMetadata, num_decodes: int, may_split: bool) -> None:
        """Decode split-K for the step's first `num_decodes` sequences: the grid width is fixed
        per decode count and whether a row may split (`DecodeSplits.width`); the decode kernel
        chooses each sequence's split count from the context lengths (kernels/decode_splits.py)."""
        splits = self.splits
        if splits is not None:
            meta.max_splits = splits.width(num_decodes, may_split)
            if meta.max_splits > 1:
                meta.workspace = splits.workspace

    def release(self) -> None:
        """Frees the input buffer; the model runs no step after it."""
        self.inputs.free()
