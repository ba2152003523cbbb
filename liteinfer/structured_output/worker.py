"""The grammar process: every constrained request's xgrammar matcher, advanced by the tokens the
engine core samples, and each step's bitmask rows, filled into host memory the core shares.

xgrammar's bitmask fill holds the GIL, so another thread's Python crawls while one fills
(docs/notes/journal.md, item 69). In the core's process no thread could overlap it with the step
loop's own work; in a process of its own it runs while the core hands out the last step's
outputs and schedules the next one.

Messages, msgpack over a pipe; the core's, in the order it sends them:
    [COMPILE, gid, kind, spec, disable_any_whitespace]  compile a grammar (on the worker's threads)
    [DROP, gid]                                        forget it (the core's cache evicted it)
    [ADD, rid, gid]                                    a matcher for the request, once gid compiled
    [FINISH, [rid, ...]]                               drop the requests' matchers
    [STEP, [[rid, [token, ...]], ...], [[row, rid(, drafts)], ...], [row, ...]]
        accept the tokens (reply ACCEPTED: one status per request), then fill the rows of the
        named requests whose grammar has not ended (a request verifying drafts: its row and
        one row after each draft) and set the last rows (the step's
        unconstrained ones) to allow every token (reply FILLED); either part may be empty, and
        an empty part gets no reply
    [POLL]                                             reply COMPILED
    [SHUTDOWN]
The worker's replies: [ACCEPTED, [status, ...], done] | [FILLED, done] | [COMPILED, done], where
`done` lists the [gid, error or None] of the compilations finished since the last reply.
"""
from __future__ import annotations

import signal
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import xgrammar as xgr

from liteinfer.logger import configure_logging
from liteinfer.structured_output.backend import XgrammarBackend
from liteinfer.structured_output.params import StructuredOutputsParams
from liteinfer.utils import ReadableWait

COMPILE, DROP, ADD, FINISH, STEP, POLL, SHUTDOWN = range(7)
ACCEPTED, FILLED, COMPILED = range(3)
# A request's status after its tokens: the grammar allowed them; it forbade one (the matcher
# stays before it); it allowed them and has reached its end.
ALLOWED, FORBIDDEN, TERMINATED = range(3)


def params_message(gid: int, params: StructuredOutputsParams) -> list[Any]:
    """The COMPILE message of a request's constraint."""
    spec = getattr(params, params.kind)
    return [COMPILE, gid, params.kind, spec, params.disable_any_whitespace]


def params_from_message(kind: str, spec: Any, disable_any_whitespace: bool
                        ) -> StructuredOutputsParams:
    return StructuredOutputsParams(**{kind: spec},
                                   disable_any_whitespace=disable_any_whitespace)


