"""llama.cpp GGUF files: config from `llama.*` metadata (`qwen3moe.*` for Qwen3-MoE; a Llama
file with experts is Mixtral), weights under Hugging Face names, tokenizer rebuilt by
transformers from the file's own vocabulary. The decoder's linear weights stay quantized when
all are of a type layers/quantization/gguf.py keeps (its `quantization_config`); every other
tensor, stacked experts included, is dequantized to float32."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderField, dequantize

from liteinfer.config import MODEL_FAMILIES
from liteinfer.layers.quantization.gguf import linear_format, unpack_blocks
from liteinfer.layers.rotary import inv_frequencies

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Experts: llama.cpp stacks each projection of a layer's experts in one [E, out, in] tensor and
# calls the router ffn_gate_inp. Each MoE family's Hugging Face names for them: the block that
# holds router and experts, and each projection's name.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_MOE_NAMES = {"qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
              "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})}
# general.architecture -> the family it is read as (a Llama file with experts: Mixtral).
_ARCHITECTURES = {"llama": "llama", "qwen3moe": "qwen3_moe"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
# llama.cpp's precomputed llama3 RoPE divisors; folded into rope_scaling instead of yielded.
_ROPE_FREQS = "rope_freqs.weight"


def open_reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06).
        return float(str(part[0]))
    return part[0].item()


def _value(field: ReaderField) -> Any:
    if field.types[0] == GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else _value(field)


def _require(reader: GGUFReader, key: str) -> Any:
    if key not in reader.fields:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return _get(reader, key)


def _hf_name(gguf_name: str, family: str) -> str | None:
    """The Hugging Face name, or None for tensors the family has no place for (biases). A
    stacked expert tensor's name has `{}` where each expert's index goes."""
    base, _, kind = gguf_name.rpartition(".")
    if kind != "weight":
        return None
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if family in _MOE_NAMES and (part == "ffn_gate_inp" or part in _EXPERT_TENSORS):
            block, projs = _MOE_NAMES[family]
            if part == "ffn_gate_inp":
                return f"model.layers.{layer}.{block}.gate.weight"
            proj = projs[_EXPERT_TENSORS[part]]
            return f"model.layers.{layer}.{block}.experts.{{}}.{proj}.weight"
        hf_part = _LAYER_TENSORS.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.weight"
    return f"{_GLOBAL_TENSORS[base]}.weight" if base in _GLOBAL_TENSORS else None


def _is_linear(hf_name: str | None) -> bool:
    """A decoder layer's projection (not the embedding, a norm, the LM head or stacked experts,
    which the fused MoE layer reads in float or e4m3)."""
    return (hf_name is not None and hf_name.startswith("model.layers.")
            and hf_name.endswith("_proj.weight") and "{}" not in hf_name)


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover rope_scaling from llama.cpp's `rope_freqs` divisors. In the interpolated band
    smooth = (old_ctx / wavelen - low) / (high - low) is linear in 1 / wavelen, so a line fit
    gives two of the three parameters' combinations; fixing low_freq_factor = 1 (Meta's value)
    pins the rest without changing the frequencies."""
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * np.pi)
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise ValueError("cannot infer llama3 rope_scaling from rope_freqs: fewer than two "
                         "interpolated frequencies")
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
    high = 1 - 1 / intercept
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": round(float(high), 4),
               "original_max_position_embeddings": round(float(slope * (high - 1)))}
    divisors = (inv_frequencies(head_dim, theta, None)
                / inv_frequencies(head_dim, theta, scaling)).numpy()
    if not np.allclose(divisors, factors, rtol=1e-3):
        raise ValueError("rope_freqs in the GGUF do not follow llama3 RoPE scaling")
    return scaling


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int
                  ) -> dict[str, Any] | None:
    kind = _get(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _require(reader, f"{arch}.rope.scaling.factor")}
    if kind != "none":
        raise ValueError(f"unsupported GGUF RoPE scaling type {kind!r}")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    return None if freqs is None else _llama3_scaling(dequantize(freqs.data, freqs.tensor_type),
                                                      theta, head_dim)


def _moe_keys(reader: GGUFReader, arch: str, family: str, names: set[str], layers: int
              ) -> dict[str, Any]:
    """A MoE family's config keys (Hugging Face's) from the file: llama.cpp keeps no
    mlp_only_layers, so the layers without a router are the dense ones, and renormalizes
    Qwen3-MoE's and Mixtral's top-k weights unless expert_weights_norm says otherwise."""
    experts = _require(reader, f"{arch}.expert_count")
    top_k = _require(reader, f"{arch}.expert_used_count")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if family == "mixtral":
        if dense:
            raise ValueError(f"GGUF Mixtral layers {dense[:8]} have no experts")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    return {"num_experts": experts, "num_experts_per_tok": top_k, "mlp_only_layers": dense,
            "moe_intermediate_size": _require(reader, f"{arch}.expert_feed_forward_length"),
            "norm_topk_prob": bool(_get(reader, f"{arch}.expert_weights_norm", True))}


