"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): a request runs as
the chat completion request it translates into (`input` items as chat messages, function
tools, `text.format` as response_format), and its output comes back as reasoning, message and
function_call items, whole or as the API's typed events (`response.created`,
`response.output_text.delta`, ..., `response.completed`).

Responses are kept in memory while the server runs (the last `MAX_STORED_RESPONSES`, unless
`store` is false), so that `previous_response_id` can continue one: its conversation so far
comes before the new input. They are kept in the engine core's process, as opaque bytes, so
that every API-server process finds them."""
from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from liteinfer.engine.async_llm import EngineError
from liteinfer.engine.messages import MAX_STORED_RESPONSES
from liteinfer.entrypoints.openai.chat_output import PartWriter
from liteinfer.entrypoints.openai.protocol import ChatCompletionRequest, PositiveCount
from liteinfer.entrypoints.openai.serving import (
    OpenAIServing,
    RequestError,
    ServerShuttingDown,
    error_body,
    json_response,
    parse,
)
from liteinfer.outputs import RequestOutput

Chunk = dict[str, Any]


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    def text(self) -> str:
        return _text(self.output)


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ReasoningItem(_Item):
    """Earlier reasoning sent back: chat templates drop it from past turns."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else value.type
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(_Item):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(_Item):
    type: Literal["text", "json_schema", "json_object"]
    name: str = "response"
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    format: TextFormat | None = None


