"""Attention through liteinfer's Triton kernels: paged decode with RoPE and the KV write fused in,
packed prefill over the pool, and FlashAttention-2 for prompts with nothing cached."""
from __future__ import annotations

import torch

from liteinfer.attention.base import AttentionBackend, AttentionMetadata
from liteinfer.kernels.decode_attention import NewKV, paged_decode_attention
from liteinfer.kernels.kv_cache import rope_store_kv
from liteinfer.kernels.prefill_attention import packed_prefill_attention


class TritonBackend(AttentionBackend):
    """A prefill step in which no prompt has cached tokens (every query attends only to keys of
    the same step) runs, in fp16/bf16 on CUDA, through PyTorch's varlen FlashAttention-2 kernel
    on the packed projections: on the H200 it reaches ~470 TFLOP/s on a 15k-token prompt where
    the paged kernel reaches 361 (scripts/bench_kernels.py). Steps that continue a prompt (chunked
    prefill) read their prefix from the pool through the packed Triton kernel."""

    def forward(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not meta.is_prefill:
            new_kv = NewKV(k, v, positions, meta.slot_mapping, cos_sin_cache)
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.context_lens, scale, torch.empty_like(q),
                                          num_splits=meta.num_splits, max_splits=meta.max_splits,
                                          workspace=meta.workspace, new_kv=new_kv)
        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        if _flash_supported(q) and meta.query_lens_host == meta.context_lens_host:
            return _flash_varlen_causal(q, k, v, meta, scale)
        return packed_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q,
                                        meta.context_lens, meta.block_tables, scale,
                                        torch.empty_like(q), meta.max_seqlen_q)


def _flash_supported(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0


def _flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's rotated q [T, Hq, D] over its own k/v [T, Hkv, D]
    (grouped-query heads natively). The aten op is the one behind SDPA's flash backend and
    torch.nn.attention.varlen, whose Python signature differs between torch releases."""
    cu = meta.cu_seqlens_q
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, meta.max_seqlen_q, meta.max_seqlen_q, 0.0, True, False, scale=scale)[0]
