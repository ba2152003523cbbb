"""A measured run step by step: one JSON line per engine step after a header (`liteinfer-bench
run --timeline`, and scripts/bench_vllm.py --timeline for vLLM's engine loop), and the account of
where the run's wall time went.

Times are seconds from the run's start (its first request's submission); the run ends with its
last token, so the account of a timeline sums to the row's wall_s. A step's share of the wall is
the time from the previous step's outputs to its own (its interval): in an overlapped loop that
is what each step adds to the run. Where the device was timed (CUDA events), the device's idle
time before a step is taken out of its interval and counted as a host gap.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from liteinfer.engine.instrumentation import StepRecord

HEADER = "header"
# Where a step's interval is counted: by its tokens and its rows against the run's width.
PROMPT_ONLY = "prompt only"
MIXED = "mixed (prompt + decode)"
FULL = "decode, full width"
BELOW = "decode, below full width"
TAIL = "tail (decode after the last prompt)"
HOST_GAPS = "host gaps (device idle)"
AFTER = "after the last step"
CATEGORIES = (FULL, MIXED, PROMPT_ONLY, BELOW, TAIL, HOST_GAPS, AFTER)
STEP_KEYS = ("step", "start", "launch", "launched", "ready", "rows", "prompt_tokens",
             "decode_tokens", "draft_tokens", "output_tokens", "waiting", "mode", "graph_size",
             "gpu_ms", "gpu_idle_ms")


@dataclass
class Timeline:
    """`header`: the engine, its build, the GPU and machine, the date, the run and its wall_s.
    `steps`: one dict of STEP_KEYS per step (None where an engine does not report a key)."""

    header: dict[str, Any]
    steps: list[dict[str, Any]]

    @property
    def width(self) -> int:
        return int(self.header["run"]["width"])

    @property
    def wall_s(self) -> float:
        return float(self.header["wall_s"])

    @property
    def label(self) -> str:
        h = self.header
        build = h.get("commit", "")[:10] or h.get("version", "?")
        return f"{h['engine']} {build} · {h.get('gpu', '?')}"


def _header(header: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    return {**header, "type": HEADER, "wall_s": end - start}


def step_dict(**values: Any) -> dict[str, Any]:
    """A step line: every key of STEP_KEYS, None where not given; a ValueError on others."""
    unknown = set(values) - set(STEP_KEYS)
    if unknown:
        raise ValueError(f"unknown timeline step keys: {sorted(unknown)}")
    return {k: values.get(k) for k in STEP_KEYS}


def from_records(records: list[StepRecord], start: float, end: float,
                 header: dict[str, Any]) -> Timeline:
    """The engine's step records (perf_counter seconds) of a run from `start` to `end`."""
    def rel(t: float | None) -> float | None:
        return None if t is None else t - start

    steps = []
    for r in records:
        d = asdict(r)
        steps.append(step_dict(
            step=r.step, start=rel(r.schedule_start), launch=rel(r.launch_start),
            launched=rel(r.launch_end), ready=rel(r.ready), graph_size=list(r.graph_size),
            **{k: d[k] for k in ("rows", "prompt_tokens", "decode_tokens", "draft_tokens",
                                 "output_tokens", "waiting", "mode", "gpu_ms", "gpu_idle_ms")}))
    return Timeline({**header, "type": HEADER, "wall_s": end - start}, steps)


class OutputSteps:
    """The steps of an engine seen from its driver only (vLLM's `LLMEngine.step()`): per call,
    its host wall time and the tokens its outputs carry. A request's first token counts its
    prompt's tokens (its prefill ended in that step) and its later tokens one decode token each;
    `running` and `waiting` come from the engine's scheduler stats where it reports them, else
    the rows are the requests the step gave tokens."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._prompt_len: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_len: int) -> None:
        self._prompt_len[request_id] = prompt_len

    def record(self, start: float, ready: float, new_tokens: list[tuple[str, int]],
               running: int | None = None, waiting: int | None = None) -> None:
        """One step() call from `start` to `ready` (perf_counter seconds); `new_tokens`: per
        request with output, how many tokens it gained."""
        prompt = decode = 0
        for rid, n in new_tokens:
            first = self._prompt_len.pop(rid, None)
            if first is not None and n:
                prompt += first
                n -= 1
            decode += n
        self.steps.append(step_dict(
            step=len(self.steps), start=start, ready=ready,
            rows=running if running is not None else len(new_tokens), prompt_tokens=prompt,
            decode_tokens=decode, draft_tokens=0,
            output_tokens=sum(n for _, n in new_tokens), waiting=waiting))

    def timeline(self, start: float, end: float, header: dict[str, Any]) -> Timeline:
        """The run from `start` (its first submission) to `end` (its last token)."""
        steps = [{**s, "start": s["start"] - start, "ready": s["ready"] - start}
                 for s in self.steps]
        return Timeline(_header(header, start, end), steps)


def write_timeline(timeline: Timeline, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(timeline.header, sort_keys=True) + "\n")
        for step in timeline.steps:
            f.write(json.dumps(step) + "\n")


def read_timeline(path: Path) -> Timeline:
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("type") != HEADER:
        raise ValueError(f"{path}: not a timeline (its first line is no header)")
    header = lines[0]
    for key in ("engine", "run", "wall_s"):
        if key not in header:
            raise ValueError(f"{path}: the timeline's header has no {key!r}")
    return Timeline(header, [step_dict(**s) for s in lines[1:]])


@dataclass
class Bucket:
    seconds: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    rows: int = 0  # summed over the steps, for their mean width
    gpu_ms: float = 0.0  # summed device spans, where timed

    def add(self, seconds: float, step: dict[str, Any]) -> None:
        self.seconds += seconds
        self.steps += 1
        self.output_tokens += step["output_tokens"] or 0
        self.prompt_tokens += step["prompt_tokens"] or 0
        self.rows += step["rows"] or 0
        self.gpu_ms += step["gpu_ms"] or 0.0


@dataclass
class Account:
    """Where a run's wall time went: CATEGORIES' buckets sum to `wall_s`; `modes` splits the
    steps' intervals by how the engine ran them (eager, a captured graph and its size)."""

    wall_s: float
    buckets: dict[str, Bucket]
    modes: dict[str, Bucket] = field(default_factory=dict)

    @property
    def accounted_s(self) -> float:
        return sum(b.seconds for b in self.buckets.values())


