"""Per-request sampling settings, validated before a request reaches the engine."""
from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

from liteinfer.structured_output import StructuredOutputsParams

# What torch.Generator.manual_seed takes: signed or unsigned 64-bit.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 128


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a seeded request's n: seed + choice, so that they differ
    and each can be reproduced, wrapped to stay a 64-bit integer."""
    if seed is None:
        return None
    seed += choice
    return seed - 2**64 if seed > SEED_MAX else seed


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs hold while it runs (vLLM's): everything so far (CUMULATIVE),
    only what is new (DELTA: streaming, at no cost per token for the tokens before), or
    nothing until it finishes (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling settings with vLLM's names and defaults.

    Temperatures below 1e-5 (0 included) mean greedy: dividing by them would overflow fp32.
    top_k 0 (or -1) and top_p 1 disable those filters.
    """

    n: int = 1  # choices per prompt (offline: LLM.generate returns them in one RequestOutput)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of each prompt token given the tokens before it, with the top-N there (vLLM's).
    prompt_logprobs: int | None = None
    # Added to the token's logit before penalties and sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: outputs carry token ids only (no text, no stop strings)
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this JSON schema, regex, choice or grammar (vLLM's).
    structured_outputs: StructuredOutputsParams | None = None
    # At most this many tokens inside the reasoning section: the end of reasoning is forced
    # then (vLLM's). The section's (start, end) tokens: the front end fills them in from the
    # tokenizer's think markers.
    thinking_token_budget: int | None = None
    think_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        if not 0.0 <= self.temperature < math.inf:
            bad(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be a non-negative integer (0 or -1 disables), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer, got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < 0):
            bad(f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop strings need detokenize=True")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.logit_bias is not None and any(
                not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()):
            bad("logit_bias maps non-negative token ids to biases in [-100, 100]")
        if self.thinking_token_budget is not None and (
                isinstance(self.thinking_token_budget, bool)
                or not isinstance(self.thinking_token_budget, int)
                or self.thinking_token_budget < 0):
            bad("thinking_token_budget must be a non-negative integer, got "
                f"{self.thinking_token_budget!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with `max_tokens` set and lists of its own, not validated again (validate()
        this one first): dataclasses.replace would run __post_init__ and validate() again, on
        every request's path (journal item 71)."""
        new = copy.copy(self)
        new.max_tokens = max_tokens
        new.stop, new.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