class ResponsesRequest(_Item):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None

    def chat_completion(self, history: list[Chunk]) -> Chunk:
        """The chat completion request (as a body) that runs this one after `history`, the
        conversation of the response it continues."""
        body: Chunk = {"model": self.model, "messages": self.messages(history),
                       "max_completion_tokens": self.max_output_tokens,
                       "temperature": self.temperature, "top_p": self.top_p,
                       "stream": self.stream, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                include={"name", "description", "parameters", "strict"}, exclude_none=True)}
                for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.json_schema or {}, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body

    def messages(self, history: list[Chunk]) -> list[Chunk]:
        """The chat messages: the instructions (never carried over from an earlier response),
        the conversation so far, then the input's items."""
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        messages += history + self.input_messages()
        return messages

    def input_messages(self) -> list[Chunk]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[Chunk] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last["content"]:
                    last.setdefault("tool_calls", []).append(call)  # calls of one turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text()})
        return messages


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, data: Any, request: Request) -> Response:
        body = parse(ResponsesRequest, data)
        history = []
        if body.previous_response_id is not None:
            history = (await self._lookup(body.previous_response_id))[1]
        try:
            chat = parse(ChatCompletionRequest, body.chat_completion(history))
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        output = self.serving.chat_output(chat)
        response_id, stream = await self.serving.start(
            chat, "resp_", self.serving.chat_prompts(chat), 1, chat.max_new_tokens, None)
        meta = {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.serving.model_name, "error": None,
                "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": (body.text.format.model_dump(by_alias=True)
                                    if body.text and body.text.format else {"type": "text"})},
                "tool_choice": (body.tool_choice.model_dump()
                                if isinstance(body.tool_choice, NamedFunction)
                                else body.tool_choice or "auto"),
                "tools": [t.model_dump() for t in body.tools or ()]}
        history += body.input_messages()  # what a response continuing this one comes after
        if body.stream:
            events = self._events(self.serving.chat_deltas(stream, output), meta, history)
            return StreamingResponse(events, media_type="text/event-stream")
        out = next(iter((await self.serving.collect(stream, request)).values()))
        items = ItemWriter()
        items.feed(output.final(out.outputs[0].text)[0])
        items.close()
        return json_response(self._completed(meta, items.items, out, history))

    async def retrieve(self, response_id: str) -> Chunk:
        return (await self._lookup(response_id))[0]

    async def _lookup(self, response_id: str) -> tuple[Chunk, list[Chunk]]:
        """A stored response's body and conversation (its input and output as messages)."""
        try:
            stored = await self.serving.engine.stored_response(response_id)
        except EngineError as e:
            raise RequestError(503, str(e)) from None
        if stored is None:
            raise RequestError(404, f"no response {response_id!r}: responses are kept in "
                                    f"memory while the server runs, the last "
                                    f"{MAX_STORED_RESPONSES} of them")
        response, conversation = orjson.loads(stored)
        return response, conversation

    def _completed(self, meta: Chunk, items: list[Chunk], out: RequestOutput,
                   history: list[Chunk]) -> Chunk:
        """The finished response, stored with its conversation if it asks to be."""
        length = out.outputs[0].finish_reason == "length"
        prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        response = {**meta, "status": "incomplete" if length else "completed",
                    "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                    "output": items,
                    "usage": {"input_tokens": prompt, "output_tokens": completion,
                              "total_tokens": prompt + completion,
                              "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                              "output_tokens_details": {"reasoning_tokens": 0}}}
        if meta["store"]:
            self.serving.engine.store_response(meta["id"], orjson.dumps(
                [response, history + [assistant_message(items)]]))
        return response

    async def _events(self, deltas: AsyncIterator[tuple[RequestOutput, Chunk, bool]],
                      meta: Chunk, history: list[Chunk]) -> AsyncIterator[bytes]:
        items = ItemWriter()
        pending = {**meta, "status": "in_progress", "incomplete_details": None, "output": [],
                   "usage": None}
        yield items.event({"type": "response.created", "response": pending})
        yield items.event({"type": "response.in_progress", "response": pending})
        out = None
        try:
            async with contextlib.aclosing(deltas):
                async for step in deltas:
                    out, delta, _ = step
                    for e in items.feed(delta):
                        yield items.event(e)
            for e in items.close():
                yield items.event(e)
            if out is not None:
                yield items.event({"type": "response.completed",
                                   "response": self._completed(meta, items.items, out,
                                                               history)})
        except EngineError as e:  # the stream has started: report in-band
            status = 503 if isinstance(e, ServerShuttingDown) else 500
            yield items.event({"type": "error", **error_body(status,
                                                             f"generation failed: {e}")})


def assistant_message(items: list[Chunk]) -> Chunk:
    """A response's output as the chat message that continues its conversation."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class ItemWriter(PartWriter):
    """Output items: reasoning, message (one output_text part), and a function_call per call;
    streamed as the Responses API's typed events, numbered in order."""

    def __init__(self) -> None:
        super().__init__()
        self._item: Chunk = {}  # the open item
        self._sequence = 0

    def event(self, body: Chunk) -> bytes:
        body["sequence_number"] = self._sequence
        self._sequence += 1
        return b"event: " + body["type"].encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def opened(self, kind: str, value: Any) -> list[Chunk]:
        where = {"output_index": self.index}
        if kind == "call":
            function = value["function"]
            self._item = {"type": "function_call", "id": f"fc_{secrets.token_hex(16)}",
                          "call_id": value["id"], "name": function["name"], "arguments": "",
                          "status": "completed"}
            added = [{"type": "response.output_item.added", **where,
                      "item": {**self._item, "status": "in_progress"}}]
            return added + (self.grown(kind, function["arguments"])
                            if function["arguments"] else [])
        if kind == "reasoning":
            self._item = {"type": "reasoning", "id": f"rs_{secrets.token_hex(16)}",
                          "summary": [], "content": [{"type": "reasoning_text", "text": ""}],
                          "status": "completed"}
            added = [{"type": "response.output_item.added", **where,
                      "item": {**self._item, "content": [], "status": "in_progress"}}]
        else:
            self._item = {"type": "message", "id": f"msg_{secrets.token_hex(16)}",
                          "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": "", "annotations": [],
                                       "logprobs": []}]}
            added = [{"type": "response.output_item.added", **where,
                      "item": {**self._item, "content": [], "status": "in_progress"}},
                     {"type": "response.content_part.added", **where, "content_index": 0,
                      "item_id": self._item["id"],
                      "part": {"type": "output_text", "text": "", "annotations": [],
                               "logprobs": []}}]
        return added + self.grown(kind, value)

    def grown(self, kind: str, text: str) -> list[Chunk]:
        if kind == "call":
            self._item["arguments"] += text
            return [{"type": "response.function_call_arguments.delta",
                     "output_index": self.index, "item_id": self._item["id"], "delta": text}]
        self._item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        return [{"type": f"response.{name}.delta", "output_index": self.index,
                 "content_index": 0, "item_id": self._item["id"], "delta": text,
                 **({"logprobs": []} if kind == "text" else {})}]

    def closed(self) -> tuple[Chunk, list[Chunk]]:
        item = self._item
        where = {"output_index": self.index, "item_id": item["id"]}
        done = {"type": "response.output_item.done", "output_index": self.index, "item": item}
        if item["type"] == "function_call":
            return item, [{"type": "response.function_call_arguments.done", **where,
                           "arguments": item["arguments"]}, done]
        part = item["content"][0]
        if item["type"] == "reasoning":
            return item, [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                           "text": part["text"]}, done]
        return item, [{"type": "response.output_text.done", **where, "content_index": 0,
                       "text": part["text"], "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": part}, done]
