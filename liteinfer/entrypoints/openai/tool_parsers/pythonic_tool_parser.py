"""Pythonic tool calls (Llama 3.2's and Llama 4's format): the whole output is a Python list of
calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, possibly
between Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values are Python
literals. Streamed, a call's arguments object is written an argument at a time, as each
value is complete."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
    ToolParser,
)
from liteinfer.entrypoints.openai.tool_parsers.json_calls import WholeOutputCalls, skip

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=")
_PARTIAL_KEYWORD = re.compile(r"[A-Za-z_]\w*\s*")  # a keyword, its "=" still to come
# What can end a value or change its nesting: brackets, separators, quotes, backslashes.
_VALUE_STRUCTURE = re.compile(r"[()\[\]{},'\"\\]")


class _Incomplete(Exception):
    """The text ends before the list does; `partial` is the call it ends inside, once named."""

    def __init__(self, partial: ParsedCall | None = None) -> None:
        super().__init__()
        self.partial = partial


class PythonicToolParser(WholeOutputCalls, ToolParser):
    tag, opening = PYTHON_START, "["

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        """The list's calls; those complete so far while it is not closed."""
        pos = skip(text, start)
        if text.startswith(PYTHON_START, pos):
            pos = skip(text, pos + len(PYTHON_START))
        pos += 1  # the list's bracket: find_calls saw it
        calls: list[ParsedCall] = []
        done = start  # where the complete calls end
        try:
            while True:
                pos = skip(text, pos)
                _more(text, pos)
                taken = _call(text, pos) if not (calls and text[pos] == "]") else None
                if taken is not None:
                    calls.append(taken[0])
                    done = pos = skip(text, taken[1])
                    _more(text, pos)
                elif not calls or text[pos] != "]":  # not a call, nor a trailing comma's end
                    return None
                if text[pos] == "]":
                    end = skip(text, pos + 1)
                    if text.startswith(PYTHON_END, end):
                        end += len(PYTHON_END)
                    elif end < len(text) and PYTHON_END.startswith(text[end:]):
                        raise _Incomplete
                    return ParsedCalls(calls, end)
                if text[pos] != ",":
                    return None
                pos += 1
        except _Incomplete as e:
            return ParsedCalls(calls, done, e.partial)


def _more(text: str, pos: int) -> None:
    """_Incomplete if the text ends at `pos`."""
    if pos == len(text):
        raise _Incomplete


def _call(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """The call `name(k=v, ...)` at `pos` and where it ends; None if it is not one."""
    _more(text, pos)
    match = _NAME.match(text, pos)
    if match is None:
        return None
    if text[match.end():] == ".":  # a dotted name goes on
        raise _Incomplete
    pos = skip(text, match.end())
    _more(text, pos)
    if text[pos] != "(":
        return None
    name, fields, keys = match[0], [], set()
    while True:
        pos = skip(text, pos + 1)
        partial = ParsedCall(name, "{" + ", ".join(fields))
        if pos == len(text):
            raise _Incomplete(partial)
        if text[pos] == ")":  # no arguments, or after a trailing comma
            return ParsedCall(name, "{" + ", ".join(fields) + "}"), pos + 1
        keyword = _KEYWORD.match(text, pos)
        if keyword is None:
            if _PARTIAL_KEYWORD.fullmatch(text, pos):
                raise _Incomplete(partial)
            return None
        key = keyword[1]
        end = _value_end(text, keyword.end())
        if end is None:
            raise _Incomplete(partial)
        try:
            value = _json_value(ast.literal_eval(text[keyword.end():end].strip()))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if key in keys or text[end] not in ",)":
            return None
        keys.add(key)
        fields.append(json.dumps(key) + ": " + json.dumps(value, ensure_ascii=False))
        pos = end
        if text[pos] == ")":
            return ParsedCall(name, "{" + ", ".join(fields) + "}"), pos + 1


def _value_end(text: str, pos: int) -> int | None:
    """Where the value at `pos` ends: at the "," or ")" after it outside brackets and strings;
    None if the text ends first."""
    depth = 0
    while (match := _VALUE_STRUCTURE.search(text, pos)) is not None:
        ch, pos = match[0], match.end()
        if ch in "'\"":
            quote = text[pos - 1:pos + 2] if text.startswith(ch * 3, pos - 1) else ch
            pos = _string_end(text, pos - 1 + len(quote), quote)
            if pos is None:
                return None
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # the call's parenthesis (or a stray bracket: not a value)
                return pos - 1
            depth -= 1
        elif ch == "," and depth == 0:
            return pos - 1
    return None


def _string_end(text: str, pos: int, quote: str) -> int | None:
    """Where the string literal whose body begins at `pos` ends (after its `quote`)."""
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text.startswith(quote, pos):
            return pos + len(quote)
        else:
            pos += 1
    return None


def _json_value(value: Any) -> Any:
    """A literal as JSON holds it (tuples as lists); TypeError for what JSON cannot."""
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a non-string key")
        return {k: _json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"not JSON: {type(value).__name__}")
