"""Tool calls written as JSON objects `{"name": ..., "parameters" | "arguments": {...}}`, as
several models' formats write them."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
    ToolParser,
)

WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
# What can change a JSON text's nesting or, at the top level, its fields: brackets, quotes,
# escapes inside strings, colons and commas.
_STRUCTURE = re.compile(r'[{}\[\]"\\:,]')
ARGUMENT_KEYS = ("parameters", "arguments")  # where a call object holds its arguments


def skip(text: str, pos: int) -> int:
    """The position of the first character at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


class WholeOutputCalls:
    """A format whose calls are the whole output or nothing: after whitespace and an optional
    `tag`, they begin with `opening`."""

    tag: str
    opening: str

    def find_calls(self, text: str, start: int = 0) -> int | None:
        """The calls begin where the output does, if they do."""
        pos = skip(text, 0)
        if text.startswith(self.tag, pos):
            pos = skip(text, pos + len(self.tag))
        return 0 if text.startswith(self.opening, pos) else None

    def holdback(self, text: str) -> int:
        """All of an output that may still become calls: whitespace and the tag."""
        pos = skip(text, 0)
        end = pos + len(self.tag)
        held = self.tag.startswith(text[pos:end]) and skip(text, end) >= len(text)
        return len(text) if held else 0


@dataclass
class _OpenObject:
    """An object the text ends inside: where it begins, how far it is scanned (past an escaped
    character still to come, when the text ends on its backslash), the nesting there, and
    where each of its own (top-level) fields' values begins and, once it has, ends."""

    start: int
    scanned: int
    depth: int = 0
    in_string: bool = False
    string_at: int = 0  # where the last string begun begins
    key: str | None = None  # the top-level key last read; None while one is expected
    after_colon: bool = False  # whether `key`'s value has begun
    fields: dict[str, list[int | None]] = field(default_factory=dict)  # key: [begin, end]

    def closes(self, text: str) -> bool:
        """Whether `text`, scanned on from where the last call stopped, closes the object's
        first brace (brackets count outside strings only, as JSON nests them)."""
        pos = self.scanned
        while (match := _STRUCTURE.search(text, pos)) is not None:
            ch, pos = match[0], match.end()
            if self.in_string:
                if ch == "\\":
                    pos += 1
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 1:
                        self._string(text, pos)
            elif ch == '"':
                self.in_string, self.string_at = True, pos - 1
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 1:
                    self._value_ends(pos if self.depth == 1 else pos - 1)
                if self.depth == 0:
                    return True
            elif self.depth == 1 and ch == ":" and self.key is not None:
                self.after_colon = True
                self.fields[self.key] = [pos, None]
            elif self.depth == 1 and ch == ",":
                self._value_ends(pos - 1)
                self.key, self.after_colon = None, False
        self.scanned = max(pos, len(text))
        return False

    def _string(self, text: str, end: int) -> None:
        """A top-level string ended at `end`: a key, or a value."""
        if self.after_colon:
            self._value_ends(end)
        elif self.key is None:
            try:
                self.key = json.loads(text[self.string_at:end])
            except json.JSONDecodeError:
                self.key = ""

    def _value_ends(self, end: int) -> None:
        span = self.fields.get(self.key) if self.after_colon else None
        if span is not None and span[1] is None:
            span[1] = end

    def value(self, text: str, key: str) -> str | None:
        """The text of `key`'s value, or as much of it as is written (None before it)."""
        span = self.fields.get(key)
        if span is None:
            return None
        begin = skip(text, span[0])
        return text[begin:len(text) if span[1] is None else span[1]].rstrip(WHITESPACE)

    def partial_call(self, text: str) -> ParsedCall | None:
        """The call this object is becoming, once its name is known: its arguments as far as
        they are written (nothing until they begin as an object)."""
        name = self.value(text, "name")
        if name is None or self.fields["name"][1] is None:
            return None
        try:
            name = json.loads(name)
        except json.JSONDecodeError:
            return None
        if not isinstance(name, str):
            return None
        arguments = next((a for k in ARGUMENT_KEYS if (a := self.value(text, k)) is not None),
                         "")
        return ParsedCall(name, arguments if arguments.startswith("{") else "")


@dataclass
class Taken:
    """What `take_call` found at a position: a complete call and where it ends, or (`end`
    None) the call the text ends inside, None until its name is known."""

    call: ParsedCall | None
    end: int | None


class JsonCallsParser(ToolParser):
    """A format whose calls are JSON objects. The parser keeps what it has read of its output
    (it serves one output, whole or streamed): an object that has closed is decoded once, and
    the one a streamed text ends inside is scanned only where the text is new, so that a long
    call costs time linear in its length however many pieces it comes in. A call's arguments
    are their text as the model wrote it (so that a partial call's are the beginning of the
    complete call's)."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._closed: dict[int, Taken | None] = {}  # by where each begins
        self._open: _OpenObject | None = None

    def take_call(self, text: str, pos: int) -> Taken | None:
        """The call object at `pos`; None if what is there is not a call."""
        return self._take(text, pos, None)

    def take_arguments(self, text: str, pos: int, name: str) -> Taken | None:
        """As take_call, for a call of `name` whose object at `pos` is its arguments."""
        return self._take(text, pos, name)

    def parse_array(self, text: str, start: int, pos: int) -> ParsedCalls | None:
        """The calls of a JSON array of call objects `[call, call, ...]` beginning at `start`,
        from `pos` after its bracket. Its calls stream as they are written, but none of its
        text is done with until it closes."""
        calls: list[ParsedCall] = []
        while True:
            pos = skip(text, pos)
            if pos == len(text):
                return ParsedCalls(calls, start)
            taken = self.take_call(text, pos)
            if taken is None:
                return None
            if taken.end is None:
                return ParsedCalls(calls, start, taken.call)
            calls.append(taken.call)
            pos = skip(text, taken.end)
            if pos == len(text):
                return ParsedCalls(calls, start)
            if text[pos] == "]":
                return ParsedCalls(calls, pos + 1)
            if text[pos] != ",":
                return None
            pos += 1

    def _take(self, text: str, pos: int, name: str | None) -> Taken | None:
        if pos in self._closed:
            return self._closed[pos]
        if text[pos] != "{":
            return None
        if self._open is None or self._open.start != pos:
            self._open = _OpenObject(pos, pos)
        if not self._open.closes(text):
            if name is not None:
                return Taken(ParsedCall(name, text[pos:].rstrip(WHITESPACE)), None)
            return Taken(self._open.partial_call(text), None)
        opened, self._open = self._open, None
        taken = self._closed[pos] = _decoded(text, pos, opened, name)
        return taken


def _decoded(text: str, pos: int, scanned: _OpenObject, name: str | None) -> Taken | None:
    """The call the object at `pos`, which closes, makes (a call object, or the arguments of
    a call of `name`); None if it is not valid JSON or not a call."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    if name is not None:
        return Taken(ParsedCall(name, text[pos:end]), end)
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    if not isinstance(value.get("name"), str) or key is None \
            or not isinstance(value[key], dict):
        return None
    return Taken(ParsedCall(value["name"], scanned.value(text, key) or ""), end)