def category(step: dict[str, Any], width: int, after_last_prompt: bool) -> str:
    if step["prompt_tokens"]:
        return MIXED if step["decode_tokens"] else PROMPT_ONLY
    if step["rows"] >= width:
        return FULL
    return TAIL if after_last_prompt else BELOW


def mode_label(step: dict[str, Any]) -> str:
    if step["mode"] is None:
        return "not reported"
    size = step["graph_size"] or []
    return step["mode"] + (f" {'x'.join(map(str, size))}" if size else "")


def account(timeline: Timeline) -> Account:
    """The account of the run's wall time (see the module's docstring)."""
    done = sorted((s for s in timeline.steps if s["ready"] is not None),
                  key=lambda s: s["ready"])
    last_prompt = max((i for i, s in enumerate(done) if s["prompt_tokens"]), default=-1)
    buckets = {c: Bucket() for c in CATEGORIES}
    modes: dict[str, Bucket] = {}
    previous = 0.0
    for i, step in enumerate(done):
        interval = step["ready"] - previous
        previous = step["ready"]
        gap = min(interval, (step["gpu_idle_ms"] or 0.0) / 1e3)
        buckets[HOST_GAPS].seconds += gap
        buckets[category(step, timeline.width, i > last_prompt)].add(interval - gap, step)
        modes.setdefault(mode_label(step), Bucket()).add(interval, step)
    buckets[AFTER].seconds = timeline.wall_s - previous
    return Account(timeline.wall_s, buckets, dict(sorted(modes.items())))


def _ms(seconds: float, steps: int) -> str:
    return f"{seconds / steps * 1e3:.2f}" if steps else "—"


def _columns(acc: Account, name: str) -> list[str]:
    b = acc.buckets[name]
    share = b.seconds / acc.wall_s if acc.wall_s else 0.0
    steps = str(b.steps) if name not in (HOST_GAPS, AFTER) else ""
    width = f"{b.rows / b.steps:.1f}" if b.steps else ""
    return [f"{b.seconds:.3f}", f"{share:.1%}", steps, _ms(b.seconds, b.steps), width]


def _table(head: list[str], lines: list[list[str]]) -> str:
    rows = [head, *lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def _describe(t: Timeline) -> str:
    run = t.header["run"]
    tokens = sum(s["output_tokens"] or 0 for s in t.steps)
    return (f"{t.label}: {run.get('kind', '')} {run.get('isl')}/{run.get('osl')} "
            f"W={run['width']}, {len(t.steps)} steps, {tokens} tokens in {t.wall_s:.3f} s "
            f"({tokens / t.wall_s:,.0f} tok/s)")


def format_account(timeline: Timeline) -> str:
    acc = account(timeline)
    head = ["where the time went", "s", "share", "steps", "ms/step", "rows"]
    lines = [[name, *_columns(acc, name)] for name in CATEGORIES]
    lines.append(["total", f"{acc.accounted_s:.3f}", "", "", "", ""])
    modes = [[name, f"{b.seconds:.3f}", f"{b.seconds / acc.wall_s:.1%}", str(b.steps),
              _ms(b.seconds, b.steps), f"{b.gpu_ms / b.steps:.2f}" if b.gpu_ms else "—"]
             for name, b in acc.modes.items()]
    return "\n\n".join([_describe(timeline), _table(head, lines),
                        _table(["how steps ran", "s", "share", "steps", "ms/step", "GPU ms"],
                               modes)])


def machines_differ(a: Timeline, b: Timeline) -> bool:
    return any(a.header.get(k) != b.header.get(k) for k in ("gpu", "host", "boot"))


def format_comparison(a: Timeline, b: Timeline) -> str:
    """The two runs' accounts side by side, and what `a` spends more (+) or less than `b`."""
    acc_a, acc_b = account(a), account(b)
    head = ["where the time went", "A s", "A share", "A steps", "A ms/step", "A rows",
            "B s", "B share", "B steps", "B ms/step", "B rows", "A - B s"]
    lines = [[name, *_columns(acc_a, name), *_columns(acc_b, name),
              f"{acc_a.buckets[name].seconds - acc_b.buckets[name].seconds:+.3f}"]
             for name in CATEGORIES]
    lines.append(["total", f"{acc_a.accounted_s:.3f}", "", "", "", "",
                  f"{acc_b.accounted_s:.3f}", "", "", "", "",
                  f"{acc_a.accounted_s - acc_b.accounted_s:+.3f}"])
    out = [f"A: {_describe(a)}", f"B: {_describe(b)}"]
    if machines_differ(a, b):
        out.append("warning: the runs were measured on different machines (GPU or host)")
    if a.width != b.width or a.header["run"].get("isl") != b.header["run"].get("isl"):
        out.append("warning: the runs measured different workloads")
    return "\n".join(out) + "\n\n" + _table(head, lines)
