"""Per-step instrumentation of the engine core: what each step ran and when, for timelines and
profiles (`EngineCore.recording`, the hook the profiling scripts use, and
`EngineCore.start_recording`). Off unless started: the core then only tests for None.

A step's host times are perf_counter seconds: when its scheduling began, when its launch began
and ended, when reading its tokens back began, and when its outputs were ready on the host. On
CUDA two events bracket the step on the device; they are read once the device has passed them
(`query`, never a wait), so recording adds no synchronization to the step loop. Optional torch
profiler ranges name each phase.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liteinfer.engine.messages import EngineCoreOutput
from liteinfer.engine.step_batch import StepBatch

EAGER = "eager"
DECODE_GRAPH = "decode-graph"
PROMPT_GRAPH = "prompt-graph"


@dataclass(frozen=True)
class StepRun:
    """How the runner ran a step: eagerly, or as a replay of a captured graph of `size`
    (a decode graph's rows; a prompt graph's decoding rows and prompt tokens)."""

    mode: str
    size: tuple[int, ...] = ()


@dataclass
class StepRecord:
    """One launched step. Token counts split the step's computed tokens: prompt tokens (prompt
    chunks, recomputed prompts), decode tokens (one per decoding or verifying sequence) and the
    draft tokens verified beside them."""

    step: int
    schedule_start: float
    launch_start: float
    launch_end: float
    rows: int  # sequences in the step
    prompt_tokens: int
    decode_tokens: int
    draft_tokens: int
    waiting: int  # requests queued, not in this step
    mode: str
    graph_size: tuple[int, ...]
    update_start: float | None = None  # reading its tokens back began (the update phase)
    ready: float | None = None  # outputs on the host; None if the step failed
    output_tokens: int = 0  # tokens the step gave its requests (accepted drafts included)
    gpu_ms: float | None = None  # device span of the step (CUDA only)
    gpu_idle_ms: float | None = None  # device idle between the previous step and this one

    @property
    def schedule_s(self) -> float:
        """Host time scheduling the step."""
        return self.launch_start - self.schedule_start

    @property
    def launch_s(self) -> float:
        """Host time launching it: its inputs, the model (a graph replay or eager launches;
        on a CPU, its computation too) and the sampler."""
        return self.launch_end - self.launch_start

    @property
    def update_s(self) -> float | None:
        """Host time from reading its tokens back (waiting for the device included) to its
        outputs; None if it has none. In the overlapped loop it runs after the next step's
        launch."""
        if self.ready is None or self.update_start is None:
            return None
        return self.ready - self.update_start


def token_counts(scheduled: StepBatch) -> tuple[int, int, int]:
    """(prompt, decode, draft) tokens the step computes."""
    decode = scheduled.num_decodes
    draft = prompt = 0
    for i in range(scheduled.num_decodes, len(scheduled.seqs)):
        drafts = scheduled.num_drafts(i)
        if drafts:
            decode += 1
            draft += drafts
        else:
            prompt += scheduled.num_tokens[i]
    return prompt, decode, draft


class _Range:
    """A torch profiler range opened and closed by calls rather than a `with` block, since a
    phase starts and ends in different methods of the core."""

    def __init__(self) -> None:
        self._open: torch.profiler.record_function | None = None

    def enter(self, name: str) -> None:
        self.exit()
        self._open = torch.profiler.record_function(name)
        self._open.__enter__()

    def exit(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


class StepRecorder:
    """Collects a StepRecord per launched step. `describe` says how the runner ran a step
    (ModelRunner.describe); `cuda` times steps on the device."""

    def __init__(self, describe: Callable[[StepBatch], StepRun], cuda: bool,
                 profile_ranges: bool = False):
        self.records: list[StepRecord] = []
        self._describe = describe
        self._cuda = cuda
        self._ranges = _Range() if profile_ranges else None
        self._schedule_start = self._launch_start = 0.0
        self._start_event: torch.cuda.Event | None = None
        # Records whose events the device has not passed yet, oldest first, with the events.
        self._timing: deque[tuple[StepRecord, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._spare: list[torch.cuda.Event] = []
        self._last_end: torch.cuda.Event | None = None

    # ---- the core's hooks ---------------------------------------------------------------
    def scheduling(self) -> None:
        self._schedule_start = time.perf_counter()
        self._enter("schedule", len(self.records))

    def launching(self) -> None:
        self._launch_start = time.perf_counter()
        self._enter("launch", len(self.records))
        if self._cuda:
            self._read_events()
            self._start_event = self._event()
            self._start_event.record()

    def launched(self, scheduled: StepBatch, waiting: int) -> StepRecord:
        end = time.perf_counter()
        end_event = None
        if self._cuda:
            end_event = self._event()
            end_event.record()
        run = self._describe(scheduled)
        prompt, decode, draft = token_counts(scheduled)
        record = StepRecord(len(self.records), self._schedule_start, self._launch_start, end,
                            len(scheduled.seqs), prompt, decode, draft, waiting, run.mode,
                            run.size)
        self.records.append(record)
        if end_event is not None:
            self._timing.append((record, self._start_event, end_event))
        self._exit()
        return record

    def sampled(self, record: StepRecord) -> None:
        """A step launched unsampled has been sampled: its device span ends later."""
        if self._timing and self._timing[-1][0] is record:
            self._timing[-1][2].record()

    def resolving(self, record: StepRecord) -> None:
        record.update_start = time.perf_counter()
        self._enter("update", record.step)

    def ready(self, record: StepRecord, outputs: list[EngineCoreOutput]) -> None:
        record.ready = time.perf_counter()
        record.output_tokens = sum(len(o.new_token_ids) for o in outputs)
        self._exit()

    def finish(self) -> list[StepRecord]:
        """Waits for the device and reads every step's times; returns the records."""
        self._exit()
        if self._timing:
            self._timing[-1][2].synchronize()
            self._read_events()
        return self.records

    # ---- internals ----------------------------------------------------------------------
    def _enter(self, phase: str, step: int) -> None:
        if self._ranges is not None:
            self._ranges.enter(f"liteinfer {phase} {step}")

    def _exit(self) -> None:
        if self._ranges is not None:
            self._ranges.exit()

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def _read_events(self) -> None:
        """Times the steps the device has finished, and recycles their events."""
        while self._timing and self._timing[0][2].query():
            record, start, end = self._timing.popleft()
            record.gpu_ms = start.elapsed_time(end)
            if self._last_end is not None:
                record.gpu_idle_ms = max(0.0, self._last_end.elapsed_time(start))
                self._spare.append(self._last_end)
            self._spare.append(start)
            self._last_end = end
