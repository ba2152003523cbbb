"""Qwen3-Coder tool calls (its chat template's XML format): content, then each call as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is its raw text (less the newline either side); one the tool's schema
does not declare a string is read as JSON where it parses (numbers, booleans, objects)."""
from __future__ import annotations

import json
from typing import Any

from liteinfer.entrypoints.openai.markers import find_marker, partial_marker
from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
    ToolParser,
)
from liteinfer.entrypoints.openai.tool_parsers.json_calls import skip

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


class _Incomplete(Exception):
    """The text ends before the call does."""


class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tools: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._closed: dict[int, tuple[ParsedCall, int] | None] = {}  # by where each begins

    def find_calls(self, text: str, start: int = 0) -> int | None:
        return find_marker(text, OPEN, start)

    def holdback(self, text: str) -> int:
        return partial_marker(text, OPEN)

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        calls, done = [], start
        while True:
            pos = skip(text, done)
            if pos not in self._closed:
                try:
                    self._closed[pos] = self._call(text, pos)
                except _Incomplete:
                    return ParsedCalls(calls, done)
            taken = self._closed[pos]
            if taken is None:
                return None
            calls.append(taken[0])
            done = taken[1]

    def _call(self, text: str, pos: int) -> tuple[ParsedCall, int] | None:
        """The call at `pos` and where it ends; None if what is there is not one."""
        pos = _expect(text, pos, OPEN)
        if pos is None:
            return None
        name, pos = _tag(text, skip(text, pos), FUNCTION)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        while True:
            pos = skip(text, pos)
            if text.startswith(PARAMETER, pos):
                key, pos = _tag(text, pos, PARAMETER)
                if key is None:
                    return None
                end = text.find(END_PARAMETER, pos)
                if PARAMETER in text[pos:len(text) if end < 0 else end]:
                    return None  # the value is never closed
                if end < 0:
                    raise _Incomplete
                arguments[key] = self._value(name, key, text[pos:end])
                pos = end + len(END_PARAMETER)
                continue
            if PARAMETER.startswith(text[pos:]):
                raise _Incomplete
            pos = _expect(text, pos, END_FUNCTION)
            pos = pos and _expect(text, skip(text, pos), CLOSE)
            return None if pos is None else (ParsedCall(name, arguments), pos)

    def _value(self, function: str, key: str, raw: str) -> Any:
        raw = raw.removeprefix("\n").removesuffix("\n")
        schema = self.tools.get(function, {}).get("properties", {}).get(key, {})
        if schema.get("type", "string") == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


def _expect(text: str, pos: int, literal: str) -> int | None:
    """Where `literal` at `pos` ends; None if something else is there."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
        raise _Incomplete
    return None


def _tag(text: str, pos: int, opening: str) -> tuple[str | None, int]:
    """The name in `<function=NAME>` (or `<parameter=NAME>`) at `pos` and where the tag ends;
    None for the name if no such tag is there."""
    start = _expect(text, pos, opening)
    if start is None:
        return None, pos
    end = text.find(">", start)
    if end < 0:
        if "\n" in text[start:]:
            return None, pos
        raise _Incomplete
    name = text[start:end].strip()
    return (name if name and "\n" not in name else None), end + 1
