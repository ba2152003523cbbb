"""The interface of tool-call parsers: a model's output text -> content and OpenAI tool calls,
whole or streamed. A parser object serves one choice of one request (it keeps state: what it
has sent, and what it has read of the output).

A parser says where an output's calls begin (`find_calls`), how much of a text's end may be
the beginning of a call marker still (`holdback`), and how its calls are written
(`parse_calls`); extracting them, whole or streamed, follows from those.

Streamed, a call goes out as vLLM streams it: a first delta with its index, id, type and name
(and the arguments so far), then deltas of its index and more of its arguments, as the model
writes them. Each call's arguments are a JSON text that parsers build so that what a partial
call holds is always the beginning of what the complete call will: its deltas concatenate to
the arguments of the same output read whole."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` as a JSON text (or a value to write as one)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


@dataclass
class ParsedCall:
    name: str
    # A JSON object's text; of a partial call, the beginning of what it will be once complete.
    arguments: str


@dataclass
class ParsedCalls:
    calls: list[ParsedCall]  # the complete calls, in order
    # Where in the text the complete calls (and what separates them) end; where they begin
    # while what holds them is still open (Mistral's array).
    end: int
    # The call the text ends inside, once its name is known.
    partial: ParsedCall | None = None


class ToolParser(ABC):
    # Whether the output's special tokens may be dropped from its text: not where a call
    # marker is one (Mistral's [TOOL_CALLS]).
    skip_special_tokens = True

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None) -> None:
        self.tools = tools or {}  # each tool's parameters (a JSON schema) by name
        self._text = ""  # the output so far
        self._calls_at: int | None = None  # where the calls begin, once found
        self._malformed = False
        self._sent_arguments: list[str] = []  # per call begun: its arguments sent so far
        self._complete_calls = 0  # of those, the ones sent whole
        self._sent_upto = 0  # characters of the text sent, as content or complete calls

    @abstractmethod
    def find_calls(self, text: str, start: int = 0) -> int | None:
        """Where the calls begin in `text`; None if none does (yet). `text[:start]` was all of
        a streamed text when no calls were found in it: only a marker its end may begin needs
        searching again."""

    @abstractmethod
    def holdback(self, text: str) -> int:
        """How many characters at the end of `text` (in which `find_calls` found no calls)
        may begin a call once more text comes: not sent as content yet."""

    @abstractmethod
    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        """The calls `text[start:]` (where `find_calls` said they begin) starts with; None if
        it is not made of calls (malformed). A streamed text is parsed again each time it has
        grown."""

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output: the text before its calls and the calls
        if all after them is complete calls, else the text as content and no calls."""
        at = self.find_calls(text)
        parsed = self.parse_calls(text, at) if at is not None else None
        if parsed is None or not parsed.calls or text[parsed.end:].strip():
            return text, []
        return text[:at] or None, [tool_call(c.name, c.arguments) for c in parsed.calls]

    def extract_tool_calls_streaming(self, text: str, finished: bool) -> dict[str, Any]:
        """The chat delta ({"content"} and/or {"tool_calls"}, possibly empty) once the output
        so far is `text` (the text of the last call and more). Content goes out as it comes,
        but for what may begin a call; calls go out as they are written. What turns out
        malformed, or is left unfinished at the end, is content from where the last complete
        call ends (a call begun there stays as far as it was sent: a stream takes nothing
        back)."""
        searched = len(self._text)
        self._text = text
        if self._calls_at is None and not self._malformed:
            self._calls_at = self.find_calls(text, searched)
            if self._calls_at is None:
                return self._content(len(text) if finished else len(text) - self.holdback(text))
        content = self._content(self._calls_at).get("content", "") \
            if self._calls_at is not None else ""
        parsed = None if self._malformed else self.parse_calls(text, self._calls_at)
        if parsed is None:
            self._malformed = True
            content += self._content(len(text)).get("content", "")
            return {"content": content} if content else {}
        delta: dict[str, Any] = {"content": content} if content else {}
        calls = parsed.calls + ([parsed.partial] if parsed.partial is not None else [])
        tool_calls = [d for i, c in enumerate(calls) if (d := self._call_delta(i, c))]
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if parsed.end > self._calls_at:  # their text is done with, and what separates them
            self._complete_calls = max(self._complete_calls, len(parsed.calls))
            self._sent_upto = max(self._sent_upto, parsed.end)
        if finished:
            rest = self._content(len(text))
            if rest.get("content", "").strip():
                delta["content"] = delta.get("content", "") + rest["content"]
        return delta

    def _call_delta(self, index: int, call: ParsedCall) -> dict[str, Any] | None:
        """The delta of call `index` (None if nothing of it is new): the whole call as far as
        it is written if it is new, else what its arguments have grown by."""
        if index == len(self._sent_arguments):
            self._sent_arguments.append(call.arguments)
            return {"index": index, **tool_call(call.name, call.arguments)}
        sent = self._sent_arguments[index]
        if len(call.arguments) <= len(sent):
            return None
        self._sent_arguments[index] = call.arguments
        return {"index": index, "function": {"arguments": call.arguments[len(sent):]}}

    def _content(self, end: int) -> dict[str, Any]:
        """A delta of the text not sent yet, up to `end`."""
        text = self._text[self._sent_upto:end]
        self._sent_upto = max(self._sent_upto, end)
        return {"content": text} if text else {}

    @property
    def saw_tool_calls(self) -> bool:
        """Whether streaming has sent a complete tool call (the choice then finishes
        "tool_calls")."""
        return self._complete_calls > 0
