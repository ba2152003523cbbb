"""The engine core in a process of its own, fed over ZeroMQ, and the asyncio client that front
ends (the HTTP server) use to reach it.

The core process owns the EngineCore and runs a busy loop: it takes new requests and aborts from
its input socket, steps while it holds work (when idle it spins on the socket for a while, then
blocks on it), and sends one message per step, msgpack-encoded EngineCoreOutputs, to each front
end that has requests in that step. Several front ends may share one core: each has a
`client_index`, its own output socket, and gets only the outputs of the requests it sent.

    front end --PUSH--> [input: PULL]  core  [output i: PUSH] --PULL--> front end i

The core admits requests for the whole server: each batch a front end sends (the choices of
one HTTP request) is admitted or refused at once, and answered, so that however many front ends
feed it, it holds at most a full batch plus `max_waiting_requests`. It also writes the server's
stats line.

At start the core reports on a handshake socket: its EngineCoreInfo once the model is loaded,
or the error that stopped it. Front ends watch the process: if it dies, every request in flight
fails with an error instead of waiting forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from liteinfer.config import EngineConfig
from liteinfer.engine.core import EngineCore
from liteinfer.engine.messages import (
    MAX_STORED_RESPONSES,
    Admission,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    StoredResponse,
)
from liteinfer.logger import configure_logging

logger = logging.getLogger(__name__)
# Input frames: [ADD, list[EngineCoreRequest]] | [ABORT, list[str]] | [SHUTDOWN] |
# [ABORT_CLIENT, client index as text] (a front-end process that died: its requests end).
ADD, ABORT, SHUTDOWN, ABORT_CLIENT = b"add", b"abort", b"shutdown", b"abort-client"
STORE, LOOKUP = b"store", b"lookup"
READY, FAILED = b"ready", b"failed"
# Once idle, the core spins on its input this long before it blocks: waking a process that
# sleeps costs from tens of microseconds to milliseconds (more on virtual machines), and all of
# it would land on the next request's first token.
IDLE_SPIN_S = 0.5
# While blocked the core wakes this often to see whether the process that started it still lives.
IDLE_POLL_MS = 1000
LIVENESS_POLL_S = 0.2
STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class CoreAddresses:
    """Where the core listens for input, where front end i reads its outputs, and where the
    core reports that it is ready."""

    input: str
    outputs: tuple[str, ...]
    handshake: str

    @classmethod
    def in_new_dir(cls, num_clients: int) -> CoreAddresses:
        base = Path(tempfile.mkdtemp(prefix="liteinfer-core-"))
        return cls(f"ipc://{base}/input", tuple(f"ipc://{base}/output-{i}"
                                                for i in range(num_clients)),
                   f"ipc://{base}/handshake")


class LoggingStatLogger:
    """The server's stats line, every STATS_INTERVAL_S while tokens flow: prompt tokens admitted
    and tokens generated per second, and the scheduler's running, waiting, KV-cache use and
    prefix-cache hit rate (and, with speculative decoding, the drafts' acceptance since the
    start)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.prompt_tokens = self.generation_tokens = 0
        self.last = (0, 0, time.monotonic())
        self.next_log = self.last[2] + STATS_INTERVAL_S

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now < self.next_log:
            return
        self.next_log = now + STATS_INTERVAL_S
        counts = (self.prompt_tokens, self.generation_tokens)
        if counts == self.last[:2]:
            self.last = (*counts, now)  # the next line's rates leave the idle time out
            return
        s, dt = self.core.scheduler.stats(), now - self.last[2]
        hits = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
        spec = ""
        if s.spec_decoding is not None:
            spec = (f", draft acceptance rate {100 * s.spec_decoding.acceptance_rate:.1f}%, "
                    f"mean acceptance length {s.spec_decoding.mean_acceptance_length:.2f}")
        logger.info("prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
                    "KV cache %.1f%%, prefix cache hit rate %.1f%%%s",
                    (counts[0] - self.last[0]) / dt, (counts[1] - self.last[1]) / dt,
                    s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * hits, spec)
        self.last = (*counts, now)


