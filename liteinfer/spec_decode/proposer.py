"""The interface every draft proposer implements."""
from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """Guesses the tokens that follow a running request. Proposers see token ids only and keep
    whatever per-request state they need, keyed by request id, until `finish`."""

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (the first `prompt_len` are
        the prompt); fewer, or none, where the proposer has no good guess."""
        ...

    def finish(self, request_id: str) -> None:
        """The request ended: drop its state (a proposer may keep what it learned from it)."""
        ...
