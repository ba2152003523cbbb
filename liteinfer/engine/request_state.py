"""The model runner's own state of each request it runs, kept from step to step and brought up
to each step by the step's SchedulerOutput (vLLM v1's CachedRequestState). Rank 0's runner and
every tensor-parallel worker's apply the same message here, so every rank runs the same step."""
from __future__ import annotations

import torch

from liteinfer.engine.pending_tokens import assign_rows
from liteinfer.engine.scheduler_output import SchedulerOutput
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.thinking_budget import ThinkingBudget
from liteinfer.sampling_params import SamplingParams


class CachedRequestState:
    """A request's tokens as far as the scheduler has read them, its block table, its counters
    as of the step being run, and what only the runner keeps: the row of its pending token in
    the sampled-token buffer, its seeded generator and its reasoning budget's progress."""

    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = params
        self.needs_penalties = params.needs_penalties
        self.thinking = ThinkingBudget.of(params, prompt_token_ids)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids the scheduler has not read yet, and the row of
        # the newest one in the step's samples (engine/pending_tokens.py).
        self.num_pending = 0
        self.pending_row = -1
        # Seeded requests only; the sampler creates it on the logits' device at the first draw.
        self.generator: torch.Generator | None = None
        # Prompt tokens scored for prompt logprobs (token 0 counts, having none); None: not
        # asked for.
        self.num_prompt_logprobs: int | None = 1 if params.prompt_logprobs is not None else None

    def __len__(self) -> int:
        """Tokens including pending ones: what the KV cache must hold."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RequestStates:
    """Every request the runner holds, by id."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, out: SchedulerOutput) -> StepBatch[CachedRequestState]:
        """Brings the states up to the step; returns the step over them."""
        requests = self.requests
        for rid in out.finished_req_ids:
            # Absent if the step that would have brought it failed before it was applied.
            requests.pop(rid, None)
        for new in out.new_requests:
            requests[new.req_id] = CachedRequestState(new.req_id, new.prompt_token_ids,
                                                      new.sampling_params)
        step = out.scheduled
        seqs = [requests[rid] for rid in step.req_ids]
        for state, computed, pending in zip(seqs, step.num_computed_tokens, step.num_pending):
            state.num_computed_tokens = computed
            state.num_pending = pending
        for i, ids in step.new_token_ids:
            seqs[i].token_ids += ids
        for i in step.resumed:
            seqs[i].block_table = []
        for i, ids in step.new_block_ids:
            seqs[i].block_table += ids
        return StepBatch(seqs, out.num_scheduled_tokens, out.is_prefill, out.num_decodes,
                         out.scheduled_spec_decode_tokens, out.num_lookahead_tokens)

    def launched(self, batch: StepBatch[CachedRequestState]) -> None:
        """The step runs: each sampling request's newest pending token will be in the step's
        row it samples last in."""
        assign_rows(batch.sampling_seqs)
