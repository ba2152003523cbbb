"""What crosses the boundary between a front end and the engine core: requests in, one message
of every request's new tokens per step out.

The core runs in the caller's process for the offline `LLM` and in a process of its own behind
the HTTP server (engine/core_process.py); the same messages are used both ways, encoded with
msgspec's msgpack when they cross a socket. They carry token ids only: tokenization, chat
templates, detokenization and stop strings belong to the front end.
"""
from __future__ import annotations

import msgspec

from liteinfer.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request, validated and tokenized by the front end (engine/processor.py)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens resolved (never None)
    arrival_time: float
    # Which front end gets this request's outputs (several may share one core).
    client_index: int = 0


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's logprobs: token_ids[0] is the sampled (or prompt) token, the rest the
    top-N, best first; `rank` is token_ids[0]'s rank in the vocabulary (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # The prompt's logprobs (position 0 has none), in the request's first output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # "stop" | "length" | "abort" | "error"; None while the request runs.
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id, for a stop on a token
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding's counts since the engine started, with vLLM's meanings: a draft is
    one sequence's drafts verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified sequence gains per step: its accepted drafts and one more."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The scheduler's state after a step (for /metrics and the periodic stats log)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_preemptions: int = 0     # since the engine started
    prefix_cache_queries: int = 0  # prompt tokens looked up, since the engine started
    prefix_cache_hits: int = 0     # of those, found in the cache
    spec_decoding: SpecDecodingStats | None = None  # None: no speculative decoding


class Admission(msgspec.Struct, array_like=True, omit_defaults=True):
    """The core's answer to one batch of requests a front end sent: all admitted, or all
    refused (the server holds as many requests as it may)."""

    request_id: str  # the batch's first request
    refusal: str | None = None


# How many stored responses the core keeps for its front ends: the newest.
MAX_STORED_RESPONSES = 1024


class StoredResponse(msgspec.Struct, array_like=True, omit_defaults=True):
    """A response the Responses API keeps (`previous_response_id`) in the core process, which
    every API-server process talks to: opaque bytes by id. As an answer to a lookup, payload
    None: not kept (never stored, or dropped as the oldest)."""

    response_id: str
    payload: bytes | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's message: every request's new tokens, and the scheduler's state; or the
    answers to the batches of requests and the lookups the core has just taken in."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # time.perf_counter() when the step's tokens reached the host: the clock of every request
    # stamp (RequestMetrics), CLOCK_MONOTONIC on Linux, so one host's processes compare them.
    timestamp: float = 0.0
    admissions: list[Admission] = msgspec.field(default_factory=list)
    stored: list[StoredResponse] = msgspec.field(default_factory=list)


class EngineCoreInfo(msgspec.Struct, array_like=True):
    """What a front end needs to know of the core it feeds, sent once when the core is ready."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
