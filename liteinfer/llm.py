"""The offline API: LLM(model).generate(...), .chat(...), .stream(...)."""
from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence as Seq
from typing import Any

from tqdm import tqdm

from liteinfer.config import EngineConfig
from liteinfer.engine.llm_engine import LLMEngine
from liteinfer.outputs import RequestOutput
from liteinfer.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings a model's generation_config.json sets, as SamplingParams fields."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {k: generation_config[k] for k in keys if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def apply_chat_template(tokenizer: Any, messages: list[Message],
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation rendered with the tokenizer's chat template, as token ids (with the
    function `tools` the model may call, for templates that render them)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"a chat message needs 'role' and 'content', got {m!r}")
    # Render, then encode without adding special tokens: the template already has them.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


class LLM:
    """A model with its engine. Keyword arguments are `EngineConfig` fields.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].outputs[0].text
    """

    def __init__(self, model: str, load_format: str = "auto", **engine_args: Any):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; valid: {sorted(fields)}")
        self.engine = LLMEngine(model, EngineConfig(**engine_args), load_format)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # Outputs produced by a step for requests other than the one being streamed.
        self._buffered: dict[str, deque[RequestOutput]] = defaultdict(deque)

    def _normalize(self, prompts: Prompt | Seq[Prompt]) -> list[str | list[int]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        out: list[str | list[int]] = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
                if p is None:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            if not isinstance(p, (str, list)):
                raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p)}")
            out.append(p)
        return out

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (as vLLM does)."""
        return SamplingParams(**generation_defaults(self.engine.generation_config))

    def _params_list(self, params: SamplingParams | Seq[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if params is None:
            params = self.default_sampling_params()
        if isinstance(params, SamplingParams):
            return [dataclasses.replace(params) for _ in range(n)]
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        return [dataclasses.replace(p) for p in params]

    def _add(self, prompts: list[str | list[int]], params: list[SamplingParams]) -> list[str]:
        """Validates every request first, so one bad prompt queues none of the batch."""
        ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            raise
        return ids

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt, batched continuously; outputs in prompt order."""
        prompts = self._normalize(prompts)
        ids = self._add(prompts, self._params_list(sampling_params, len(prompts)))
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(final) < len(ids):
                for out in self._step():
                    if out.request_id not in wanted:
                        self._buffered[out.request_id].append(out)
                    elif out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c, add_generation_prompt)
                              for c in conversations], sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields this request's output each time it gains tokens; the last one is finished.
        Other requests keep running and keep their outputs."""
        prompts = self._normalize(prompt)
        if len(prompts) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(prompts)}")
        (rid,) = self._add(prompts, self._params_list(sampling_params, 1))
        try:
            while True:
                while self._buffered[rid]:
                    out = self._buffered[rid].popleft()
                    yield out
                    if out.finished:
                        return
                for out in self._step():
                    self._buffered[out.request_id].append(out)
        finally:
            self._buffered.pop(rid, None)
            self.engine.abort(rid)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def _step(self) -> list[RequestOutput]:
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("no requests are running")
        return self.engine.step()

    def shutdown(self) -> None:
        """Releases the model and the KV pool (e.g. before loading another model)."""
        from liteinfer.utils import free_device_memory
        self.engine.shutdown()
        del self.engine
        free_device_memory()
