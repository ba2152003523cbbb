"""Engine and model configuration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}

ATTENTION_BACKENDS = ("torch", "sdpa", "triton")
# The fewest prompt tokens a captured prompt step is sized for (scheduler.prompt_piece_sizes);
# mixed_prompt_tokens is at least this.
MIN_PROMPT_PIECE = 16


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """The Llama hyper-parameters liteinfer needs, read from a Hugging Face config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(
                f"not a Llama-architecture model (model_type={cfg.get('model_type')!r}, "
                f"architectures={archs}); liteinfer serves LlamaForCausalLM models")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"model config is missing {missing}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("Llama models with attention or MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts besides the model. Defaults are the fastest configuration."""

    dtype: str = "auto"                   # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"                  # auto: cuda if available, else cpu
    max_model_len: int | None = None      # default: min(max_position_embeddings, 16384)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    gpu_memory_utilization: float = 0.85  # fraction of free device memory given to the KV pool
    num_kv_blocks: int | None = None      # explicit pool size; overrides the memory budget
    cpu_kv_cache_gb: float = 2.0          # KV budget on CPU
    attention_backend: str = "auto"       # torch | sdpa | triton; auto: triton on CUDA, torch on CPU
    enforce_eager: bool = False           # True: no CUDA graphs
    # A step that decodes carries at most this many prompt tokens (a power of two), trimmed to a
    # size that makes its rows a power of two; steps of up to this many prompt tokens replay
    # CUDA graphs.
    mixed_prompt_tokens: int = 2048
    # Prompts reuse the KV blocks of prefixes computed before (shared system prompts, earlier
    # turns of a conversation) instead of computing them again.
    enable_prefix_caching: bool = False
    # Ranks the model is split over, one process (and on CUDA one GPU) each.
    tensor_parallel_size: int = 1
    # "fp8": e4m3 linear layers (a bf16/fp16 checkpoint is quantized at load; a checkpoint's own
    # FP8 quantization_config is used whatever this says). The LM head stays in the model dtype.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"          # auto: the model dtype; fp8: e4m3 K/V, twice the tokens
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def validate(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS + ("auto",):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or 'auto'")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        m = self.mixed_prompt_tokens
        if m < MIN_PROMPT_PIECE or m & (m - 1):
            raise ValueError(f"mixed_prompt_tokens must be a power of two >= "
                             f"{MIN_PROMPT_PIECE}, got {m}")
