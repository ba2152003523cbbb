"""Pythonic tool calls (Llama 3.2's and Llama 4's format): the whole output is a Python list of
calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, possibly
between Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values are Python
literals."""
from __future__ import annotations

import ast
from typing import Any

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedCalls,
    ToolParser,
)
from liteinfer.entrypoints.openai.tool_parsers.json_calls import WHITESPACE, WholeOutputCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(WholeOutputCalls, ToolParser):
    tag, opening = PYTHON_START, "["

    def parse_calls(self, text: str, start: int) -> ParsedCalls | None:
        """The list's calls once it is complete Python; none (yet) while it is not, which
        a streamed list is until its last bracket comes (only then is it parsed)."""
        body = text[start:].strip(WHITESPACE)
        body = body.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip(WHITESPACE)
        if not body.endswith("]"):
            return ParsedCalls([], start)
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:  # unfinished, or never Python: text, if nothing more comes
            return ParsedCalls([], start)
        calls = _calls(tree)
        return None if calls is None else ParsedCalls(calls, len(text))


def _calls(tree: ast.expr) -> list[ParsedCall] | None:
    """The calls a list of calls with literal keyword arguments makes; None for anything else."""
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        name = _name(node.func)
        try:
            arguments = {k.arg: _json_value(ast.literal_eval(k.value)) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if name is None:
            return None
        calls.append(ParsedCall(name, arguments))
    return calls


def _name(func: ast.expr) -> str | None:
    """`f` or a dotted `module.f`."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = _name(func.value)
        return None if owner is None else f"{owner}.{func.attr}"
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
