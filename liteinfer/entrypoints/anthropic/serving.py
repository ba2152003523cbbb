"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): each request
runs as the chat completion request it translates into, and its output (reasoning, text, tool
calls) comes back as thinking, text and tool_use blocks, whole or as Anthropic's stream of
events. Errors, on these routes, take Anthropic's shape."""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from liteinfer.engine.async_llm import EngineError
from liteinfer.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
)
from liteinfer.entrypoints.openai.chat_output import PartWriter
from liteinfer.entrypoints.openai.protocol import ChatCompletionRequest
from liteinfer.entrypoints.openai.serving import (
    OpenAIServing,
    RequestError,
    ServerShuttingDown,
    json_response,
    parse,
)
from liteinfer.outputs import RequestOutput

Chunk = dict[str, Any]


class AnthropicServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def messages(self, data: Any, request: Request) -> Response:
        body = parse(MessagesRequest, data)
        chat = self._chat_request(body, body.chat_completion)
        output = self.serving.chat_output(chat)
        message_id, stream = await self.serving.start(
            chat, "msg_", self.serving.chat_prompts(chat), 1, chat.max_new_tokens, None)
        meta = {"id": message_id, "type": "message", "role": "assistant",
                "model": self.serving.model_name}
        if body.stream:
            events = self._events(self.serving.chat_deltas(stream, output), meta, body)
            return StreamingResponse(events, media_type="text/event-stream")
        out = next(iter((await self.serving.collect(stream, request)).values()))
        fields, calls = output.final(out.outputs[0].text)
        blocks = BlockWriter()
        blocks.feed(fields)
        blocks.close()
        return json_response({**meta, "content": blocks.items,
                              **stop(out, calls, body.stop_sequences),
                              "usage": {"input_tokens": len(out.prompt_token_ids),
                                        "output_tokens": len(out.outputs[0].token_ids)}})

    async def count_tokens(self, data: Any) -> Chunk:
        """The prompt's tokens as the chat template renders it, tools included."""
        body = parse(CountTokensRequest, data)
        chat = self._chat_request(body, body.chat_request)
        tokens = await self.serving._in_pool(lambda: self.serving.chat_prompts(chat)()[0])
        return {"input_tokens": len(tokens)}

    @staticmethod
    def _chat_request(body: CountTokensRequest, translate: Any) -> ChatCompletionRequest:
        try:
            return parse(ChatCompletionRequest, translate())
        except ValueError as e:
            raise RequestError(400, str(e)) from None

    async def _events(self, deltas: AsyncIterator[tuple[RequestOutput, Chunk, bool]],
                      meta: Chunk, body: MessagesRequest) -> AsyncIterator[bytes]:
        blocks = BlockWriter()
        out, calls = None, False
        try:
            async with contextlib.aclosing(deltas):
                async for step in deltas:
                    if out is None:  # the first output: the prompt's tokens are known
                        yield event({"type": "message_start", "message": {
                            **meta, "content": [], "stop_reason": None, "stop_sequence": None,
                            "usage": {"input_tokens": len(step[0].prompt_token_ids),
                                      "output_tokens": 0}}})
                    out, delta, calls = step
                    for e in blocks.feed(delta):
                        yield event(e)
            for e in blocks.close():
                yield event(e)
            if out is not None:
                yield event({"type": "message_delta",
                             "delta": stop(out, calls, body.stop_sequences),
                             "usage": {"output_tokens": len(out.outputs[0].token_ids)}})
                yield event({"type": "message_stop"})
        except EngineError as e:  # the stream has started: report in-band
            status = 503 if isinstance(e, ServerShuttingDown) else 500
            yield event(anthropic_error_body(status, f"generation failed: {e}"))


def event(body: Chunk) -> bytes:
    """A server-sent event named by its type, as Anthropic's clients read them."""
    return b"event: " + body["type"].encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


def stop(out: RequestOutput, calls: bool, stop_sequences: list[str] | None) -> Chunk:
    """Why the message ended: its stop_reason and the stop sequence that ended it."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or ()):
        return {"stop_reason": "stop_sequence", "stop_sequence": c.stop_reason}
    return {"stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None}


class BlockWriter(PartWriter):
    """Content blocks: thinking, text, and a tool_use block per call; streamed as
    content_block_start, its deltas, and content_block_stop."""

    def __init__(self) -> None:
        super().__init__()
        self._block: Chunk = {}  # the open block
        self._arguments = ""  # the open tool_use block's input, as JSON text so far

    def opened(self, kind: str, value: Any) -> list[Chunk]:
        if kind == "call":
            function, text = value["function"], value["function"]["arguments"]
            self._block = {"type": "tool_use", "id": value["id"], "name": function["name"],
                           "input": {}}
            self._arguments = ""
        else:
            self._block = ({"type": "thinking", "thinking": "", "signature": ""}
                           if kind == "reasoning" else {"type": "text", "text": ""})
            text = value
        start = [{"type": "content_block_start", "index": self.index,
                  "content_block": dict(self._block)}]
        return start + (self.grown(kind, text) if text else [])

    def grown(self, kind: str, text: str) -> list[Chunk]:
        if kind == "call":
            self._arguments += text
            delta = {"type": "input_json_delta", "partial_json": text}
        else:
            key = "thinking" if kind == "reasoning" else "text"
            self._block[key] += text
            delta = {"type": f"{key}_delta", key: text}
        return [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def closed(self) -> tuple[Chunk, list[Chunk]]:
        if self._block["type"] == "tool_use":
            # A call a stream left unfinished has no input to show (only a stream has one).
            with contextlib.suppress(json.JSONDecodeError):
                self._block["input"] = json.loads(self._arguments)
        return self._block, [{"type": "content_block_stop", "index": self.index}]
