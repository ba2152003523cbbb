"""A tool call written as a JSON object `{"name": ..., "parameters" | "arguments": {...}}`,
as several models' formats write them."""
from __future__ import annotations

import json

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCall

WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()


def skip(text: str, pos: int) -> int:
    """The position of the first character at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def take_call(text: str, pos: int) -> tuple[ParsedCall | None, int] | None:
    """The call at `pos` and where it ends; (None, pos) if the text ends inside an object
    begun there; None if what is there is not a call."""
    if text[pos] != "{":
        return None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return (None, pos) if _unclosed(text[pos:]) else None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments"))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], arguments), end


def _unclosed(text: str) -> bool:
    """Whether `text`, which failed to parse as one JSON object, never closes its first brace
    (more text may complete it); one that closes but is invalid is malformed."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True
