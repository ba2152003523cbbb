"""The offline API: LLM(model).generate(...), .chat(...), .stream(...)."""
from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict, deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from liteinfer.config import EngineConfig
from liteinfer.engine.llm_engine import LLMEngine
from liteinfer.engine.processor import Message, generation_defaults
from liteinfer.outputs import RequestOutput
from liteinfer.sampling_params import RequestOutputKind, SamplingParams, choice_seed

Prompt = str | list[int] | dict[str, Any]


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
            return [params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        return list(params)

    def _add(self, prompts: list[str | list[int]], params: list[SamplingParams],
             output_kind: RequestOutputKind | None = None) -> list[tuple[str, list[str]]]:
        """Queues every prompt's n choices (choice i of a seeded request draws from seed + i,
        so that they differ and each can be reproduced); returns each prompt's request id and
        its choices' ids. One bad prompt queues none of the batch."""
        ids: list[tuple[str, list[str]]] = []
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                base = str(next(self._ids))
                ids.append((base, [base] if p.n == 1 else [f"{base}-{i}" for i in range(p.n)]))
                if output_kind is not None:
                    p = dataclasses.replace(p, output_kind=output_kind)
                choices = [(rid, prompt, p if p.seed is None or i == 0 else
                            dataclasses.replace(p, seed=choice_seed(p.seed, i)))
                           for i, rid in enumerate(ids[-1][1])]
                self.engine.add_requests(choices)
                added += ids[-1][1]
        except ValueError:
            self.engine.abort(added)
            raise
        return ids

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt, batched continuously; outputs in prompt order, each with
        its SamplingParams.n choices. A request that fails (finish reason "error") does not
        take the others with it."""
        prompts = self._normalize(prompts)
        # Only the final outputs are wanted: no snapshot is built per token.
        groups = self._add(prompts, self._params_list(sampling_params, len(prompts)),
                           RequestOutputKind.FINAL_ONLY)
        wanted = {rid for _, group in groups for rid in group}
        final: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(wanted), desc="generating", disable=not use_tqdm) as bar:
                while len(final) < len(wanted):
                    for out in self._step():
                        if out.request_id not in wanted:
                            self._buffered[out.request_id].append(out)
                        elif out.finished:
                            final[out.request_id] = out
                            bar.update(1)
        finally:  # interrupted: nothing of this call stays queued
            self.engine.abort([rid for rid in wanted if rid not in final])
        return [_merge_choices(base, [final[rid] for rid in group]) for base, group in groups]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c, add_generation_prompt)
                              for c in conversations], sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message],
                            add_generation_prompt: bool = True) -> list[int]:
        return self.engine.processor.apply_chat_template(messages, add_generation_prompt)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yields this request's output each time it gains tokens; the last one is finished.
        Other requests keep running and keep their outputs."""
        prompts = self._normalize(prompt)
        if len(prompts) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(prompts)}")
        params = self._params_list(sampling_params, 1)
        if params[0].n != 1:
            raise ValueError("stream() takes one choice (n=1)")
        ((_, (rid,)),) = self._add(prompts, params)
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
        return bool(self.engine.abort(request_id))

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


def _merge_choices(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n choices as one RequestOutput (choice i at index i)."""
    if len(outs) == 1:
        return outs[0]
    choices = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return dataclasses.replace(outs[0], request_id=request_id, outputs=choices,
                               new_token_ids=[], new_text="",
                               error="; ".join(o.error for o in outs if o.error) or None)
