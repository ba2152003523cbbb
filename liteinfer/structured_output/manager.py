"""The engine core's structured outputs: the constrained requests, their grammars (compiled,
cached and matched in the grammar process, structured_output/worker.py) and the token bitmask
of each step's constrained rows.

A request's grammar is compiled in the grammar process when the request arrives (compiled
grammars are cached by constraint, least recently used first out); the scheduler keeps it
waiting until `is_ready`. Each step's sampled tokens go to `advance` as soon as they reach the
host, with the bitmask rows of the step that samples next; `accepted` then gives each request's
status (its grammar's end finishes it with "stop"), and the grammar process fills the rows
while the core goes on: `grammar_bitmask` waits for them only when that step samples.

The grammar process starts with the first constrained request (reading a 128k vocabulary and
starting a process take a few seconds).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.multiprocessing
import xgrammar as xgr

from liteinfer.structured_output import worker
from liteinfer.structured_output.backend import tokenizer_info
from liteinfer.structured_output.params import StructuredOutputsParams
from liteinfer.structured_output.worker import ALLOWED, FORBIDDEN, TERMINATED
from liteinfer.utils import ReadableWait, cpus_to_spin

__all__ = ["ALLOWED", "FORBIDDEN", "TERMINATED", "GrammarBitmask", "GrammarWorkerDied",
           "StructuredOutputManager", "apply_grammar_bitmask"]
# Fill threads in the grammar process: the best count measured (worker.py); half the cores at
# most.
FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
COMPILE_THREADS = 2
# `poll` asks at most this often: an idle core steps in a tight loop while a grammar compiles,
# and each question is a round trip the grammar process answers while it compiles.
POLL_INTERVAL_S = 0.001


@dataclass
class GrammarBitmask:
    """One step's allowed tokens: bit t of row r (int32 words, 32 tokens each) is set when
    token t may follow. `rows` are the constrained rows; the others allow every token (rows of
    requests that finished since may hold anything: their tokens are discarded)."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [step rows, ceil(vocab / 32)], on the host


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> None:
    """Sets the logits of the tokens the grammar forbids to -inf, in place (on CUDA one Triton
    kernel over every row). On CUDA the bitmask (pinned) is copied on a stream of its own: the
    copy, ~0.5 MB for 32 rows of a 128k vocabulary, runs while the step's forward pass still
    does instead of after it on the step's stream."""
    bitmask = grammar.bitmask
    if logits.device.type == "cuda":
        step_stream = torch.cuda.current_stream(logits.device)
        copy_stream = _bitmask_copy_stream(logits.device)
        with torch.cuda.stream(copy_stream):
            bitmask = bitmask.to(logits.device, non_blocking=True)
        step_stream.wait_stream(copy_stream)
        bitmask.record_stream(step_stream)  # allocated on the copy stream, read on this one
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


@functools.cache
def _bitmask_copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class GrammarWorkerDied(RuntimeError):
    pass


@dataclass
class _Grammar:
    gid: int
    ready: bool = False
    error: str | None = None


