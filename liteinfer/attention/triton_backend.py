"""Attention through liteinfer's Triton kernels: paged decode with RoPE and the KV write fused in,
packed prefill over the pool, and torch's fused SDPA for a lone long prompt. A mixed step's
decoding rows go through the prefill launch with its prompt chunks (their entries in the tile
map), where their memory-bound programs overlap the compute-bound prompt tiles."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from liteinfer.attention.base import AttentionBackend, AttentionMetadata
from liteinfer.kernels.decode_attention import NewKV, paged_decode_attention
from liteinfer.kernels.kv_cache import rope_store_kv
from liteinfer.kernels.prefill_attention import packed_prefill_attention

# Never the math backend: at 15k tokens it would materialize 30 GB of scores.
_FUSED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION]


class TritonBackend(AttentionBackend):
    """A step that prefills one prompt of at least `sdpa_min_tokens` with nothing cached goes
    through torch's fused SDPA on the contiguous projections instead, which runs a long prompt
    faster than the paged kernel and than PyTorch's varlen FlashAttention-2 (which would take
    several prompts at once) (docs/notes/journal.md, items 12 and 14)."""

    def __init__(self, sdpa_min_tokens: int = 1024):
        self.sdpa_min_tokens = sdpa_min_tokens

    def forward(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not meta.is_prefill:
            new_kv = None
            if meta.query_len > 1:  # a verification's tokens: every one's K/V written first
                rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                              meta.slot_mapping)
            else:
                new_kv = NewKV(k, v, positions, meta.slot_mapping, cos_sin_cache)
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.context_lens, scale, torch.empty_like(q),
                                          max_splits=meta.max_splits, workspace=meta.workspace,
                                          new_kv=new_kv, query_len=meta.query_len)
        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        if self._lone_fresh_prompt(meta):
            return _causal_sdpa(q, k, v, scale)
        return packed_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q,
                                        meta.context_lens, meta.block_tables, meta.tile_map,
                                        meta.tile_tokens, scale, torch.empty_like(q),
                                        meta.workspace, with_decodes=meta.num_decodes > 0)

    def _lone_fresh_prompt(self, meta: AttentionMetadata) -> bool:
        if len(meta.query_lens_host) != 1:  # several sequences, or a captured step
            return False
        return meta.query_lens_host[0] == meta.context_lens_host[0] >= self.sdpa_min_tokens


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Causal attention of one sequence's rotated q [T, Hq, D] over its k/v [T, Hkv, D]. KV
    heads are repeated up front: with enable_gqa SDPA may fall back to its math path."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1).transpose(0, 1)[None] for t in (k, v))
    with sdpa_kernel(_FUSED_SDPA):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True,
                                             scale=scale)
    return out[0].transpose(0, 1)
