"""Tool calls written as JSON objects `{"name": ..., "parameters" | "arguments": {...}}`, as
several models' formats write them."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCall, ToolParser

WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
# What can change a JSON text's nesting: brackets, quotes, and escapes inside strings.
_STRUCTURE = re.compile(r'[{}\[\]"\\]')


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
    character still to come, when the text ends on its backslash), and the nesting there."""

    start: int
    scanned: int
    depth: int = 0
    in_string: bool = False

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
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return True
        self.scanned = max(pos, len(text))
        return False


class JsonCallsParser(ToolParser):
    """A format whose calls are JSON objects. The parser keeps what it has read of its output
    (it serves one output, whole or streamed): an object that has closed is decoded once, and
    the one a streamed text ends inside is scanned only where the text is new, so that a long
    call costs time linear in its length however many pieces it comes in."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._closed: dict[int, tuple[ParsedCall, int] | None] = {}  # by where each begins
        self._open: _OpenObject | None = None

    def take_call(self, text: str, pos: int) -> tuple[ParsedCall | None, int] | None:
        """The call at `pos` and where it ends; (None, pos) if the text ends inside an object
        begun there; None if what is there is not a call."""
        return self._take(text, pos, _call)

    def take_arguments(self, text: str, pos: int, name: str
                       ) -> tuple[ParsedCall | None, int] | None:
        """As take_call, for a call of `name` whose object at `pos` is its arguments."""
        return self._take(text, pos, lambda t, p: _arguments(name, t, p))

    def _take(self, text: str, pos: int,
              decode: Callable[[str, int], tuple[ParsedCall, int] | None]
              ) -> tuple[ParsedCall | None, int] | None:
        if pos in self._closed:
            return self._closed[pos]
        if text[pos] != "{":
            return None
        if self._open is None or self._open.start != pos:
            self._open = _OpenObject(pos, pos)
        if not self._open.closes(text):
            return None, pos
        self._open = None
        taken = self._closed[pos] = decode(text, pos)
        return taken


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def _call(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """The call the object at `pos`, which closes, makes and where it ends; None if it is not
    valid JSON or not a call."""
    decoded = _decode(text, pos)
    if decoded is None:
        return None
    value, end = decoded
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments"))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], arguments), end


def _arguments(name: str, text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """A call of `name` whose arguments are the object at `pos`, which closes."""
    decoded = _decode(text, pos)
    if decoded is None or not isinstance(decoded[0], dict):
        return None
    return ParsedCall(name, decoded[0]), decoded[1]
