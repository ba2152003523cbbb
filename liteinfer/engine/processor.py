"""Front-end input processing: prompts into token ids, checked against the model, so that
only requests that can run reach the engine core (a bad one is refused before it is
admitted, and never fails a step that other requests share)."""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from liteinfer.config import ModelConfig
from liteinfer.engine.messages import EngineCoreRequest
from liteinfer.sampling_params import SamplingParams
from liteinfer.structured_output.backend import build_grammar
from liteinfer.utils import ints_below

# The reasoning section's markers, as the reasoning models served write them (Qwen3,
# DeepSeek-R1): a reasoning budget is counted between them.
THINK_MARKERS = ("<think>", "</think>")

Message = dict[str, Any]


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings a model's generation_config.json sets, as SamplingParams fields."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {k: generation_config[k] for k in keys if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def check_text(text: str, what: str) -> None:
    """A ValueError for text that cannot be encoded as UTF-8 (lone surrogates), which the
    tokenizer would reject with an error of its own."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} at position "
                         f"{e.start}") from None


class InputProcessor:
    """Tokenizes and validates requests for one model (the tokenizer may be None: prompts must
    then be token ids)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, max_model_len: int):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def think_token_ids(self) -> tuple[int, int]:
        """The tokens of the think markers; ValueError if they are not tokens of the model's."""
        tok = self.tokenizer
        ids = [tok.convert_tokens_to_ids(m) for m in THINK_MARKERS] if tok is not None else []
        if len(ids) != 2 or any(not isinstance(i, int) or i == tok.unk_token_id for i in ids):
            raise ValueError("thinking_token_budget needs a reasoning model: its tokenizer has "
                             f"no {' and '.join(THINK_MARKERS)} tokens")
        return ids[0], ids[1]

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompt token ids")
        check_text(text, "the prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        """A conversation rendered with the tokenizer's chat template, as token ids."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"a chat message needs a 'role', got {m!r}")
            if isinstance(m.get("content"), str):
                check_text(m["content"], "a message's content")
        # Render, then encode without adding special tokens: the template already has them.
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=False, **template_kwargs)
        return self.tokenize(text, add_special_tokens=False)

    def check_token_ids(self, token_ids: Iterable[Any], what: str) -> None:
        """A ValueError unless every id is one of the model's vocabulary."""
        vocab = self.vocab_size
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not ids or ints_below(ids, vocab):  # only bad ids need the loop that names them
            return
        bad = [t for t in ids
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def process(self, requests: Sequence[tuple[str, str | list[int], SamplingParams]],
                arrival_time: float | None = None) -> list[EngineCoreRequest]:
        """The (request id, prompt, params) requests as the core takes them, each with
        max_tokens resolved in a copy of its params (the caller's objects are never changed).
        ValueError for anything that cannot run. A prompt or a constraint several of them share
        (the choices of one prompt) is tokenized and checked, or its grammar parsed, once."""
        # By id: every object is alive in `requests` until the call returns.
        prompts: dict[int, list[int]] = {}
        checked: set[int] = set()
        return [self._process(rid, prompt, params, arrival_time, prompts, checked)
                for rid, prompt, params in requests]

    def _process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 arrival_time: float | None, prompts: dict[int, list[int]],
                 checked: set[int]) -> EngineCoreRequest:
        params.validate()
        token_ids = prompts.get(id(prompt))
        if token_ids is None:
            token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            if not token_ids:
                raise ValueError("the prompt is empty")
            self.check_token_ids(token_ids, "prompt")
            prompts[id(prompt)] = token_ids
        else:  # each request's own list: its sequence grows from it
            token_ids = list(token_ids)
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs", "top_k"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary size "
                                 f"{vocab}")
        self.check_token_ids(params.logit_bias or (), "logit_bias")
        if params.thinking_token_budget is not None and params.think_token_ids is None:
            params.think_token_ids = self.think_token_ids()
        constraint = params.structured_outputs
        if constraint is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            if id(constraint) not in checked:
                build_grammar(constraint)  # the parser's message if it is invalid
                checked.add(id(constraint))
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt of {n} tokens leaves no room in "
                             f"max_model_len={self.max_model_len}")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n
        elif n + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        return EngineCoreRequest(request_id, token_ids, params.with_max_tokens(max_tokens),
                                 arrival_time or time.perf_counter())
