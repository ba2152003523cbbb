"""Mistral tool calls, after the `[TOOL_CALLS]` token (kept in the text: the parser asks for
special tokens). Two layouts: a JSON array of calls, `[TOOL_CALLS] [{"name": "f", "arguments":
{...}}, ...]` (Mistral 7B v0.3, Nemo, Small 2409: tokenizers before v11), and one call per
marker, `[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}` (v11 and later: Small 3.2,
Devstral, Magistral). Content may come before the first marker."""
from __future__ import annotations

import re

from liteinfer.entrypoints.openai.markers import find_marker, partial_marker
from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
)
from liteinfer.entrypoints.openai.tool_parsers.json_calls import JsonCallsParser, skip

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(JsonCallsParser):
    skip_special_tokens = False

    def find_calls(self, text: str, start: int = 0) -> int | None:
        return find_marker(text, TOOL_CALLS, start)

    def holdback(self, text: str) -> int:
        return partial_marker(text, TOOL_CALLS)

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        pos = skip(text, start + len(TOOL_CALLS))
        if pos == len(text):
            return ParsedCalls([], start)
        if text[pos] == "[":
            return self.parse_array(text, start, pos + 1)
        return self._marked(text, start)

    def _marked(self, text: str, start: int) -> ParsedCalls | None:
        """`[TOOL_CALLS]name[ARGS]{...}`, repeated."""
        calls, done = [], start
        while True:
            pos = skip(text, done)
            if pos == len(text) or TOOL_CALLS.startswith(text[pos:]):
                return ParsedCalls(calls, done)
            if not text.startswith(TOOL_CALLS, pos):
                return None
            pos += len(TOOL_CALLS)
            name_end = _NAME.match(text, pos).end()
            if name_end == len(text) or ARGS.startswith(text[name_end:]):
                return ParsedCalls(calls, done)
            if name_end == pos or not text.startswith(ARGS, name_end):
                return None
            name = text[pos:name_end]
            args = skip(text, name_end + len(ARGS))
            if args == len(text):
                return ParsedCalls(calls, done, ParsedCall(name, ""))
            taken = self.take_arguments(text, args, name)
            if taken is None:
                return None
            if taken.end is None:
                return ParsedCalls(calls, done, taken.call)
            calls.append(taken.call)
            done = taken.end
