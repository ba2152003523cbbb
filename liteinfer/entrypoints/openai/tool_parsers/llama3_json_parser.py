"""Llama 3.1/3.2/3.3 JSON tool calls (their model cards' custom-tool format): the output is
`{"name": "f", "parameters": {...}}` (or "arguments"), possibly after `<|python_tag|>`, several
separated by ";"."""
from __future__ import annotations

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCalls, ToolParser
from liteinfer.entrypoints.openai.tool_parsers.json_calls import WHITESPACE, skip, take_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def find_calls(self, text: str) -> int | None:
        """Calls are the whole output or nothing: they begin where it does."""
        s = text.lstrip(WHITESPACE).removeprefix(PYTHON_TAG).lstrip(WHITESPACE)
        return 0 if s.startswith("{") else None

    def holdback(self, text: str) -> int:
        """All of an output that may still become calls: whitespace and the python tag."""
        s = text.lstrip(WHITESPACE)
        if PYTHON_TAG.startswith(s) or (s.startswith(PYTHON_TAG)
                                        and not s[len(PYTHON_TAG):].strip(WHITESPACE)):
            return len(text)
        return 0

    def parse_calls(self, text: str) -> ParsedCalls | None:
        done = skip(text, 0)  # the end of what is parsed
        if text.startswith(PYTHON_TAG, done):
            done += len(PYTHON_TAG)
        calls = []
        while True:
            pos = skip(text, done)
            if pos == len(text):
                return ParsedCalls(calls, done, False)
            taken = take_call(text, pos)
            if taken is None:
                return None
            call, end = taken
            if call is None:  # the rest is the beginning of a call
                return ParsedCalls(calls, done, True)
            calls.append(call)
            done = end
            pos = skip(text, end)
            if pos < len(text):
                if text[pos] != ";":
                    return None
                done = pos + 1
