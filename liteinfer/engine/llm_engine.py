"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, stop."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from liteinfer.config import EngineConfig, ModelConfig, parse_dtype
from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.detokenizer import Detokenizer
from liteinfer.engine.model_runner import ModelRunner
from liteinfer.engine.sampler import SampledTokens, Sampler, logprob_entries, logprob_table
from liteinfer.engine.scheduler import ScheduledBatch, Scheduler
from liteinfer.engine.sequence import Sequence
from liteinfer.engine.tensor_parallel import WorkerGroup
from liteinfer.loader import load_model_source
from liteinfer.outputs import CompletionOutput, RequestOutput
from liteinfer.sampling_params import SamplingParams

# Prompt rows scored at once: their fp32 logits over a 128k vocabulary take 256 MiB.
PROMPT_LOGPROB_ROWS = 512


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    sampled: SampledTokens


def resolve_config(config: EngineConfig, model_config: ModelConfig) -> int:
    """Fills in the 'auto' settings; returns max_model_len."""
    config.validate()
    if config.device == "auto":
        config.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = torch.device(config.device).type == "cuda"
    if config.dtype == "auto":
        config.dtype = "bfloat16" if on_cuda else "float32"
    parse_dtype(config.dtype)
    if config.attention_backend == "auto":
        config.attention_backend = "triton" if on_cuda else "torch"
    tp = config.tensor_parallel_size
    for what, n in (("attention heads", model_config.num_attention_heads),
                    ("KV heads", model_config.num_key_value_heads),
                    ("MLP features", model_config.intermediate_size)):
        if n % tp:
            raise ValueError(f"the model's {n} {what} do not split over "
                             f"tensor_parallel_size={tp}")
    if on_cuda and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    max_len = config.max_model_len or model_config.max_context
    model_config.check_max_model_len(max_len)
    return max_len


