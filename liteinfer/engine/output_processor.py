"""Front-end output processing: the core's per-step token ids into text and RequestOutputs.

Each request's text is decoded incrementally (engine/detokenizer.py). A stop string is found
here, not in the core: the request is then finished for its caller at once, and the driver
aborts it in the core (`ProcessedOutputs.requests_to_abort`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from liteinfer.engine.detokenizer import IncrementalDetokenizer
from liteinfer.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from liteinfer.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from liteinfer.sampling_params import RequestOutputKind


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)  # stopped on a stop string


class RequestState:
    """One request's tokens, text, logprobs and timings in the front end."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any):
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.sampling_params
        self.output_token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                   self.params)
                            if tokenizer is not None and self.params.detokenize else None)

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""


class OutputProcessor:
    """The requests a front end has in flight, turned into outputs as their tokens arrive."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None = None) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = RequestState(request, prompt, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput],
                        timestamp: float | None = None) -> ProcessedOutputs:
        """timestamp: when the core had the step's tokens (perf_counter on the same host)."""
        now = timestamp if timestamp is not None else time.perf_counter()
        processed = ProcessedOutputs()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted by its caller while the step ran
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            new_text, new_ids = self._append(state, out, now)
            detok = state.detokenizer
            if detok is not None and detok.stop_string is not None and finish_reason != "error":
                # A stop string wins over a length limit it coincides with.
                if finish_reason is None:
                    processed.requests_to_abort.append(out.request_id)
                finish_reason, stop_reason = "stop", detok.stop_string
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.requests[out.request_id]
            elif state.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            processed.request_outputs.append(
                self._output(state, new_ids, new_text, finish_reason, stop_reason, out.error))
        return processed

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finishes the named requests for their callers (finish reason "abort")."""
        outputs = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            new_text = state.detokenizer.update([], finished=True) if state.detokenizer else ""
            state.metrics.finished_time = time.perf_counter()
            outputs.append(self._output(state, [], new_text, "abort", None, None))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finishes every request with an error (the core is gone)."""
        outputs = [self._output(state, [], "", "error", None, error)
                   for state in self.requests.values()]
        self.requests.clear()
        return outputs

    def _append(self, state: RequestState, out: EngineCoreOutput, now: float
                ) -> tuple[str, list[int]]:
        """Adds the output's tokens; returns the new final text and the tokens that count. A
        stop string may end at any of several tokens that arrive together (a front end that
        fell behind): the tokens after it are dropped, as if the request had stopped there."""
        new = out.new_token_ids
        detok = state.detokenizer
        state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [self._logprobs(e, detok is not None) if e is not None
                                     else None for e in out.prompt_logprobs]
        m = state.metrics
        if new:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        stopped_on_token = out.finish_reason == "stop"
        text = ""
        if detok is not None and state.params.stop and len(new) > 1:
            for i, token in enumerate(new):
                last = i == len(new) - 1
                text += detok.update([token], finished=out.finished and last,
                                     stopped_on_token=stopped_on_token and last)
                if detok.stop_string is not None:
                    new = new[:i + 1]
                    break
        elif detok is not None:
            text = detok.update(new, finished=out.finished, stopped_on_token=stopped_on_token)
        state.output_token_ids += new
        if state.logprobs is not None and out.new_logprobs is not None:
            state.logprobs += [self._logprobs(e, detok is not None)
                               for e in out.new_logprobs[:len(new)]]
        return text, new

    def _logprobs(self, entry: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        """{token: Logprob} of one position, the chosen token first, then the top-N; each
        token's text if `decode`."""
        tokenizer = self.tokenizer
        ranks = [entry.rank, *range(1, len(entry.token_ids))]
        # A chosen token among the top-N keeps its place first.
        return {t: Logprob(lp, r, tokenizer.decode([t]) if decode else None)
                for t, lp, r in zip(entry.token_ids, entry.logprobs, ranks)}

    @staticmethod
    def _output(state: RequestState, new_token_ids: list[int], new_text: str,
                finish_reason: str | None, stop_reason: int | str | None,
                error: str | None) -> RequestOutput:
        """A snapshot: later steps never change what a caller holds. With DELTA outputs the
        completion holds only what is new. `new_token_ids` is the caller's to keep (a list
        nothing else holds); positional arguments, as this runs per request per step."""
        logprobs = state.logprobs
        if state.params.output_kind == RequestOutputKind.DELTA:
            completion = CompletionOutput(
                0, new_text, new_token_ids,
                None if logprobs is None else logprobs[len(logprobs) - len(new_token_ids):],
                finish_reason, stop_reason)
        else:
            completion = CompletionOutput(
                0, state.text, list(state.output_token_ids),
                None if logprobs is None else list(logprobs), finish_reason, stop_reason)
        m = state.metrics
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, [completion],
            finish_reason is not None,
            RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                           m.last_token_time, m.finished_time),
            new_token_ids, new_text, state.num_cached_tokens, state.prompt_logprobs, error)
