"""Tool-call parsers by name (vLLM's `--tool-call-parser` names)."""
from __future__ import annotations

from liteinfer.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from liteinfer.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from liteinfer.entrypoints.openai.tool_parsers.llama3_json_parser import Llama3JsonToolParser
from liteinfer.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from liteinfer.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from liteinfer.entrypoints.openai.tool_parsers.qwen3_coder_tool_parser import (
    Qwen3CoderToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {"llama3_json": Llama3JsonToolParser,
                                             "hermes": HermesToolParser,
                                             "qwen3_coder": Qwen3CoderToolParser,
                                             "mistral": MistralToolParser,
                                             "pythonic": PythonicToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "PythonicToolParser", "Qwen3CoderToolParser", "ToolParser"]
