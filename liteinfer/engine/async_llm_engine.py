"""The engine loop on a thread of its own, for servers: coroutines add requests and read their
outputs while the loop keeps stepping every running request.

Only the loop's thread touches the LLMEngine. Coroutines hand it commands through a queue (add a
group of requests, abort one) and receive outputs through their event loop, so a slow client
never holds up a step and a step never waits for an event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence

from liteinfer.config import EngineConfig
from liteinfer.engine.llm_engine import LLMEngine
from liteinfer.outputs import RequestOutput
from liteinfer.sampling_params import SamplingParams

Prompt = str | list[int]


class RequestStream:
    """Outputs of a group of requests (e.g. the n choices of one HTTP request) in the order the
    engine produced them; ends when all have finished. abort() ends those still running."""

    def __init__(self, engine: AsyncLLMEngine, request_ids: Sequence[str]):
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        for request_id in self.unfinished:
            self._engine.abort(request_id)
        self.unfinished.clear()


class AsyncLLMEngine:
    """An LLMEngine driven by a background thread (`liteinfer.entrypoints.openai` serves it)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._thread = threading.Thread(target=self._run, name="liteinfer-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str, load_format: str = "auto", **engine_args) -> AsyncLLMEngine:
        return cls(LLMEngine(model, EngineConfig(**engine_args), load_format))

    async def add_requests(self, requests: Sequence[tuple[str, Prompt, SamplingParams]]
                           ) -> RequestStream:
        """Queues every request or none: a ValueError (bad prompt or parameters) leaves the
        engine as it was. Returns the stream of their outputs."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, [rid for rid, _, _ in requests])
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def add() -> None:
            added: list[str] = []
            try:
                for rid, prompt, params in requests:
                    self.engine.add_request(rid, prompt, params)
                    added.append(rid)
                    self._streams[rid] = (loop, stream)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                for rid in added:
                    self.engine.abort(rid)
                    del self._streams[rid]
                done.set_exception(e)
            else:
                done.set_result(None)

        self._commands.put(add)
        await asyncio.wrap_future(done)
        return stream

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams
                       ) -> RequestStream:
        return await self.add_requests([(request_id, prompt, params)])

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)

        self._commands.put(abort)

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join()
        self.engine.shutdown()

    # ---- the loop's thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # Idle: sleep until a command arrives. Busy: take what has arrived, then step.
            block = not self.engine.has_unfinished_requests()
            while True:
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                if command is None:
                    return
                command()
                block = False
            if self.engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine's requests fail, the loop goes on
            for rid, (loop, stream) in list(self._streams.items()):
                with contextlib.suppress(Exception):  # the loop must outlive a broken step
                    self.engine.abort(rid)
                self._deliver(rid, loop, stream, e)
            self._streams.clear()
            return
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, stream = entry
            # The engine keeps appending to a running request's logprobs list: hand over a copy.
            completion = out.outputs[0]
            if completion.logprobs is not None:
                completion = dataclasses.replace(completion, logprobs=list(completion.logprobs))
                out = dataclasses.replace(out, outputs=[completion])
            self._deliver(out.request_id, loop, stream, out)

    def _deliver(self, request_id: str, loop: asyncio.AbstractEventLoop, stream: RequestStream,
                 item: RequestOutput | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # its event loop has closed: nobody will read this request
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)
