"""FP8 checkpoints in the compressed-tensors layout, written here as real safetensors files
with their `quantization_config` built by compressed-tensors itself: per-channel weights with
dynamic per-token activations (its FP8_DYNAMIC preset) and per-tensor weights with static
per-tensor activation scales (its FP8 preset, scales calibrated on a prompt)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from fixtures import build_llm
from liteinfer import LLM, SamplingParams
from liteinfer.layers.quantization import Fp8Config
from reference import assert_same_greedy_outputs, random_prompts

E4M3 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def _e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def _calibrated_input_scales(model_dir: Path) -> dict[str, float]:
    """max |input| / 448 of every projection over a calibration prompt (static activations)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, args, name=name: amax.__setitem__(name, args[0].abs().max().item()))
        for name, module in model.named_modules() if name.endswith(PROJECTIONS)]
    with torch.no_grad():
        model(torch.tensor(random_prompts(1, 300, 60, 60, seed=3)))
    for hook in hooks:
        hook.remove()
    return {name: a / 448 for name, a in amax.items()}


def write_checkpoint(src: Path, dst: Path, preset: str) -> Path:
    """The fp32 model at src as a compressed-tensors FP8 checkpoint at dst."""
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    per_channel = scheme.weights.strategy == "channel"
    static = not scheme.input_activations.dynamic
    input_scales = _calibrated_input_scales(src) if static else {}
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]:
        w = tensors[name]
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = amax / 448
        tensors[name] = _e4m3(w, scale)
        module = name.removesuffix(".weight")
        tensors[f"{module}.weight_scale"] = scale
        if static:
            tensors[f"{module}.input_scale"] = torch.tensor([input_scales[module]])
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized",
        quantization_status="compressed").model_dump(mode="json")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 300, 4, 30, seed=11)


def test_channel_dynamic_checkpoint_runs_as_quantized_at_load(tiny_llama_dir, tmp_path,
                                                              prompts, monkeypatch):
    """Per-channel scales ([N, 1]) are the ones quantizing the fp32 weights at load computes,
    so both engines hold the same e4m3 weights and must produce the same logprobs. The
    checkpoint leaves its LM head in the model dtype; here quantizing at load does too."""
    ckpt = write_checkpoint(tiny_llama_dir, tmp_path / "fp8-dynamic", "FP8_DYNAMIC")
    loaded = build_llm(str(ckpt), dtype="float32", device="cpu", max_model_len=256)
    monkeypatch.setattr(Fp8Config, "lm_head_method", lambda self, use_triton: None)
    at_load = build_llm(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                        quantization="fp8")
    assert_same_greedy_outputs(loaded.generate(prompts, GREEDY, use_tqdm=False),
                               at_load.generate(prompts, GREEDY, use_tqdm=False), 1e-5)


def _fake_quantized_hf(ckpt: Path, src: Path) -> torch.nn.Module:
    """transformers' Llama on the checkpoint's dequantized weights, each projection's input
    rounded through e4m3 at its static scale: the model the checkpoint describes."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors = load_file(ckpt / "model.safetensors")
    for name, module in model.named_modules():
        if not name.endswith(PROJECTIONS):
            continue
        scale = tensors[f"{name}.weight_scale"].float()
        w = tensors[f"{name}.weight"].float() * (scale if scale.dim() == 2 else scale.reshape(()))
        module.weight.data.copy_(w)
        s = tensors[f"{name}.input_scale"].reshape(())
        module.register_forward_pre_hook(
            lambda m, args, s=s: (_e4m3(args[0], s).float() * s,))
    return model


def test_tensor_static_checkpoint_matches_its_transformers_model(tiny_llama_dir, tmp_path,
                                                                 prompts):
    """Per-tensor weight scales (each of q, k, v, gate and up its own, spread over its rows in
    the fused projections) and static input scales, against transformers running the same
    arithmetic: liteinfer's tokens score as transformers' top tokens (within 1e-3, the fp32
    rounding of two summation orders) and their logprobs agree."""
    ckpt = write_checkpoint(tiny_llama_dir, tmp_path / "fp8-static", "FP8")
    hf = _fake_quantized_hf(ckpt, tiny_llama_dir)
    llm = build_llm(str(ckpt), dtype="float32", device="cpu", max_model_len=256)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        logprobs = logits.double().log_softmax(-1)
        for step, token in enumerate(tokens):
            assert logprobs[step].max() - logprobs[step, token] < 1e-3
            for t, entry in out.outputs[0].logprobs[step].items():
                assert abs(entry.logprob - logprobs[step, t].item()) < 1e-3


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                                         "dynamic": False, "symmetric": True}),
     "kv_cache_scheme"),
    (lambda q: q.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "unquantized"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None), "W8A8"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"),
     "only symmetric FP8"),
    (lambda q: q.update(quant_method="gptq"), "not supported"),
])
def test_unsupported_checkpoints_are_refused(tiny_llama_dir, tmp_path, change, message):
    ckpt = write_checkpoint(tiny_llama_dir, tmp_path / "fp8", "FP8_DYNAMIC")
    config = json.loads((ckpt / "config.json").read_text())
    change(config["quantization_config"])
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=256)


@pytest.mark.parametrize("kwargs, message", [({"quantization": "int8"}, "quantization"),
                                             ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype")])
def test_unknown_settings_are_refused(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256, **kwargs)