class EngineCoreProc:
    """The core process's loop around an EngineCore (`run_engine_core` starts it).
    max_requests: requests the core may hold (running or waiting); None, no limit."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, addresses: CoreAddresses,
                 max_requests: int | None = None):
        self.core = core
        self.max_requests = max_requests
        self.stats = LoggingStatLogger(core)
        self.input = ctx.socket(zmq.PULL)
        self.input.bind(addresses.input)
        self.outputs = []
        for address in addresses.outputs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # a front end reads every step; never drop one
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self.outputs.append(sock)
        self.owner: dict[str, int] = {}  # request id -> client index
        self.encoder = msgspec.msgpack.Encoder()
        self.requests_decoder = msgspec.msgpack.Decoder(list[EngineCoreRequest])
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.stored_decoder = msgspec.msgpack.Decoder(StoredResponse)
        self.stored: OrderedDict[str, bytes] = OrderedDict()
        self.parent = os.getppid()

    def run(self) -> None:
        busy = False
        while True:
            if not self.core.has_unfinished_requests():
                if busy:  # what the last requests leave behind: stats with the pool freed
                    self._publish(self.core.step(), broadcast=True)
                    busy = False
                if not self._wait_for_input():
                    return  # the front end is gone without a word
            if not self._take_inputs():
                return
            if self.core.has_unfinished_requests():
                busy = True
                self._step()
                self.stats.maybe_log()

    def _wait_for_input(self) -> bool:
        """Spins, then blocks, until input arrives; False if the parent process is gone."""
        deadline = time.monotonic() + IDLE_SPIN_S
        while time.monotonic() < deadline:
            if self.input.poll(0):
                return True
        while not self.input.poll(IDLE_POLL_MS):
            if os.getppid() != self.parent:
                return False
            self.stats.maybe_log()  # the interval that the last requests ended in
        return True

    def _take_inputs(self) -> bool:
        """Handles every message waiting on the input socket, then answers each front end's
        batches of requests; False on SHUTDOWN."""
        admissions: dict[int, list[Admission]] = {}
        lookups: dict[int, list[StoredResponse]] = {}
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            kind = frames[0].bytes
            if kind == SHUTDOWN:
                return False
            if kind == ADD:
                batch = self.requests_decoder.decode(frames[1].buffer)
                admission = self._admit(batch)
                admissions.setdefault(batch[0].client_index, []).append(admission)
            elif kind == ABORT:
                self._abort(self.ids_decoder.decode(frames[1].buffer))
            elif kind == ABORT_CLIENT:
                client = int(frames[1].bytes)
                self._abort([rid for rid, c in self.owner.items() if c == client])
            elif kind == STORE:
                self._store(self.stored_decoder.decode(frames[1].buffer))
            elif kind == LOOKUP:
                client, response_id = self.ids_decoder.decode(frames[1].buffer)
                lookups.setdefault(int(client), []).append(
                    StoredResponse(response_id, self.stored.get(response_id)))
        for client in admissions.keys() | lookups.keys():
            self._send(client, EngineCoreOutputs(admissions=admissions.get(client, []),
                                                 stored=lookups.get(client, [])))
        return True

    def _store(self, response: StoredResponse) -> None:
        self.stored[response.response_id] = response.payload or b""
        self.stored.move_to_end(response.response_id)
        while len(self.stored) > MAX_STORED_RESPONSES:
            self.stored.popitem(last=False)

    def _admit(self, batch: list[EngineCoreRequest]) -> Admission:
        """Adds the batch's requests, or none of them if the core would then hold more than
        max_requests."""
        held = len(self.owner)
        if self.max_requests is not None and held + len(batch) > self.max_requests:
            return Admission(batch[0].request_id, f"the server is at capacity ({held} requests "
                             f"running or waiting, at most {self.max_requests}); retry later")
        for request in batch:
            self._add(request)
        return Admission(batch[0].request_id)

    def _abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            self.owner.pop(rid, None)

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:  # the front end validates first; this is the last line
            failed = EngineCoreOutput(request.request_id, [], finish_reason="error", error=str(e))
            self._send(request.client_index, EngineCoreOutputs([failed],
                                                               timestamp=time.perf_counter()))
            return
        self.owner[request.request_id] = request.client_index
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:  # fail what is in flight, keep serving
            traceback.print_exc()
            ids = list(self.owner)
            with contextlib.suppress(Exception):
                self.core.abort_requests(ids)
            self._fail(ids, f"engine step failed: {e}")
            return
        self._publish(outputs)
        if self.owner and not self.core.has_unfinished_requests():
            # Requests the core no longer holds would keep their streams waiting: they fail.
            logger.error("the engine core lost requests %s", list(self.owner))
            self._fail(list(self.owner), "the engine core lost this request")

    def _fail(self, request_ids: list[str], error: str) -> None:
        """Ends each request, which the core no longer runs, with `error` to its front end."""
        self._publish(EngineCoreOutputs(
            [EngineCoreOutput(rid, [], finish_reason="error", error=error) for rid in request_ids],
            timestamp=time.perf_counter()))

    def _publish(self, outputs: EngineCoreOutputs, broadcast: bool = False) -> None:
        """One message per front end that has outputs in this step (every one if broadcast)."""
        per_client: dict[int, list[EngineCoreOutput]] = {}
        if broadcast:
            per_client = {i: [] for i in range(len(self.outputs))}
        for out in outputs.outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue
            self.stats.generation_tokens += len(out.new_token_ids)
            if out.finished:
                del self.owner[out.request_id]
            per_client.setdefault(client, []).append(out)
        for client, outs in per_client.items():
            self._send(client, EngineCoreOutputs(outs, outputs.scheduler_stats,
                                                 outputs.timestamp))

    def _send(self, client: int, outputs: EngineCoreOutputs) -> None:
        # A PUSH without a peer would block: a front end not connected (yet) has no requests.
        with contextlib.suppress(zmq.Again):
            self.outputs[client].send(self.encoder.encode(outputs), zmq.NOBLOCK, copy=False)


def run_engine_core(model: str, config: EngineConfig, load_format: str,
                    addresses: CoreAddresses, max_waiting_requests: int | None) -> None:
    """The core process's entry point: load, report READY (or FAILED and why), then loop."""
    configure_logging()
    # Ctrl-C in a terminal reaches the whole process group: the front end decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(addresses.handshake)
    try:
        core = EngineCore(model, config, load_format)
        proc = EngineCoreProc(core, ctx, addresses, None if max_waiting_requests is None
                              else core.config.max_num_seqs + max_waiting_requests)
    except Exception as e:  # reported to the front end, which exits with it
        handshake.send_multipart([FAILED, f"{type(e).__name__}: {e}".encode()])
        handshake.close()
        ctx.term()
        return
    handshake.send_multipart([READY, msgspec.msgpack.encode(core.info)])
    handshake.close()
    try:
        proc.run()
    finally:
        core.shutdown()
        ctx.destroy(linger=0)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class CoreHandle:
    """What a front end needs to reach a running core (picklable, for front-end processes)."""

    addresses: CoreAddresses
    pid: int
    info: EngineCoreInfo


