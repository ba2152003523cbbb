"""Attention through liteinfer's Triton kernels: fused RoPE + KV write, packed prefill, paged decode."""
from __future__ import annotations

import torch

from liteinfer.attention.base import AttentionBackend, AttentionMetadata
from liteinfer.kernels.decode_attention import paged_decode_attention
from liteinfer.kernels.kv_cache import rope_store_kv
from liteinfer.kernels.prefill_attention import packed_prefill_attention


class TritonBackend(AttentionBackend):
    def forward(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.is_prefill:
            return packed_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q,
                                            meta.context_lens, meta.block_tables, scale, out,
                                            meta.max_seqlen_q)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      scale, out, num_splits=meta.num_splits,
                                      max_splits=meta.max_splits, workspace=meta.workspace)
