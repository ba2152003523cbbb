"""What the engine hands back to callers: snapshots, never live engine state."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Host timestamps (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class Logprob:
    """A token's log-probability, its rank in the vocabulary (1 = most likely) and its text
    (vLLM's)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the sampled (or prompt) token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Token ids and text produced since the previous output of this request (for streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token.
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
