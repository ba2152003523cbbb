"""The server's engine client: validation and tokenization in a thread pool, the engine core in a
process of its own (engine/core_process.py), detokenization and stop strings on the way back.

The event loop never tokenizes and never runs the model: it sends validated requests to the
core, and once per step message (or once per batch of them, when it fell behind) turns every
request's new tokens into text and hands them to that HTTP request's collector. A collector
merges what its client has not read yet, so a slow client gets all its pending tokens in one
event rather than one queued event per token.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.core_process import CoreDiedError, CoreHandle, CoreProcess, EngineCoreClient
from liteinfer.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    StoredResponse,
)
from liteinfer.engine.output_processor import OutputProcessor
from liteinfer.engine.processor import InputProcessor
from liteinfer.loader import load_model_source
from liteinfer.outputs import RequestOutput
from liteinfer.sampling_params import SamplingParams

Prompt = str | list[int]
T = TypeVar("T")
# Tokenizing and templating run here, off the event loop; tokenizers release the GIL.
TOKENIZER_THREADS = 4
# Token-id prompts up to this many tokens in all are validated on the event loop: a hop to the
# pool and back costs more (a few hundred microseconds of the first token's latency).
INLINE_PROMPT_TOKENS = 4096


class EngineError(RuntimeError):
    """A request failed in the engine (its step failed, or the core died)."""


class ServerBusyError(RuntimeError):
    """The core holds as many requests as it may: the request is refused (HTTP 503)."""


class RequestStream:
    """Outputs of a group of requests (e.g. the n choices of one HTTP request); ends when all
    have finished. Outputs a consumer has not taken yet merge, one per request."""

    def __init__(self, client: AsyncLLM, request_ids: Sequence[str]):
        self._client = client
        self.unfinished = set(request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        # Set once the core admits the requests; ServerBusyError if it refuses them.
        self.admission = asyncio.get_running_loop().create_future()

    def put(self, out: RequestOutput) -> None:
        before = self._pending.get(out.request_id)
        if before is not None:  # the snapshot's cumulative fields are newer; deltas add up
            out = dataclasses.replace(out, new_token_ids=before.new_token_ids + out.new_token_ids,
                                      new_text=before.new_text + out.new_text)
        self._pending[out.request_id] = out
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` once the outputs already received are taken."""
        self._error = error
        self._ready.set()
        if not self.admission.done():
            self.admission.set_exception(error)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._pending:
                rid = next(iter(self._pending))
                out = self._pending.pop(rid)
                if out.finished:
                    self.unfinished.discard(rid)
                return out
            if not self.unfinished:
                raise StopAsyncIteration
            if self._error is not None:
                self.unfinished.clear()
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def abort(self) -> None:
        """Ends the requests still running (a no-op once all have finished)."""
        if self.unfinished:
            self._client.abort(list(self.unfinished))
            self.unfinished.clear()


