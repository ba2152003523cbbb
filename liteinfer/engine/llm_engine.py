"""The offline driver: the engine core in the caller's process, with the front end's input and
output processing around it and no IPC between them."""
from __future__ import annotations

import logging
from typing import Any

from liteinfer.config import EngineConfig
from liteinfer.engine.core import EngineCore
from liteinfer.engine.output_processor import OutputProcessor
from liteinfer.engine.processor import InputProcessor
from liteinfer.loader import load_model_source
from liteinfer.outputs import RequestOutput
from liteinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """add_request / abort / step over an in-process EngineCore."""

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto"):
        source = load_model_source(model, load_format)
        self.core = EngineCore(model, config, load_format, source=source)
        self.model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        self.tokenizer: Any = source.tokenizer
        self.generation_config = source.generation_config
        self.processor = InputProcessor(self.model_config, self.tokenizer, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validates and queues a request; a ValueError leaves the engine as it was."""
        self.add_requests([(request_id, prompt, params)], arrival_time)

    def add_requests(self, requests: list[tuple[str, str | list[int], SamplingParams]],
                     arrival_time: float | None = None) -> None:
        """Validates and queues requests together (a prompt's n choices: the constraint they
        share is parsed once); a ValueError leaves the engine as it was."""
        processed = self.processor.process(requests, arrival_time)
        added: list[str] = []
        try:
            for request, (_, prompt, _) in zip(processed, requests, strict=True):
                self.output_processor.add_request(request,
                                                  prompt if isinstance(prompt, str) else None)
                added.append(request.request_id)
                self.core.add_request(request)
        except Exception:
            self.abort(added)  # the core ignores ids it never took
            raise

    def abort(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Finishes the named requests (finish reason "abort"); returns their last outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one step of the core; the outputs of the requests that gained tokens or
        finished."""
        core_outputs = self.core.step()
        processed = self.output_processor.process_outputs(core_outputs.outputs,
                                                          core_outputs.timestamp)
        if processed.requests_to_abort:
            self.core.abort_requests(processed.requests_to_abort)
        if (self.output_processor.has_unfinished_requests()
                and not self.core.has_unfinished_requests()):
            # Requests the core no longer holds would be waited for for ever: they fail now.
            lost = self.output_processor.fail_all("the engine core lost this request")
            logger.error("the engine core lost requests %s", [o.request_id for o in lost])
            processed.request_outputs.extend(lost)
        return processed.request_outputs

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
