"""What a request's output must match (vLLM's StructuredOutputsParams)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json`, a JSON schema (a dict or its text); `regex`; `choice`, one of
    these strings exactly; `grammar`, EBNF (GBNF) text whose start rule is `root`;
    `json_object`, any JSON object. `disable_any_whitespace` allows no whitespace between JSON
    tokens beyond single spaces (small models otherwise tend to emit runs of it).
    `reasoning_end_token_id`: a reasoning model's end-of-thinking token; the output is held to
    the constraint only after it (its reasoning is free), and not at all if it never comes."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs: json must be a schema (an object or its text)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("structured outputs: regex must be a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("structured outputs: grammar must be a non-empty string")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: (kind, spec text, disable_any_whitespace)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, (dict, list)):
            spec = json.dumps(spec, sort_keys=True)
        elif spec is True:
            spec = ""
        return self.kind, spec, self.disable_any_whitespace
