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


class ScheduledRequests(msgspec.Struct, array_like=True, omit_defaults=True):
    """The step's requests, in its order, as parallel lists (built and applied with one pass
    over the requests, every step): their counters as the scheduler holds them before the
    step, and what changed since the runner last saw them, for those where something did."""

    req_ids: list[str]
    num_computed_tokens: list[int]
    # Tokens sampled on the device that the scheduler has not read yet.
    num_pending: list[int]
    # (index, token ids appended to its token ids): sampled tokens the scheduler has read.
    new_token_ids: list[tuple[int, list[int]]] = []
    # (index, block ids appended to its block table).
    new_block_ids: list[tuple[int, list[int]]] = []
    # Indices whose new block ids are the whole table (admitted again after preemption).
    resumed: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One model step. Prefill steps compute prompt chunks and verify draft tokens (and, in a
    mixed step, one token of each decoding request beside them); decode steps one token per
    request. The first `num_decodes` requests decode one token each."""

    scheduled: ScheduledRequests
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
