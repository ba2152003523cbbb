"""Engine and model configuration."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "sdpa", "triton")
QUANTIZATIONS = ("fp8", "int4")
KV_CACHE_DTYPES = ("auto", "fp8")
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


# The families whose configs ModelConfig reads, by model_type, with their architecture names
# (models.MODEL_REGISTRY gives each its model class). Their configs read as Llama's, with a
# sliding window for some and a MoeConfig for the mixtures of experts.
MODEL_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _family(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type in MODEL_FAMILIES:
        return model_type
    for family, arch in MODEL_FAMILIES.items():
        if arch in archs:
            return family
    raise ValueError(
        f"unsupported model (model_type={model_type!r}, architectures={archs}); liteinfer "
        f"serves {', '.join(MODEL_FAMILIES.values())}")


def _sliding_window(cfg: dict[str, Any], family: str) -> int | None:
    """The attention window of the config, None when every layer attends to the whole context.
    Qwen configs carry a window that applies only with `use_sliding_window`."""
    window = cfg.get("sliding_window")
    if family.startswith("qwen") and not cfg.get("use_sliding_window"):
        return None
    if "sliding_attention" not in (cfg.get("layer_types") or ["sliding_attention"]):
        return None
    return window


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token's `top_k` of `num_experts` SwiGLU experts of
    `intermediate_size` channels, weighted by the softmax of the router's logits over all experts
    (renormalized over the chosen ones: Mixtral, and Qwen3-MoE with norm_topk_prob).
    `sparse_layers` are the layers whose MLP is the experts; the others are dense."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]


def _moe_config(cfg: dict[str, Any], family: str) -> MoeConfig | None:
    """The experts of a Qwen3-MoE or Mixtral config (transformers' readings of their keys)."""
    layers = range(cfg["num_hidden_layers"])
    if family == "mixtral":
        return MoeConfig(cfg["num_local_experts"], cfg.get("num_experts_per_tok", 2),
                         cfg["intermediate_size"], True, tuple(layers))
    if family != "qwen3_moe":
        return None
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in layers if experts > 0 and i not in dense and (i + 1) % step == 0)
    if not sparse:
        return None
    return MoeConfig(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                     bool(cfg.get("norm_topk_prob", False)), sparse)


@dataclass
class ModelConfig:
    """The hyper-parameters liteinfer needs, read from a Hugging Face config dict: Llama's, a
    sliding window, and the experts of a mixture (MODEL_FAMILIES). What a family's
    architecture fixes (Qwen2's q/k/v biases, Qwen3's q/k norms) is its model class's."""

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
    model_type: str = "llama"
    # Mistral v0.1: each token attends to the last `sliding_window` positions only (not
    # implemented: such a model runs only with max_model_len <= sliding_window).
    sliding_window: int | None = None
    moe: MoeConfig | None = None  # Qwen3-MoE, Mixtral: the experts, and which layers have them

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        family = _family(cfg)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"model config is missing {missing}")
        # Qwen2 always has q/k/v biases and no output bias; elsewhere attention_bias puts a
        # bias on the output projection too, which the model does not have.
        if family != "qwen2" and cfg.get("attention_bias"):
            raise ValueError(f"{family} models with attention biases are not supported")
        if cfg.get("mlp_bias"):
            raise ValueError("models with MLP biases are not supported")
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
            model_type=family,
            sliding_window=_sliding_window(cfg, family),
            moe=_moe_config(cfg, family),
        )

    @property
    def max_context(self) -> int:
        """The longest context the model runs at: its positions, within its sliding window."""
        return min(self.max_position_embeddings, self.sliding_window or sys.maxsize)

    def fit_max_model_len(self, max_model_len: int, explicit: bool, pool_tokens: int) -> int:
        """max_model_len for a KV pool of `pool_tokens` tokens: a default longer than one
        sequence could hold there shrinks to fit (logged); an explicit one is an error."""
        if max_model_len <= pool_tokens:
            return max_model_len
        if explicit:
            raise ValueError(f"max_model_len={max_model_len} does not fit in the KV pool "
                             f"({pool_tokens} tokens); lower max_model_len or give the pool "
                             f"more memory (gpu_memory_utilization, cpu_kv_cache_gb, "
                             f"num_kv_blocks)")
        logger.info("max_model_len %d (the model's context) exceeds the KV pool's %d tokens; "
                    "serving at max_model_len=%d", max_model_len, pool_tokens, pool_tokens)
        return pool_tokens

    def check_max_model_len(self, max_model_len: int) -> None:
        """A ValueError unless the model runs correctly at `max_model_len` tokens."""
        if max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"{self.max_position_embeddings} positions")
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(
                f"this {self.model_type} model attends within a sliding window of "
                f"{self.sliding_window} tokens, which liteinfer does not implement; set "
                f"max_model_len <= {self.sliding_window} (full attention is the same there)")