def read_config(reader: GGUFReader) -> dict[str, Any]:
    """A Hugging Face style config.json dict (Llama's, Mixtral's or Qwen3-MoE's) from the GGUF's
    metadata."""
    arch = _require(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture is {arch!r}; liteinfer serves "
                         f"{sorted(_ARCHITECTURES)}")
    family = _ARCHITECTURES[arch]
    if family == "llama" and _get(reader, "llama.expert_count", 0):
        family = "mixtral"
    hidden = _require(reader, f"{arch}.embedding_length")
    heads = _require(reader, f"{arch}.attention.head_count")
    head_dim = _get(reader, f"{arch}.attention.key_length", hidden // heads)
    if _get(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF applies RoPE to part of each head; Llama rotates the whole head")
    theta = _get(reader, f"{arch}.rope.freq_base", 10000.0)
    layers = _require(reader, f"{arch}.block_count")
    names = {t.name for t in reader.tensors}
    unknown = sorted(n for n in names - {_ROPE_FREQS} if _hf_name(n, family) is None)
    if unknown:
        raise ValueError(f"GGUF has tensors a {family} model does not use: {unknown[:8]}")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    linear_types = {t.tensor_type for t in reader.tensors
                    if _is_linear(_hf_name(t.name, family))}
    eos_ids = list(dict.fromkeys(i for i in (_get(reader, f"tokenizer.ggml.{k}_token_id")
                                             for k in ("eos", "eot", "eom")) if i is not None))
    moe = _moe_keys(reader, arch, family, names, layers) if family in _MOE_NAMES else {}
    return {
        "architectures": [MODEL_FAMILIES[family]],
        "model_type": family,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _require(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _get(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _require(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, head_dim),
        "vocab_size": _get(reader, f"{arch}.vocab_size", int(embed.data.shape[0])),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": _require(reader, f"{arch}.context_length"),
        "bos_token_id": _get(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        "pad_token_id": _get(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # what iter_weights yields after dequantization
        **moe,
        **({} if (quant := linear_format(linear_types)) is None
           else {"quantization_config": quant}),
    }


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter stores each q/k head's rows interleaved (rotary pairs adjacent, as
    its RoPE kernel expects); restore Hugging Face's half-split order (pairs dim/2 apart)."""
    per_head = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return per_head.swapaxes(1, 2).reshape(w.shape)


def iter_weights(reader: GGUFReader, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time from the memory-mapped file: float32 (a stacked expert tensor one
    expert at a time), or for a kept linear its codes, scales and mins (`qweight`, `scales`,
    `mins`, see layers/quantization/gguf.py)."""
    # llama.cpp permutes q/k rows for its Llama RoPE only (Qwen's rotates halves, as HF does).
    permuted = cfg["model_type"] in ("llama", "mixtral")
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    kept = "quantization_config" in cfg
    for t in reader.tensors:
        name = _hf_name(t.name, cfg["model_type"])
        if name is None:
            continue
        proj = name.split(".")[-2]
        if kept and _is_linear(name):
            parts = zip(("qweight", "scales", "mins"), unpack_blocks(t.data, t.tensor_type),
                        strict=True)
        else:
            parts = [("weight", dequantize(t.data, t.tensor_type).astype(np.float32, copy=False))]
        for kind, w in parts:
            if permuted and proj in heads:  # rows, whatever they hold
                w = _unpermute(w, heads[proj])
            full = f"{name.removesuffix('weight')}{kind}"
            if "{}" in name:
                for expert in range(w.shape[0]):
                    yield full.format(expert), _tensor(w[expert])
            else:
                yield full, _tensor(w)


def _tensor(w: np.ndarray) -> torch.Tensor:
    # F32 tensors come back as read-only views of the file; copy those only.
    return torch.from_numpy(np.require(w, None, ["C", "W"]))


def chat_template(reader: GGUFReader) -> str | None:
    return _get(reader, "tokenizer.chat_template")


def has_tokenizer(reader: GGUFReader) -> bool:
    return "tokenizer.ggml.model" in reader.fields


def load_tokenizer(path: Path, template: str | None) -> Any:
    # transformers' own GGUF vocabulary conversion. Not AutoTokenizer: it parses the whole file a
    # second time (seconds) just to pick this same class.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
