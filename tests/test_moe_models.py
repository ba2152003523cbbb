"""Qwen3-MoE and Mixtral against transformers, token for token, on tiny random models (CPU, fp32,
greedy): several expert counts and top-k, norm_topk_prob on and off, dense layers among the
sparse ones; alone, in mixed batches with chunked prompts, over cached prefixes, through the
Triton kernels (interpreted); and their configs, dummy weights and FP8 experts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fixtures import TINY_LLAMA, build_llm, make_tiny_model_dir
from liteinfer import SamplingParams
from liteinfer.config import ModelConfig, MoeConfig
from liteinfer.kernels.fused_moe import GEMV_MAX_ROWS
from liteinfer.loader import load_model_source
from liteinfer.models import model_class
from reference import hf_greedy, random_prompts

MAX_NEW = 12
MAX_LEN = 256
# id -> (model_type, config overrides, the MoeConfig liteinfer should read).
VARIANTS: dict[str, tuple[str, dict[str, Any], MoeConfig]] = {
    # Qwen3-30B-A3B's routing (renormalized top-8 of 128, here top-2 of 8), a dense layer 1.
    "qwen3_moe-8x2-dense1": ("qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        head_dim=32, mlp_only_layers=[1]), MoeConfig(8, 2, 32, True, (0,))),
    # Weights not renormalized; every second layer sparse.
    "qwen3_moe-6x3-step2": ("qwen3_moe", dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
        decoder_sparse_step=2, num_hidden_layers=4), MoeConfig(6, 3, 24, False, (1, 3))),
    "mixtral-4x2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                    intermediate_size=48), MoeConfig(4, 2, 48, True, (0, 1))),
    "mixtral-8x1": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1),
                    MoeConfig(8, 1, 128, True, (0, 1))),
}


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    """(variant, model directory, prompts, transformers' greedy continuations). The prompts
    share a 40-token prefix in pairs, so that the prefix cache has something to find."""
    model_type, overrides, _ = VARIANTS[request.param]
    directory = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), model_type,
                                    **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    vocab = TINY_LLAMA["vocab_size"]
    prefix = random_prompts(1, vocab, 40, 40, seed=4)[0]
    prompts = random_prompts(6, vocab, 1, 60, seed=3)
    prompts = [(prefix if i % 2 else []) + p for i, p in enumerate(prompts)]
    return request.param, directory, prompts, hf_greedy(hf_model, prompts, MAX_NEW)


def test_config_reads_the_experts(variant) -> None:
    name, directory, _, _ = variant
    cfg = ModelConfig.from_hf(load_model_source(str(directory)).hf_config)
    assert cfg.moe == VARIANTS[name][2]
    assert model_class(cfg).qk_norm == name.startswith("qwen3")


def _check_against_transformers(variant, **engine_args: Any) -> None:
    """All prompts at once (prompt pieces and decoding rows share steps), then every second
    one again over its cached prefix."""
    _, directory, prompts, reference = variant
    llm = build_llm(str(directory), dtype="float32", device="cpu", max_model_len=MAX_LEN,
                    **engine_args)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    again = llm.generate(prompts[1::2], greedy(), use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert [o.outputs[0].token_ids for o in again] == reference[1::2]


def test_moe_matches_transformers(variant) -> None:
    _check_against_transformers(variant)


@pytest.mark.parametrize("variant", ["qwen3_moe-6x3-step2", "mixtral-4x2"], indirect=True)
def test_moe_with_chunked_prompts_matches_transformers(variant) -> None:
    """Prompts prefilled 16 tokens a step, beside the decoding rows."""
    _check_against_transformers(variant, max_num_batched_tokens=16, block_size=32)


@pytest.mark.parametrize("variant", ["mixtral-4x2"], indirect=True)
def test_moe_through_the_triton_kernels(variant) -> None:
    """The router and expert kernels (interpreted): the grouped GEMMs for the prompts (over
    GEMV_MAX_ROWS rows), the one-row GEMV path for the decoding steps."""
    _, directory, prompts, reference = variant
    assert max(len(p) for p in prompts[:2]) * 2 > GEMV_MAX_ROWS
    llm = build_llm(str(directory), dtype="float32", device="cpu", max_model_len=MAX_LEN,
                    attention_backend="triton", num_kv_blocks=40)
    outputs = llm.generate(prompts[:2], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:2]


@pytest.mark.parametrize("variant", ["qwen3_moe-8x2-dense1"], indirect=True)
def test_fp8_experts(variant) -> None:
    """quantization="fp8" quantizes the experts too: each row of each expert e4m3-rounded over
    its own scale, each GEMM's input per token; the router stays in the model dtype. A sparse
    block's output stays within e4m3's rounding of the unquantized block's."""
    _, directory, _, _ = variant
    args = dict(dtype="float32", device="cpu", max_model_len=MAX_LEN)
    blocks = [build_llm(str(directory), quantization=q, **args).engine.core.runner.model.layers[0]
              for q in (None, "fp8")]
    (exact, norm), (fp8, _) = [(layer.mlp, layer.post_attention_layernorm) for layer in blocks]
    w13 = fp8.experts.w13_weight
    scale = w13.abs().amax(-1, keepdim=True) / 448.0
    torch.testing.assert_close(w13, (w13 / scale).to(torch.float8_e4m3fn).float() * scale,
                               rtol=1e-6, atol=0.0)
    assert not torch.equal(w13, exact.experts.w13_weight)
    assert torch.equal(fp8.gate.weight, exact.gate.weight)
    x = torch.randn(20, TINY_LLAMA["hidden_size"], generator=torch.Generator().manual_seed(0))
    outs = []
    for block in (exact, fp8):
        stream = x.clone()
        with torch.inference_mode():
            block(stream, norm)
        outs.append(stream - x)
    error = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    # e4m3 rounds each value by up to 2^-4 of itself (~3.6% RMS), four times on the way
    # (weights and inputs of both GEMMs): ~7%. 6.2% here.
    assert 0.01 < error < 2 ** -3


def test_known_moe_configs() -> None:
    qwen = load_model_source("qwen3-30b-a3b").model_config
    assert qwen.moe == MoeConfig(128, 8, 768, True, tuple(range(48)))
    assert (qwen.model_type, model_class(qwen).qk_norm, qwen.head_dim) == ("qwen3_moe", True,
                                                                             128)
    mixtral = load_model_source("mixtral-8x7b-instruct").model_config
    assert mixtral.moe == MoeConfig(8, 2, 14336, True, tuple(range(32)))
    assert (mixtral.model_type, model_class(mixtral).qk_norm) == ("mixtral", False)


@pytest.mark.parametrize("name", ["qwen3_moe-8x2-dense1", "mixtral-4x2"])
def test_dummy_weights(tmp_path: Path, name: str) -> None:
    """Random weights drawn for every expert and router, as a checkpoint would fill them."""
    model_type, overrides, _ = VARIANTS[name]
    directory = make_tiny_model_dir(tmp_path, model_type, **overrides)
    llm = build_llm(str(directory), load_format="dummy", dtype="float32", device="cpu",
                    max_model_len=MAX_LEN)
    block = llm.engine.core.runner.model.layers[0].mlp
    for param in (block.gate.weight, block.experts.w13_weight, block.experts.w2_weight):
        assert 0.015 < param.std().item() < 0.025
    out = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_type, overrides, _ = VARIANTS["mixtral-4x2"]
    directory = make_tiny_model_dir(tmp_path, model_type, **overrides)
    for shard in directory.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight", None)
        save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.mlp\.experts\.w13_weight"):
        build_llm(str(directory), dtype="float32", device="cpu", max_model_len=MAX_LEN)


def _write_moe_gguf(path: Path, directory: Path) -> Path:
    """The tiny model in `directory` as llama.cpp's converter writes it: Qwen3-MoE as
    `qwen3moe`, Mixtral as `llama` with experts (q/k rows permuted), each layer's experts
    stacked per projection, float32."""
    import gguf

    from fixtures import llama_cpp_permute

    cfg = load_model_source(str(directory)).hf_config
    qwen = cfg["model_type"] == "qwen3_moe"
    arch = "qwen3moe" if qwen else "llama"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": cfg["num_hidden_layers"],
            "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": head_dim, "rope.dimension_count": head_dim,
            "expert_count": cfg.get("num_experts") or cfg["num_local_experts"],
            "expert_used_count": cfg["num_experts_per_tok"]}
    if qwen:
        meta["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
        writer.add_bool(f"{arch}.expert_weights_norm", cfg["norm_topk_prob"])
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                   "o_proj": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
                   "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                   "gate": "ffn_gate_inp"}
    global_names = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in load_model_source(str(directory)).iter_weights():
        w = tensor.numpy()
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.{block}.experts.E.{proj}.weight
            kind = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}.get(
                parts[-2], "down")
            experts.setdefault(f"blk.{parts[2]}.ffn_{kind}_exps.weight", {})[int(parts[5])] = w
            continue
        if parts[-2] in heads and not qwen:
            w = llama_cpp_permute(w, heads[parts[-2]])
        gguf_name = (global_names[name] if name in global_names
                     else f"blk.{parts[2]}.{layer_names[parts[-2]]}.weight")
        writer.add_tensor(gguf_name, w)
    for name, by_expert in experts.items():
        writer.add_tensor(name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", ["qwen3_moe-6x3-step2", "mixtral-4x2"], indirect=True)
def test_gguf_moe_matches_transformers(variant, tmp_path: Path) -> None:
    """A GGUF of the model (experts stacked, dense layers without a router, Mixtral as a Llama
    file with experts) reads as the same config and generates transformers' tokens."""
    name, directory, prompts, reference = variant
    path = _write_moe_gguf(tmp_path / f"{name}.gguf", directory)
    source = load_model_source(str(path))
    assert source.load_format == "gguf"
    assert source.model_config.moe == VARIANTS[name][2]
    llm = build_llm(str(path), dtype="float32", device="cpu", max_model_len=MAX_LEN)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
