"""Attention in plain PyTorch over the paged pool: runs anywhere, the reference for the kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from liteinfer.attention.base import AttentionBackend, AttentionMetadata
from liteinfer.kernels import FP8_DTYPE, FP8_MAX
from liteinfer.layers.rotary import apply_rotary_torch
from liteinfer.utils import cdiv


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (block, row) index of flat slots: cache[slot_rows(cache, slots)] is their
    [len(slots), Hkv, D] rows, whatever the pool's memory order."""
    slots = slots.long()
    return slots // cache.shape[1], slots % cache.shape[1]


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of `dtype` stores it; an e4m3 pool clamps to its finite range first."""
    if dtype == FP8_DTYPE:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    at = slot_rows(k_cache, slot_mapping[valid])
    k_cache[at] = to_cache(k[valid], k_cache.dtype)
    v_cache[at] = to_cache(v[valid], v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, length, Hkv, D]: the first `length` cached tokens of each sequence, as `dtype`
    (default: the pool's)."""
    num_blocks = cdiv(length, cache.shape[1])
    kv = cache[block_tables[:, :num_blocks].long()].flatten(1, 2)[:, :length]
    return kv if dtype is None else kv.to(dtype)


class TorchBackend(AttentionBackend):
    """Softmax(QK^T)V with explicit fp32 matmuls."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q: [B, Lq, Hq, D], k/v: [B, Lk, Hkv, D], mask: [B, Lq, Lk] (True = attend)."""
        groups = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(groups, dim=2).float()
        v = v.repeat_interleave(groups, dim=2).float()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v).to(q.dtype)

    def forward(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        q = apply_rotary_torch(q, positions, cos_sin_cache)
        k = apply_rotary_torch(k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.is_prefill:  # query_len tokens a sequence, at its last positions
            n = meta.query_len
            length = max(meta.context_lens_host)
            keys = gather_kv(k_cache, meta.block_tables, length, q.dtype)
            values = gather_kv(v_cache, meta.block_tables, length, q.dtype)
            ends = (meta.context_lens[:, None] - n + 1
                    + torch.arange(n, device=q.device)[None, :])
            mask = torch.arange(length, device=q.device)[None, None, :] < ends[:, :, None]
            out = self.attend(q.view(-1, n, *q.shape[1:]), keys, values, mask, scale)
            return out.flatten(0, 1)
        out = torch.empty_like(q)
        start = 0
        for b, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            keys = gather_kv(k_cache, meta.block_tables[b:b + 1], ctx, q.dtype)
            values = gather_kv(v_cache, meta.block_tables[b:b + 1], ctx, q.dtype)
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            out[start:start + q_len] = self.attend(q[None, start:start + q_len], keys, values,
                                                   mask[None], scale)[0]
            start += q_len
        return out


class SdpaBackend(TorchBackend):
    """The same gathers, with attention itself through torch's fused SDPA kernels."""

    def attend(self, q, k, v, mask, scale):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
