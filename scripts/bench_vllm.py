"""vLLM on the workloads of benchmarks/WORKLOADS.md, on the GPU liteinfer runs on, so that both
engines are compared on one machine (H200 machines differ by a few percent; docs/notes/journal.md,
item 55). vLLM is driven by liteinfer's own bench loop (`runner.drive`): the same prompts,
warm-up, admission and token timestamps. Its defaults stay on (offline `LLM` class:
torch.compile, CUDA graphs, 16,384 batched tokens on an H200, prefix caching), except that the
prefix cache is emptied before each measured run: mixed2048/16 and mixed2048/128
draw the same prompts.

Rows are written in the format of benchmarks/reference/ (`liteinfer-bench report --reference DIR`
reads a directory of them), with the model's name (the directory's) and, where set, the
quantization and KV-cache dtype as engine args, so that the report sets them beside liteinfer's
rows of the same model and precision. Needs vLLM importable (../shared/vllm/ installs it beside
the machine's torch) and a directory holding the model's config.json (dummy weights):

    python scripts/bench_vllm.py MODEL_DIR --out vllm_rows.jsonl [--runs mixed2048:16:32 ...]
                                 [--latency 128:256:3 ...]
                                 [--quantization fp8 | --awq] [--kv-cache-dtype fp8]

`--awq` runs vLLM's AWQ-Marlin kernels on dummy 4-bit weights: a copy of MODEL_DIR's config.json
with an AutoAWQ `quantization_config` (4-bit, groups of 128, GEMM layout) in a temporary
directory; its rows are labelled quantization "int4", beside liteinfer's `quantization="int4"`.

A throughput run is ISL:OSL:WIDTH[:PROMPTS] (200 prompts unless given), a latency run (one
request at a time) ISL:OSL:PROMPTS; with neither, every run of the report's tables.

`--timeline DIR` records every measured run step by step beside its row, in
DIR/<kind>-<isl>-<osl>-w<W>.jsonl (`liteinfer-bench timeline` reads it): per `step()` call its
host wall time, the requests running and waiting (vLLM's scheduler stats: vLLM's stat logging is
turned on for it) and the tokens its outputs carry, so that
`liteinfer-bench timeline OURS.jsonl VLLM.jsonl` sets the two runs side by side.

Speculative decoding against `liteinfer-bench spec` on real weights: the prompts that command
wrote (`--tokens-out`), each answer ending where the model ends it, at each width:

    python scripts/bench_vllm.py HF_DIR --out rows.jsonl --real-weights --prompts-file T.json
        --osl 256 --widths 1 8 32 [--speculative-config '{"method": "ngram", ...}']
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liteinfer.bench.metrics import summarize
from liteinfer.bench.registry import DEFAULT, full_matrix
from liteinfer.bench.runner import drive, warm_up, workload
from liteinfer.bench.store import machine_boot, now_iso
from liteinfer.bench.timeline import OutputSteps, write_timeline
from liteinfer.bench.workloads import SEED, Shape
from liteinfer.sampling_params import SamplingParams
from liteinfer.utils import model_label


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool


class SchedulerStatsTap:
    """The scheduler stats of the engine core's latest outputs (None while vLLM logs no
    stats), read where `LLMEngine.step()` fetches them: its core client's `get_output`."""

    def __init__(self, engine) -> None:
        self.latest: Any = None
        client = engine.engine_core
        get_output = client.get_output

        def tapped(*args, **kwargs):
            outputs = get_output(*args, **kwargs)
            self.latest = getattr(outputs, "scheduler_stats", None)
            return outputs

        client.get_output = tapped

    def counts(self) -> tuple[int | None, int | None]:
        """(running, waiting) requests, or Nones."""
        stats = self.latest
        if stats is None:
            return None, None
        return stats.num_running_reqs, stats.num_waiting_reqs


class VLLMEngine:
    """vLLM's LLMEngine behind the three calls `drive` makes of liteinfer's engine; while
    `recording` is set, each step() call adds a step to it."""

    def __init__(self, engine, params_cls, prompt_cls, stats: SchedulerStatsTap | None = None):
        self.engine, self.params_cls, self.prompt_cls = engine, params_cls, prompt_cls
        self.seen: dict[str, int] = {}  # tokens already reported per request
        self.stats = stats
        self.recording: OutputSteps | None = None

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.seen[rid] = 0
        if self.recording is not None:
            self.recording.add_request(rid, len(prompt))
        self.engine.add_request(rid, self.prompt_cls(prompt_token_ids=prompt), self.params_cls(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            detokenize=False))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        raw = self.engine.step()
        ready = time.perf_counter()
        outs = []
        for o in raw:
            ids = o.outputs[0].token_ids  # cumulative
            outs.append(StepOutput(o.request_id, list(ids[self.seen[o.request_id]:]), o.finished))
            self.seen[o.request_id] = len(ids)
        if self.recording is not None:
            running, waiting = self.stats.counts() if self.stats else (None, None)
            self.recording.record(start, ready, [(o.request_id, len(o.new_token_ids))
                                                 for o in outs], running, waiting)
        return outs


def measure_run(engine: VLLMEngine, prompts: list[list[int]], max_tokens: list[int], width: int,
                timeline: Path | None, header: dict[str, Any], ignore_eos: bool = True) -> list:
    """The traces of one measured run (`drive`); with `timeline`, its steps written there."""
    if timeline is not None:
        engine.recording = OutputSteps()
    traces = drive(engine, prompts, max_tokens, width, ignore_eos=ignore_eos)
    if timeline is not None:
        start, end = min(t.submit for t in traces), max(t.tokens[-1] for t in traces if t.tokens)
        write_timeline(engine.recording.timeline(start, end, {**header, "date": now_iso()}),
                       timeline)
        engine.recording = None
    return traces


