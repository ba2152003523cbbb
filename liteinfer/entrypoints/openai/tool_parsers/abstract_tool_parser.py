"""The interface of tool-call parsers: a model's output text -> content and OpenAI tool calls,
whole or streamed. A parser object serves one choice of one request (streaming keeps state)."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` as a JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


@dataclass
class ParsedCall:
    name: str
    arguments: Any  # the arguments object (or its JSON text)
    end: int  # where the call ends in the text parsed


class ToolParser(ABC):
    """Subclasses say how calls are written (`parse_calls`) and how an output that holds
    calls begins (`call_start`); whole and streamed extraction follow from those."""

    def __init__(self) -> None:
        self._text = ""
        self._sent_calls = 0
        self._sent_upto = 0  # characters of the text accounted for in deltas
        self._mode: str | None = None  # "content" | "calls"; None while undecided

    @abstractmethod
    def call_start(self, text: str) -> bool | None:
        """Whether an output beginning with `text` holds tool calls; None: not known yet."""

    @abstractmethod
    def parse_calls(self, text: str) -> tuple[list[ParsedCall], bool] | None:
        """The complete calls at the start of `text`, and whether the rest could still become
        more calls (True: nothing or an unfinished call follows); None if `text` is not made
        of calls (malformed)."""

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output: its calls if it is made of calls
        entirely, else the text as content and no calls."""
        parsed = self.parse_calls(text) if self.call_start(text) else None
        if not parsed or not parsed[0] or text[parsed[0][-1].end:].strip(" \t\n;"):
            return text, []
        return None, [tool_call(c.name, c.arguments) for c in parsed[0]]

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool
                                     ) -> dict[str, Any]:
        """The chat delta ({"content"} and/or {"tool_calls"}, possibly empty) for the output's
        next piece of text. Text that may begin a call is held back until it is a call (sent
        whole, one delta entry per call) or is not (sent as content); at the end, whatever was
        not a complete call is content."""
        self._text += delta_text
        if self._mode is None:
            start = self.call_start(self._text)
            if start is None and not finished:
                return {}
            self._mode = "calls" if start else "content"
        if self._mode == "content":
            return self._content_delta()
        parsed = self.parse_calls(self._text)
        if parsed is None:  # malformed: everything not sent as a call is content
            self._mode = "content"
            return self._content_delta()
        calls, _ = parsed
        delta: dict[str, Any] = {}
        if len(calls) > self._sent_calls:
            delta["tool_calls"] = [
                {"index": i, **tool_call(c.name, c.arguments)}
                for i, c in enumerate(calls[self._sent_calls:], start=self._sent_calls)]
            self._sent_calls = len(calls)
            self._sent_upto = calls[-1].end
        if finished and self._text[self._sent_upto:].strip(" \t\n;"):
            delta.update(self._content_delta())
        return delta

    def _content_delta(self) -> dict[str, Any]:
        text, self._sent_upto = self._text[self._sent_upto:], len(self._text)
        return {"content": text} if text else {}

    @property
    def saw_tool_calls(self) -> bool:
        """Whether streaming has sent any tool call (the choice then finishes "tool_calls")."""
        return self._sent_calls > 0