class GrammarWorker:
    def __init__(self, conn: Connection, tokenizer_info: str, bitmask: torch.Tensor,
                 fill_threads: int, compile_threads: int, spin: bool):
        self.conn = conn
        # While a constrained request runs, its next step's tokens come within a step: the
        # wait spins where `spin` (utils.ReadableWait), else blocks. The spin is bounded: the
        # matchers of finished requests go only with the core's next message.
        self.step_wait = ReadableWait(conn.fileno(), spin)
        self.bitmask = bitmask  # int32 [rows, words], shared with the core
        # Compiled grammars are cached by the core, which names each one (gid).
        self.backend = XgrammarBackend(xgr.TokenizerInfo.deserialize_json(tokenizer_info),
                                       compile_threads)
        self.executor = ThreadPoolExecutor(compile_threads, thread_name_prefix="compile")
        self.grammars: dict[int, Future[xgr.CompiledGrammar]] = {}
        self.unreported: list[int] = []  # compilations whose end the core has not been told
        self.dropped: set[int] = set()
        self.waiting: dict[int, list[str]] = {}  # gid -> requests whose matcher waits for it
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        # Bitmask rows that allow every token as they stand: a step's unconstrained rows are
        # mostly last step's too, and rewriting them (16 KB a row) would delay each fill.
        self.allowing_all: set[int] = set()
        # A few threads fill fastest: more cost more to start than they take over (item 69).
        self.batch = xgr.BatchGrammarMatcher(fill_threads)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder()

    def run(self) -> None:
        while True:
            if self.matchers:
                self.step_wait.wait()
            try:
                message = self.decoder.decode(self.conn.recv_bytes())
            except EOFError:  # the core is gone
                return
            kind = message[0]
            if kind == SHUTDOWN:
                return
            if kind == COMPILE:
                self._compile(message[1], params_from_message(*message[2:]))
            elif kind == DROP:
                self._drop(message[1])
            elif kind == ADD:
                self._add(message[1], message[2])
            elif kind == FINISH:
                self._finish(message[1])
            elif kind == STEP:
                accepts, rows, free_rows = message[1:]
                if accepts:
                    statuses = [self._accept(rid, tokens) for rid, tokens in accepts]
                    self._reply(ACCEPTED, statuses)
                if rows:
                    self._allow_all(free_rows)
                    self._fill(rows)
                    self._reply(FILLED)
            elif kind == POLL:
                self._reply(COMPILED)

    def _reply(self, kind: int, *payload: Any) -> None:
        self.conn.send_bytes(self.encoder.encode([kind, *payload, self._finished_compiles()]))

    def _compile(self, gid: int, params: StructuredOutputsParams) -> None:
        self.grammars[gid] = self.executor.submit(self.backend.compile, params)
        self.unreported.append(gid)

    def _drop(self, gid: int) -> None:
        if gid in self.unreported:  # its waiting requests get their matchers first
            self.dropped.add(gid)
        else:
            del self.grammars[gid]

    def _add(self, rid: str, gid: int) -> None:
        grammar = self.grammars[gid]
        if grammar.done():
            if grammar.exception() is None:
                self.matchers[rid] = xgr.GrammarMatcher(grammar.result())
        else:
            self.waiting.setdefault(gid, []).append(rid)

    def _finish(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            for waiting in self.waiting.values():  # finished while its grammar compiled
                if rid in waiting:
                    waiting.remove(rid)

    def _finished_compiles(self) -> list[tuple[int, str | None]]:
        """The compilations finished since the last reply, as [gid, error]; their waiting
        requests get their matchers."""
        done = [gid for gid in self.unreported if self.grammars[gid].done()]
        if not done:
            return []
        self.unreported = [gid for gid in self.unreported if gid not in done]
        results = []
        for gid in done:
            grammar = self.grammars[gid]
            error = grammar.exception()
            waiting = self.waiting.pop(gid, [])
            if error is None:
                compiled = grammar.result()
                for rid in waiting:
                    self.matchers[rid] = xgr.GrammarMatcher(compiled)
            if gid in self.dropped:
                self.dropped.discard(gid)
                del self.grammars[gid]
            results.append((gid, None if error is None else str(error)))
        return results

    def _accept(self, rid: str, tokens: Sequence[int]) -> int:
        matcher = self.matchers.get(rid)
        if matcher is None or not all(matcher.accept_token(t) for t in tokens):
            return FORBIDDEN
        return TERMINATED if matcher.is_terminated() else ALLOWED

    def _allow_all(self, rows: Sequence[int]) -> None:
        """Sets the rows to allow every token, writing only those that do not already."""
        stale = [row for row in rows if row not in self.allowing_all]
        if stale:
            self.bitmask[stale] = -1
            self.allowing_all.update(stale)

    def _fill(self, rows: Sequence[Sequence[Any]]) -> None:
        """rows: [row, rid] or, for a request verifying drafts, [row, rid, drafts]."""
        indices, matchers = [], []
        for row, rid, *drafts in rows:
            matcher = self.matchers.get(rid)
            if matcher is None or matcher.is_terminated():
                continue
            if drafts:
                self._fill_verified(row, matcher, drafts[0])
            else:
                indices.append(row)
                matchers.append(matcher)
        if matchers:
            self.batch.batch_fill_next_token_bitmask(matchers, self.bitmask, indices=indices)
            self.allowing_all.difference_update(indices)

    def _fill_verified(self, row: int, matcher: xgr.GrammarMatcher, drafts: list[int]) -> None:
        """Row + i allows what may follow the request's drafts[:i]. Past a draft the grammar
        forbids, or its end (a stop token, where the request ends), the rows allow every
        token: the target's masked sample rejects that draft at its own row, and the rows
        after it are discarded."""
        accepted = 0
        for i in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(self.bitmask, row + i)
            self.allowing_all.discard(row + i)
            if i == len(drafts) or not matcher.accept_token(drafts[i]):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        self._allow_all(range(row + i + 1, row + len(drafts) + 1))
        matcher.rollback(accepted)


def run_grammar_worker(conn: Connection, tokenizer_info: str, bitmask: torch.Tensor,
                       fill_threads: int, compile_threads: int, spin: bool) -> None:
    """The grammar process's main function."""
    configure_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the core's to handle
    torch.set_num_threads(1)
    GrammarWorker(conn, tokenizer_info, bitmask, fill_threads, compile_threads, spin).run()
