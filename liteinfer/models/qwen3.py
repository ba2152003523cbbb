"""Qwen3: Llama with an RMSNorm over each query and key head before RoPE."""
from __future__ import annotations

from liteinfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
