"""The step contract: what the scheduler hands the model runner for one step, as plain data
(vLLM v1's SchedulerOutput). Rank 0's runner gets the object itself; tensor-parallel workers
get it encoded (engine/worker.py). Either way the runner applies it to its own state of each
request (engine/request_state.py) and never sees the scheduler's sequences.

It carries deltas only: a request's prompt and sampling params cross once, and each step after
that brings what changed since the runner last saw the request (tokens read back, blocks
added) and the counters the step reads.
"""
from __future__ import annotations

import msgspec

from liteinfer.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the runner has not seen, sent with its first step."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request of a step: what changed since the runner last saw it, and its counters as
    the scheduler holds them before the step."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int] = []  # appended to its token ids (sampled tokens read back)
    new_block_ids: list[int] = []  # appended to its block table
    resumed: bool = False  # new_block_ids is its whole table (admitted again after preemption)
    num_pending: int = 0  # tokens sampled on the device that the scheduler has not read yet


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One model step. Prefill steps compute prompt chunks and verify draft tokens (and, in a
    mixed step, one token of each decoding request beside them); decode steps one token per
    request. The first `num_decodes` requests decode one token each."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: list[int]  # tokens each request computes in this step
    is_prefill: bool
    num_decodes: int
    # Per request, the draft tokens it verifies after its last token; empty: no drafts.
    scheduled_spec_decode_tokens: list[list[int]] = []
    # Drafts a model proposes on the device after the step, per sampling request (0: none).
    num_lookahead_tokens: int = 0
    new_requests: list[NewRequestData] = []
    # Requests finished since the last step; dropped before `new_requests` are added, as a
    # new request may reuse a finished one's id.
    finished_req_ids: list[str] = []
