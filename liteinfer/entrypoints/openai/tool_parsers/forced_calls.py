"""The calls of a forced tool choice, whose output a JSON schema holds (structured.py's
`forced_tool_schema`): a named function's arguments object, or for "required" an array of
`{"name": ..., "parameters": {...}}` calls. Read as the parsers read what models write, so that
they stream the same way (the name first, then the arguments as they are written)."""
from __future__ import annotations

from typing import Any

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
)
from liteinfer.entrypoints.openai.tool_parsers.json_calls import JsonCallsParser, skip


class ForcedCallsParser(JsonCallsParser):
    """The whole output is the calls: nothing of it is content until it turns out not to be
    (cut off at the length limit)."""

    def find_calls(self, text: str, start: int = 0) -> int | None:
        return 0

    def holdback(self, text: str) -> int:
        return 0


class RequiredCallsParser(ForcedCallsParser):
    """tool_choice "required": an array of calls."""

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        pos = skip(text, start)
        if pos == len(text):
            return ParsedCalls([], start)
        return self.parse_array(text, start, pos + 1) if text[pos] == "[" else None


class NamedCallParser(ForcedCallsParser):
    """A named function: the output is its arguments."""

    def __init__(self, name: str, tools: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.name = name

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        pos = skip(text, start)
        if pos == len(text):
            return ParsedCalls([], start, ParsedCall(self.name, ""))
        taken = self.take_arguments(text, pos, self.name)
        if taken is None:
            return None
        if taken.end is None:
            return ParsedCalls([], start, taken.call)
        return ParsedCalls([taken.call], taken.end)
