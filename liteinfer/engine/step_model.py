"""The model as every step runs it, eager or captured: token ids that are still pending on the
device are read from the last step's sampled tokens, and narrow decode batches split their
attention over the KV length (split-K)."""
from __future__ import annotations

import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for, rows_may_split
from liteinfer.models.llama import LlamaForCausalLM


class StepModel:
    """The model, the sampled-token buffer that feeds the next step, and the split-K
    workspace (None: no split-K, as on the torch backends)."""

    def __init__(self, model: LlamaForCausalLM, max_sampled_rows: int, num_kv_heads: int,
                 head_dim: int, num_sms: int, decode_workspace: DecodeWorkspace | None,
                 device: torch.device):
        self.model = model
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_sms = num_sms
        self.decode_workspace = decode_workspace
        # The newest step's sampled tokens, which feed the next step on the device.
        self.sampled_tokens = torch.zeros(max_sampled_rows, dtype=torch.int32, device=device)

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
