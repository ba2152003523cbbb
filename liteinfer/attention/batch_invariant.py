"""Batch-invariant attention (`EngineConfig.batch_invariant`): a query's output is the same bits
whether it decodes, sits in a prompt chunk of any size, or shares the step with any other
sequences. With the Triton backend the kernel of kernels/invariant_attention.py does it; this
module's torch form serves the other backends.

Every query reduces over its keys KEY_BLOCK keys at a time (whatever the pool's block size), from
the first keys up to its own position, with the online-softmax update (running max, rescaled sum
and accumulator in fp32), so the order of the additions depends on the query's position only.
Within a block the dot products over the head dimension and the weighted sum over the block's
keys are folded pairwise by halves (`fold_sum`): elementwise adds, whose result does not depend
on the tensor's shape, where a matmul's or a reduction's kernel would be chosen by the batch.
Keys past a query's position weigh exactly zero, so the block boundaries are the same whichever
step computes the query.
"""
from __future__ import annotations

import torch

from liteinfer.attention.base import AttentionBackend, AttentionMetadata
from liteinfer.attention.torch_backend import write_kv
from liteinfer.layers.batch_invariant import fold_sum
from liteinfer.layers.rotary import apply_rotary_torch

KEY_BLOCK = 16  # keys one online-softmax update takes


def invariant_attention(q: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q: [T, Hq, D] rotated queries; positions: [T]; block_tables: [T, max_blocks], each
    query's sequence's blocks, which hold its keys up to its own position. Returns [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    groups = num_heads // num_kv_heads
    qf = q.float().view(num_tokens, num_kv_heads, groups, 1, head_dim)
    m = torch.full((num_tokens, num_kv_heads, groups, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(num_tokens, num_kv_heads, groups, head_dim, device=q.device)
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    last_block = positions // KEY_BLOCK
    for j in range(int(last_block.max()) + 1 if num_tokens else 0):
        rows = (last_block >= j).nonzero()[:, 0]
        key_pos = j * KEY_BLOCK + offsets
        # The pool may end before a key block does (past the sequence's end): those keys weigh
        # zero, so any block stands in for them.
        slot_block = (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
        at = (block_tables[rows][:, slot_block].long(), (key_pos % block_size)[None])
        # [n, Hkv, 1, KEY_BLOCK, D]: the keys of each query's sequence, head-major.
        keys = k_cache[at].float().transpose(1, 2).unsqueeze(2)
        values = v_cache[at].float().transpose(1, 2).unsqueeze(2)
        scores = fold_sum(qf[rows] * keys) * scale  # [n, Hkv, G, KEY_BLOCK]
        future = key_pos[None] > positions[rows, None]
        scores.masked_fill_(future[:, None, None], float("-inf"))
        m_old = m[rows]
        m_new = torch.maximum(m_old, scores.amax(-1, keepdim=True))
        alpha = torch.exp(m_old - m_new)
        p = torch.exp(scores - m_new)
        denom[rows] = denom[rows] * alpha + fold_sum(p)[..., None]
        pv = fold_sum(p[..., None].transpose(-1, -2) * values.transpose(-1, -2))
        acc[rows] = acc[rows] * alpha + pv
        m[rows] = m_new
    return (acc / denom).view(num_tokens, num_heads, head_dim).to(q.dtype)


class BatchInvariantBackend(AttentionBackend):
    """With `triton`, RoPE and the K/V write through kernels/kv_cache.py and attention through
    kernels/invariant_attention.py (one kernel for every kind of step, all of which capture in
    CUDA graphs: a prompt step's tile map is in its inputs, eager or captured); otherwise RoPE
    and the K/V write as the torch backend does them (elementwise, so invariant), then
    `invariant_attention` above."""

    def __init__(self, triton: bool):
        self.triton = triton

    def forward(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.triton:
            return self._forward_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                        meta, scale)
        q = apply_rotary_torch(q, positions, cos_sin_cache)
        k = apply_rotary_torch(k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            lens = torch.tensor(meta.query_lens_host, device=q.device)
            seq_of_token = torch.repeat_interleave(
                torch.arange(len(lens), device=q.device), lens, output_size=q.shape[0])
        else:
            seq_of_token = torch.arange(q.shape[0], device=q.device)
        return invariant_attention(q, positions, meta.block_tables[seq_of_token], k_cache,
                                   v_cache, scale)

    def _forward_triton(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from liteinfer.kernels import invariant_attention as kernel
        from liteinfer.kernels.kv_cache import rope_store_kv

        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        # A prompt or mixed step's query tiles, in its inputs (eager or captured, the step
        # model filled them); a decode step needs none.
        tiles = meta.tile_map if meta.is_prefill else None
        return kernel.invariant_attention(q, k_cache, v_cache, positions, meta.block_tables,
                                          tiles, meta.cu_seqlens_q, scale, torch.empty_like(q))
