"""Grammars with xgrammar: a request's constraint parsed into an `xgrammar.Grammar` (checked in
the front end, so that a bad schema is the client's error before anything is queued) and
compiled against the model's vocabulary (in the engine core)."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from liteinfer.structured_output.params import StructuredOutputsParams

# xgrammar's errors begin with "[hh:mm:ss] /path/file.cc:123: " and may name a failed check.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_LABELS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
           "choice": "choice", "grammar": "grammar"}


def choice_ebnf(choices: Sequence[str]) -> str:
    """A grammar matching exactly one of `choices` (string literals escaped as JSON does)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as a grammar; ValueError with the parser's message if it is invalid."""
    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                params.json, any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        message = _SOURCE_PREFIX.sub("", str(e).strip())
        raise ValueError(f"invalid {_LABELS[kind]} for structured outputs: "
                         f"{message}") from None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
                   ) -> xgr.TokenizerInfo:
    """A model's vocabulary as xgrammar reads it (once: a 128k vocabulary takes a while), padded
    to the width of the model's logits (`vocab_size`)."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(stop_token_ids))


class XgrammarBackend:
    """Compiles grammars for one model's vocabulary (`tokenizer_info`)."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2):
        # Compiled grammars are cached by the manager, keyed by the request's constraint.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(build_grammar(params))
