"""The Llama architecture: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP. Mistral is Llama
as it is; the families that vary it (models/qwen2.py, qwen3.py, moe.py) subclass the model and
set its class attributes or build their own MLPs."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from liteinfer.attention import AttentionBackend, AttentionMetadata
from liteinfer.config import ModelConfig
from liteinfer.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from liteinfer.layers.norm_act import RMSNorm, SiluAndMul
from liteinfer.layers.ops import LayerOps
from liteinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from liteinfer.models.weights import PACKED_MODULES_MAPPING, load_tensor, packed_param


class LlamaAttention(nn.Module):
    """`bias`: biases on the q, k and v projections; `qk_norm`: an RMSNorm over each query and
    key head before RoPE."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps,
                 bias: bool = False, qk_norm: bool = False):
        super().__init__()
        self.num_heads = cfg.num_attention_heads // ops.tp_size
        self.num_kv_heads = cfg.num_key_value_heads // ops.tp_size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, ops, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        ops)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.backend = backend
        # Views into the engine's KV pool, bound by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Adds attention over norm(x) to the residual stream x, in place."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj.forward_normed(x, norm)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # before the backend rotates q and k
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        out = self.backend.forward(q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache,
                                   meta, self.scale)
        self.o_proj.forward_add(out.reshape(-1, q_size), x)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, {"gate": size, "up": size},
                                                       ops)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, ops)
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> None:
        """Adds the SwiGLU MLP of norm(x) to the residual stream x, in place."""
        self.down_proj.forward_add(self.gate_up_proj.forward_normed(x, norm, self.act), x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: LlamaAttention, mlp: nn.Module,
                 ops: LayerOps):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp  # called as mlp(x, norm): adds its output to the residual stream x
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                meta: AttentionMetadata) -> None:
        """Adds both sublayers to the residual stream x in place: each output projection adds
        its result inside its GEMM (beta = 1) or GEMV kernel, so the norm after it reads one
        tensor and writes one instead of adding the two."""
        self.self_attn(x, self.input_layernorm, positions, cos_sin_cache, meta)
        self.mlp(x, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    """A family built on Llama subclasses this model: its class attributes say how its
    attention differs, `make_mlp` builds its MLPs, and `packed_modules_mapping` (with
    `param_name` for anything a table cannot say) places its checkpoint's tensors."""

    # Checkpoint projections that live inside a fused parameter: name -> (fused name, shard).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = PACKED_MODULES_MAPPING
    qkv_bias: ClassVar[bool] = False  # biases on the q, k and v projections
    qk_norm: ClassVar[bool] = False   # an RMSNorm over each query and key head before RoPE

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ops)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, LlamaAttention(cfg, backend, ops, self.qkv_bias, self.qk_norm),
                              self.make_mlp(i, ops), ops)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # Every rank ends with the full logits.
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ops)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        # Set by the runner once the model sits on its device (fp32, see layers/rotary.py).
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        # Layers whose input (the residual stream entering them) an EAGLE-3 head reads, and
        # where each forward pass writes them side by side ([tokens, hidden * layers]: one
        # buffer, so that captured steps leave them where the head reads them).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def keep_aux_hidden_states(self, layers: tuple[int, ...], max_tokens: int,
                               dtype: torch.dtype, device: torch.device) -> None:
        """Each forward pass (of at most `max_tokens` tokens) keeps the input of `layers` in
        the first rows of `aux_hidden_states`, in that order."""
        self.aux_hidden_state_layers = layers
        self.aux_hidden_states = torch.empty(max_tokens, len(layers) * self.config.hidden_size,
                                             dtype=dtype, device=device)

    def make_mlp(self, layer: int, ops: LayerOps) -> nn.Module:
        """Layer `layer`'s MLP (a family with experts puts them here)."""
        return LlamaMLP(self.config, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer (the final norm runs with the LM head)."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            for j, aux_layer in enumerate(self.aux_hidden_state_layers):
                if aux_layer == i:  # before the layer adds to x in place
                    width = x.shape[-1]
                    self.aux_hidden_states[:x.shape[0], j * width:(j + 1) * width].copy_(x)
            layer(x, positions, self.cos_sin_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every row of hidden (the final norm runs here, fused into the LM head for
        a single row)."""
        return self.lm_head.forward_normed(hidden, self.norm)

    def param_name(self, name: str) -> tuple[str, Any]:
        """The parameter a checkpoint tensor (Hugging Face name) fills, and which shard of it
        (None: the whole parameter)."""
        return packed_param(name.removeprefix("model."), self.packed_modules_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies (Hugging Face name, tensor) pairs from liteinfer.loader into the parameters."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for ckpt_name, tensor in weights:
            # The loader already drops RoPE buffers and a tied model's lm_head.
            name, shard = self.param_name(ckpt_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the "
                                 f"{self.config.model_type} model")
            load_tensor(params[name], tensor, shard, name)
            loaded.add((name, shard))
        expected = set()
        for name, param in params.items():
            layer = self.get_submodule(name.rpartition(".")[0])
            shards = ([s for s, _ in layer.checkpoint_shapes(param)]
                      if hasattr(layer, "checkpoint_shapes") else [None])
            expected |= {(name, s) for s in shards}
        missing = sorted(n if s is None else f"{n}:{s}" for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarking without a checkpoint (vLLM's load_format="dummy").
        Each checkpoint tensor is drawn whole and loaded like a real one, so that every rank
        holds its shard of the model one rank would get."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            layer = self.get_submodule(name.rpartition(".")[0])
            for shard, shape in layer.checkpoint_shapes(param):
                full = torch.empty(shape, dtype=param.dtype, device=param.device)
                param.weight_loader(param, full.normal_(0.0, 0.02, generator=gen), shard)
