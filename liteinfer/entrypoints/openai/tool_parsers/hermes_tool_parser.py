"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): content, then each call as
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`."""
from __future__ import annotations

from liteinfer.entrypoints.openai.markers import find_marker, partial_marker
from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCalls
from liteinfer.entrypoints.openai.tool_parsers.json_calls import JsonCallsParser, skip

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(JsonCallsParser):
    def find_calls(self, text: str, start: int = 0) -> int | None:
        return find_marker(text, OPEN, start)

    def holdback(self, text: str) -> int:
        return partial_marker(text, OPEN)

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        calls, done = [], start  # done: the end of what is parsed
        while True:
            pos = skip(text, done)
            if len(text) - pos < len(OPEN) and OPEN.startswith(text[pos:]):
                return ParsedCalls(calls, done)
            if not text.startswith(OPEN, pos):
                return None
            body = skip(text, pos + len(OPEN))
            if body == len(text):
                return ParsedCalls(calls, done)
            taken = self.take_call(text, body)
            if taken is None:
                return None
            if taken.end is None:
                return ParsedCalls(calls, done, taken.call)
            end = skip(text, taken.end)
            if len(text) - end < len(CLOSE) and CLOSE.startswith(text[end:]):
                return ParsedCalls(calls, done, taken.call)
            if not text.startswith(CLOSE, end):
                return None
            calls.append(taken.call)
            done = end + len(CLOSE)
