"""Drafts a model proposed on the device (draft_model, eagle3): the model runner proposes them
after each step that asks for them (`SchedulerOutput.num_lookahead_tokens`) and the scheduler
hands them here once the step's tokens are on the host, keyed by the request's length they
follow, until the next step asks for them."""
from __future__ import annotations


class ModelDraftsProposer:
    def __init__(self) -> None:
        self.drafts: dict[str, tuple[int, list[int]]] = {}

    def add(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Drafts to follow the request's first `num_tokens` tokens."""
        self.drafts[request_id] = (num_tokens, drafts)

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        num_tokens, drafts = self.drafts.pop(request_id, (-1, []))
        # Drafts proposed for another length (a step without proposals came between) are stale.
        return drafts[:max_tokens] if num_tokens == len(token_ids) else []

    def finish(self, request_id: str) -> None:
        self.drafts.pop(request_id, None)