SPECULATIVE_METHODS = ("ngram", "suffix", "reference", "draft_model", "eagle3")
# Methods whose drafts a model proposes on the device, in the model runner.
MODEL_METHODS = ("draft_model", "eagle3")
# Verifications a step can split along their keys (their tokens' split-K workspace rows): more
# fill the SMs unsplit (16 rows x 8 KV heads: 128 programs on 132 SMs).
NARROW_VERIFICATIONS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`speculative_config`, vLLM's keys). Each step a running sequence
    may verify up to `num_speculative_tokens` draft tokens beside its next token; the engine
    shortens the drafts, or drafts nothing, where the measured acceptance and the batch width
    say verifying costs more than it saves (spec_decode/draft_length.py).

    - ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the
      sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min).
    - suffix: the continuation most often seen after the sequence's longest matching suffix,
      in its own tokens and in earlier requests', as long as its estimated probability stays
      above `suffix_min_probability` (an adaptive draft length).
    - draft_model: a smaller model with the target's vocabulary (`model`: a path or a name the
      loader knows) proposes greedily, beside the target in the model runner, with a KV pool
      of its own indexed by the target's block tables.
    - eagle3: an EAGLE-3 head (`model`: its checkpoint directory) proposes greedily from the
      target's hidden states of three layers (models/eagle3.py).
    - reference: benchmarks only. Proposes each request's known continuation
      (`reference_outputs`, keyed by prompt) with each token corrupted with probability
      `corrupt_probability`, for controlled acceptance on dummy weights. With
      `force_acceptance` a draft counts as accepted unless it was corrupted, whatever the
      target samples: in bf16 a dummy model's greedy answer depends on the kernels that
      compute it (a verification step rounds otherwise than a decode step), so no fixed
      continuation is its own; forced acceptance gives the set acceptance rate exactly, with
      the same device work. Outputs are then the drafts', not the target's.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model, eagle3: the draft
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_depth: int = 8
    suffix_min_probability: float = 0.1
    suffix_cached_requests: int = 64
    corrupt_probability: float = 0.0
    reference_outputs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    force_acceptance: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> SpeculativeConfig | None:
        """None for no speculation; a ValueError naming what is wrong otherwise."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = dict(config)
        if config.get("method") is None and config.get("model") is not None:
            # As vLLM: a draft named as an EAGLE-3 head is one, any other is a draft model.
            name = str(config["model"]).lower()
            config["method"] = "eagle3" if "eagle3" in name else "draft_model"
        method = config.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{SPECULATIVE_METHODS}, got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        values = dict(config)
        values["reference_outputs"] = tuple(
            (tuple(prompt), tuple(output)) for prompt, output in config.get(
                "reference_outputs", ()))
        spec = cls(**values)
        if not 1 <= spec.num_speculative_tokens <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be in 1..16")
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if (spec.method in MODEL_METHODS) != (spec.model is not None):
            raise ValueError(f"speculative_config: `model` names the draft of "
                             f"{' and '.join(MODEL_METHODS)}, and only of them")
        if not 0.0 <= spec.corrupt_probability <= 1.0:
            raise ValueError("speculative_config: corrupt_probability must be in [0, 1]")
        if spec.force_acceptance and spec.method != "reference":
            raise ValueError("speculative_config: force_acceptance is for the benchmark-only "
                             "'reference' method")
        if not 0.0 < spec.suffix_min_probability <= 1.0 or spec.suffix_max_depth < 1:
            raise ValueError("speculative_config: suffix_min_probability must be in (0, 1] "
                             "and suffix_max_depth positive")
        return spec

    @property
    def drafts_on_device(self) -> bool:
        """Whether a model proposes the drafts in the model runner (else a host proposer)."""
        return self.method in MODEL_METHODS


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` accepts besides the model. Defaults are the fastest configuration.

    Frozen: the engine never changes the caller's object. It resolves a copy
    (engine/core.py `resolve_config`: the 'auto' settings filled in), and the engine core's own
    copy also carries what the model runner derived (max_model_len and num_kv_blocks as the KV
    pool allows)."""

    dtype: str = "auto"                   # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"                  # auto: cuda if available, else cpu
    max_model_len: int | None = None      # default: the model's context, as the KV pool allows
    max_num_seqs: int = 128               # most sequences running at once
    max_num_batched_tokens: int = 16384   # most tokens a step computes; prompts are chunked
    block_size: int = 16                  # tokens a KV block holds (a power of two)
    gpu_memory_utilization: float = 0.85  # fraction of free device memory given to the KV pool
    num_kv_blocks: int | None = None      # explicit pool size; overrides the memory budget
    cpu_kv_cache_gb: float = 2.0          # KV budget on CPU
    attention_backend: str = "auto"       # torch | sdpa | triton; auto: triton on CUDA, else torch
    enforce_eager: bool = False           # True: no CUDA graphs
    # A step that decodes carries at most this many prompt tokens (a power of two), trimmed to a
    # size that makes its rows a power of two; steps of up to this many prompt tokens replay
    # CUDA graphs.
    mixed_prompt_tokens: int = 2048
    # Prompts reuse the KV blocks of prefixes computed before (shared system prompts, earlier
    # turns of a conversation) instead of computing them again.
    enable_prefix_caching: bool = True
    # Ranks the model is split over, one process (and on CUDA one GPU) each.
    tensor_parallel_size: int = 1
    # "fp8": e4m3 linear layers and LM head (a tied embedding keeps its own rows); "int4": 4-bit
    # codes in groups of 128 (round to nearest), the LM head in the model dtype. A bf16/fp16
    # checkpoint (or a GGUF's blocks) is quantized at load; a checkpoint's own
    # quantization_config (FP8, AWQ, GPTQ, pack-quantized) is used whatever this says, and leaves
    # the LM head in the model dtype.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"          # auto: the model dtype; fp8: e4m3 K/V, twice the tokens
    seed: int = 0                         # dummy weights' seed (and sampling's in the CLI)
    # Speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5} (SpeculativeConfig).
    speculative_config: dict[str, Any] | None = None
    # Every request's tokens and logprobs are the same bits whatever else shares its steps, however
    # its prompt is chunked or cached (a fixed reduction order per row in every matmul, norm and
    # attention; layers/batch_invariant.py, attention/batch_invariant.py).
    batch_invariant: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def validate(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS + ("auto",):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or 'auto'")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
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
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.drafts_on_device and self.tensor_parallel_size > 1:
            # The workers run no drafter: the draft's KV and proposals live on rank 0 only.
            raise ValueError(f"speculative decoding with method {spec.method!r} and "
                             "tensor_parallel_size > 1 is not supported yet (ngram and "
                             "suffix are)")
        if self.batch_invariant:
            self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        """What batch-invariant mode does not cover yet: quantized linears (their kernels pick
        reduction orders by batch), tensor parallelism (an all-reduce sums in an order set by
        the message size), speculative decoding (draft lengths follow the batch width, and a
        seeded request's draws follow its drafts)."""
        if self.quantization is not None:
            raise ValueError("batch_invariant does not support quantization yet")
        if self.speculative_config is not None:
            raise ValueError("batch_invariant does not support speculative decoding yet")
        if self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant does not support tensor_parallel_size > 1 yet")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        """Most draft tokens a sequence verifies in one step (0: no speculation)."""
        spec = self.speculative
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def max_sampled_rows(self) -> int:
        """Most rows a step samples: one per sequence, and one more per draft it verifies."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def split_workspace_rows(self) -> int:
        """Rows of the split-K workspace: one a decoding sequence, and one a query token of a
        verification split along its keys (kernels/prefill_tiles.py), for up to
        NARROW_VERIFICATIONS of them a step."""
        narrow = min(self.max_num_seqs, NARROW_VERIFICATIONS)
        return max(self.max_num_seqs, narrow * (1 + self.num_speculative_tokens))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """EngineConfig fields from KEY=VALUE pairs (`--set`); values are JSON where they parse
    (true, 4096, null), else strings."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
