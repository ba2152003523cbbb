"""Tool-call parsers by name (vLLM's `--tool-call-parser` names)."""
from __future__ import annotations

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from liteinfer.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from liteinfer.entrypoints.openai.tool_parsers.llama3_json_parser import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"llama3_json": Llama3JsonToolParser,
                                             "hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "ToolParser"]
