"""Qwen3 (and QwQ-style) reasoning: the model opens its think block itself,
`<think>\nreasoning\n</think>\n\nanswer`; with `enable_thinking: false` the chat template
writes an empty block into the prompt and the output is all answer."""
from __future__ import annotations

from liteinfer.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
)


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
