"""The interface between the model and an attention implementation."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from liteinfer.kernels import FP8_DTYPE


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit in the KV pool. Built by the model runner once per step.

    A step's T tokens are the B sequences' query tokens laid end to end (one each when decoding).
    `context_lens` counts each sequence's KV tokens including this step's, whose K/V are written
    into the pool at `slot_mapping` before attention runs.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor            # [T] int64, -1 = padding (not written)
    context_lens: torch.Tensor            # [B] int32
    block_tables: torch.Tensor            # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None     # [B+1] int32 (prefill)
    # A mixed step (prefill): its first `num_decodes` sequences decode one token each, and their
    # rows come first.
    num_decodes: int = 0
    # A decode step of verifications: each sequence's query tokens (its last token and its
    # drafts, padded), at its last `query_len` positions of `context_lens`.
    query_len: int = 1
    # Host copies for the eager paths; captured steps have none.
    query_lens_host: list[int] = field(default_factory=list)
    context_lens_host: list[int] = field(default_factory=list)
    # Packed prefill (Triton): its programs' work, the split rows' splits (decoding rows, and
    # queries that fit one tile such as a verification's) and then the prompt sequences' query
    # tiles (kernels/prefill_tiles.py).
    tile_map: torch.Tensor | None = None  # [N, 2] int32
    tile_tokens: int = 0  # query tokens a tile
    # Split-K: a decode step's fixed grid width (the kernel chooses each sequence's split count),
    # and the partials' workspace, which a prompt step's split rows use too.
    max_splits: int = 1
    workspace: Any = None


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a validated `EngineConfig.kv_cache_dtype`: "auto" the model
    dtype, "fp8" e4m3. FP8 K/V are stored unscaled
    (scale 1, as vLLM without calibrated scales): e4m3's relative precision (2^-4) is the same
    anywhere in its normal range [2^-6, 448], where a Llama model's K and V sit, so a
    per-tensor scale would only matter beyond it; values past 448 are clamped."""
    return FP8_DTYPE if name == "fp8" else model_dtype


def allocate_kv_pool(*leading: int, num_blocks: int, block_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed KV pool indexed [*leading, num_blocks, block_size, num_kv_heads, head_dim] (a
    token's flat slot is block * block_size + row), stored head-major (block, head, row, dim):
    a block's rows of one KV head, which one attention program reads together, are one
    contiguous run instead of head_dim-sized pieces num_kv_heads * head_dim apart."""
    pool = torch.zeros(*leading, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                       device=device)
    return pool.transpose(-3, -2)


class AttentionBackend(ABC):
    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]; returns [T, Hq, D]."""
