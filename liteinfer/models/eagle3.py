"""The EAGLE-3 draft head of a Llama target, in its published checkpoint layout
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge):

- `fc.weight` [H, 3 H_target]: fuses the target's hidden states from three layers (the
  residual stream entering layers `aux_hidden_state_layers`, vLLM's default 2, L/2, L - 3);
- one decoder layer, `midlayer.*`, whose attention reads the concatenation of the normed token
  embedding (`input_layernorm`) and the normed incoming hidden state (`hidden_norm`), 2H wide;
- `norm.weight`, and `lm_head.weight` over a draft vocabulary of `draft_vocab_size` tokens,
  whose ids map to the target's as `d + d2t[d]` (`t2d` marks the target tokens kept);
- the token embedding is the target's unless the checkpoint has `embed_tokens.weight`.

At position p the head reads the token at p + 1 and a hidden state at p: the target's (fused)
while it catches up over the target's tokens, its own output (before `norm`) while drafting.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from liteinfer.attention import AttentionBackend, AttentionMetadata
from liteinfer.config import ModelConfig
from liteinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from liteinfer.layers.norm_act import RMSNorm
from liteinfer.layers.ops import LayerOps
from liteinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from liteinfer.models.llama import LlamaForCausalLM, LlamaMLP
from liteinfer.models.weights import PACKED_MODULES_MAPPING, load_tensor, packed_param

NUM_AUX_LAYERS = 3


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` default, the layers EAGLE-3 was trained on."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, self.num_heads,
                                          self.num_kv_heads, ops)
        self.o_proj = RowParallelLinear(self.num_heads * cfg.head_dim, cfg.hidden_size, ops)
        self.backend = backend
        # Views into the head's KV pool, bound by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Adds attention over x (the 2H-wide concatenation) to `residual`, in place."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        out = self.backend.forward(q.reshape(-1, self.num_heads, self.head_dim),
                                   k.reshape(-1, self.num_kv_heads, self.head_dim),
                                   v.reshape(-1, self.num_kv_heads, self.head_dim), positions,
                                   cos_sin_cache, self.k_cache, self.v_cache, meta, self.scale)
        self.o_proj.forward_add(out.reshape(-1, q_size), residual)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg, backend, ops)
        self.mlp = LlamaMLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the layer; `hidden` is its input (kept as it is)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = hidden.clone()
        self.self_attn(x, residual, positions, cos_sin_cache, meta)
        self.mlp(residual, self.post_attention_layernorm)
        return residual


class Eagle3LlamaForCausalLM(nn.Module):
    """`cfg`: the head's config (hidden size, heads, MLP, RoPE; vocab_size the target's);
    `target_hidden_size`: the width of each of the target's fused hidden states."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = PACKED_MODULES_MAPPING

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, target_hidden_size: int,
                 backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.config = cfg
        # The head is small: whole on every rank, in the model dtype, multiplied by cuBLAS;
        # of the target's choices it takes only the Triton norms and SwiGLU.
        ops = LayerOps(triton=ops.triton, scratch=ops.scratch)
        self.fc = ColumnParallelLinear(NUM_AUX_LAYERS * target_hidden_size, cfg.hidden_size, ops)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ops)
        # One layer, in a list as the runner binds KV pools to `layers`.
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg, backend, ops)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = ParallelLMHead(draft_vocab_size, cfg.hidden_size, ops)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.has_own_embedding = False  # whether the checkpoint brought `embed_tokens`

    def share_embedding(self, target: LlamaForCausalLM) -> None:
        """Reads tokens with the target's embedding (checkpoints without one of their own)."""
        self.embed_tokens = target.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer (before `norm`), the next pass's `hidden`.
        `hidden`: the target's three hidden states side by side, or the head's own."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        return self.layers[0](self.embed_tokens(input_ids), hidden, positions,
                              self.cos_sin_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head.forward_normed(hidden, self.norm)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the head from checkpoint tensors (names as published)."""
        params: dict[str, Any] = dict(self.named_parameters())
        params["d2t"] = self.d2t
        loaded = set()
        for ckpt_name, tensor in weights:
            if ckpt_name == "t2d":  # the inverse map: nothing to keep
                continue
            name, shard = packed_param(ckpt_name.replace("midlayer.", "layers.0.", 1),
                                       self.packed_modules_mapping)
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in an EAGLE-3 "
                                 f"head")
            load_tensor(params[name], tensor, shard, ckpt_name)
            loaded.add(name)
        missing = sorted({n for n in params if n != "embed_tokens.weight"} - loaded)
        if missing:
            raise ValueError(f"the EAGLE-3 checkpoint lacks {missing[:3]}")
        self.has_own_embedding = "embed_tokens.weight" in loaded

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
        self.d2t.zero_()