class CoreProcess:
    """A started engine-core process, ready: its pid, addresses and EngineCoreInfo.
    max_waiting_requests: requests it may hold beyond a full batch; more are refused."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto",
                 num_clients: int = 1, max_waiting_requests: int | None = None):
        self.addresses = CoreAddresses.in_new_dir(num_clients)
        ctx = zmq.Context.instance()
        handshake = ctx.socket(zmq.PULL)
        handshake.bind(self.addresses.handshake)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(model, config, load_format, self.addresses, max_waiting_requests),
            name="liteinfer-engine-core")
        self.proc.start()
        try:
            while not handshake.poll(int(LIVENESS_POLL_S * 1000)):
                if not self.proc.is_alive():
                    raise RuntimeError(f"the engine core exited with code {self.proc.exitcode} "
                                       "while starting")
            kind, payload = handshake.recv_multipart()
        finally:
            handshake.close(linger=0)
        if kind == FAILED:
            self.proc.join()
            raise ValueError(payload.decode())
        assert self.proc.pid is not None
        self.handle = CoreHandle(self.addresses, self.proc.pid,
                                 msgspec.msgpack.decode(payload, type=EngineCoreInfo))

    def abort_client(self, client_index: int) -> None:
        """Ends the requests of a front end that died (their clients are gone)."""
        self._send([ABORT_CLIENT, str(client_index).encode()])

    def _send(self, frames: list[bytes]) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.addresses.input)
        sock.send_multipart(frames)
        sock.close()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Asks the core to stop, then makes sure it has."""
        if self.proc.is_alive():
            self._send([SHUTDOWN])
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        directory = Path(self.addresses.input.removeprefix("ipc://")).parent
        for path in directory.iterdir():
            path.unlink(missing_ok=True)
        directory.rmdir()


