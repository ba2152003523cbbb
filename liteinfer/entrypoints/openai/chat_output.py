"""What a chat choice's text becomes: with a reasoning parser, its reasoning is split off first;
tool calls are then read from (or the output constraint applied to) the answer that follows.
The chat completions, Responses and Messages APIs all render their outputs from these fields
(OpenAI chat's message and delta fields: `content`, `reasoning_content`, `tool_calls`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from liteinfer.entrypoints.openai.reasoning_parsers import ReasoningParser
from liteinfer.entrypoints.openai.structured import ToolCalls

Chunk = dict[str, Any]


class ChatOutput:
    """The choices of one chat request. Without `include_reasoning` the reasoning is dropped
    (it is still split off: the answer is what follows it)."""

    def __init__(self, tools: ToolCalls, reasoning_parser: type[ReasoningParser] | None = None,
                 include_reasoning: bool = True):
        self.tools = tools
        self._reasoning_parser = reasoning_parser
        self._include_reasoning = include_reasoning
        # Per streamed choice: its reasoning parser and the answer so far.
        self._parsers: dict[int, ReasoningParser] = {}
        self._answers: dict[int, str] = {}

    def final(self, text: str) -> tuple[Chunk, bool]:
        """A whole choice's message fields and whether it holds tool calls."""
        if self._reasoning_parser is None:
            content, calls = self.tools.final(text)
            return _message(content, calls), bool(calls)
        reasoning, answer = self._reasoning_parser().extract_reasoning(text)
        content, calls = self.tools.final(answer or "")
        message = _message(content or None, calls)
        if self._include_reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message, bool(calls)

    def delta(self, choice: int, new_text: str, text: str, finished: bool
              ) -> tuple[Chunk, bool]:
        """A streamed choice's delta for `new_text`, the end of its output so far `text`, and
        whether it has sent tool calls."""
        if self._reasoning_parser is None:
            return self.tools.delta(choice, new_text, text, finished)
        parser = self._parsers.get(choice)
        if parser is None:
            parser = self._parsers[choice] = self._reasoning_parser()
        reasoning, new_answer = parser.extract_reasoning_streaming(text, finished)
        answer = self._answers[choice] = self._answers.get(choice, "") + new_answer
        delta, calls = self.tools.delta(choice, new_answer, answer, finished)
        if reasoning and self._include_reasoning:
            delta = {"reasoning_content": reasoning, "reasoning": reasoning, **delta}
        return delta, calls

    def finish_reason(self, calls: bool, reason: str) -> str:
        return self.tools.finish_reason(calls, reason)


def _message(content: str | None, calls: list[Chunk]) -> Chunk:
    message: Chunk = {"content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def output_parts(fields: Chunk) -> list[tuple[str, Any]]:
    """A message's or delta's fields as the ordered parts the Responses and Messages APIs
    render: ("reasoning", text), ("text", text), then for each call delta ("call", tool call)
    where a call begins and ("arguments", text) where the last one's arguments grow."""
    parts: list[tuple[str, Any]] = []
    if fields.get("reasoning_content"):
        parts.append(("reasoning", fields["reasoning_content"]))
    if fields.get("content"):
        parts.append(("text", fields["content"]))
    parts += [("call", call) if "id" in call else ("arguments", call["function"]["arguments"])
              for call in fields.get("tool_calls") or ()]
    return parts


class PartWriter(ABC):
    """A choice's parts as an API's output items (content blocks, output items), whole or
    streamed: consecutive parts of one kind make one item, each tool call an item of its own
    (which its arguments' fragments grow).
    Subclasses say how an item opens (with its first part), grows and closes, as a list of
    events; the finished items are kept, in order, in `items`."""

    def __init__(self) -> None:
        self.items: list[Chunk] = []
        self._kind: str | None = None  # the open item's

    def feed(self, fields: Chunk) -> list[Chunk]:
        """The events of a message's or delta's fields."""
        events: list[Chunk] = []
        for kind, value in output_parts(fields):
            if kind == "arguments":
                events += self.grown("call", value)
                continue
            if kind == self._kind and kind != "call":
                events += self.grown(kind, value)
                continue
            events += self.close()
            self._kind = kind
            events += self.opened(kind, value)
        return events

    def close(self) -> list[Chunk]:
        """Closes the open item, if any: its events; it joins `items`."""
        if self._kind is None:
            return []
        self._kind = None
        item, events = self.closed()
        self.items.append(item)
        return events

    @property
    def index(self) -> int:
        """The open item's index (or the next one's)."""
        return len(self.items)

    @abstractmethod
    def opened(self, kind: str, value: Any) -> list[Chunk]:
        """A new item of `kind` begins with `value` (text, or a tool call as far as it is
        written)."""

    @abstractmethod
    def grown(self, kind: str, text: str) -> list[Chunk]:
        """The open item's text (a call's: its arguments) grows by `text`."""

    @abstractmethod
    def closed(self) -> tuple[Chunk, list[Chunk]]:
        """The open item, whole, and the events that close it."""
