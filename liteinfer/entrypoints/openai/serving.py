"""Serving the OpenAI API over an AsyncLLM: requests parsed and checked, turned into engine
requests, and engine outputs rendered as completions and chat completions, whole or streamed.
Errors are answered in the API's own shape. The Responses API (responses.py) and Anthropic's
Messages API (entrypoints/anthropic/) build on `OpenAIServing`; api_server.py routes them."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from liteinfer.engine.async_llm import AsyncLLM, EngineError, Prompt, RequestStream, ServerBusyError
from liteinfer.engine.processor import generation_defaults
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
from liteinfer.outputs import Logprob, RequestOutput

Chunk = dict[str, Any]
Body = TypeVar("Body", bound=BaseModel)
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


def json_response(body: Chunk) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


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
