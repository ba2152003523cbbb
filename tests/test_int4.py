"""4-bit (and GGUF's 8-bit) checkpoints kept quantized: compressed-tensors pack-quantized
(symmetric and asymmetric), AutoAWQ GEMM, GPTQ, and GGUF blocks written with the `gguf`
library, each loaded as it is. Every projection matches a float64 dequantize-then-matmul of the
checkpoint's own values, and the model generates what the same model with those weights
dequantized generates. The quantizer and the packers here are the test's own (or the format
library's): they share nothing with the loaders."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures import TINY_LLAMA, build_llm, make_tiny_gguf
from liteinfer import LLM, SamplingParams
from liteinfer.layers.linear import matmul
from reference import assert_same_greedy_outputs, random_prompts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The tiny model's rows are 64 and 128 wide.
GROUP = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
Tensors = dict[str, torch.Tensor]


def _quantize(w: torch.Tensor, symmetric: bool, group: int = GROUP):
    """Round to nearest in float64: codes [N, K], fp16 scales and integer zero points [N, G]."""
    g = w.double().reshape(w.shape[0], -1, group)
    if symmetric:
        scales = (g.abs().amax(-1) / 7).clamp_min(1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-8).half()
        zeros = (-lo / scales.double()).round().clamp(0, 15).long()
    codes = (g / scales.double()[..., None] + zeros[..., None]).round().clamp(0, 15).long()
    return codes.reshape(w.shape), scales, zeros


def _dequantized(codes, scales, zeros, group: int = GROUP) -> torch.Tensor:
    return ((codes - zeros.repeat_interleave(group, 1)).double()
            * scales.double().repeat_interleave(group, 1))


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., W, 8] nibbles -> int32 [..., W], the i-th in bits 4i."""
    w = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return (w - ((w >> 31) << 32)).int()


def _compressed_tensors(symmetric: bool):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    def write(name: str, codes, scales, zeros) -> Tensors:
        out = {f"{name}.weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
               f"{name}.weight_scale": scales.float(),
               f"{name}.weight_shape": torch.tensor(codes.shape)}
        if not symmetric:
            out[f"{name}.weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4,
                                                             packed_dim=0)
        return out
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                               group_size=GROUP)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"], format="pack-quantized", quantization_status="compressed")
    return write, config.model_dump(mode="json")