class _Process:
    """The started grammar process, the pipe to it and the bitmask it fills."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_rows: int):
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.bitmask = torch.zeros(max_rows, words, dtype=torch.int32).share_memory_()
        # Registered with CUDA, the shared pages are pinned: the copy to the device is async.
        self.registered = torch.cuda.is_available()
        if self.registered:
            nbytes = self.bitmask.numel() * self.bitmask.element_size()
            flags = 1  # cudaHostRegisterPortable: pinned for every device
            error = torch.cuda.cudart().cudaHostRegister(self.bitmask.data_ptr(), nbytes, flags)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of the grammar bitmask failed: {error}")
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # Both ends spin on the pipe where the CPUs allow: a constrained step waits on the
        # grammar process's replies, and the grammar process on the core's tokens.
        spin = cpus_to_spin(2)
        self.reply_wait = ReadableWait(self.conn.fileno(), spin)
        self.proc = ctx.Process(target=worker.run_grammar_worker, daemon=True,
                                name="liteinfer-grammar",
                                args=(child, info.serialize_json(), self.bitmask, FILL_THREADS,
                                      COMPILE_THREADS, spin))
        self.proc.start()
        child.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # it may be gone already
            self.conn.send_bytes(msgspec.msgpack.encode([worker.SHUTDOWN]))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.bitmask.data_ptr())


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_rows: int, cache_size: int = 256):
        self._process_args = (tokenizer, vocab_size, stop_token_ids, max_rows)
        self.cache_size = cache_size
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="grammar-start")
        self._process: Future[_Process] | None = None
        self._outbox: list[bytes] = []  # sent once the process has started
        self._grammars: OrderedDict[tuple[str, str, bool], _Grammar] = OrderedDict()
        self._by_gid: dict[int, _Grammar] = {}
        self._next_gid = 0
        self._requests: dict[str, _Grammar] = {}
        # Requests still reasoning, with the token that ends it: their rows are not masked and
        # their tokens not given to their grammars until it comes.
        self._reasoning: dict[str, int] = {}
        self._finished: list[str] = []  # told to the grammar process with the next message
        self._fills: list[dict[int, str]] = []  # rows asked for, not filled yet, oldest first
        self._filled: dict[int, str] = {}  # rows filled for the step that samples next
        self._accepting = False  # an ACCEPTED reply is due
        # Why the grammar process is gone (it did not start, or exited): every constrained
        # request fails, and the core goes on with the others.
        self._broken: str | None = None
        self._polled = 0.0  # when `poll` last asked
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Starts (or reuses) the compilation of the request's grammar."""
        if self._broken is not None:
            self._requests[request_id] = _Grammar(-1, error=self._broken)
            return
        grammar = self._grammar(params)
        self._requests[request_id] = grammar
        if params.reasoning_end_token_id is not None:
            self._reasoning[request_id] = params.reasoning_end_token_id
        self._send([worker.ADD, request_id, grammar.gid])

    def _grammar(self, params: StructuredOutputsParams) -> _Grammar:
        key = params.key
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        if self._process is None:
            self._process = self._starter.submit(_Process, *self._process_args)
        grammar = _Grammar(self._next_gid)
        self._next_gid += 1
        self._grammars[key] = self._by_gid[grammar.gid] = grammar
        self._send(worker.params_message(grammar.gid, params))
        if len(self._grammars) > self.cache_size:
            _, evicted = self._grammars.popitem(last=False)
            self._send([worker.DROP, evicted.gid])
        return grammar

    def poll(self) -> None:
        """Learns which compilations have finished (for `is_ready`)."""
        now = time.monotonic()
        if now - self._polled < POLL_INTERVAL_S or self._live() is None:
            return
        self._polled = now
        self._send([worker.POLL])
        self._receive(worker.COMPILED)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request can run: its grammar compiled (or failed: see `error`), as of
        the last reply from the grammar process (`poll` asks for one)."""
        grammar = self._requests[request_id]
        return grammar.ready or grammar.error is not None

    def error(self, request_id: str) -> str | None:
        return self._requests[request_id].error

    def is_constrained(self, request_id: str) -> bool:
        """Whether the request's steps sample with a bitmask (a split step), reasoning or not:
        the step after the one that ends its reasoning must wait for its grammar."""
        return request_id in self._requests

    @property
    def has_requests(self) -> bool:
        """Whether any request is constrained (else a step skips every per-row check)."""
        return bool(self._requests)

    def finish_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._finished.append(request_id)
            self._reasoning.pop(request_id, None)

    # ---- steps ----------------------------------------------------------------------------
    def advance(self, accepts: Sequence[tuple[str, list[int]]],
                next_rows: Sequence[tuple[int, str]] = (), num_rows: int = 0) -> list[str]:
        """Gives each request its new tokens (their statuses: `accepted`). `next_rows` (row,
        request id) are the constrained rows of the step that samples next, of its `num_rows`:
        the grammar process fills them after these tokens, while the caller goes on. A request
        still reasoning gets none (its grammar has not begun): returns those that did, in
        order."""
        if self._accepting:  # the last statuses were never read (that step failed): skip them
            self.accepted()
        if self._reasoning:
            accepts = [(rid, tokens) for rid, tokens in accepts if not self._reasons(rid, tokens)]
            next_rows = [(row, rid) for row, rid in next_rows if rid not in self._reasoning]
        self._accepting = bool(accepts)
        if accepts or next_rows:
            self._send([worker.STEP, list(accepts),
                        *self._fill_message(next_rows, (row for row, _ in next_rows), num_rows)])
        if next_rows:
            self._fills.append(dict(next_rows))
        return [rid for rid, _ in accepts]

    def _reasons(self, request_id: str, tokens: list[int]) -> bool:
        """Whether these tokens are the request's reasoning (its grammar begins after the one
        that ends it)."""
        end = self._reasoning.get(request_id)
        if end is None:
            return False
        if end in tokens:
            del self._reasoning[request_id]
        return True

    def accepted(self) -> list[int]:
        """The statuses of the tokens of the last `advance`, in its order: ALLOWED, FORBIDDEN
        (the matcher stays before the token) or TERMINATED (the grammar's end)."""
        if not self._accepting:
            return []
        self._accepting = False
        return self._receive(worker.ACCEPTED)[1]

    def grammar_bitmask(self, request_ids: Sequence[str | None],
                        drafts: Mapping[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The bitmask of one step's rows (request ids in row order), filled for the rows of
        the constrained requests still running; None if there are none. A request verifying
        `drafts[rid]` has one row more per draft: each allows what may follow the drafts
        before it."""
        while self._fills:  # rows asked for by `advance`
            self._receive(worker.FILLED)
        filled, self._filled = self._filled, {}
        rows = [(row, rid) for row, rid in enumerate(request_ids) if rid is not None
                and rid in self._requests and rid not in self._reasoning]
        if not rows:
            return None
        missing: list[Any] = [(row, rid) for row, rid in rows
                              if filled.get(row) != rid and not (drafts and rid in drafts)]
        if drafts:
            first: dict[str, int] = {}
            for row, rid in rows:
                first.setdefault(rid, row)
            missing += [(first[rid], rid, ds) for rid, ds in drafts.items() if rid in first]
        if missing:
            self._send([worker.STEP, [], *self._fill_message(
                missing, (row for row, _ in rows), len(request_ids))])
            self._fills.append({m[0]: m[1] for m in missing})
            self._receive(worker.FILLED)
            self._filled = {}
        bitmask = self._live_or_raise().bitmask
        return GrammarBitmask([row for row, _ in rows], bitmask[:len(request_ids)])

    @staticmethod
    def _fill_message(rows: Sequence[tuple[int, str]], constrained: Iterable[int],
                      num_rows: int) -> list[Any]:
        """The rows to fill, and the step's unconstrained rows: they allow every token."""
        held = set(constrained)
        return [list(rows), [r for r in range(num_rows) if r not in held]]

    def shutdown(self) -> None:
        self._starter.shutdown(wait=False, cancel_futures=True)
        process = self._live()
        if process is not None:
            process.close()

    # ---- the pipe -------------------------------------------------------------------------
    def _live(self) -> _Process | None:
        """The grammar process once it has started, while it lives (None before it has, or
        once it is gone: a start that failed breaks the manager here)."""
        if self._broken is not None or self._process is None or not self._process.done():
            return None
        error = self._process.exception()
        if error is not None:
            self._break(f"structured outputs: the grammar process did not start: {error}")
            return None
        return self._process.result()

    def _live_or_raise(self) -> _Process:
        """The grammar process a reply is awaited from, once it has started."""
        if self._process is not None:
            wait([self._process])
        process = self._live()
        if process is None:
            raise GrammarWorkerDied(self._broken or "structured outputs: no grammar process")
        return process

    def _break(self, reason: str) -> None:
        """The grammar process is gone: the grammars still compiling fail with `reason`, as
        will later requests; the requests running fail at their next step
        (GrammarWorkerDied)."""
        self._broken = reason
        for grammar in self._by_gid.values():
            grammar.error = reason
        self._by_gid.clear()
        self._grammars.clear()
        self._outbox.clear()
        self._fills.clear()
        self._filled = {}

    def _send(self, message: list[Any]) -> None:
        """Sends `message` (with the requests finished since the last one), or keeps it until
        the grammar process has started; dropped once it is gone."""
        if self._broken is not None:
            return
        if self._finished:
            finished, self._finished = self._finished, []
            self._send([worker.FINISH, finished])
        self._outbox.append(self._encoder.encode(message))
        process = self._live()
        if process is not None:
            self._flush(process)

    def _flush(self, process: _Process) -> None:
        try:
            for data in self._outbox:
                process.conn.send_bytes(data)
        except OSError:  # it exited: the next reply awaited says so
            self._break(self._exit_reason(process))
        self._outbox.clear()

    def _receive(self, kind: int) -> list[Any]:
        """Replies until one of `kind`; each reports the compilations that have finished."""
        process = self._live_or_raise()
        self._flush(process)
        process = self._live_or_raise()  # the flush finds an exit first
        while True:
            reply = self._decoder.decode(self._recv(process))
            for gid, error in reply[-1]:
                grammar = self._by_gid.pop(gid)
                grammar.ready = error is None
                grammar.error = None if error is None else f"structured outputs: {error}"
            if reply[0] == worker.FILLED:
                self._filled.update(self._fills.pop(0))
            if reply[0] == kind:
                return reply

    def _recv(self, process: _Process) -> bytes:
        # A grammar process that exits closes its end of the pipe (this one's copy of it was
        # closed at the start), which ends the wait and the read.
        try:
            process.reply_wait.wait()
            return process.conn.recv_bytes()
        except (EOFError, OSError):
            self._break(self._exit_reason(process))
            raise GrammarWorkerDied(self._broken) from None

    @staticmethod
    def _exit_reason(process: _Process) -> str:
        process.proc.join(1)
        return f"structured outputs: the grammar process exited (code {process.proc.exitcode})"