def awq_config_dir(model_dir: str) -> str:
    """A temporary directory holding model_dir's config.json with an AutoAWQ 4-bit
    quantization_config, named as model_dir so that its rows keep the model's name."""
    import tempfile
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                     "zero_point": True, "version": "gemm"}
    directory = os.path.join(tempfile.mkdtemp(), os.path.basename(os.path.normpath(model_dir)))
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--out", required=True, help="JSON-lines file to append rows to")
    p.add_argument("--runs", nargs="+", default=[], metavar="ISL:OSL:WIDTH[:PROMPTS]",
                   help="throughput runs")
    p.add_argument("--latency", nargs="+", default=[], metavar="ISL:OSL:PROMPTS",
                   help="latency runs")
    p.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's")
    p.add_argument("--quantization", help="vLLM's quantization (e.g. fp8); default: none")
    p.add_argument("--awq", action="store_true",
                   help="dummy AWQ 4-bit weights through vLLM's awq_marlin (rows: int4)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's (e.g. fp8); default: auto")
    p.add_argument("--real-weights", action="store_true",
                   help="load the directory's weights and tokenizer (default: dummy weights)")
    p.add_argument("--prompts-file", help="token-id prompts per width (JSON, from "
                                          "liteinfer-bench spec --tokens-out), run at --widths; "
                                          "answers end at EOS (at most --osl tokens)")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--osl", type=int, default=256)
    p.add_argument("--speculative-config", type=json.loads, help="vLLM's, as JSON")
    p.add_argument("--timeline", type=Path, metavar="DIR",
                   help="record each measured run step by step in DIR (liteinfer-bench timeline)")
    args = p.parse_args()
    label = args.quantization
    if args.awq:
        args.model_dir, args.quantization, label = awq_config_dir(args.model_dir), "awq_marlin", \
            "int4"
    with open(os.path.join(args.model_dir, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # liteinfer's bench modules initialize CUDA before vLLM starts its engine process.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import torch
    import vllm
    from vllm import LLM
    from vllm import SamplingParams as VLLMParams
    from vllm.inputs import TokensPrompt

    if args.runs or args.latency:
        plan = [("latency", Shape.parse(isl, osl), 1, int(n))
                for isl, osl, n in (spec.split(":") for spec in args.latency)]
        for spec in args.runs:
            isl, osl, width, *n = spec.split(":")
            plan.append(("throughput", Shape.parse(isl, osl), int(width), int(n[0]) if n else 200))
    else:
        plan = [(r.kind, r.shape, r.width, r.prompts) for r in full_matrix([DEFAULT])]
    llm = LLM(model=args.model_dir, load_format="auto" if args.real_weights else "dummy",
              skip_tokenizer_init=not args.real_weights,
              dtype="bfloat16", max_model_len=4096 if args.real_weights else 16384,
              max_num_seqs=128, seed=0, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              speculative_config=args.speculative_config,
              disable_log_stats=args.timeline is None)
    stats = SchedulerStatsTap(llm.llm_engine) if args.timeline is not None else None
    engine = VLLMEngine(llm.llm_engine, VLLMParams, TokensPrompt, stats)
    engine_args = {k: v for k, v in (("quantization", label),
                                     ("kv_cache_dtype", args.kv_cache_dtype)) if v not in
                   (None, "auto")}
    env = {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "host": socket.gethostname(),
           "boot": machine_boot(),
           "model": model_label(args.model_dir),
           "engine_args": engine_args, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.speculative_config is not None:
        env["speculative_config"] = args.speculative_config
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts_at = json.load(f)  # {width: prompts}, as liteinfer-bench spec wrote them
        with open(args.out, "a", encoding="utf-8") as out:
            for width in args.widths:
                prompts = prompts_at[str(width)]
                warm_up(engine, Shape.parse(128, args.osl), width, vocab)
                assert llm.reset_prefix_cache()
                traces = measure_run(
                    engine, prompts, [args.osl] * len(prompts), width,
                    args.timeline and args.timeline / f"spec-w{width}.jsonl",
                    {**env, "run": {"kind": "latency" if width == 1 else "throughput",
                                    "isl": len(prompts[0]), "osl": args.osl, "width": width,
                                    "prompts": len(prompts)}}, ignore_eos=False)
                row = {**env, "kind": "latency" if width == 1 else "throughput",
                       "isl": len(prompts[0]), "osl": args.osl, "prompts": len(prompts),
                       "width": width, "workload": os.path.basename(args.prompts_file),
                       **summarize(traces, args.osl), "at": time.time()}
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"W={width}: tok/s {row['tok_s']:.1f}, ITL p50 {row['itl_p50']:.3f} ms, "
                      f"{row['out_tokens']} tokens", flush=True)
        return
    with open(args.out, "a", encoding="utf-8") as out:
        for kind, shape, width, n in plan:
            warm_up(engine, shape, width, vocab)
            prompts, _ = workload(shape, n, SEED, vocab)
            assert llm.reset_prefix_cache()
            run = {"kind": kind, "isl": shape.isl, "osl": shape.osl, "width": width,
                   "prompts": n}
            traces = measure_run(
                engine, prompts, [shape.osl] * n, width,
                args.timeline and args.timeline / f"{kind}-{shape.isl}-{shape.osl}-w{width}.jsonl",
                {**env, "run": run})
            row = {**env, "kind": kind, "isl": shape.isl, "osl": shape.osl, "prompts": n,
                   "width": width, "seed": SEED, **summarize(traces, shape.osl), "at": time.time()}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{kind} {shape.label} W={width}: tok/s {row['tok_s']:.1f}, "
                  f"ITL p50 {row['itl_p50']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