def _awq():
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i holds column order[i] of its 8

    def pack(t: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
        return _words(t.reshape(t.shape[0], -1, 8)[..., list(order)])

    def write(name: str, codes, scales, zeros) -> Tensors:
        return {f"{name}.qweight": pack(codes.t()), f"{name}.qzeros": pack(zeros.t()),
                f"{name}.scales": scales.t().contiguous()}
    return write, {"quant_method": "awq", "w_bit": 4, "q_group_size": GROUP, "zero_point": True,
                   "version": "gemm"}


def _gptq(desc_act: bool = False):
    def write(name: str, codes, scales, zeros) -> Tensors:
        k = codes.shape[1]
        return {f"{name}.qweight": _words(codes.t().reshape(k // 8, 8, -1).transpose(1, 2)),
                f"{name}.qzeros": _words((zeros - 1).t().reshape(zeros.shape[1], -1, 8)),
                f"{name}.scales": scales.t().contiguous(),
                f"{name}.g_idx": torch.arange(k, dtype=torch.int32) // GROUP}
    return write, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act,
                   "sym": False, "checkpoint_format": "gptq"}


FORMATS: dict[str, tuple[Callable, bool]] = {
    "ct-sym": (lambda: _compressed_tensors(True), True),
    "ct-asym": (lambda: _compressed_tensors(False), False),
    "awq": (_awq, False),
    "gptq": (_gptq, False),
}


def write_checkpoints(src: Path, dst: Path, fmt: str) -> tuple[Path, Path]:
    """The fp32 model at src quantized into `fmt` at dst / fmt, and the same model with those
    weights dequantized (float64, rounded once to fp32) at dst / "dequantized"."""
    factory, symmetric = FORMATS[fmt]
    write, quant_config = factory()
    tensors: Tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    packed, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]:
        codes, scales, zeros = _quantize(tensors[name], symmetric)
        del packed[name]
        packed.update(write(name.removesuffix(".weight"), codes, scales, zeros))
        dense[name] = _dequantized(codes, scales, zeros).float()
    out = []
    for kind, weights, quant in ((fmt, packed, quant_config), ("dequantized", dense, None)):
        directory = dst / kind
        directory.mkdir()
        for f in src.iterdir():
            if not f.name.startswith("model"):
                shutil.copy(f, directory / f.name)
        save_file({k: v.contiguous() for k, v in weights.items()},
                  directory / "model.safetensors")
        if quant is not None:
            config = json.loads((src / "config.json").read_text())
            config["quantization_config"] = quant
            (directory / "config.json").write_text(json.dumps(config))
        out.append(directory)
    return out[0], out[1]


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.runner.model


def assert_layers_match(llm: LLM, reference: LLM) -> None:
    """Each projection of llm on fresh random rows against float64 rows times the reference
    model's (dequantized) weight."""
    gen = torch.Generator().manual_seed(0)
    ref_modules = dict(_model(reference).named_modules())
    for name, module in _model(llm).named_modules():
        if not name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            continue
        weight = ref_modules[name].weight.double().cpu()
        device = next(module.parameters()).device
        for rows in (1, 5, 200):  # the GEMV, few-row and wide paths where they differ
            x = torch.randn(rows, weight.shape[1], generator=gen)
            got = matmul(module, x.to(device)).double().cpu()
            want = x.double() @ weight.t()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (name, rows)


def assert_same_generations(llm: LLM, reference: LLM, vocab: int) -> None:
    """Four prompts together, then one alone (its decode steps are one row each: on the GPU the
    GEMV with the norm, SwiGLU and residual add fused in)."""
    for count, seed in ((4, 5), (1, 6)):
        prompts = random_prompts(count, vocab, 3, 20, seed=seed)
        assert_same_greedy_outputs(llm.generate(prompts, GREEDY, use_tqdm=False),
                                   reference.generate(prompts, GREEDY, use_tqdm=False), 1e-4)


def _cpu_llm(path: Path, **kwargs) -> LLM:
    return build_llm(str(path), dtype="float32", device="cpu", max_model_len=128, **kwargs)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_loads_as_it_is(tiny_llama_dir, tmp_path, fmt):
    ckpt, dense = write_checkpoints(tiny_llama_dir, tmp_path, fmt)
    llm, reference = _cpu_llm(ckpt), _cpu_llm(dense)
    assert_layers_match(llm, reference)
    assert_same_generations(llm, reference, TINY_LLAMA["vocab_size"])


def test_gptq_with_activation_order_is_refused(tiny_llama_dir, tmp_path):
    ckpt, _ = write_checkpoints(tiny_llama_dir, tmp_path, "gptq")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=128)


def test_int4_at_load_is_round_to_nearest(tmp_path):
    """quantization="int4": each projection is its fp32 weight rounded to the nearest of 16
    levels per group of 128 (asymmetric), within half a step of it."""
    from fixtures import make_tiny_llama_dir
    src = make_tiny_llama_dir(tmp_path, hidden_size=128, intermediate_size=256)
    llm, dense = _cpu_llm(src, quantization="int4"), _cpu_llm(src)
    dense_modules = dict(_model(dense).named_modules())
    for name, module in _model(llm).named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            w = dense_modules[name].weight.double()
            g = w.reshape(w.shape[0], -1, 128)
            step = (g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)) / 15
            err = (module.weight.double() - w).reshape(g.shape).abs().amax(-1)
            assert (err <= step * 0.5 + 1e-6).all(), name
            assert (err > 0).any(), name
    assert _model(llm).lm_head.weight.dtype == torch.float32


# GGUF: Q4_0, Q4_1 and Q8_0 blocks from the library's own quantizer; K-quant blocks (which it
# cannot write) from each row's float bits, with their super-block scales set to sane values.
# Both are functions of a row alone, so they commute with llama.cpp's q/k row permutation.
GGUF_CONFIG = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512}
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 d (dmin)


