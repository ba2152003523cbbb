"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of a
request's last n tokens, in its prompt or its output."""
from __future__ import annotations


class _NgramIndex:
    """For each n, the latest start of every n-gram of a request's tokens that has a token
    after it. Grown as tokens arrive, so a proposal costs O(n), not a scan of the request."""

    def __init__(self, min_n: int, max_n: int):
        self.ns = range(min_n, max_n + 1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ns}
        self.num_indexed = 0  # tokens whose n-grams (ending there) are indexed

    def extend(self, token_ids: list[int]) -> None:
        # An n-gram ending at token e - 1 is indexed once token e exists (its continuation).
        for end in range(max(self.num_indexed, 1), len(token_ids)):
            for n in self.ns:
                if end >= n:
                    self.latest[n][tuple(token_ids[end - n:end])] = end - n
        self.num_indexed = max(self.num_indexed, len(token_ids))


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, prompt_len: int, token_ids: list[int],
                max_tokens: int) -> list[int]:
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = _NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        length = len(token_ids)
        for n in reversed(index.ns):  # the longest match first
            if n >= length:
                continue
            start = index.latest[n].get(tuple(token_ids[length - n:]))
            if start is not None:
                return token_ids[start + n:start + n + max_tokens]
        return []

    def finish(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
