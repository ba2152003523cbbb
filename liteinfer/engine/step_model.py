"""The model as every step runs it, eager or captured: token ids that are still pending on the
device are read from the last step's sampled tokens, and narrow decode batches split their
attention over the KV length (split-K). An eager step's inputs are built here too."""
from __future__ import annotations

import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for, rows_may_split
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens
from liteinfer.layers.ops import StepScratch
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.utils import to_device


class StepModel:
    """The model, the sampled-token buffer that feeds the next step, and the runner's scratch
    buffers, whose split-K decode workspace the attention metadata carries (None: no split-K,
    as on the torch backends)."""

    def __init__(self, model: LlamaForCausalLM, max_sampled_rows: int, num_kv_heads: int,
                 head_dim: int, num_sms: int, scratch: StepScratch, device: torch.device):
        self.model = model
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_sms = num_sms
        self.scratch = scratch
        # The newest step's sampled tokens, which feed the next step on the device.
        self.sampled_tokens = torch.zeros(max_sampled_rows, dtype=torch.int32, device=device)
        self.device = device
        cfg = model.config
        # Query heads per KV head: prefill attention's tiles hold all of a group's heads.
        self.query_group_size = cfg.num_attention_heads // cfg.num_key_value_heads

    def prepare(self, batch: StepBatch, block_size: int, table_width: int
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                           torch.Tensor | None]:
        """An eager step's token ids, positions, attention metadata, the rows whose logits are
        sampled and the rows scoring prompt tokens (`prompt_logprob_spans`; None if there are
        none)."""
        step = build_step_inputs(batch, block_size, table_width)
        def as_tensor(data, dtype):
            return to_device(data, dtype, self.device)
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=as_tensor(step.slots, torch.int64),
            context_lens=as_tensor(step.context_lens, torch.int32),
            block_tables=as_tensor(step.block_tables, torch.int32),
            cu_seqlens_q=as_tensor(step.cu_seqlens, torch.int32) if batch.is_prefill else None,
            num_decodes=step.num_decodes if batch.is_prefill else 0,
            query_lens_host=step.query_lens.tolist(),
            context_lens_host=step.context_lens.tolist(),
        )
        triton = self.decode_workspace is not None
        if triton and batch.is_prefill:
            d = step.num_decodes
            meta.tile_tokens = prefill_tile_tokens(int(step.query_lens[d:].max()),
                                                   self.query_group_size)
            meta.tile_map = as_tensor(step.attention_tile_map(
                meta.tile_tokens, d, self.max_decode_splits, self.split_rows), torch.int32)
            meta.workspace = self.decode_workspace
        elif triton:
            self.set_split_k(meta, step.num_decodes, self.rows_may_split(step.context_lens))
        ids = as_tensor(step.input_ids, torch.int32)
        if step.has_pending:
            ids = self.with_pending(ids, as_tensor(step.pending_rows, torch.int32))
        # A device index: indexing with a host list would copy it synchronously and stall the
        # host until the whole step has run, instead of letting it prepare the next one.
        prompt_rows = as_tensor(step.prompt_rows, torch.int64) if len(step.prompt_rows) else None
        return (ids, as_tensor(step.positions, torch.int64), meta,
                as_tensor(step.sample_rows, torch.int64), prompt_rows)

    @property
    def decode_workspace(self) -> DecodeWorkspace | None:
        return self.scratch.decode

    def with_pending(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> torch.Tensor:
        """Token ids with pending ones (row >= 0) read from the last sampled tokens."""
        return torch.where(pending_rows >= 0, self.sampled_tokens[pending_rows.clamp(min=0)], ids)

    def keep_sampled(self, token_ids: torch.Tensor) -> None:
        self.sampled_tokens[:token_ids.shape[0]].copy_(token_ids)

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