class CoreDiedError(RuntimeError):
    pass


class EngineCoreClient:
    """A front end's connection to the core: sends requests and aborts, and runs one task that
    reads each step's message and hands it to `on_outputs` in one call. `on_death` runs once
    if the core process stops while the client is open."""

    def __init__(self, core: CoreHandle, client_index: int,
                 on_outputs: Callable[[list[EngineCoreOutputs]], None],
                 on_death: Callable[[CoreDiedError], None]):
        addresses = core.addresses
        self.client_index = client_index
        self.core_pid = core.pid
        self.ctx = zmq.Context()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(addresses.input)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.connect(addresses.outputs[client_index])
        self.on_outputs, self.on_death = on_outputs, on_death
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.tasks: list[asyncio.Task[None]] = []
        self.dead: CoreDiedError | None = None

    def start(self) -> None:
        """Starts the reader and the watcher on the running event loop."""
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.output.getsockopt(zmq.FD), self._read_outputs)
        self.tasks = [asyncio.create_task(self._watch())]
        self._read_outputs()  # messages that came before the reader was added signal nothing

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(ADD, self.encoder.encode(requests))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self._send(ABORT, self.encoder.encode(ids))

    def store_response(self, response: StoredResponse) -> None:
        self._send(STORE, self.encoder.encode(response))

    def lookup_response(self, response_id: str) -> None:
        """Asks for a stored response: the answer comes in an output's `stored`."""
        self._send(LOOKUP, self.encoder.encode([str(self.client_index), response_id]))

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        # SNDHWM 0: a PUSH to a connected peer never blocks, so this needs no await. Two
        # sends, not send_multipart: half its cost in Python for a two-frame message.
        self.input.send(kind, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
        self.input.send(payload, zmq.NOBLOCK, copy=False)

    def _read_outputs(self) -> None:
        """Runs when the output socket's descriptor is readable (a plain socket read on the
        event loop: pyzmq's asyncio futures cost more a message, journal item 67). Each call
        takes every step message already waiting, so a front end that fell behind catches up
        in one pass instead of one pass per step. The descriptor is edge-triggered: read until
        the socket has nothing left."""
        batch = []
        while self.output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            batch.append(self.decoder.decode(self.output.recv(zmq.NOBLOCK, copy=False)))
        if batch:
            self.on_outputs(batch)

    async def _watch(self) -> None:
        while process_alive(self.core_pid):
            await asyncio.sleep(LIVENESS_POLL_S)
        # Outputs it sent before dying are still worth delivering.
        await asyncio.sleep(LIVENESS_POLL_S)
        self.dead = CoreDiedError("the engine core process died")
        self.on_death(self.dead)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.output.getsockopt(zmq.FD))
        self.input.close()
        self.output.close()
        self.ctx.term()
