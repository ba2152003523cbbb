"""Speculative decoding: proposers guess the tokens after each running request, the target
model scores the request's next token and the drafts in one pass, and the longest prefix of
drafts the target agrees with is kept (engine/scheduler.py).

Drafts are deterministic guesses, so accepting a draft exactly when the target samples it,
and keeping the target's own sample at the first disagreement, is rejection sampling that
reproduces the target's distribution: with a one-point draft distribution q = 1{d}, a draft
d is accepted with probability p(d), and a rejection leaves the target's sample conditioned
on not being d, which is the residual (p - q)+ normalised."""
from __future__ import annotations

from liteinfer.config import SpeculativeConfig
from liteinfer.engine.messages import SpecDecodingStats
from liteinfer.spec_decode.draft_length import DraftLengthPolicy
from liteinfer.spec_decode.model_drafts import ModelDraftsProposer
from liteinfer.spec_decode.ngram import NgramProposer
from liteinfer.spec_decode.proposer import Proposer
from liteinfer.spec_decode.reference import ReferenceProposer
from liteinfer.spec_decode.suffix import SuffixProposer

# A step of this many tokens still costs about one read of the weights (bf16 or fp8 on a
# Hopper GPU: the GEMMs turn compute-bound near a few hundred rows, attention adds to them).
KNEE_TOKENS = 128
# A verification step cannot overlap the next step's scheduling with its own run: the host
# gap that leaves, as a fraction of a step.
SYNC_COST = 0.1


def build_proposer(spec: SpeculativeConfig, vocab_size: int) -> Proposer:
    if spec.drafts_on_device:
        return ModelDraftsProposer()
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixProposer(spec.suffix_max_depth, spec.suffix_min_probability,
                              spec.suffix_cached_requests)
    return ReferenceProposer(dict(spec.reference_outputs), spec.corrupt_probability,
                             vocab_size)


class Speculator:
    """The proposer, the draft-length policy and the counters, as the scheduler uses them."""

    def __init__(self, spec: SpeculativeConfig, vocab_size: int, time_steps: bool):
        self.proposer = build_proposer(spec, vocab_size)
        # Benchmarks only: the reference proposer decides acceptance (config.py says why).
        self.forced = self.proposer if spec.force_acceptance else None
        self.drafts_on_device = spec.drafts_on_device
        self.policy = DraftLengthPolicy(spec.num_speculative_tokens, KNEE_TOKENS, SYNC_COST,
                                        time_steps)
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * spec.num_speculative_tokens)
        # When the host last read a step's results (None after a pause), if steps are timed
        # for the policy (else it keeps its modelled costs).
        self.last_step_read: float | None = None
        self.last_step_verified = False

    def draft_length(self, num_decoding: int) -> int:
        return self.policy.draft_length(num_decoding)

    def wants_host_tokens(self, num_decoding: int) -> bool:
        return self.policy.wants_host_tokens(num_decoding)

    def step_scheduled(self, batch: int, asked: int, drafted: int) -> None:
        self.policy.step_scheduled(batch, asked, drafted)

    def step_read(self, now: float, batch: int, num_tokens: int, verified: bool,
                  decode_only: bool) -> None:
        """The host has read the results of a step of `batch` sequences at `now`: a decode
        step (`decode_only`) is timed from the previous step's reading, for the policy's cost
        of verifying."""
        last, self.last_step_read = self.last_step_read, now
        after_verifying, self.last_step_verified = self.last_step_verified, verified
        # A plain step after a verifying one was scheduled after the host read it: its time
        # holds that round trip, which is the verifying step's cost, not its own.
        steady = verified or not after_verifying
        if self.policy.timed and last is not None and decode_only and steady:
            self.policy.record_step_time(batch, num_tokens, verified, now - last)

    def paused(self) -> None:
        """No step is running: the next one's time starts with it."""
        self.last_step_read = None

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        return self.proposer.propose(request_id, prompt_len, token_ids, max_tokens)

    def add_drafts(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Drafts the model runner proposed to follow the request's first `num_tokens`."""
        self.proposer.add(request_id, num_tokens, drafts)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1
        self.policy.record(num_drafted, num_accepted)

    def accepted_length(self, request_id: str, drafts: list[int], sampled: list[int]) -> int:
        """How many of the drafts the target agrees with: its samples at their positions."""
        if self.forced is not None:
            return self.forced.forced_accepted_length(request_id, len(drafts))
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        return accepted

    def finish(self, request_id: str) -> None:
        self.proposer.finish(request_id)
