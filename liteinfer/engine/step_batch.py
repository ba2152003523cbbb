"""One step over request objects, and what follows from their state before it: which requests
sample, the rows they sample in, and the prompt tokens scored. The scheduler builds it over
its sequences (engine/sequence.py), the model runner over its own request states
(engine/request_state.py) from the step's SchedulerOutput: both derive the same rows from the
same counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class StepRequest(Protocol):
    """What a step's derived rows read of a request."""

    num_computed_tokens: int
    num_prompt_tokens: int

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Prompt tokens whose logprobs are known (token 0's counts as one); None: not asked."""

    def __len__(self) -> int:
        """Tokens including pending ones."""


R = TypeVar("R", bound=StepRequest)


@dataclass
class StepBatch(Generic[R]):
    """A sequence verifying drafts (speculative decoding) computes its next token and its
    drafts as a chunk of `1 + len(drafts)` tokens after the decoding ones, and samples a token
    at every one of them: the drafts the samples agree with are kept, and the first sample that
    disagrees (or the one after the last draft) follows them (Scheduler.update_from_output).
    A step of decodes and verifications only may run as a decode step of such chunks
    (`verification_width`)."""

    seqs: list[R]
    num_tokens: list[int]  # tokens each sequence computes in this step
    is_prefill: bool
    num_decodes: int = 0  # the leading sequences that decode one token (all, in a decode step)
    # Per sequence, the draft tokens it verifies (after its last token); empty: no drafts.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # Drafts a model proposes on the device after the step, for each sequence that samples in
    # it (draft_model, eagle3); 0: none. Their KV is written ahead, so the scheduler reserved
    # room for them where it could without preempting.
    num_lookahead_tokens: int = 0
    # Derived at creation, from the sequences' state before the step (which the scheduler
    # advances as soon as the step is launched).
    sample_mask: list[bool] = field(init=False)
    # The sequence of every sampled row, in row order (a verifying sequence has a row for its
    # next token and one per draft).
    sampling_seqs: list[R] = field(init=False)
    # (sequence index, first token in its chunk, count) of the tokens whose logits give a prompt
    # token's logprob that sequence asked for and does not have yet (a prompt recomputed after
    # preemption is not scored twice). Token p scores prompt token p + 1.
    prompt_logprob_spans: list[tuple[int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        # A sequence samples when this step reaches its last token. A decoding one computes
        # its last token by construction: only the others are checked (this runs every step).
        d = self.num_decodes
        seqs, drafts = self.seqs, self.draft_token_ids or [()] * len(self.seqs)
        self.sample_mask = [True] * d + [
            seqs[i].num_computed_tokens + self.num_tokens[i] == len(seqs[i]) + len(drafts[i])
            for i in range(d, len(seqs))]
        self.sampling_seqs = seqs[:d]
        for i in range(d, len(seqs)):
            if self.sample_mask[i]:
                self.sampling_seqs += [seqs[i]] * (1 + len(drafts[i]))
        self.prompt_logprob_spans = []
        for i in range(self.num_decodes, len(self.seqs)):
            seq = self.seqs[i]
            scored = seq.num_prompt_logprobs
            if scored is None:
                continue
            start = seq.num_computed_tokens
            first = max(start, scored - 1)
            end = min(start + self.num_tokens[i], seq.num_prompt_tokens - 1)
            if end > first:
                self.prompt_logprob_spans.append((i, first - start, end - first))

    def samples(self, i: int) -> bool:
        """Whether a token is sampled for sequence i in this step."""
        return self.sample_mask[i]

    def num_drafts(self, i: int) -> int:
        return len(self.draft_token_ids[i]) if self.draft_token_ids else 0

    def verification_width(self) -> int:
        """Where every sequence of the step decodes or verifies drafts (its newest token and
        its drafts, no prompt tokens scored), 1 + the most drafts one verifies: the query
        tokens each sequence takes as a decode step of verifications. 0 for any other step."""
        if not self.draft_token_ids or self.prompt_logprob_spans:
            return 0
        for i in range(self.num_decodes, len(self.seqs)):
            drafts = self.num_drafts(i)
            if not drafts or self.num_tokens[i] != 1 + drafts or not self.sample_mask[i]:
                return 0
        return 1 + max(map(len, self.draft_token_ids))
