"""DeepSeek-R1 reasoning: its chat template ends the prompt with `<think>\n`, so the output
is reasoning from its first token up to `</think>`, then the answer (an opening `<think>` the
model writes anyway is skipped)."""
from __future__ import annotations

from liteinfer.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
)


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
