"""A reasoning budget (vLLM's `thinking_token_budget`): once a request has written that many
tokens inside its reasoning section without closing it, its next token is the end of
reasoning, and its answer follows. The core sees token ids only: the front end gives it the
section's start and end tokens."""
from __future__ import annotations

from liteinfer.sampling_params import SamplingParams


class ThinkingBudget:
    """One sequence's reasoning, read a token at a time. The section is open from the start
    if the prompt ends inside it (a chat template that opens it, as DeepSeek-R1's), or opens
    if the first output token is its start (Qwen3's); otherwise, or once it has closed, there
    is nothing more to enforce (`over`)."""

    def __init__(self, budget: int, start: int, end: int, prompt: list[int]) -> None:
        self.budget, self.start, self.end = budget, start, end
        last_start, last_end = _last(prompt, start), _last(prompt, end)
        self.inside = last_start > last_end
        self.count = 0  # tokens written inside the section
        self.scanned = len(prompt)
        self.over = False

    @classmethod
    def of(cls, params: SamplingParams, prompt: list[int]) -> ThinkingBudget | None:
        """The request's budget; None if it has none."""
        if params.thinking_token_budget is None or params.think_token_ids is None:
            return None
        return cls(params.thinking_token_budget, *params.think_token_ids, prompt)

    def must_end(self, token_ids: list[int]) -> bool:
        """Whether the token after `token_ids` (the prompt and every output so far) must end
        the reasoning."""
        if self.over:
            return False
        for t in token_ids[self.scanned:]:
            if not self.inside:
                if t != self.start:  # the output does not begin with reasoning
                    self.over = True
                    return False
                self.inside = True
            elif t == self.end:
                self.over = True
                return False
            else:
                self.count += 1
        self.scanned = len(token_ids)
        return self.inside and self.count >= self.budget

    def is_over(self, token_ids: list[int]) -> bool:
        """Whether there is nothing more to enforce after `token_ids`."""
        self.must_end(token_ids)
        return self.over


def _last(tokens: list[int], token: int) -> int:
    """Where `token` last occurs in `tokens`; -1 if nowhere."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == token:
            return i
    return -1