def _gguf_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    import gguf
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _K_SCALES:
        return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(w, np.float32).view(np.uint8)[:, :w.shape[1] // block * size]
    blocks = raw.copy().reshape(-1, size)
    for offset in _K_SCALES[kind]:
        blocks[:, offset:offset + 2] = np.array([2e-4], np.float16).view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


def _gguf_pair(tmp_path: Path, types: dict[str, str]) -> tuple[Path, Path]:
    """A tiny model's GGUF with each projection in blocks of its type in `types` (by the
    projection's short name: q, k, v, o, gate, up, down), and its GGUF with those blocks
    dequantized by the `gguf` library (float32)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        state = LlamaForCausalLM(LlamaConfig(**GGUF_CONFIG)).float().state_dict()
    state = {k: v for k, v in state.items() if "rotary" not in k}

    def blocks(name: str, w: np.ndarray):
        if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            return None
        kind = types[name.split(".")[-2].removesuffix("_proj")]
        return _gguf_blocks(w, kind), gguf.GGMLQuantizationType[kind]
    dense = {name: torch.from_numpy(gguf.quants.dequantize(b[0], b[1])) if (
        b := blocks(name, v.numpy())) else v for name, v in state.items()}
    return (make_tiny_gguf(tmp_path / "blocks.gguf", state, config=GGUF_CONFIG, quantize=blocks),
            make_tiny_gguf(tmp_path / "dense.gguf", dense, config=GGUF_CONFIG))


# A Q4_K_M file's projections in one layer where llama.cpp keeps v and down at Q6_K.
Q4_K_M_TYPES = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q4_K", "gate": "Q4_K", "up": "Q4_K",
                "down": "Q6_K"}


@pytest.mark.parametrize("types, bits, group, layouts", [
    ({"q": "Q4_0", "k": "Q4_1", "v": "Q4_K", "o": "Q4_1", "gate": "Q4_K", "up": "Q4_0",
      "down": "Q4_1"}, 4, 32, {"qkv": (4, 32), "o": (4, 32), "gate_up": (4, 32), "down": (4, 32)}),
    ({"q": "Q4_K", "k": "Q8_0", "v": "Q6_K", "o": "Q5_K", "gate": "Q4_K", "up": "Q8_0",
      "down": "Q6_K"}, 8, 16, {"qkv": (8, 16), "o": (8, 32), "gate_up": (8, 32), "down": (8, 16)}),
    (Q4_K_M_TYPES, 8, 16, {"qkv": (8, 16), "o": (4, 32), "gate_up": (4, 32), "down": (8, 16)}),
], ids=["4-bit", "mixed", "q4_k_m"])
def test_gguf_blocks_load_as_they_are(tmp_path, types, bits, group, layouts):
    """Every kept type, several in one fused projection. A file's projections are created at
    the widest bits and the finest group among its types, and each is repacked to the fewest
    bits and widest groups its own types allow (a Q4_K_M file's Q4_K projections to 4 bits in
    groups of 32, its Q6_K ones kept at 8 in groups of 16)."""
    blocks, dense = _gguf_pair(tmp_path, types)
    llm, reference = _cpu_llm(blocks), _cpu_llm(dense)
    layer = _model(llm).layers[0]
    assert (layer.mlp.down_proj.quant_method.config.bits,
            layer.mlp.down_proj.quant_method.config.group_size) == (bits, group)
    projections = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                   "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    assert {name: (p.bits, p.group_size) for name, p in projections.items()} == layouts
    assert_layers_match(llm, reference)
    assert_same_generations(llm, reference, GGUF_CONFIG["vocab_size"])


def test_int4_through_the_kernels_matches_its_dequantized_weights(tmp_path):
    """The GPU's int4 path on the CPU (the Triton layers, under the interpreter): the codes in
    the kernels' tile order, multiplied by the GEMV (one row), the few-row kernel and the
    dequantized scratch weight (wide steps), each projection as the engine that dequantized the
    same codes once loaded, and the two generate alike."""
    from fixtures import make_tiny_llama_dir
    src = make_tiny_llama_dir(tmp_path, hidden_size=128, intermediate_size=256)
    kernels = build_llm(str(src), dtype="float32", device="cpu", max_model_len=128,
                        quantization="int4", attention_backend="triton")
    cpu = _cpu_llm(src, quantization="int4")
    assert _model(kernels).layers[0].self_attn.qkv_proj.weight is None
    assert_layers_match(kernels, cpu)
    # Three prompts ending one after another: decode steps of 3 and 2 rows, then of one (the
    # GEMV with the norm, SwiGLU and residual add fused in). Interpreted steps take seconds.
    prompts = random_prompts(3, TINY_LLAMA["vocab_size"], 3, 20, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (2, 3, 5)]
    assert_same_greedy_outputs(kernels.generate(prompts, params, use_tqdm=False),
                               cpu.generate(prompts, params, use_tqdm=False), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_kept_on_the_gpu_multiplies_its_dequantized_weights(tmp_path):
    """On CUDA the int4 codes stay packed and the Triton kernels multiply them (fp32 here, so
    the comparison is exact up to summation order): each projection matches the CPU engine's,
    which dequantized the same codes once loaded, and the two generate alike."""
    from fixtures import make_tiny_llama_dir
    src = make_tiny_llama_dir(tmp_path, hidden_size=128, intermediate_size=256)
    gpu = build_llm(str(src), dtype="float32", device="cuda", max_model_len=128,
                    quantization="int4")
    cpu = _cpu_llm(src, quantization="int4")
    assert _model(gpu).layers[0].self_attn.qkv_proj.weight is None
    assert_layers_match(gpu, cpu)
    assert_same_generations(gpu, cpu, TINY_LLAMA["vocab_size"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gguf_of_mixed_types_kept_on_the_gpu_multiplies_each_at_its_bits(tmp_path):
    """A Q4_K_M-like file on CUDA: its Q4_K projections' 4-bit codes and its Q6_K ones' 8-bit
    codes stay packed, each multiplied by the kernels at its own bits, and match the engine that
    loaded the same blocks dequantized, projection by projection and in what they generate."""
    blocks, dense = _gguf_pair(tmp_path, Q4_K_M_TYPES)
    gpu = build_llm(str(blocks), dtype="float32", device="cuda", max_model_len=128)
    layer = _model(gpu).layers[0]
    assert [(p.bits, p.qweight.is_cuda) for p in (layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ] == [(4, True), (8, True)]
    reference = _cpu_llm(dense)
    assert_layers_match(gpu, reference)
    assert_same_generations(gpu, reference, GGUF_CONFIG["vocab_size"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_split_launches_sum_through_the_runners_workspace(tmp_path):
    """A down projection long enough to be cut along K (4,096 codes a row): the runner sizes one
    workspace from its layers' split launches before capturing its graphs, the engine generates
    as the CPU's through it (captured steps included), each launch leaves the arrival counters
    at zero, and shutting the engine down frees it with the graphs."""
    from fixtures import make_tiny_llama_dir
    from liteinfer.kernels import num_sms
    from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS
    from liteinfer.layers.quantization import split_k_launches
    src = make_tiny_llama_dir(tmp_path, hidden_size=128, intermediate_size=4096)
    gpu = build_llm(str(src), dtype="float32", device="cuda", max_model_len=128,
                    quantization="int4")
    runner = gpu.engine.core.runner
    launches = split_k_launches(runner.model, num_sms(runner.device))
    assert {n for n, _ in launches} == {128} and all(s > 1 for _, s in launches)
    workspace = runner.scratch.split_k
    assert workspace.partials.numel() == max(n * s for n, s in launches) * FEWROW_MAX_ROWS
    assert runner.graphs is not None
    assert_same_generations(gpu, _cpu_llm(src, quantization="int4"), TINY_LLAMA["vocab_size"])
    assert not workspace.counters.any()
    gpu.shutdown()
    assert runner.scratch.split_k is None and runner.scratch.decode is None
    assert runner.graphs is None and runner.step_model.splits is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_q4_1_kept_on_the_gpu_answers_as_on_the_cpu(smollm2_llm, smollm2_path):
    """SmolLM2's Q4_1 file, its projections kept as 4-bit codes on the GPU and multiplied by the
    W4A16 kernels (bf16 activations), gives the fp32 CPU model's answers, close calls free to go
    either way (test_fp8's `_answer`)."""
    from test_fp8 import FACTS, _answer
    llm = build_llm(str(smollm2_path), dtype="bfloat16", device="cuda", max_model_len=512)
    down = _model(llm).layers[0].mlp.down_proj
    assert down.weight is None and down.qweight.dtype == torch.int32 and down.qweight.is_cuda
    prompts = [smollm2_llm.apply_chat_template([{"role": "user", "content": q}]) for q in FACTS]
    references = smollm2_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                                              logprobs=2), use_tqdm=False)
    for prompt, ref, facts in zip(prompts, references, FACTS.values(), strict=True):
        text = llm.tokenizer.decode(_answer(llm, prompt, ref.outputs[0]),
                                    skip_special_tokens=True)
        assert all(fact in text for fact in facts), (ref.outputs[0].text, text)
