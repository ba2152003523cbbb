"""The engine core in a process of its own, fed over ZeroMQ, and the asyncio client that front
ends (the HTTP server) use to reach it.

The core process owns the EngineCore and runs a busy loop: it takes new requests and aborts from
its input socket, steps while it holds work (when idle it spins on the socket for a while, then
blocks on it), and sends one message per step, msgpack-encoded EngineCoreOutputs, to each front
end that has requests in that step. Several front ends may share one core: each has a
`client_index`, its own output socket, and gets only the outputs of the requests it sent.

    front end --PUSH--> [input: PULL]  core  [output i: PUSH] --PULL--> front end i

At start the core reports on a handshake socket: its EngineCoreInfo once the model is loaded,
or the error that stopped it. Front ends watch the process: if it dies, every request in flight
fails with an error instead of waiting forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from liteinfer.config import EngineConfig
from liteinfer.engine.core import EngineCore
from liteinfer.engine.messages import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)

# Input frames: [ADD, list[EngineCoreRequest]] | [ABORT, list[str]] | [SHUTDOWN].
ADD, ABORT, SHUTDOWN = b"add", b"abort", b"shutdown"
READY, FAILED = b"ready", b"failed"
# Once idle, the core spins on its input this long before it blocks: waking a process that
# sleeps costs from tens of microseconds to milliseconds (more on virtual machines), and all of
# it would land on the next request's first token.
IDLE_SPIN_S = 0.5
# While blocked the core wakes this often to see whether the process that started it still lives.
IDLE_POLL_MS = 1000
LIVENESS_POLL_S = 0.2


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


class EngineCoreProc:
    """The core process's loop around an EngineCore (`run_engine_core` starts it)."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, addresses: CoreAddresses):
        self.core = core
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

    def _wait_for_input(self) -> bool:
        """Spins, then blocks, until input arrives; False if the parent process is gone."""
        deadline = time.monotonic() + IDLE_SPIN_S
        while time.monotonic() < deadline:
            if self.input.poll(0):
                return True
        while not self.input.poll(IDLE_POLL_MS):
            if os.getppid() != self.parent:
                return False
        return True

    def _take_inputs(self) -> bool:
        """Handles every message waiting on the input socket; False on SHUTDOWN."""
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            kind = frames[0].bytes
            if kind == SHUTDOWN:
                return False
            if kind == ADD:
                for request in self.requests_decoder.decode(frames[1].buffer):
                    self._add(request)
            elif kind == ABORT:
                ids = self.ids_decoder.decode(frames[1].buffer)
                self.core.abort_requests(ids)
                for rid in ids:
                    self.owner.pop(rid, None)

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:  # the front end validates first; this is the last line
            failed = EngineCoreOutput(request.request_id, [], finish_reason="error", error=str(e))
            self._send(request.client_index, EngineCoreOutputs([failed],
                                                               timestamp=time.monotonic()))
            return
        self.owner[request.request_id] = request.client_index

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:  # fail what is in flight, keep serving
            traceback.print_exc()
            ids = list(self.owner)
            with contextlib.suppress(Exception):
                self.core.abort_requests(ids)
            outputs = EngineCoreOutputs(
                [EngineCoreOutput(rid, [], finish_reason="error", error=f"engine step failed: {e}")
                 for rid in ids], timestamp=time.monotonic())
        self._publish(outputs)

    def _publish(self, outputs: EngineCoreOutputs, broadcast: bool = False) -> None:
        """One message per front end that has outputs in this step (every one if broadcast)."""
        per_client: dict[int, list[EngineCoreOutput]] = {}
        if broadcast:
            per_client = {i: [] for i in range(len(self.outputs))}
        for out in outputs.outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue
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
                    addresses: CoreAddresses) -> None:
    """The core process's entry point: load, report READY (or FAILED and why), then loop."""
    # Ctrl-C in a terminal reaches the whole process group: the front end decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(addresses.handshake)
    try:
        core = EngineCore(model, config, load_format)
        proc = EngineCoreProc(core, ctx, addresses)
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
    """A started engine-core process, ready: its pid, addresses and EngineCoreInfo."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto",
                 num_clients: int = 1):
        self.addresses = CoreAddresses.in_new_dir(num_clients)
        ctx = zmq.Context.instance()
        handshake = ctx.socket(zmq.PULL)
        handshake.bind(self.addresses.handshake)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(model, config, load_format, self.addresses),
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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Asks the core to stop, then makes sure it has."""
        if self.proc.is_alive():
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self.addresses.input)
            sock.send_multipart([SHUTDOWN])
            sock.close()
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

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        # SNDHWM 0: a PUSH to a connected peer never blocks, so this needs no await. Two
        # sends, not send_multipart: half its cost in Python for a two-frame message.
        self.input.send(kind, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
        self.input.send(payload, zmq.NOBLOCK, copy=False)

    def _read_outputs(self) -> None:
        """Runs when the output socket's descriptor is readable (a plain socket read on the
        event loop: pyzmq's asyncio futures add ~0.1 ms a message). Each call takes every step
        message already waiting, so a front end that fell behind catches up in one pass
        instead of one pass per step. The descriptor is edge-triggered: read until the socket
        has nothing left."""
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
