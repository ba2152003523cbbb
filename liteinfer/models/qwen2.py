"""Qwen2: Llama with biases on the q, k and v projections (always: its config has no switch)."""
from __future__ import annotations

from liteinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
