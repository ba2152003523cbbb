"""Attention backends: each applies RoPE, writes K/V into the paged pool and attends over it."""
from __future__ import annotations

from liteinfer.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    allocate_kv_pool,
    kv_cache_dtype,
)


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from liteinfer.attention.torch_backend import TorchBackend
        return TorchBackend()
    if name == "sdpa":
        from liteinfer.attention.torch_backend import SdpaBackend
        return SdpaBackend()
    if name == "triton":
        from liteinfer.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "allocate_kv_pool", "get_backend",
           "kv_cache_dtype"]
