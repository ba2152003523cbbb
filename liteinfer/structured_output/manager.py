"""The engine core's structured outputs: grammars compiled off the step loop, one matcher per
constrained request, and the token bitmask of each step's constrained rows.

A request's grammar is compiled on a worker thread when the request arrives (compiled grammars
are cached by constraint, least recently used first out); the scheduler keeps it waiting until
`is_ready`. Before a step samples, `grammar_bitmask` fills on the host the bitmask of the rows
whose requests are constrained (the sampler applies it on the device, to those rows only); the
tokens sampled are then given to `accept_tokens`, in order. A matcher that accepts a stop token
has reached the grammar's end (`is_terminated`): the request finishes with "stop".
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from liteinfer.structured_output.backend import XgrammarBackend
from liteinfer.structured_output.params import StructuredOutputsParams
from liteinfer.utils import to_device


@dataclass
class GrammarBitmask:
    """One step's allowed tokens: bit t of row r (int32 words, 32 tokens each) is set when
    token t may follow; only `rows` are filled and applied."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [step rows, ceil(vocab / 32)], on the host


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> None:
    """Sets the logits of the tokens the grammar forbids to -inf, in place, in the constrained
    rows only (on CUDA one Triton kernel; the bitmask is copied asynchronously from pinned
    memory, as are the rows)."""
    bitmask = grammar.bitmask.to(logits.device, non_blocking=True)
    rows = to_device(grammar.rows, torch.int32, logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


@dataclass
class _Request:
    grammar: Future[xgr.CompiledGrammar]
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256, compile_threads: int = 2):
        self._backend_args = (tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._executor = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar")
        # Built on the first constrained request (reading a 128k vocabulary takes a while).
        self._backend: Future[XgrammarBackend] | None = None
        self._compiled: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = (
            OrderedDict())
        self._requests: dict[str, _Request] = {}
        # Filling a step's rows is on the step's path. On the H200 host 16 rows took 1.02 ms on
        # one thread, 0.38-0.41 on four and 0.44 on eight (xgrammar's "auto": half the cores),
        # and rows that allow few tokens 0.15 ms on four against 0.33 on eight (the threads'
        # start): at most four.
        self._batch_matcher = xgr.BatchGrammarMatcher(max(1, min(4, (os.cpu_count() or 2) // 2)))
        self._pin = torch.cuda.is_available()

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Starts (or reuses) the compilation of the request's grammar."""
        self._requests[request_id] = _Request(self._grammar(params))

    def _grammar(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = params.key
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        if self._backend is None:
            self._backend = self._executor.submit(XgrammarBackend, *self._backend_args)
        backend = self._backend
        future = self._executor.submit(lambda: backend.result().compile(params))
        self._compiled[key] = future
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    def is_ready(self, request_id: str) -> bool:
        """Whether the request can run: its grammar compiled (or failed: see `error`)."""
        req = self._requests[request_id]
        if req.matcher is not None or req.error is not None:
            return True
        if not req.grammar.done():
            return False
        try:
            req.matcher = xgr.GrammarMatcher(req.grammar.result())
        except Exception as e:  # reported as this request's error
            req.error = f"structured outputs: {e}"
        return True

    def error(self, request_id: str) -> str | None:
        return self._requests[request_id].error

    def grammar_bitmask(self, request_ids: Sequence[str | None]) -> GrammarBitmask | None:
        """The bitmask of one step's rows (request ids in row order): filled for the rows of
        constrained requests whose grammar has not terminated; None if there are none."""
        rows, matchers = [], []
        for row, rid in enumerate(request_ids):
            req = self._requests.get(rid) if rid is not None else None
            if req is not None and req.matcher is not None and not req.matcher.is_terminated():
                rows.append(row)
                matchers.append(req.matcher)
        if not rows:
            return None
        bitmask = torch.empty(len(request_ids), xgr.get_bitmask_shape(1, self.vocab_size)[1],
                              dtype=torch.int32, pin_memory=self._pin)
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return GrammarBitmask(rows, bitmask)

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advances the request's matcher; False if a token is not one the grammar allows
        (the matcher stays where it was before that token)."""
        matcher = self._requests[request_id].matcher
        return all(matcher.accept_token(t) for t in token_ids)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self._requests[request_id].matcher
        return matcher is not None and matcher.is_terminated()

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def has_requests(self) -> bool:
        """Whether any request is constrained (else a step skips every per-row check)."""
        return bool(self._requests)

    def finish_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
