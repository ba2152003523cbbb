"""Llama 3.1/3.2/3.3 JSON tool calls (their model cards' custom-tool format):
`{"name": "f", "parameters": {...}}` (or "arguments"), possibly after `<|python_tag|>`, several
separated by ";"."""
from __future__ import annotations

import json

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCall, ToolParser

PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\n\r"


class Llama3JsonToolParser(ToolParser):
    def call_start(self, text: str) -> bool | None:
        s = text.lstrip(_WHITESPACE)
        if not s or (PYTHON_TAG.startswith(s) and s != PYTHON_TAG):
            return None
        s = s.removeprefix(PYTHON_TAG).lstrip(_WHITESPACE)
        return None if not s else s.startswith("{")

    def parse_calls(self, text: str) -> tuple[list[ParsedCall], bool] | None:
        decoder = json.JSONDecoder()
        pos = len(text) - len(text.lstrip(_WHITESPACE))
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        calls: list[ParsedCall] = []
        while True:
            pos = _skip(text, pos, _WHITESPACE)
            if pos == len(text):
                return calls, True
            if text[pos] != "{":
                return None
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                # Unfinished if the rest is a prefix of some JSON text; malformed otherwise
                # (only the end of the text can tell, so an error before it is malformed).
                return (calls, True) if _unfinished(text[pos:]) else None
            call = _call(value, end)
            if call is None:
                return None
            calls.append(call)
            pos = _skip(text, end, _WHITESPACE)
            if pos < len(text):
                if text[pos] != ";":
                    return None
                pos += 1


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _call(value: object, end: int) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments"))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], arguments, end)


def _unfinished(text: str) -> bool:
    """Whether `text`, which failed to parse as one JSON object, never closes its first brace
    (so more text may complete it); a closed but invalid object is malformed."""
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
