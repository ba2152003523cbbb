"""Suffix speculation: the continuation seen most often after the longest suffix of a
request's tokens that occurred before, in the request itself or in earlier requests (agents
and coding tools repeat themselves across requests), drafted token by token while its
estimated probability stays high. The draft length adapts: a context seen once with one
continuation drafts far, an ambiguous one stops early.

Occurrences are counted per context of 1..max_depth tokens: `_Counts` maps each context to
the counts of the tokens that followed it."""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass


class _Counts:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.next_tokens: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def add(self, token_ids: list[int], start: int, end: int, sign: int = 1) -> None:
        """Counts (or with sign -1 forgets) the continuations of tokens start..end - 1."""
        table = self.next_tokens
        for pos in range(max(start, 1), end):
            follower = token_ids[pos]
            for depth in range(1, min(self.max_depth, pos) + 1):
                key = tuple(token_ids[pos - depth:pos])
                counts = table[key]
                counts[follower] += sign
                if counts[follower] <= 0:
                    del counts[follower]
                    if not counts:
                        del table[key]

    def lookup(self, context: list[int]) -> tuple[int, Counter[int] | None]:
        """The longest suffix of `context` seen before (its length) and what followed it."""
        for depth in range(min(self.max_depth, len(context)), 0, -1):
            counts = self.next_tokens.get(tuple(context[-depth:]))
            if counts:
                return depth, counts
        return 0, None


@dataclass
class _Request:
    counts: _Counts
    token_ids: list[int]  # the sequence's own list: it only grows, and is counted up to
    num_counted: int = 0


class SuffixProposer:
    def __init__(self, max_depth: int, min_probability: float, cached_requests: int):
        self.max_depth = max_depth
        self.min_probability = min_probability
        self.cached_requests = cached_requests
        self.requests: dict[str, _Request] = {}
        # Counts over the last `cached_requests` finished requests, and their tokens (to
        # forget them again).
        self.shared = _Counts(max_depth)
        self.finished: deque[list[int]] = deque()

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        request = self.requests.get(request_id)
        if request is None:
            request = self.requests[request_id] = _Request(_Counts(self.max_depth), token_ids)
        own = request.counts
        own.add(token_ids, request.num_counted, len(token_ids))
        request.num_counted = len(token_ids)
        context = token_ids[-self.max_depth:]
        drafts: list[int] = []
        probability = 1.0
        while len(drafts) < max_tokens:
            token, p = self._next(own, context)
            probability *= p
            if token is None or probability < self.min_probability:
                break
            drafts.append(token)
            context = context[1:] + [token] if len(context) >= self.max_depth else \
                context + [token]
        return drafts

    def _next(self, own: _Counts, context: list[int]) -> tuple[int | None, float]:
        """The likeliest next token after the longest matching suffix in the request's own
        counts or the shared ones (own first where they match equally far)."""
        depth, counts = own.lookup(context)
        shared_depth, shared_counts = self.shared.lookup(context)
        if shared_depth > depth:
            counts = shared_counts
        if not counts:
            return None, 0.0
        token, count = counts.most_common(1)[0]
        return token, count / sum(counts.values())

    def finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        tokens = request.token_ids
        self.shared.add(tokens, 0, len(tokens))
        self.finished.append(tokens)
        while len(self.finished) > self.cached_requests:
            old = self.finished.popleft()
            self.shared.add(old, 0, len(old), sign=-1)
