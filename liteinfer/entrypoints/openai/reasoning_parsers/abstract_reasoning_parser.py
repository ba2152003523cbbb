"""The interface of reasoning parsers: a model's output text -> its reasoning (what it wrote
between the think markers) and its content (the rest, the answer), whole or streamed. A parser
object serves one choice of one request: streamed, it keeps what it has sent."""
from __future__ import annotations

from typing import Any

from liteinfer.entrypoints.openai.markers import find_marker, partial_marker


class ReasoningParser:
    """Reasoning is what comes between `start` and `end`. A model whose chat template opens
    the think block in the prompt (`starts_in_reasoning`) writes its reasoning from its first
    token (an opening marker there is skipped); another only after it writes `start`. An
    output whose reasoning never ends is all reasoning (it ran out of tokens thinking)."""

    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False

    def __init__(self) -> None:
        self._sent_reasoning = 0
        self._sent_content = 0

    @classmethod
    def answer_starts_after(cls, tokenizer: Any, prompt: list[int], history: list[int]
                            ) -> int | None:
        """The token after which the answer (what an output constraint holds) begins: the
        end marker, unless the generation prompt (what `prompt` adds to `history`, the
        conversation rendered without it) has closed the reasoning already (Qwen3 with
        enable_thinking off), or the marker is not one token. None: from the first token."""
        end = tokenizer.convert_tokens_to_ids(cls.end)
        if not isinstance(end, int) or end == tokenizer.unk_token_id:
            return None
        generation = prompt[len(history):] if prompt[:len(history)] == history else prompt
        return None if end in generation else end

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for either that is empty."""
        reasoning, content = self._split(text, finished=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) not sent yet once the output so far is `text`. What may still
        become a marker is held back until more text comes."""
        reasoning, content = self._split(text, finished)
        delta = reasoning[self._sent_reasoning:], content[self._sent_content:]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return delta

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`; unless `finished`, without a marker's beginning at
        its end. The whitespace around the reasoning and before the answer (the newlines the
        models write beside the markers) is neither's; a streamed text's last whitespace is
        held back while it may turn out to be so. Each is a prefix of what it becomes as the
        text grows."""
        before = ""
        if self.starts_in_reasoning:
            lead = len(text) - len(text.lstrip())
            if text.startswith(self.start, lead):
                text = text[lead + len(self.start):]
            elif not finished and self.start.startswith(text[lead:]):
                return "", ""
        else:
            at = find_marker(text, self.start)
            if at is None:
                return "", text if finished else text[:len(text) - partial_marker(text,
                                                                                  self.start)]
            before, text = text[:at], text[at + len(self.start):]
        at = find_marker(text, self.end)
        if at is not None:
            return text[:at].strip(), before + text[at + len(self.end):].lstrip()
        if not finished:
            text = text[:len(text) - partial_marker(text, self.end)]
        return text.strip(), before
