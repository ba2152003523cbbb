"""An OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (streamed as
server-sent events or whole), /v1/models and /v1/models/{id}, /health (readiness), /livez
(liveness), /metrics (Prometheus), and vLLM's /version, /tokenize and /detokenize, over an
AsyncLLM (whose engine core runs in a process of its own). OpenAI's Responses API
(responses.py) and Anthropic's Messages API (entrypoints/anthropic/) run on the chat path and
are routed here.

Every HTTP request becomes one engine request per prompt and choice, all admitted together or
not at all. Bad input of any kind (a body too large, malformed JSON, a field out of range, text
the tokenizer rejects) is answered with an OpenAI-style 4xx before anything reaches the engine,
so it never disturbs the requests already running; so is every other error the framework raises
(404, 405). A client that disconnects has its requests aborted and their KV blocks returned.

    liteinfer serve --model DIR_OR_NAME [--port 8000] [--api-key KEY]

With an API key, every route but /health and /livez (and /metrics, unless --metrics-need-key)
needs `Authorization: Bearer KEY`. On SIGTERM the server refuses new requests with a 503, lets
the streams in flight finish for a grace period, ends the rest with an error, and exits. /health
answers 200 only while requests are admitted: a 503 while shutting down, once the engine core
died, and while any API-server process is down; /livez answers 200 while the process does.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import secrets
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from liteinfer import __version__
from liteinfer.config import EngineConfig
from liteinfer.engine.async_llm import AsyncLLM, EngineError, Prompt, RequestStream, ServerBusyError
from liteinfer.engine.core_process import CoreHandle, CoreProcess
from liteinfer.engine.processor import generation_defaults
from liteinfer.entrypoints.anthropic.protocol import ANTHROPIC_PATH, anthropic_error_body
from liteinfer.entrypoints.openai.chat_output import ChatOutput
from liteinfer.entrypoints.openai.cli_args import ServerArgs
from liteinfer.entrypoints.openai.metrics import ServerMetrics
from liteinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    conversation,
)
from liteinfer.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from liteinfer.entrypoints.openai.structured import ToolCalls
from liteinfer.loader.overrides import ModelOverrides
from liteinfer.logger import configure_logging, logging_level
from liteinfer.outputs import Logprob, RequestOutput
from liteinfer.utils import freeze_heap, model_label

Chunk = dict[str, Any]
Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowed", 413: "RequestTooLarge", 499: "ClientClosedRequest",
               500: "InternalServerError", 503: "ServiceUnavailable"}


class ServerShuttingDown(EngineError):
    pass


class Readiness:
    """Whether each API-server process of the server admits requests, in memory that they
    share with the process that supervises them: each marks itself once it serves and unmarks
    itself when it drains; the supervisor unmarks one that died. One process alone holds a
    list of one."""

    def __init__(self, flags: Any = None, index: int = 0):
        self.flags = [False] if flags is None else flags
        self.index = index

    def set(self, ready: bool) -> None:
        self.flags[self.index] = ready

    def all(self) -> bool:
        return all(self.flags)


class RequestError(Exception):
    """Answered with an OpenAI-style error of `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> Chunk:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": None, "code": status}}


def error_response(status: int, message: str, path: str = "") -> Response:
    """An error in the shape of the API `path` belongs to (Anthropic's on its routes)."""
    body = (anthropic_error_body if path.startswith(ANTHROPIC_PATH) else error_body)(status,
                                                                                    message)
    return Response(orjson.dumps(body), status, media_type="application/json")


def json_response(body: Chunk) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, refused (413) as soon as it is known to exceed `limit` bytes:
    from its Content-Length, or while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body exceeds the server's {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body exceeds the server's {limit} bytes")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as e:  # also invalid UTF-8, lone surrogates, deep nesting
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


def parse(model: type[Body], data: Any) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                             for err in e.errors(include_url=False))
        raise RequestError(400, problems or "invalid request body") from None


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLLM, model_name: str, args: ServerArgs,
                 readiness: Readiness | None = None):
        self.engine = engine
        self.model_name = model_name
        self.args = args
        self.readiness = readiness or Readiness()
        self.tokenizer = engine.tokenizer
        self.defaults = generation_defaults(engine.generation_config)
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine, model_name)
        self.draining = False

    def models(self) -> Chunk:
        return {"object": "list", "data": [self.model(self.model_name)]}

    def model(self, model_id: str) -> Chunk:
        """The served model's card (/v1/models/{id}); a 404 for any other id."""
        self._check_model(model_id)
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "liteinfer", "max_model_len": self.engine.max_model_len}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return await self._serve(body, request, "cmpl-", "text_completion", prompts,
                                 len(prompts), body.max_tokens, body.logprobs, None)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(body, request, "chatcmpl-", "chat.completion",
                                 self.chat_prompts(body), 1, body.max_new_tokens,
                                 body.num_logprobs, self.chat_output(body))

    def chat_prompts(self, body: ChatCompletionRequest) -> Callable[[], list[Prompt]]:
        """The request's prompt, rendered by the chat template (in the pool). With a reasoning
        parser, an output constraint holds the answer that follows the reasoning."""
        reasoning = self.args.reasoning_parser

        def prompts() -> list[Prompt]:
            def render(generation_prompt: bool) -> list[int]:
                return self.engine.processor.apply_chat_template(
                    body.conversation(), generation_prompt, tools=body.tool_dicts(),
                    **(body.chat_template_kwargs or {}))

            prompt = render(body.add_generation_prompt)
            if reasoning and body.add_generation_prompt and body.output_constraint():
                body.answer_starts_after(REASONING_PARSERS[reasoning].answer_starts_after(
                    self.tokenizer, prompt, render(False)))
            return [prompt]

        return prompts

    def chat_output(self, body: ChatCompletionRequest) -> ChatOutput:
        """How the request's choices become messages. A tool-call parser whose marker is a
        special token has the request keep special tokens in its text."""
        try:
            tools = ToolCalls(body.tools, body.tool_choice, self.args.tool_call_parser)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if not tools.skip_special_tokens:
            body.skip_special_tokens = False
        reasoning = self.args.reasoning_parser
        return ChatOutput(tools, REASONING_PARSERS[reasoning] if reasoning else None,
                          body.include_reasoning)

    async def tokenize(self, body: TokenizeRequest) -> Chunk:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError(400, "give either prompt or messages")
        processor = self.engine.processor

        def tokenize() -> list[int]:
            if body.prompt is not None:
                return processor.tokenize(body.prompt)
            return processor.apply_chat_template(conversation(body.messages),
                                                 body.add_generation_prompt)

        tokens = await self._in_pool(tokenize)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> Chunk:
        self._check_model(body.model)
        if self.tokenizer is None:
            raise RequestError(400, "this model has no tokenizer")
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise RequestError(400, f"tokens: token ids outside the vocabulary [0, {vocab}): "
                                    f"{bad[:5]}")
        return {"prompt": await self._in_pool(lambda: self.tokenizer.decode(body.tokens))}

    async def _in_pool(self, fn: Callable[[], Any]) -> Any:
        """Tokenizer work off the event loop; text it rejects is the client's error."""
        try:
            return await self.engine.run_in_pool(fn)
        except (ValueError, TypeError, UnicodeError) as e:
            raise RequestError(400, str(e)) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(404, f"The model `{model}` does not exist.")

    def _check_admitting(self) -> None:
        if self.draining:
            raise RequestError(503, "the server is shutting down")

    def unready(self) -> str | None:
        """Why the server would not admit requests now (/health's 503), or None."""
        if self.engine.dead is not None:
            return str(self.engine.dead)
        if self.draining:
            return "the server is shutting down"
        if not self.readiness.all():
            return "an API-server process is down or starting"
        return None

    async def _serve(self, body: SamplingRequest, request: Request, prefix: str, kind: str,
                     prompts: list[Prompt] | Callable[[], list[Prompt]], num_prompts: int,
                     max_tokens: int | None, logprobs: int | None,
                     tools: ChatOutput | None) -> Response:
        response_id, stream = await self.start(body, prefix, prompts, num_prompts, max_tokens,
                                               logprobs)
        meta = {"id": response_id, "created": int(time.time()), "model": self.model_name}
        render = ChoiceRenderer(self.tokenizer, logprobs, echo=getattr(body, "echo", False),
                                tools=tools)
        if body.stream:
            return StreamingResponse(self._events(stream, render, meta, kind, body),
                                     media_type="text/event-stream")
        finals = await self.collect(stream, request)
        outs = sorted(finals.values(), key=choice_index)
        return json_response({**meta, "object": kind,
                              "choices": [render.final(o) for o in outs],
                              "usage": usage(outs, body.n)})

    async def start(self, body: SamplingRequest, prefix: str,
                    prompts: list[Prompt] | Callable[[], list[Prompt]], num_prompts: int,
                    max_tokens: int | None, logprobs: int | None) -> tuple[str, RequestStream]:
        """Admits the request's engine requests, all or none: the response's id (`prefix`
        and 32 hex digits) and their outputs' stream."""
        self._check_model(body.model)
        self._check_admitting()
        try:
            body.check_supported()
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if num_prompts > self.args.max_prompts_per_request:
            raise RequestError(400, f"{num_prompts} prompts exceed the server's limit of "
                                    f"{self.args.max_prompts_per_request} per request")
        # 32 random hex digits like uuid4().hex, without the cost of building a UUID.
        response_id = f"{prefix}{secrets.token_hex(16)}"
        # A chat template renders in the pool; completion prompts are ready.
        rendered = await self._in_pool(prompts) if callable(prompts) else prompts
        try:
            choices = body.sampling_params(self.defaults, max_tokens, logprobs)
            # Choice i of n for prompt p is request p * n + i, and the response's choice index.
            requests = [(f"{response_id}-{p * body.n + i}", prompt, params)
                        for p, prompt in enumerate(rendered) for i, params in enumerate(choices)]
            stream = await self.engine.add_requests(
                requests, self.args.max_prompt_tokens_per_request)
        except (ValueError, TypeError, UnicodeError) as e:
            raise RequestError(400, str(e)) from None
        except ServerBusyError as e:
            raise RequestError(503, str(e)) from None
        except EngineError as e:
            raise RequestError(503, str(e)) from None
        return response_id, stream

    async def collect(self, stream: RequestStream, request: Request
                      ) -> dict[str, RequestOutput]:
        """Each request's last output."""
        finals: dict[str, RequestOutput] = {}

        async def consume() -> None:
            async for out in stream:
                self.metrics.observe(out)
                if out.finished:
                    finals[out.request_id] = out

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise RequestError(499, "client disconnected")
            error = task.exception()
        finally:
            self.finish(stream)
        if isinstance(error, ServerShuttingDown):
            raise RequestError(503, str(error))
        if error is not None:
            raise RequestError(500, f"generation failed: {error}")
        return finals

    async def _events(self, stream: RequestStream, render: ChoiceRenderer, meta: Chunk,
                      kind: str, body: SamplingRequest) -> AsyncIterator[bytes]:
        chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
        outs: dict[str, RequestOutput] = {}
        try:
            if render.chat:  # the role comes first, in a chunk of its own per choice
                for rid in sorted(stream.unfinished, key=choice_index):
                    yield sse({**meta, "object": chunk_kind, "choices": [{
                        "index": choice_index(rid), "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
            async for out in stream:
                outs[out.request_id] = out
                yield sse({**meta, "object": chunk_kind, "choices": [render.delta(out)]})
                # Counted once the event is sent: off each event's latency (journal item 71).
                self.metrics.observe(out)
            if body.include_usage:
                yield sse({**meta, "object": chunk_kind, "choices": [],
                           "usage": usage(sorted(outs.values(), key=choice_index), body.n)})
        except EngineError as e:  # the stream has started: report in-band
            status = 503 if isinstance(e, ServerShuttingDown) else 500
            yield sse(error_body(status, f"generation failed: {e}"))
        finally:
            self.finish(stream)
        yield b"data: [DONE]\n\n"

    async def chat_deltas(self, stream: RequestStream, output: ChatOutput
                          ) -> AsyncIterator[tuple[RequestOutput, Chunk, bool]]:
        """A one-choice chat stream's outputs, each with its delta's fields and whether tool
        calls have been sent, for the APIs that render them as their own events."""
        try:
            async for out in stream:
                delta, calls = output.delta(0, out.new_text, out.outputs[0].text, out.finished)
                yield out, delta, calls
                self.metrics.observe(out)
        finally:
            self.finish(stream)

    def finish(self, stream: RequestStream) -> None:
        """Once a response is over: its requests still running are the client's that left."""
        self.metrics.forget(stream.unfinished)
        stream.abort()  # a no-op once all have finished; else the client left


def sse(chunk: Chunk) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def choice_index(request_id: str | RequestOutput) -> int:
    rid = request_id if isinstance(request_id, str) else request_id.request_id
    return int(rid.rsplit("-", 1)[1])


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return None if reason is None else "length" if reason == "length" else "stop"


def usage(outs: list[RequestOutput], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n choices share it)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


class ChoiceRenderer:
    """A choice of either endpoint, whole or as a streamed delta, with its logprobs. A chat
    choice's text goes through `tools` (None for completions). With echo (completions), the
    prompt and its tokens' logprobs come first (in a stream's first chunk of each choice)."""

    def __init__(self, tokenizer: Any, logprobs: int | None, echo: bool = False,
                 tools: ChatOutput | None = None):
        self.tokenizer, self.logprobs, self.echo, self.tools = tokenizer, logprobs, echo, tools
        self.chat = tools is not None

    def final(self, out: RequestOutput) -> Chunk:
        c = out.outputs[0]
        if self.tools is None:
            return self._completion(out, c.text, c.token_ids, c.logprobs, first=True)
        fields, calls = self.tools.final(c.text)
        return self._chat(self.tools, out, "message", {"role": "assistant", **fields}, calls,
                          c.token_ids, c.logprobs)

    def delta(self, out: RequestOutput) -> Chunk:
        c, n = out.outputs[0], len(out.new_token_ids)
        entries = c.logprobs[len(c.logprobs) - n:] if c.logprobs is not None else None
        if self.tools is None:
            return self._completion(out, out.new_text, out.new_token_ids, entries,
                                    first=len(c.token_ids) == n)
        delta, calls = self.tools.delta(choice_index(out), out.new_text, c.text,
                                       out.finished)
        return self._chat(self.tools, out, "delta", delta, calls, out.new_token_ids, entries)

    def _chat(self, tools: ChatOutput, out: RequestOutput, key: str, body: Chunk, calls: bool,
              token_ids: list[int], entries: list[dict[int, Logprob]] | None) -> Chunk:
        """A chat choice: its `message` (whole) or `delta` (streamed) `body`."""
        reason = finish_reason(out)
        return {"index": choice_index(out), key: body,
                "logprobs": self._logprobs(token_ids, entries),
                "finish_reason": reason and tools.finish_reason(calls, reason)}

    def _completion(self, out: RequestOutput, text: str, token_ids: list[int],
                    entries: list[dict[int, Logprob]] | None, first: bool) -> Chunk:
        if self.echo and first:
            prompt = out.prompt
            if prompt is None:
                prompt = self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""
            text, token_ids = prompt + text, out.prompt_token_ids + token_ids
            if entries is not None:
                entries = (out.prompt_logprobs or []) + entries
        return {"index": choice_index(out), "text": text,
                "logprobs": self._logprobs(token_ids, entries),
                "finish_reason": finish_reason(out)}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None] | None
                  ) -> Chunk | None:
        if self.logprobs is None or entries is None:
            return None

        def text(t: int, e: dict[int, Logprob] | None = None) -> str:
            lp = None if e is None else e.get(t)
            if lp is not None and lp.decoded_token is not None:
                return lp.decoded_token
            return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

        if self.chat:
            def item(t: int, e: dict[int, Logprob]) -> Chunk:
                s = text(t, e)
                return {"token": s, "logprob": e[t].logprob, "bytes": list(s.encode())}

            return {"content": [
                {**item(t, e), "top_logprobs": [
                    item(k, e) for k in sorted(e, key=lambda k: -e[k].logprob)
                ][:self.logprobs]} for t, e in zip(token_ids, entries, strict=True)]}
        tokens = [text(t, e) for t, e in zip(token_ids, entries, strict=True)]
        offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        # A prompt's first token has no logprob (nothing comes before it).
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else e[t].logprob
                                   for t, e in zip(token_ids, entries, strict=True)],
                "top_logprobs": [None if e is None else {text(k, e): v.logprob
                                                         for k, v in e.items()}
                                 for e in entries],
                "text_offset": offsets}


class APIKeyGuard:
    """ASGI middleware: a 401 for any route but the open ones without the key, given as a
    bearer token or (as Anthropic's clients send it) in `x-api-key`."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str]):
        self.app, self.open_paths = app, open_paths
        self.key, self.expected = api_key.encode(), f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            if not (secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                await error_response(401, "invalid or missing API key", scope["path"])(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, model_name: str, args: ServerArgs | None = None,
              readiness: Readiness | None = None) -> Starlette:
    """The ASGI app; its lifespan binds the engine client to the serving event loop. Plain
    Starlette: requests are parsed by the protocol's models, so FastAPI's layers over it
    (dependency solving, its middlewares) would only add to every request's path (journal
    item 67)."""
    # Imported here: they build on this module.
    from liteinfer.entrypoints.anthropic.serving import AnthropicServing
    from liteinfer.entrypoints.openai.responses import OpenAIServingResponses

    args = args or ServerArgs()
    serving = OpenAIServing(engine, model_name, args, readiness)
    responses_api = OpenAIServingResponses(serving)
    anthropic_api = AnthropicServing(serving)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await engine.start()
        freeze_heap()  # the tokenizer and the app, as the engine core freezes its own heap
        serving.readiness.set(True)
        try:
            yield
        finally:
            serving.readiness.set(False)
            await engine.stop()

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return error_response(exc.status, str(exc), request.url.path)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), request.url.path)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error ({type(exc).__name__})", request.url.path)

    async def body_of(request: Request, model: type[Body]) -> Body:
        return parse(model, await read_json(request, args.max_body_bytes))

    async def health(_: Request) -> Response:
        reason = serving.unready()
        if reason is not None:
            return error_response(503, reason)
        return json_response({"status": "ok"})

    async def livez(_: Request) -> Response:
        return json_response({"status": "alive"})

    async def metrics(_: Request) -> Response:
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    async def version(_: Request) -> Response:
        return json_response({"version": __version__})

    async def models(_: Request) -> Response:
        return json_response(serving.models())

    async def model(request: Request) -> Response:
        return json_response(serving.model(request.path_params["model_id"]))

    async def completions(request: Request) -> Response:
        return await serving.completions(await body_of(request, CompletionRequest), request)

    async def chat(request: Request) -> Response:
        return await serving.chat(await body_of(request, ChatCompletionRequest), request)

    async def responses(request: Request) -> Response:
        return await responses_api.create(await read_json(request, args.max_body_bytes),
                                          request)

    async def stored_response(request: Request) -> Response:
        return json_response(await responses_api.retrieve(request.path_params["response_id"]))

    async def messages(request: Request) -> Response:
        return await anthropic_api.messages(await read_json(request, args.max_body_bytes),
                                            request)

    async def count_tokens(request: Request) -> Response:
        return json_response(await anthropic_api.count_tokens(
            await read_json(request, args.max_body_bytes)))

    async def tokenize(request: Request) -> Response:
        return json_response(await serving.tokenize(await body_of(request, TokenizeRequest)))

    async def detokenize(request: Request) -> Response:
        return json_response(await serving.detokenize(await body_of(request, DetokenizeRequest)))

    middleware = []
    if args.api_key:
        open_paths = frozenset({"/health", "/livez"} | (set() if args.metrics_need_key
                                                         else {"/metrics"}))
        middleware.append(Middleware(APIKeyGuard, api_key=args.api_key, open_paths=open_paths))
    app = Starlette(
        # Matched in order: the generation routes, where latency counts, come first.
        routes=[Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", stored_response),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
                Route("/health", health), Route("/livez", livez), Route("/metrics", metrics),
                Route("/version", version), Route("/v1/models", models),
                Route("/v1/models/{model_id:path}", model),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/detokenize", detokenize, methods=["POST"])],
        middleware=middleware,
        exception_handlers={RequestError: request_error, HTTPException: http_error,
                            Exception: internal_error},
        lifespan=lifespan)
    app.state.serving = serving
    return app


async def drain(serving: OpenAIServing, grace_s: float) -> None:
    """Refuses new requests, lets those in flight run for `grace_s`, then ends the rest."""
    serving.draining = True
    serving.readiness.set(False)  # the other API servers' /health answers 503 too
    deadline = time.monotonic() + grace_s
    while serving.engine.num_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    serving.engine.fail_all(ServerShuttingDown("the server is shutting down"))
    await asyncio.sleep(0.1)  # let the error events reach their clients


class Server:
    """uvicorn serving the app, with a shutdown that drains (SIGTERM, SIGINT, or a dead core)
    instead of cutting streams off. `ignored_signals` are left to the process that started
    this one (API-server processes leave Ctrl-C to their parent)."""

    def __init__(self, app: Starlette, config: Any, ignored_signals: frozenset[int] = frozenset()):
        import uvicorn

        outer = self

        class DrainingServer(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if sig in ignored_signals:
                    return
                if outer.draining is not None:  # a second signal: stop now
                    self.force_exit = self.should_exit = True
                    return
                if outer.loop is not None:
                    outer.loop.call_soon_threadsafe(outer.begin_drain)

        self.app = app
        self.serving: OpenAIServing = app.state.serving
        self.uvicorn = DrainingServer(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining: asyncio.Task[None] | None = None
        self.serving.engine.on_death.append(
            lambda: self.loop is not None and self.loop.call_soon_threadsafe(self.begin_drain))

    def begin_drain(self) -> None:
        if self.draining is None:
            grace = self.serving.args.shutdown_grace_s if self.serving.engine.dead is None else 0
            self.draining = asyncio.ensure_future(self._drain(grace))

    async def _drain(self, grace_s: float) -> None:
        await drain(self.serving, grace_s)
        self.uvicorn.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await self.uvicorn.serve(sockets)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves on uvicorn's event loop (uvloop where installed) until shut down."""
        with asyncio.Runner(loop_factory=self.uvicorn.config.get_loop_factory()) as runner:
            runner.run(self.serve(sockets))


def uvicorn_config(app: Starlette, host: str, port: int, log_level: str | None = None) -> Any:
    """uvloop and httptools where installed, else asyncio and h11. uvicorn logs through
    liteinfer's handler (logger.py), at `log_level` or else --log-level."""
    import importlib.util

    import uvicorn

    fast = {"loop": "uvloop"} if importlib.util.find_spec("uvloop") else {}
    if importlib.util.find_spec("httptools"):
        fast["http"] = "httptools"
    return uvicorn.Config(app, host=host, port=port, log_level=log_level or logging_level(),
                          log_config=None, timeout_graceful_shutdown=5, **fast)


def run_server(model: str, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, load_format: str = "auto",
               args: ServerArgs | None = None, overrides: ModelOverrides | None = None,
               **engine_args: Any) -> None:
    """overrides: a chat template and generation config in place of the model's."""
    args = args or ServerArgs()
    overrides = overrides or ModelOverrides()
    name = served_model_name or model_label(model)
    if args.api_server_count > 1:
        run_api_servers(model, host, port, name, load_format, args, overrides, **engine_args)
        return
    # Before loading: a port in use fails at once.
    socks = listening_sockets(host, port, 1, reuse_port=False)
    try:
        with StartingResponder(socks):
            engine = AsyncLLM.from_args(model, load_format, args.max_waiting_requests,
                                        **engine_args)
        serve_engine(engine, name, args, overrides, host, port, socks)
    finally:
        for sock in socks:
            sock.close()


def serve_engine(engine: AsyncLLM, name: str, args: ServerArgs, overrides: ModelOverrides,
                 host: str, port: int, sockets: list[socket.socket] | None = None,
                 ignored_signals: frozenset[int] = frozenset(),
                 readiness: Readiness | None = None) -> None:
    """Serves `engine` until shut down (on `sockets` when given, else it binds host:port),
    then shuts it down; a dead engine is the process's error."""
    try:
        overrides.apply(engine)
        app = build_app(engine, name, args, readiness)
        Server(app, uvicorn_config(app, host, port), ignored_signals).run(sockets)
    finally:
        engine.shutdown()
    if engine.dead is not None:
        raise SystemExit(f"error: {engine.dead}")


# ---- several API-server processes on one engine core ---------------------------------------
def listening_sockets(host: str, port: int, n: int, reuse_port: bool = True
                      ) -> list[socket.socket]:
    """n listening sockets on one port (SO_REUSEPORT, which one server alone leaves off: it
    would let a second server share the port). The kernel spreads new connections evenly over
    them; processes sharing one socket would not (an event loop that wakes up accepts every
    connection waiting, so one process takes a burst of them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse_port)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others join the one the first got
            sock.listen(2048)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class StartingResponder:
    """While the engine core loads and the API servers start, answers every connection on the
    server's listening sockets with a 503 in OpenAI's shape, instead of leaving it unanswered in
    the backlog: /health tells the truth from the moment the port is bound. A thread, until
    `stop()` or until `done()` holds (the API servers accept on the same sockets by then)."""

    def __init__(self, socks: list[socket.socket], done: Callable[[], bool] = lambda: False):
        self.socks, self.done = socks, done
        self.stopped = threading.Event()
        for sock in socks:  # an API server may take a connection this thread was woken for
            sock.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="liteinfer-starting", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = orjson.dumps(error_body(503, "the server is starting"))
        response = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        with selectors.DefaultSelector() as selector:
            for sock in self.socks:
                selector.register(sock, selectors.EVENT_READ)
            while not self.stopped.is_set() and not self.done():
                for key, _ in selector.select(0.05):
                    with contextlib.suppress(OSError):  # taken by an API server, or a reset
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                        with conn:
                            conn.settimeout(1.0)
                            conn.recv(65536)  # the request's head
                            conn.sendall(response)
                            conn.shutdown(socket.SHUT_WR)
        self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def __enter__(self) -> StartingResponder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_api_server_process(model: str, config: EngineConfig, core: CoreHandle,
                           load_format: str, client_index: int, sock: socket.socket | None,
                           address: tuple[str, int], name: str, args: ServerArgs,
                           overrides: ModelOverrides, ready: Any) -> None:
    """An API-server process: front end `client_index` of the core, serving on `sock`, else
    (a replacement) on a socket of its own at `address`, bound once it can serve so that no
    connection waits for it meanwhile; `ready` holds every API server's readiness flag."""
    configure_logging()
    engine = AsyncLLM(model, config, core, load_format, client_index)
    host, port = address
    if sock is None:
        (sock,) = listening_sockets(host, port, 1)
    serve_engine(engine, name, args, overrides, host, port, [sock], frozenset({signal.SIGINT}),
                 Readiness(ready, client_index))


# An API-server process that dies is replaced, unless this many died in the last window: then
# something kills them faster than they serve, and the server exits.
MAX_RESTARTS, RESTART_WINDOW_S = 3, 60.0


class RestartBudget:
    """At most MAX_RESTARTS replacements in any RESTART_WINDOW_S."""

    def __init__(self) -> None:
        self.times: collections.deque[float] = collections.deque()

    def take(self, now: float) -> bool:
        while self.times and now - self.times[0] > RESTART_WINDOW_S:
            self.times.popleft()
        if len(self.times) >= MAX_RESTARTS:
            return False
        self.times.append(now)
        return True


def run_api_servers(model: str, host: str, port: int, name: str, load_format: str,
                    args: ServerArgs, overrides: ModelOverrides, **engine_args: Any) -> None:
    """`args.api_server_count` API-server processes, each front end of one engine core and
    listening on the same port. SIGTERM or SIGINT here drains them all. An API server that
    dies has its requests ended in the core and is replaced, the others serving meanwhile
    (within a RestartBudget). When the core dies the API servers end their streams with an
    error and exit, and so does this process. /metrics counts every process's requests
    (prometheus_client's multiprocess mode)."""
    n = args.api_server_count
    config = EngineConfig(**engine_args)
    socks = listening_sockets(host, port, n)  # before loading: a port in use fails at once
    port = socks[0].getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="liteinfer-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the children's imports
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Array("b", n, lock=False)  # each API server sets its own; this process clears
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    stopping = False

    def stop(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        ready[:] = [0] * n
        for proc in procs.values():  # a second signal reaches them too: they stop at once
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    responder: StartingResponder | None = StartingResponder(socks, lambda: all(ready))
    core = None
    core_died = False
    failed: str | None = None
    try:
        core = CoreProcess(model, config, load_format, n, args.max_waiting_requests)

        def start(i: int, sock: socket.socket | None) -> None:
            assert core is not None
            procs[i] = ctx.Process(target=run_api_server_process,
                                   name=f"liteinfer-api-server-{i}",
                                   args=(model, config, core.handle, load_format, i, sock,
                                         (host, port), name, args, overrides, ready))
            procs[i].start()

        for i, sock in enumerate(socks):
            if stopping:  # a signal while the model loaded
                break
            start(i, sock)
        budget = RestartBudget()
        while not stopping and failed is None:
            # Until a child exits or the core does. (Sentinels, not is_alive(): a process
            # closes its pipes before it can be reaped.)
            ended = mp_connection.wait([p.sentinel for p in procs.values()]
                                       + [core.proc.sentinel],
                                       None if responder is None else 0.1)
            if responder is not None and responder.stopped.is_set():
                # Every API server serves: this process's copies of their sockets go, so that
                # the kernel stops sending connections to the socket of one that dies.
                responder.stop()
                responder = None
                for sock in socks:
                    sock.close()
            if stopping:
                break
            if core.proc.sentinel in ended or mp_connection.wait([core.proc.sentinel], 0):
                core_died = True
                break
            for i, proc in list(procs.items()):
                if proc.sentinel not in ended:
                    continue
                ready[i] = 0
                proc.join()
                core.abort_client(i)  # its clients are gone
                if not budget.take(time.monotonic()):
                    failed = (f"{MAX_RESTARTS + 1} API-server processes died within "
                              f"{RESTART_WINDOW_S:.0f} s")
                    break
                logger.warning("%s exited (code %s); starting another", proc.name,
                               proc.exitcode)
                start(i, None)
        if not core_died and not stopping:  # too many deaths: the others drain
            stop(signal.SIGTERM, None)
        deadline = time.monotonic() + args.shutdown_grace_s + 10
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if responder is not None:
            responder.stop()
        for sock in socks:
            sock.close()
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        if core is not None:
            core.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if core_died:
        raise SystemExit("error: the engine core process died")
    if failed:
        raise SystemExit(f"error: {failed}")
