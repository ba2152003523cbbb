"""The transformers baselines (nocache, eager, eager-b4): generate() on a model built from the
config with random bf16 weights, one static batch of `width` requests at a time."""
from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.generation.streamers import BaseStreamer

from liteinfer.bench.metrics import Trace
from liteinfer.bench.registry import TRANSFORMERS, Run
from liteinfer.bench.runner import make_row, progress, workload
from liteinfer.bench.store import Row
from liteinfer.bench.workloads import MIXED, SEED, WARMUP_SEED
from liteinfer.loader import load_model_source
from liteinfer.utils import free_device_memory

_WARMUP_TOKENS = 16  # eager transformers captures nothing: a short batch warms CUDA and cuBLAS


class HFBaseline:
    """A transformers model with random bf16 weights, built from the model's config; like LLM,
    `shutdown()` frees its memory before the next config loads."""

    def __init__(self, model: str):
        config = LlamaConfig.from_dict(load_model_source(model, "dummy").hf_config)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def shutdown(self) -> None:
        del self.model
        free_device_memory()


class TokenClock(BaseStreamer):
    """Times each generated token; generate() pushes them after copying them to the host."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True  # the first push is the prompt itself

    def end(self) -> None:
        pass


def _generate(hf_model: Any, prompts: list[list[int]], osl: int, use_cache: bool,
              width: int, bar: Any = None) -> list[Trace]:
    gen = GenerationConfig(max_new_tokens=osl, min_new_tokens=osl, do_sample=False,
                           use_cache=use_cache, pad_token_id=0)
    traces: list[Trace] = []
    for start in range(0, len(prompts), width):
        batch = prompts[start:start + width]
        ids = torch.tensor(batch, device=hf_model.device)
        clock = TokenClock()
        submit = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                              streamer=clock)
        traces += [Trace(submit, list(clock.times)) for _ in batch]
        if bar is not None:
            bar.update(len(batch))
    return traces


def measure_hf(baseline: HFBaseline, run: Run, model: str, engine_args: dict[str, Any]) -> Row:
    """Static batches of run.width; engine_args['use_cache'] False re-feeds the whole sequence."""
    if run.shape.isl == MIXED and run.width > 1:
        raise ValueError("static transformers batches need one prompt length; use a fixed ISL")
    hf_model = baseline.model
    vocab = hf_model.config.vocab_size
    use_cache = engine_args["use_cache"]
    warm, _ = workload(run.shape, run.width, WARMUP_SEED, vocab)
    _generate(hf_model, warm, min(run.shape.osl, _WARMUP_TOKENS), use_cache, run.width)
    prompts, fold = workload(run.shape, run.prompts, SEED, vocab)
    with progress(run) as bar:
        traces = _generate(hf_model, prompts, run.shape.osl, use_cache, run.width, bar)
    return make_row(run, TRANSFORMERS, traces, prompts, fold, model, engine_args=engine_args,
                    warmup_requests=len(warm))