class LLMEngine:
    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto",
                 tp_rank: int = 0):
        source = load_model_source(model, load_format)
        self.model_config = ModelConfig.from_hf(source.hf_config)
        self.config = config
        self.max_model_len = resolve_config(config, self.model_config)
        self.tokenizer = source.tokenizer
        self.generation_config = source.generation_config
        # Rank 0 drives the other tensor-parallel ranks' engines (engine/tensor_parallel.py).
        self.workers: WorkerGroup | None = None
        if config.tensor_parallel_size > 1 and tp_rank == 0:
            self.workers = WorkerGroup(model, config, load_format)
        self.runner = ModelRunner(self.model_config, config, source, source.load_format,
                                  self.max_model_len, tp_rank)
        self.max_model_len = self.runner.max_model_len  # within what its KV pool holds
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        # Decodes would be padded to the longest prompt chunk in a padded prefill step.
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   mixed_steps=config.mixed_steps and config.packed_prefill,
                                   mixed_prompt_tokens=config.mixed_prompt_tokens or None)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.seqs: dict[str, Sequence] = {}
        self.inflight: InFlight | None = None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validates and queues a request; raises ValueError before touching the engine."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids")
            text, prompt = prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary size "
                                 f"{vocab}")
        self.check_token_ids(token_ids, "prompt")
        self.check_token_ids(params.logit_bias or (), "logit_bias")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room in "
                             f"max_model_len={self.max_model_len}")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        elif len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len={self.max_model_len}")
        arrival_time = arrival_time or time.perf_counter()
        if self.workers is not None:
            self.workers.call("add_request", request_id, token_ids, params, arrival_time)
        seq = Sequence(request_id, token_ids, params, arrival_time, text)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def check_token_ids(self, token_ids: Iterable[int], what: str) -> None:
        """A ValueError unless every id is one of the model's vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def abort(self, request_id: str) -> bool:
        if self.workers is not None:
            self.workers.call("abort", request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        return True

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache (on every tensor-parallel rank, whose schedulers must decide
        alike), e.g. between benchmark runs."""
        if self.workers is not None:
            self.workers.call("reset_prefix_cache")
        self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.workers is not None:
            self.runner.release_graphs()
            self.workers.shutdown()
            self.workers = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (
            self.inflight is not None and not all(s.is_finished for s in self.inflight.seqs))

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launches the next step, then returns the outputs of the previous one.

        With overlap scheduling the host schedules and launches step N+1 while the device still
        runs step N: step N's sampled tokens feed step N+1 on the device and reach the host
        afterwards. Without it (or when penalties need every token on the host) each step is
        launched and read back in turn.
        """
        if self.workers is not None:
            self.workers.call("step")
        inflight, self.inflight = self.inflight, None
        if inflight is not None and not self._can_overlap(inflight):
            return self._resolve(inflight)
        batch = self.scheduler.schedule()
        if batch is not None:
            self.inflight = self._launch(batch)
        if not self.config.overlap_scheduling and self.inflight is not None:
            inflight, self.inflight = self.inflight, None
        return self._resolve(inflight) if inflight is not None else []

    def _can_overlap(self, inflight: InFlight) -> bool:
        return self.config.overlap_scheduling and not any(
            s.sampling_params.needs_penalties for s in inflight.seqs)

    def _launch(self, batch: ScheduledBatch) -> InFlight | None:
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        logits, prompt_hidden = self.runner.execute(batch)
        if prompt_hidden is not None:
            _record_prompt_logprobs(batch, prompt_hidden, self.runner.prompt_logits)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
        if not sampling:
            return None
        sampled = self.sampler.sample(logits, sampling)
        self.runner.keep_sampled(sampled.token_ids)
        for row, seq in enumerate(sampling):
            seq.num_pending += 1
            seq.pending_row = row
        return InFlight(sampling, sampled)

    def _resolve(self, inflight: InFlight) -> list[RequestOutput]:
        out = inflight.sampled.result()
        now = time.perf_counter()
        outputs = []
        for seq, token, logprobs in zip(inflight.seqs, out.token_ids, out.logprobs):
            seq.num_pending -= 1
            if not seq.is_finished:  # else finished or aborted while this step ran
                outputs.append(self._append(seq, token, logprobs, now))
        return outputs

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None,
                now: float) -> RequestOutput:
        seq.append_token(token)
        self.block_manager.cache_computed_blocks(seq)  # its KV may be computed already
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        self._check_stop_token(seq, token)
        new_text = ""
        if self.detokenizer is not None:
            new_text = self.detokenizer.decode_new(seq, finished=seq.finish_reason is not None)
            # A stop string wins over the length limit it coincides with (not over a stop token).
            if seq.finish_reason != "stop" and self.detokenizer.check_stop_strings(seq) is not None:
                seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            m.finished_time = now
            self.scheduler.finish(seq)
            del self.seqs[seq.request_id]
        return self._output(seq, [token], new_text)

    def _check_stop_token(self, seq: Sequence, token: int) -> None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, seq: Sequence, new_tokens: list[int], new_text: str) -> RequestOutput:
        completion = CompletionOutput(text=seq.output_text, token_ids=seq.output_token_ids,
                                      logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=seq.finish_reason is not None, metrics=seq.metrics,
                             new_token_ids=new_tokens, new_text=new_text,
                             num_cached_tokens=seq.num_cached_tokens,
                             prompt_logprobs=seq.prompt_logprobs)


def _record_prompt_logprobs(batch: ScheduledBatch, hidden: torch.Tensor,
                            to_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Appends the prompt tokens' logprobs (and each sequence's top-N) that this step's rows
    scoring prompt tokens give (`batch.prompt_logprob_spans`, in order; their final hidden
    states). Logits are taken PROMPT_LOGPROB_ROWS rows at a time, so that a long prompt chunk
    never holds [tokens, vocab] at once, and read back at once: a request asking for prompt
    logprobs gives up the overlap of its prompt steps."""
    seqs, targets, tops = [], [], []
    for i, first, n in batch.prompt_logprob_spans:
        seq = batch.seqs[i]
        pos = seq.num_computed_tokens + first
        seqs += [seq] * n
        targets += seq.token_ids[pos + 1:pos + 1 + n]
        tops += [seq.sampling_params.prompt_logprobs] * n
    k = max(tops)
    for start in range(0, len(seqs), PROMPT_LOGPROB_ROWS):
        end = start + PROMPT_LOGPROB_ROWS
        ids = torch.tensor(targets[start:end], device=hidden.device)
        table = logprob_table(to_logits(hidden[start:end]), ids, k)
        for seq, entry in zip(seqs[start:end], logprob_entries(table.tolist(), tops[start:end], k)):
            seq.prompt_logprobs.append(entry)
