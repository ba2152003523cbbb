"""A benchmark-only proposer with controlled acceptance: it proposes each request's known
continuation (its output from a run without speculation, keyed by its prompt) and corrupts
each draft token with a set probability. On dummy weights no real draft can exist; this
measures what verification costs and saves at a chosen acceptance rate. With forced
acceptance the engine keeps every draft before the first corrupted one, whatever the target
samples (`accepted_length`), for weights whose greedy answer depends on the kernel path."""
from __future__ import annotations

import random


class ReferenceProposer:
    def __init__(self, reference_outputs: dict[tuple[int, ...], tuple[int, ...]],
                 corrupt_probability: float, vocab_size: int, seed: int = 0):
        self.outputs = reference_outputs
        # Per request, the index of the first corrupted draft of its latest proposal.
        self.first_corrupted: dict[str, int] = {}
        self.corrupt_probability = corrupt_probability
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def set_reference(self, reference_outputs: dict[tuple[int, ...], tuple[int, ...]],
                      corrupt_probability: float) -> None:
        self.outputs = reference_outputs
        self.corrupt_probability = corrupt_probability

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        reference = self.outputs.get(tuple(token_ids[:prompt_len]))
        if reference is None:
            return []
        # The reference's tokens at the output's position, also where a sampled output has
        # left it (they are then rarely accepted).
        done = len(token_ids) - prompt_len
        drafts = list(reference[done:done + max_tokens])
        first = len(drafts)
        for i in range(len(drafts)):
            if self.rng.random() < self.corrupt_probability:
                # Any other token: the target rejects it.
                drafts[i] = (drafts[i] + 1 + self.rng.randrange(self.vocab_size - 1)) \
                    % self.vocab_size
                first = min(first, i)
        self.first_corrupted[request_id] = first
        return drafts

    def forced_accepted_length(self, request_id: str, num_drafts: int) -> int:
        """Under forced acceptance: the drafts before the first corrupted one."""
        return min(self.first_corrupted.get(request_id, 0), num_drafts)

    def finish(self, request_id: str) -> None:
        self.first_corrupted.pop(request_id, None)
