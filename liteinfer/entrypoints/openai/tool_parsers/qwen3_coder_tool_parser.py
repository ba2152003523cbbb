"""Qwen3-Coder tool calls (its chat template's XML format): content, then each call as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is its raw text (less the newline either side); one the tool's schema
does not declare a string is read as JSON where it parses (numbers, booleans, objects).
Streamed, the arguments object is written as the parameters come: each one's key as soon as
its tag closes, a string's characters as they come, any other value once it is complete."""
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
    """The text ends before the call does; `partial` is the call so far, once named."""

    def __init__(self, partial: ParsedCall | None = None) -> None:
        super().__init__()
        self.partial = partial


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
                except _Incomplete as e:
                    return ParsedCalls(calls, done, e.partial)
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
        fields: list[str] = []  # each parameter as the JSON object's `"key": value`
        keys: set[str] = set()
        while True:
            pos = skip(text, pos)
            if text.startswith(PARAMETER, pos):
                try:
                    key, pos = _tag(text, pos, PARAMETER)
                except _Incomplete:
                    raise _Incomplete(ParsedCall(name, _object(fields, closed=False))) from None
                if key is None or key in keys:
                    return None
                keys.add(key)
                end = text.find(END_PARAMETER, pos)
                if PARAMETER in text[pos:len(text) if end < 0 else end]:
                    return None  # the value is never closed
                string = self._is_string(name, key)
                if end < 0:
                    fields.append(json.dumps(key, ensure_ascii=False) + ": "
                                  + (_open_string(text[pos:]) if string else ""))
                    raise _Incomplete(ParsedCall(name, _object(fields, closed=False)))
                raw = text[pos:end].removeprefix("\n").removesuffix("\n")
                value = raw if string else _json_or_text(raw)
                fields.append(json.dumps(key, ensure_ascii=False) + ": "
                              + json.dumps(value, ensure_ascii=False))
                pos = end + len(END_PARAMETER)
                continue
            if PARAMETER.startswith(text[pos:]):
                raise _Incomplete(ParsedCall(name, _object(fields, closed=False)))
            try:
                pos = _expect(text, pos, END_FUNCTION)
                pos = pos and _expect(text, skip(text, pos), CLOSE)
            except _Incomplete:
                raise _Incomplete(ParsedCall(name, _object(fields, closed=False))) from None
            return None if pos is None else (ParsedCall(name, _object(fields, closed=True)), pos)

    def _is_string(self, function: str, key: str) -> bool:
        schema = self.tools.get(function, {}).get("properties", {}).get(key, {})
        return schema.get("type", "string") == "string"


def _object(fields: list[str], closed: bool) -> str:
    """The arguments object of `fields` (json.dumps' layout); without its closing brace while
    more may come."""
    return "{" + ", ".join(fields) + ("}" if closed else "")


def _open_string(raw: str) -> str:
    """The beginning of the JSON string a parameter's value so far `raw` will be: less what
    may be the newline and the closing tag after it."""
    raw = raw[:len(raw) - partial_marker(raw, END_PARAMETER)]
    if raw == "\n":
        raw = ""
    raw = raw.removeprefix("\n").removesuffix("\n")
    return json.dumps(raw, ensure_ascii=False)[:-1]


def _json_or_text(raw: str) -> Any:
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