class AsyncLLM:
    """Front end of an engine core process. `start()` binds it to the running event loop (the
    server's lifespan does); `shutdown()` stops the core if this front end started it."""

    def __init__(self, model: str, config: EngineConfig, core: CoreHandle,
                 load_format: str = "auto", client_index: int = 0,
                 owned_core: CoreProcess | None = None):
        source = load_model_source(model, load_format)
        self.model_config = ModelConfig.from_hf(source.hf_config)
        self.tokenizer = source.tokenizer
        self.generation_config = source.generation_config
        self.core_handle = core
        self.info = core.info
        self.max_model_len = core.info.max_model_len
        self.processor = InputProcessor(self.model_config, self.tokenizer, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client_index = client_index
        self._owned_core = owned_core
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS,
                                                           thread_name_prefix="liteinfer-tok")
        self._client: EngineCoreClient | None = None
        self._streams: dict[str, RequestStream] = {}
        self._lookups: dict[str, list[asyncio.Future[bytes | None]]] = {}  # by response id
        self.scheduler_stats = SchedulerStats()
        self.dead: EngineError | None = None
        self.on_death: list[Callable[[], None]] = []

    @classmethod
    def from_args(cls, model: str, load_format: str = "auto",
                  max_waiting_requests: int | None = None, num_clients: int = 1,
                  **engine_args: Any) -> AsyncLLM:
        """Starts an engine core process for the model (holding at most a full batch and
        `max_waiting_requests` more) and becomes its front end 0."""
        config = EngineConfig(**engine_args)
        core = CoreProcess(model, config, load_format, num_clients, max_waiting_requests)
        try:
            return cls(model, config, core.handle, load_format, owned_core=core)
        except BaseException:
            core.shutdown()
            raise

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._client = EngineCoreClient(self.core_handle, self.client_index, self._on_outputs,
                                        self._on_core_death)
        self._client.start()

    async def stop(self) -> None:
        """Fails what is still running and disconnects from the core."""
        self.fail_all(EngineError("the server is shutting down"))
        if self._client is not None:
            self._client.close()
            self._client = None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owned_core is not None:
            self._owned_core.shutdown()

    @property
    def num_requests(self) -> int:
        """Engine requests of this front end still running."""
        return len(self._streams)

    # ---- requests -------------------------------------------------------------------------
    async def run_in_pool(self, fn: Callable[[], T]) -> T:
        """Runs tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def add_requests(self, requests: Sequence[tuple[str, Prompt, SamplingParams]],
                           max_prompt_tokens: int | None = None) -> RequestStream:
        """Validates and tokenizes every request (in the pool), then sends them all to the
        core, or none: a ValueError (bad prompt or parameters) leaves the engine as it was.
        Returns once the core has admitted them: ServerBusyError when it holds as many requests
        as it may (every front end's), EngineError when the core is gone."""
        if not requests:  # the core answers each batch by its first request
            raise ValueError("no requests given")
        self._check_alive()
        arrival = time.perf_counter()

        def process() -> list[EngineCoreRequest]:
            processed = self.processor.process(requests, arrival)
            total = sum(len(r.prompt_token_ids) for r in processed)
            if max_prompt_tokens is not None and total > max_prompt_tokens:
                raise ValueError(f"the request's prompts hold {total} tokens, more than the "
                                 f"server's limit of {max_prompt_tokens}")
            return processed

        if all(isinstance(p, list) for _, p, _ in requests) and sum(
                len(p) for _, p, _ in requests) <= INLINE_PROMPT_TOKENS:
            processed = process()
        else:
            processed = await self.run_in_pool(process)
            self._check_alive()
        assert self._client is not None, "AsyncLLM.start() was not called"
        for request in processed:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            request.client_index = self.client_index
        # Sent first, so that the core starts on them while this front end sets up their
        # state: their outputs are read on this thread, after this call returns.
        self._client.add_requests(processed)
        ids = [r.request_id for r in processed]
        stream = RequestStream(self, ids)
        for request, (_, prompt, _) in zip(processed, requests):
            self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
            self._streams[request.request_id] = stream
        try:
            await stream.admission
        except ServerBusyError:
            self._forget(ids)  # the core never took them
            raise
        except BaseException:  # the core died, or the caller was cancelled
            stream.abort()
            raise
        return stream

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def abort(self, request_ids: list[str]) -> None:
        ids = self._forget(request_ids)
        if ids and self._client is not None and self.dead is None:
            self._client.abort_requests(ids)

    # ---- the Responses API's stored responses, kept by the core for every front end -------
    def store_response(self, response_id: str, payload: bytes) -> None:
        self._live_client().store_response(StoredResponse(response_id, payload))

    async def stored_response(self, response_id: str) -> bytes | None:
        """A stored response's payload; None if the core does not keep it."""
        future = asyncio.get_running_loop().create_future()
        self._lookups.setdefault(response_id, []).append(future)
        self._live_client().lookup_response(response_id)
        return await future

    def _live_client(self) -> EngineCoreClient:
        if self.dead is not None:
            raise self.dead
        if self._client is None:
            raise EngineError("the engine client is not started")
        return self._client

    def _forget(self, request_ids: list[str]) -> list[str]:
        """Drops this front end's state of the requests; returns those it held."""
        ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if ids:
            self.output_processor.abort_requests(ids)
        return ids

    def fail_all(self, error: BaseException) -> None:
        """Ends every request in flight with `error` (shutdown, a dead core)."""
        streams = {id(s): s for s in self._streams.values()}
        self.abort(list(self._streams))
        for stream in streams.values():
            stream.fail(error)
        lookups, self._lookups = self._lookups, {}
        for future in (f for fs in lookups.values() for f in fs if not f.done()):
            future.set_exception(error)

    # ---- outputs (the client's reader task) -----------------------------------------------
    def _on_outputs(self, steps: list[EngineCoreOutputs]) -> None:
        for step in steps:
            if step.scheduler_stats is not None:
                self.scheduler_stats = step.scheduler_stats
            for admission in step.admissions:
                stream = self._streams.get(admission.request_id)
                if stream is None or stream.admission.done():
                    continue
                if admission.refusal is None:
                    stream.admission.set_result(None)
                else:
                    stream.admission.set_exception(ServerBusyError(admission.refusal))
            for stored in step.stored:
                for future in self._lookups.pop(stored.response_id, []):
                    if not future.done():
                        future.set_result(stored.payload)
        outputs = merge_steps(steps)
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed:
            outputs = [o for o in outputs if o.finish_reason != "error"]
            for out in failed:
                stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    self.output_processor.abort_requests([out.request_id])
                    stream.fail(EngineError(out.error or "the request failed in the engine"))
        # The core's stamp, as the offline driver takes it: a request's times are when the core
        # had its tokens, whichever front end reads them (merged steps: the newest's).
        stamp = steps[-1].timestamp if steps else 0.0
        processed = self.output_processor.process_outputs(outputs, stamp or None)
        if processed.requests_to_abort and self._client is not None:
            self._client.abort_requests(processed.requests_to_abort)
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _on_core_death(self, error: CoreDiedError) -> None:
        self.dead = EngineError(str(error))
        self.fail_all(self.dead)
        for callback in self.on_death:
            callback()


def merge_steps(steps: list[EngineCoreOutputs]) -> list[EngineCoreOutput]:
    """Several steps' outputs as one per request, in order (a front end that fell behind)."""
    if len(steps) == 1:
        return steps[0].outputs
    merged: dict[str, EngineCoreOutput] = {}
    for step in steps:
        for out in step.outputs:
            before = merged.get(out.request_id)
            if before is None:
                merged[out.request_id] = out
                continue
            logprobs = before.new_logprobs
            if out.new_logprobs is not None:
                logprobs = (logprobs or []) + out.new_logprobs
            merged[out.request_id] = EngineCoreOutput(
                out.request_id, before.new_token_ids + out.new_token_ids, logprobs,
                before.prompt_logprobs or out.prompt_logprobs, out.finish_reason,
                out.stop_reason, out.num_cached_tokens, out.error)
    return list(merged.values())
