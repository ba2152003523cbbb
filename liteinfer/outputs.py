"""What the engine hands back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Host timestamps (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> logprob, holding the sampled token and the top-N.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Token ids produced since the previous output of this request (for streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, as Sequence.prompt_logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
