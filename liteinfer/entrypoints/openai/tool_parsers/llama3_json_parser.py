"""Llama 3.1/3.2/3.3 JSON tool calls (their model cards' custom-tool format): the output is
`{"name": "f", "parameters": {...}}` (or "arguments"), possibly after `<|python_tag|>`, several
separated by ";"."""
from __future__ import annotations

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCalls
from liteinfer.entrypoints.openai.tool_parsers.json_calls import (
    JsonCallsParser,
    WholeOutputCalls,
    skip,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(WholeOutputCalls, JsonCallsParser):
    tag, opening = PYTHON_TAG, "{"

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        done = skip(text, start)  # the end of what is parsed
        if text.startswith(PYTHON_TAG, done):
            done += len(PYTHON_TAG)
        calls = []
        while True:
            pos = skip(text, done)
            if pos == len(text):
                return ParsedCalls(calls, done)
            taken = self.take_call(text, pos)
            if taken is None:
                return None
            if taken.end is None:  # the rest is the beginning of a call
                return ParsedCalls(calls, done, taken.call)
            calls.append(taken.call)
            done = taken.end
            pos = skip(text, done)
            if pos < len(text):
                if text[pos] != ";":
                    return None
                done = pos + 1
