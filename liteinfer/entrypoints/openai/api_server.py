"""An OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (streamed as
server-sent events or whole), /v1/models, /health, /metrics (Prometheus), and vLLM's /tokenize
and /detokenize, over an AsyncLLMEngine.

Every HTTP request becomes one engine request per prompt and choice, all admitted together or
not at all. Bad input is answered with an OpenAI-style 400 before anything reaches the engine's
batch, so it never disturbs the requests already running; a client that disconnects has its
requests aborted and their KV blocks returned.

    liteinfer serve --model DIR_OR_NAME [--port 8000] [--api-key KEY]

With an API key, every /v1 request must carry `Authorization: Bearer KEY` (an OpenAI-style 401
otherwise); /health stays open for load balancers.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from liteinfer.engine.async_llm_engine import AsyncLLMEngine, Prompt, RequestStream
from liteinfer.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, SamplingRequest,
                                                   TokenizeRequest, conversation)
from liteinfer.entrypoints.openai.metrics import ServerMetrics
from liteinfer.llm import apply_chat_template, generation_defaults
from liteinfer.loader.overrides import apply_model_overrides
from liteinfer.outputs import RequestOutput
from liteinfer.utils import model_label

Chunk = dict[str, Any]
DISCONNECT_POLL_S = 0.5


def error_response(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.defaults = generation_defaults(engine.engine.generation_config)
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine, model_name)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "liteinfer", "max_model_len": self.engine.engine.max_model_len}]}

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, "cmpl", "text_completion", body.prompts,
                                 body.max_tokens, body.logprobs)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        def prompts() -> list[Prompt]:
            return [apply_chat_template(self.tokenizer, body.conversation(),
                                        body.add_generation_prompt)]

        return await self._serve(body, request, "chatcmpl", "chat.completion", prompts,
                                 body.max_new_tokens, body.num_logprobs)

    def tokenize(self, body: TokenizeRequest):
        if (error := self._check_model(body.model)) is not None:
            return error
        try:
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("give either prompt or messages")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer")
            tokens = (self.tokenizer.encode(body.prompt) if body.prompt is not None else
                      apply_chat_template(self.tokenizer, conversation(body.messages),
                                          body.add_generation_prompt))
        except ValueError as e:
            return error_response(400, str(e))
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": self.engine.engine.max_model_len}

    def detokenize(self, body: DetokenizeRequest):
        if (error := self._check_model(body.model)) is not None:
            return error
        try:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer")
            self.engine.engine.check_token_ids(body.tokens, "tokens")
        except ValueError as e:
            return error_response(400, str(e))
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _check_model(self, model: str | None) -> JSONResponse | None:
        """A 404 for a model name other than the one served."""
        if model is not None and model != self.model_name:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
        return None

    async def _serve(self, body: SamplingRequest, request: Request, prefix: str, kind: str,
                     prompts: Callable[[], list[Prompt]], max_tokens: int | None,
                     logprobs: int | None):
        if (error := self._check_model(body.model)) is not None:
            return error
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            body.check_supported()
            # Choice i of n for prompt p is request p * n + i, and the response's choice index.
            requests = [(f"{response_id}-{p * body.n + i}", prompt,
                         body.sampling_params(self.defaults, max_tokens, logprobs, i))
                        for p, prompt in enumerate(prompts()) for i in range(body.n)]
            stream = await self.engine.add_requests(requests)
        except ValueError as e:
            return error_response(400, str(e))
        meta = {"id": response_id, "created": int(time.time()), "model": self.model_name}
        render = ChoiceRenderer(self.tokenizer, kind == "chat.completion", logprobs,
                                echo=getattr(body, "echo", False))
        if body.stream:
            return StreamingResponse(self._events(stream, render, meta, kind, body),
                                     media_type="text/event-stream")
        finals = await self._collect(stream, request)
        if finals is None:  # the client left; its requests are aborted
            return error_response(499, "client disconnected", "ClientClosedRequest")
        if isinstance(finals, Exception):
            return error_response(500, f"generation failed: {finals}", "InternalServerError")
        outs = sorted(finals.values(), key=choice_index)
        return {**meta, "object": kind, "choices": [render.final(o) for o in outs],
                "usage": usage(outs, body.n)}

    async def _collect(self, stream: RequestStream, request: Request
                       ) -> dict[str, RequestOutput] | Exception | None:
        """Each request's last output; None if the client disconnected first."""
        finals: dict[str, RequestOutput] = {}

        async def consume() -> None:
            async for out in stream:
                self.metrics.observe(out)
                if out.finished:
                    finals[out.request_id] = out

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                stream.abort()
                return None
        return task.exception() or finals

    async def _events(self, stream: RequestStream, render: ChoiceRenderer, meta: Chunk,
                      kind: str, body: SamplingRequest) -> AsyncIterator[str]:
        chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
        outs: dict[str, RequestOutput] = {}
        try:
            if render.chat:  # the role comes first, in a chunk of its own per choice
                for rid in sorted(stream.unfinished, key=choice_index):
                    yield sse({**meta, "object": chunk_kind, "choices": [{
                        "index": choice_index(rid), "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
            async for out in stream:
                self.metrics.observe(out)
                outs[out.request_id] = out
                yield sse({**meta, "object": chunk_kind, "choices": [render.delta(out)]})
            if body.include_usage:
                yield sse({**meta, "object": chunk_kind, "choices": [],
                           "usage": usage(sorted(outs.values(), key=choice_index), body.n)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse({"error": {"message": f"generation failed: {e}",
                                 "type": "InternalServerError", "code": 500}})
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()  # a no-op once all have finished; else the client left


def sse(chunk: Chunk) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def choice_index(request_id: str | RequestOutput) -> int:
    rid = request_id if isinstance(request_id, str) else request_id.request_id
    return int(rid.rsplit("-", 1)[1])


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return None if reason is None else "length" if reason == "length" else "stop"


def usage(outs: list[RequestOutput], n: int) -> dict[str, int]:
    """Prompt tokens count once per prompt (its n choices share it)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


class ChoiceRenderer:
    """A choice of either endpoint, whole or as a streamed delta, with its logprobs. With echo
    (completions), the prompt and its tokens' logprobs come first (in a stream's first chunk of
    each choice)."""

    def __init__(self, tokenizer: Any, chat: bool, logprobs: int | None, echo: bool = False):
        self.tokenizer, self.chat, self.logprobs, self.echo = tokenizer, chat, logprobs, echo

    def final(self, out: RequestOutput) -> Chunk:
        c = out.outputs[0]
        if self.chat:
            return {"index": choice_index(out), "message": {"role": "assistant",
                                                            "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish_reason(out)}
        return self._completion(out, c.text, c.token_ids, c.logprobs, first=True)

    def delta(self, out: RequestOutput) -> Chunk:
        c, n = out.outputs[0], len(out.new_token_ids)
        entries = c.logprobs[len(c.logprobs) - n:] if c.logprobs is not None else None
        if not self.chat:
            return self._completion(out, out.new_text, out.new_token_ids, entries,
                                    first=len(c.token_ids) == n)
        return {"index": choice_index(out),
                "delta": {"content": out.new_text} if out.new_text else {},
                "logprobs": self._logprobs(out.new_token_ids, entries),
                "finish_reason": finish_reason(out)}

    def _completion(self, out: RequestOutput, text: str, token_ids: list[int],
                    entries: list[dict[int, float]] | None, first: bool) -> Chunk:
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

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None] | None
                  ) -> Chunk | None:
        if self.logprobs is None or entries is None:
            return None
        text = lambda t: self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)
        if self.chat:
            def item(t: int, lp: float) -> Chunk:
                s = text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [
                {**item(t, e[t]), "top_logprobs": [
                    item(k, v) for k, v in sorted(e.items(), key=lambda kv: -kv[1])
                ][:self.logprobs]} for t, e in zip(token_ids, entries)]}
        tokens = [text(t) for t in token_ids]
        offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        # A prompt's first token has no logprob (nothing comes before it).
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [None if e is None else {text(k): v for k, v in e.items()}
                                 for e in entries],
                "text_offset": offsets}


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    serving = OpenAIServing(engine, model_name)
    app = FastAPI(title="liteinfer", docs_url=None, redoc_url=None)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            given = request.headers.get("Authorization", "").encode()
            if request.url.path.startswith("/v1") and not secrets.compare_digest(given,
                                                                                 expected):
                return error_response(401, "invalid or missing API key", "AuthenticationError")
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}"
                             for e in exc.errors())
        return error_response(400, problems or "invalid request body")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)

    return app


def run_server(model: str, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, load_format: str = "auto",
               api_key: str | None = None, chat_template: str | None = None,
               generation_config: dict[str, Any] | None = None, **engine_args: Any) -> None:
    """chat_template and generation_config replace the model's (loader/overrides.py)."""
    import uvicorn

    engine = AsyncLLMEngine.from_args(model, load_format, **engine_args)
    apply_model_overrides(engine.engine, chat_template, generation_config)
    try:
        uvicorn.run(build_app(engine, served_model_name or model_label(model), api_key),
                    host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
