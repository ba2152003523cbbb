"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum

from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.thinking_budget import ThinkingBudget
from liteinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Token ids, KV blocks and sampling state of one request in the engine core (its text
    lives in the front end: engine/output_processor.py).

    `num_computed_tokens` counts tokens whose K/V are in the cache. After preemption it drops to 0
    and the whole sequence (prompt + generated) is prefilled again: recomputation changes no output
    because the next sampled token still comes from the same logits and the same generator.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = params
        # Penalties read every earlier token on the host: such a sequence's steps never overlap.
        self.needs_penalties = params.needs_penalties
        # So does a reasoning budget, until the reasoning is over.
        self.thinking = ThinkingBudget.of(params, self.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prefix caching: prompt tokens found in the cache at admission, and the hashed keys of
        # the leading blocks registered or found so far (block_manager.py).
        self.num_cached_tokens = 0
        self.block_key_hashes: list[int] = []
        # Tokens sampled on the device whose ids the host has not read yet (overlapped steps).
        self.num_pending = 0
        # What the model runner holds of it (its SchedulerOutput deltas): token ids and blocks
        # sent so far; 0 token ids: never sent. Blocks go back to 0 when it is preempted.
        self.num_sent_token_ids = 0
        self.num_sent_blocks = 0
        # Entry t: prompt token t's logprobs given tokens < t; none for token 0. Filled as the
        # prompt is computed, sent with the first output.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None

    @property
    def reads_outputs(self) -> bool:
        """Whether sampling reads every earlier token on the host (no step may overlap it)."""
        return self.needs_penalties or (self.thinking is not None
                                        and not self.thinking.is_over(self.token_ids))

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None if self.prompt_logprobs is None else len(self.prompt_logprobs)

    def __len__(self) -> int:
        """Tokens including pending ones: what the KV cache must hold."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
