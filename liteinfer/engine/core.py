"""The engine core: the scheduler, the KV block manager and the model runner, stepped in an
overlap loop. It sees token ids only; front ends (engine/llm_engine.py offline, the server's
engine/async_llm.py over engine/core_process.py) tokenize, detokenize and match stop strings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from liteinfer.config import EngineConfig, ModelConfig, parse_dtype
from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.instrumentation import StepRecord, StepRecorder
from liteinfer.engine.messages import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from liteinfer.engine.model_runner import ModelRunner, StagedStep
from liteinfer.engine.runner_output import ModelRunnerOutput, StepForward
from liteinfer.engine.scheduler import ScheduledStep, Scheduler
from liteinfer.engine.sequence import Sequence
from liteinfer.engine.tensor_parallel import RankDiedError, init_distributed, torchrun_rank
from liteinfer.engine.worker import EXIT_WAIT, WorkerGroup
from liteinfer.loader import ModelSource, load_model_source
from liteinfer.spec_decode import Speculator
from liteinfer.structured_output.manager import (
    FORBIDDEN,
    TERMINATED,
    GrammarWorkerDied,
    StructuredOutputManager,
)
from liteinfer.utils import freeze_heap

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    scheduled: ScheduledStep
    staged: StagedStep  # the runner's view of it
    output: ModelRunnerOutput | None  # None: its sampling waits for its grammars (`forward`)
    forward: StepForward | None = None
    record: StepRecord | None = None  # while the core records steps (`start_recording`)


@dataclass
class Ahead:
    """The next step, scheduled (and given to the model runner, where `staged`: a captured
    decode step's inputs are sent then) before its launch."""

    scheduled: ScheduledStep
    staged: StagedStep | None


def resolve_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """A copy of `config` with its 'auto' settings filled in (device, dtype, attention backend),
    checked against the model. max_model_len stays as given (None: the model's context, as
    much of it as the KV pool holds), which the model runner settles (`KVPoolSize`)."""
    config.validate()
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = torch.device(device).type == "cuda"
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_cuda else "float32"
    parse_dtype(dtype)
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    tp = config.tensor_parallel_size
    for what, n in (("attention heads", model_config.num_attention_heads),
                    ("KV heads", model_config.num_key_value_heads),
                    ("MLP features", model_config.intermediate_size)):
        if n % tp:
            raise ValueError(f"the model's {n} {what} do not split over "
                             f"tensor_parallel_size={tp}")
    if on_cuda and tp > torch.cuda.device_count() and torchrun_rank() is None:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    if config.max_model_len is not None:
        model_config.check_max_model_len(config.max_model_len)
    return dataclasses.replace(config, device=device, dtype=dtype, attention_backend=backend)


def eos_token_ids(model_config: ModelConfig, tokenizer: object | None) -> list[int]:
    """The config's EOS ids and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(eos)
    return sorted(ids)


class EngineCore:
    """One model on one device (or tensor-parallel group), stepping every request it holds.

    `step()` launches the next step before returning the outputs of the one before it, so the
    host schedules step N+1 while the device still runs step N (overlap scheduling); step N's
    sampled tokens feed step N+1 on the device and reach the host afterwards. A step whose
    requests need every earlier token on the host (penalties) is read back before the next.
    A step that samples for constrained requests (structured outputs) is launched without its
    sampling, which waits for the next call: by then the step before it has been read, its
    tokens given to the grammars, and the grammar process has been filling the bitmask while
    this core returned those outputs and schedules the step after. That call samples the step,
    launches the next one and only then reads it, so the device always has a forward pass
    queued while the host processes outputs.

    A step that raises fails its own requests (finish reason "error", blocks returned); the
    others, and the core, go on. A tensor-parallel rank that exits is fatal (RankDiedError).
    """

    def __init__(self, model: str, config: EngineConfig, load_format: str = "auto",
                 source: ModelSource | None = None):
        """source: the model already resolved (a front end in the same process has it)."""
        source = source or load_model_source(model, load_format)
        self.model_config = ModelConfig.from_hf(source.hf_config)
        resolved = resolve_config(config, self.model_config)
        # The EOS ids here; the grammar process gets the tokenizer for its vocabulary.
        self.eos_token_ids = eos_token_ids(self.model_config, source.tokenizer)
        # The other tensor-parallel ranks are workers that run the steps this core schedules
        # (engine/worker.py), unless torchrun started every rank with a core of its own.
        self.workers: WorkerGroup | None = None
        self.external_rank = torchrun_rank() if resolved.tensor_parallel_size > 1 else None
        tp_rank = 0
        if self.external_rank is not None:
            tp_rank = self.external_rank
            world = int(os.environ["WORLD_SIZE"])
            if world != resolved.tensor_parallel_size:
                raise ValueError(f"torchrun started {world} ranks for tensor_parallel_size="
                                 f"{resolved.tensor_parallel_size}")
            init_distributed(tp_rank, world, "env://", resolved.device,
                             int(os.environ.get("LOCAL_RANK", 0)))
        elif resolved.tensor_parallel_size > 1:
            self.workers = WorkerGroup(model, resolved, load_format, self.eos_token_ids)
        if resolved.tensor_parallel_size > 1:
            # Unseeded requests draw from the default generator: the same on every rank.
            torch.manual_seed(resolved.seed)
        self.runner = ModelRunner(self.model_config, resolved, source, source.load_format,
                                  self.eos_token_ids, tp_rank)
        # The configuration as built: the pool's size and the longest sequence it holds.
        pool = self.runner.kv_pool
        self.config = dataclasses.replace(resolved, max_model_len=pool.max_model_len,
                                          num_kv_blocks=pool.num_blocks)
        self.max_model_len = pool.max_model_len
        self.block_manager = BlockManager(pool.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        spec = self.config.speculative
        # Steps are timed for the draft-length policy on CUDA alone: a CPU step's time is the
        # host's (and would make CPU runs schedule differently from run to run), and cores in
        # lockstep under torchrun must decide alike without sharing a clock.
        time_steps = (torch.device(self.config.device).type == "cuda"
                      and self.external_rank is None)
        speculator = None if spec is None else Speculator(spec, self.model_config.vocab_size,
                                                          time_steps)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.max_model_len,
                                   self.config.mixed_prompt_tokens, self.eos_token_ids, speculator,
                                   self.runner.prompt_buckets)
        self.inflight: InFlight | None = None
        self.structured_output = StructuredOutputManager(
            source.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
            self.config.max_sampled_rows)
        # Constrained requests whose grammar is still compiling; queued once it is ready.
        self.compiling: list[Sequence] = []
        self.recorder: StepRecorder | None = None
        freeze_heap()

    @property
    def info(self) -> EngineCoreInfo:
        return EngineCoreInfo(self.max_model_len, self.model_config.vocab_size,
                              self.block_manager.num_blocks, self.config.block_size)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request the front end has validated (engine/processor.py); a ValueError
        if it still cannot run."""
        params = request.sampling_params
        if params.max_tokens is None:
            raise ValueError("max_tokens must be resolved before a request reaches the core")
        n = len(request.prompt_token_ids)
        if n == 0 or n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) must fit "
                             f"in max_model_len={self.max_model_len}")
        constraint = params.structured_outputs
        if constraint is not None and self.config.tensor_parallel_size > 1:
            raise ValueError("structured outputs are not supported with tensor parallelism")
        seq = Sequence(request.request_id, request.prompt_token_ids, params)
        if constraint is not None:
            self.structured_output.add_request(request.request_id, constraint)
        # A grammar compiled before (cached) is ready at once and keeps the request's place; one
        # that failed fails the request through `compiling`, as a compilation that fails later.
        manager = self.structured_output
        if constraint is None or (manager.is_ready(request.request_id)
                                  and manager.error(request.request_id) is None):
            self.scheduler.add(seq)
        else:
            self.compiling.append(seq)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finishes the named requests (unknown or finished ones are ignored). No output is
        sent for them: whoever aborts a request finishes it for its client."""
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, "abort")
        aborted = set(request_ids)
        self.compiling = [s for s in self.compiling if s.request_id not in aborted]
        for rid in request_ids:
            self.structured_output.finish_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling) or (
            self.inflight is not None
            and not all(s.is_finished for s in self.inflight.scheduled.seqs))

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache, e.g. between benchmark runs."""
        self.block_manager.reset_prefix_cache()

    def start_recording(self, profile_ranges: bool = False) -> None:
        """Records every step from now on (engine/instrumentation.py); `profile_ranges` also
        names each step's phases for the torch profiler."""
        self.recorder = StepRecorder(self.runner.describe, self.runner.device.type == "cuda",
                                     profile_ranges)

    def stop_recording(self) -> list[StepRecord]:
        """The steps recorded since `start_recording` (their device times read); recording
        stops. A step launched but not yet read has no `ready` time."""
        if self.recorder is None:
            raise ValueError("the core is not recording steps")
        recorder, self.recorder = self.recorder, None
        return recorder.finish()

    @contextlib.contextmanager
    def recording(self, profile_ranges: bool = False) -> Iterator[list[StepRecord]]:
        """The instrumentation hook for profiling: records the steps run inside the block, and
        fills the list it yields with their StepRecords (host times of each phase, how the step
        ran, its tokens, its device time on CUDA) once the block ends. `profile_ranges` names
        each step's phases ("liteinfer schedule N", "launch N", "update N") for the torch
        profiler."""
        records: list[StepRecord] = []
        self.start_recording(profile_ranges)
        try:
            yield records
        finally:
            records.extend(self.stop_recording())

    def shutdown(self) -> None:
        """Frees the runner's graphs and scratch buffers, then stops the other tensor-parallel
        ranks or leaves torchrun's group."""
        self.runner.release()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        elif self.external_rank is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.structured_output.shutdown()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Launches the next step, then returns the outputs of the previous one."""
        outputs: list[EngineCoreOutput] = self._queue_compiled()
        inflight, self.inflight = self.inflight, None
        ahead: Ahead | None = None
        if inflight is not None and inflight.output is None:
            if self._can_overlap(inflight):
                # While the grammar process fills the bitmask the sampling waits for.
                ahead = self._schedule_ahead(outputs)
            outputs += self._sample_constrained(inflight, ahead)
            if inflight.output is None:  # its sampling failed, and so did its requests
                inflight = ahead = None
        if inflight is not None and not self._can_overlap(inflight):
            outputs += self._resolve(inflight)
            inflight = None
        if ahead is None:
            scheduled, failed = self._schedule()
            outputs += failed
            ahead = Ahead(scheduled, None) if scheduled is not None else None
        if ahead is not None:
            outputs += self._launch(ahead)
        if inflight is not None:
            outputs += self._resolve(inflight)
        if self.structured_output.has_requests:
            for out in outputs:
                if out.finished:
                    self.structured_output.finish_request(out.request_id)
        return EngineCoreOutputs(outputs, self.scheduler.stats(), time.perf_counter())

    def _queue_compiled(self) -> list[EngineCoreOutput]:
        """Queues the constrained requests whose grammar is ready; fails those whose grammar
        did not compile."""
        if not self.compiling:
            return []
        manager = self.structured_output
        manager.poll()
        ready = [s for s in self.compiling if manager.is_ready(s.request_id)]
        if not ready:
            return []
        self.compiling = [s for s in self.compiling if s not in ready]
        failed = []
        for seq in ready:
            error = manager.error(seq.request_id)
            if error is None:
                self.scheduler.add(seq)
            else:
                seq.finish_reason = "error"
                failed.append(EngineCoreOutput(seq.request_id, [], finish_reason="error",
                                               error=error))
        return failed

    def _can_overlap(self, inflight: InFlight) -> bool:
        """Whether the next step may be scheduled before this one's tokens are read: not if
        its sampling reads every earlier token (penalties, a reasoning budget), nor if the
        next step verifies drafts, which follow this step's tokens and what it accepted (or
        were proposed on the device after it)."""
        scheduled = inflight.scheduled
        return not (scheduled.draft_token_ids or scheduled.num_lookahead_tokens
                    or self.scheduler.wants_drafts()
                    or any(s.reads_outputs for s in scheduled.seqs))

    def _schedule(self) -> tuple[ScheduledStep | None, list[EngineCoreOutput]]:
        """The next step (None if there is nothing to run), and the outputs of the requests
        that failed if scheduling raised."""
        if self.recorder is not None:
            self.recorder.scheduling()
        try:
            return self.scheduler.schedule(), []
        except Exception as e:  # the requests fail, the core goes on
            return None, self._fail([*self.scheduler.running, *self.scheduler.waiting], e)

    def _schedule_ahead(self, outputs: list[EngineCoreOutput]) -> Ahead | None:
        """Schedules the next step and sends its inputs (a captured decode step's) before the
        launched one is sampled; failures are added to `outputs`."""
        scheduled, failed = self._schedule()
        outputs += failed
        if scheduled is None:
            return None
        try:
            return Ahead(scheduled, self.runner.stage(scheduled.output))
        except Exception as e:  # as in _launch; the next step is scheduled afresh
            outputs += self._fail(scheduled.seqs, e)
            return None

    def _launch(self, ahead: Ahead) -> list[EngineCoreOutput]:
        """Launches the scheduled step (self.inflight); outputs only of requests that failed.
        A step that samples for constrained requests is launched unsampled."""
        scheduled, staged = ahead.scheduled, ahead.staged
        recorder = self.recorder
        try:
            if recorder is not None:
                recorder.launching()
            if self.workers is not None:
                self.workers.execute_model(scheduled.output)
            staged = staged or self.runner.stage(scheduled.output)
            if self._samples_constrained(scheduled):
                inflight = InFlight(scheduled, staged, None, self.runner.forward(staged))
            else:
                inflight = InFlight(scheduled, staged, self.runner.execute(staged))
        except RankDiedError:
            raise
        except Exception as e:  # the step's requests fail, the core goes on
            return self._fail(scheduled.seqs, e)
        if recorder is not None:
            inflight.record = recorder.launched(scheduled, len(self.scheduler.waiting))
        self.scheduler.mark_launched(scheduled)
        self.inflight = inflight
        return []

    def _samples_constrained(self, scheduled: ScheduledStep) -> bool:
        manager = self.structured_output
        return manager.has_requests and any(
            manager.is_constrained(s.request_id) for s in scheduled.sampling_seqs)

    def _sample_constrained(self, inflight: InFlight, ahead: Ahead | None
                            ) -> list[EngineCoreOutput]:
        """Samples the launched step with its bitmask (every earlier step has been read);
        outputs only of requests that failed. If it fails, so does the step scheduled after it
        (`ahead`): its rows would read tokens never sampled."""
        scheduled = inflight.scheduled
        failed: list[EngineCoreOutput] = []
        try:
            try:
                drafts = {seq.request_id: ds for seq, ds in zip(scheduled.seqs,
                                                                 scheduled.draft_token_ids)
                          if ds}
                bitmask = self.structured_output.grammar_bitmask(
                    [s.request_id for s in scheduled.sampling_seqs], drafts)
            except GrammarWorkerDied as e:  # the constrained requests fail, the others go on
                failed, bitmask = self._fail_constrained(e), None
            inflight.output = self.runner.sample(inflight.staged, inflight.forward, bitmask)
            if inflight.record is not None and self.recorder is not None:
                self.recorder.sampled(inflight.record)
        except Exception as e:  # as in _launch
            return failed + self._fail(
                scheduled.seqs + (ahead.scheduled.seqs if ahead else []), e)
        inflight.forward = None
        return failed

    def _resolve(self, inflight: InFlight) -> list[EngineCoreOutput]:
        """The step's outputs."""
        outputs: list[EngineCoreOutput] = []
        failed: list[EngineCoreOutput] = []
        recorder = self.recorder if inflight.record is not None else None
        if recorder is not None:
            recorder.resolving(inflight.record)
        try:
            if inflight.scheduled.draft_token_ids:
                # A verifying request's grammar takes the tokens it kept, known only after
                # the update (such a step is never overlapped with the next one).
                outputs = self.scheduler.update_from_output(inflight.scheduled, inflight.output)
                advancing = self._advance_grammars(inflight, outputs)
            else:
                advancing = self._advance_grammars(inflight)
                outputs = self.scheduler.update_from_output(inflight.scheduled, inflight.output)
            try:
                self._apply_grammar_statuses(outputs, advancing)
            except GrammarWorkerDied as e:  # the constrained requests fail, the others go on
                failed = self._fail_constrained(e)
            self.scheduler.update_draft_token_ids(inflight.scheduled, inflight.output)
        except Exception as e:  # as in _launch
            # The update's outputs stand (those of the requests it finished among them), and
            # the step's requests still running fail after them.
            return outputs + failed + self._fail(inflight.scheduled.seqs, e)
        if recorder is not None:
            recorder.ready(inflight.record, outputs)
        return outputs + failed

    def _advance_grammars(self, inflight: InFlight,
                          outputs: list[EngineCoreOutput] | None = None) -> list[str]:
        """Gives each constrained request's new token to its grammar as soon as the step's
        tokens are on the host, and asks for the bitmask rows of the launched step if it waits
        for one: the grammar process works while the core processes the outputs. Returns the
        requests advanced, in order."""
        manager = self.structured_output
        if not manager.has_requests:
            return []
        if outputs is not None:  # a step that verified drafts: each request's kept tokens
            accepts = [(o.request_id, o.new_token_ids) for o in outputs
                       if not o.finished and manager.is_constrained(o.request_id)]
        else:
            tokens = inflight.output.wait().token_ids
            accepts = [(s.request_id, [t]) for s, t in zip(inflight.scheduled.sampling_seqs,
                                                            tokens)
                       if not s.is_finished and manager.is_constrained(s.request_id)]
        next_rows, num_rows = [], 0
        if self.inflight is not None and self.inflight.output is None:
            upcoming = self.inflight.scheduled.sampling_seqs
            num_rows = len(upcoming)
            next_rows = [(row, s.request_id) for row, s in enumerate(upcoming)
                         if not s.is_finished and manager.is_constrained(s.request_id)]
        return manager.advance(accepts, next_rows, num_rows)

    def _apply_grammar_statuses(self, outputs: list[EngineCoreOutput], advanced: list[str]
                                ) -> None:
        """A token at its grammar's end finishes the request ("stop"); one the grammar forbids
        (none can be sampled, unless min_tokens held back the only stop token allowed) fails it.
        Requests that finished on their own (length, a stop token) keep their reason."""
        if not advanced:
            return
        statuses = dict(zip(advanced, self.structured_output.accepted()))
        for out in outputs:
            status = statuses.get(out.request_id)
            if out.finished or status is None:
                continue
            if status == FORBIDDEN:
                out.finish_reason = "error"
                out.error = "the sampled token is not one the output's grammar allows"
            elif status == TERMINATED:
                out.finish_reason = "stop"
            if out.finished:
                self.scheduler.finish_requests([out.request_id], out.finish_reason)

    def _fail_constrained(self, error: GrammarWorkerDied) -> list[EngineCoreOutput]:
        """Fails every constrained request the scheduler holds (their grammars are gone)."""
        manager = self.structured_output
        seqs = [s for s in (*self.scheduler.running, *self.scheduler.waiting)
                if manager.is_constrained(s.request_id)]
        if seqs:
            logger.error("%s; its %d constrained requests are finished with an error", error,
                         len(seqs))
        return self.scheduler.fail(seqs, str(error))

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[EngineCoreOutput]:
        if self.workers is not None:
            # A dead rank is fatal: every later step would fail too.
            self.workers.check(EXIT_WAIT)
        logger.error("a step failed; its %d requests are finished with an error:\n%s",
                     len(seqs), "".join(traceback.format_exception(error)))
        return self.scheduler.fail(seqs, f"{type(error).__name__}: {error}")

