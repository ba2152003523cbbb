"""Reasoning parsers by name (vLLM's `--reasoning-parser` names)."""
from __future__ import annotations

from liteinfer.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
)
from liteinfer.entrypoints.openai.reasoning_parsers.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
)
from liteinfer.entrypoints.openai.reasoning_parsers.qwen3_reasoning_parser import (
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                       "deepseek_r1": DeepSeekR1ReasoningParser}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "ReasoningParser"]
