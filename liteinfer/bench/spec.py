"""`liteinfer-bench spec`: speculative decoding against plain decoding on one engine build.

Two kinds of run:
- real weights and a proposer (`--method ngram` or `suffix`) on the input-grounded prompts of
  benchmarks/workloads/grounded.jsonl (rewrite, summarize, edit code: outputs that reuse the
  prompt), greedy, each answer ending where the model ends it (at most --osl tokens);
- controlled acceptance on dummy weights (`--method reference`): the proposer drafts each
  request's continuation from the run without speculation, with every draft token corrupted
  with the probability that gives the mean accepted length asked for (draft length
  --num-speculative-tokens), and the engine accepts the drafts before the first corrupted one
  (`force_acceptance`: in bf16 a dummy model's greedy answer depends on the kernel path, so no
  continuation stays its own). The device work is speculation's at that acceptance. The rows
  name the proposer, which exists for benchmarks only;
- a draft model (`--method draft_model --draft-model NAME`), e.g. the 1B config drafting for
  the 8B one on dummy weights, where drafts are never accepted: drafting is forced on (the
  acceptance the draft length follows is held at 1) and the rows record what the draft costs
  a step, its catch-up over the step's tokens and its proposals, beside the whole step.

Each width runs without speculation (config `spec-off`) and with it (`spec-<method>`), on the
same prompts (--latency-prompts one at a time, 2W at width W); rows record the drafts'
measured acceptance. `--tokens-out` writes each width's prompts as token ids, so that
scripts/bench_vllm.py runs vLLM on exactly the same ones.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from liteinfer.bench.registry import LITEINFER, Run
from liteinfer.bench.runner import BENCH_MAX_MODEL_LEN, drive, make_row, workload
from liteinfer.bench.store import SPEC_DIR, append_row, environment, now_iso, results_file
from liteinfer.bench.workloads import SEED, WARMUP_SEED, Shape
from liteinfer.engine.messages import SpecDecodingStats
from liteinfer.llm import LLM

GROUNDED = Path("benchmarks/workloads/grounded.jsonl")


def corrupt_probability(mean_length: float, num_drafts: int) -> float:
    """The per-token corruption that makes k drafts yield `mean_length` tokens a step: with
    acceptance a, 1 + a + ... + a^k; solved by bisection."""
    if not 1.0 <= mean_length <= num_drafts + 1:
        raise ValueError(f"a mean accepted length must be in [1, {num_drafts + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(num_drafts + 1)) < mean_length:
            lo = a
        else:
            hi = a
    return 1.0 - lo


def grounded_prompts(llm: LLM) -> list[list[int]]:
    with open(GROUNDED, encoding="utf-8") as f:
        return [llm.apply_chat_template(json.loads(line)["messages"]) for line in f]


def _stats(llm: LLM) -> SpecDecodingStats | None:
    stats = llm.engine.core.scheduler.stats().spec_decoding
    return None if stats is None else SpecDecodingStats(
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
        list(stats.num_accepted_tokens_per_pos))


def _measure(llm: LLM, config: str, prompts: list[list[int]], osl: int, width: int,
             model: str, engine_args: dict[str, Any], ignore_eos: bool,
             extra: dict[str, Any], token_ids: list[list[int]] | None = None,
             after_warm_up: Callable[[], Any] | None = None
             ) -> dict[str, Any]:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    # Compilation, graphs and allocator: every batch size of the run, on other prompts.
    warm, _ = workload(Shape.parse(128, 32), max(2, width), WARMUP_SEED, vocab)
    drive(engine, warm, [32] * len(warm), width)
    engine.reset_prefix_cache()
    if after_warm_up is not None:
        after_warm_up()
    before = _stats(llm)
    traces = drive(engine, prompts, [osl] * len(prompts), width, ignore_eos=ignore_eos,
                   token_ids=token_ids)
    after = _stats(llm)
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        extra = {**extra, "spec_num_drafts": drafts,
                 "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                 "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}
    kind = "latency" if width == 1 else "throughput"
    run = Run(config, kind, Shape.parse(len(prompts[0]), osl), width, len(prompts))
    return make_row(run, LITEINFER, traces, prompts, None, model, engine_args=engine_args,
                    **extra)


class DraftTimer:
    """Device time of the draft model's catch-up and proposals and of whole steps (the target's
    forward and sampling with the draft's work inside), from CUDA events around the runner's
    calls (host time on CPU)."""

    PARTS = ("catch_up", "propose", "step")

    def __init__(self, runner: Any):
        self.spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        drafter = runner.drafter
        drafter.before_step = self._timed("catch_up", drafter.before_step)
        drafter.after_sampling = self._timed("propose", drafter.after_sampling)
        runner.execute = self._timed("step", runner.execute)
        self.cuda = runner.device.type == "cuda"

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            out = call(*args, **kwargs)
            self.spans[part].append((start, self._mark()))
            return out
        return timed

    def take(self) -> dict[str, Any]:
        """Mean milliseconds per step of each part since the last call, and the steps."""
        if self.cuda:
            torch.cuda.synchronize()
        steps = len(self.spans["step"])
        out: dict[str, Any] = {"spec_steps": steps}
        for part in self.PARTS:
            spans = self.spans.pop(part, [])
            total = sum(s.elapsed_time(e) if self.cuda else (e - s) * 1e3 for s, e in spans)
            out[f"spec_{part}_ms"] = total / steps if steps else 0.0
        out["spec_draft_share"] = ((out["spec_catch_up_ms"] + out["spec_propose_ms"])
                                   / out["spec_step_ms"] if steps else 0.0)
        return out


def prompts_at(prompts: list[list[int]], width: int, latency_prompts: int) -> list[list[int]]:
    """The prompts a width runs: `latency_prompts` one at a time, else two waves of the width
    (the list repeated where it is shorter)."""
    n = latency_prompts if width == 1 else 2 * width
    return [prompts[i % len(prompts)] for i in range(n)]


def cmd_spec(args: argparse.Namespace) -> None:
    base_args: dict[str, Any] = {"dtype": args.dtype, "max_model_len": args.max_model_len,
                                 "max_num_seqs": max(args.widths)}
    load_format = "dummy" if args.method == "reference" else "auto"
    synthetic = args.method in ("reference", "draft_model")  # no tokenizer needed
    out = results_file(args.out or SPEC_DIR, environment()["gpu"], now_iso())
    plain = LLM(args.model, load_format=load_format, **base_args)
    vocab = plain.engine.model_config.vocab_size
    if synthetic:
        most = max(args.latency_prompts, 2 * max(args.widths))
        prompts, _ = workload(Shape.parse(args.isl, args.osl), most, SEED, vocab)
    else:
        prompts = grounded_prompts(plain)
    if args.tokens_out is not None:
        args.tokens_out.write_text(json.dumps(
            {str(w): prompts_at(prompts, w, args.latency_prompts) for w in args.widths}))
    ignore_eos = synthetic
    rows = []

    def measure(llm: LLM, config: str, width: int, engine_args: dict[str, Any],
                extra: dict[str, Any], token_ids: list[list[int]] | None = None) -> None:
        row = _measure(llm, config, prompts_at(prompts, width, args.latency_prompts), args.osl,
                       width, args.model, engine_args, ignore_eos, extra, token_ids)
        append_row(row, out)
        rows.append(row)
        print(f"{config} W={width} {extra}: ITL p50 {row['itl_p50']:.3f} ms, tok/s "
              f"{row['tok_s']:.1f}, mean accepted length "
              f"{row.get('spec_mean_acceptance_length', 1.0):.2f}", flush=True)

    references: dict[tuple[int, ...], tuple[int, ...]] = {}
    for width in args.widths:
        outputs: list[list[int]] = []
        measure(plain, "spec-off", width, base_args, {}, outputs)
        references.update((tuple(p), tuple(o)) for p, o in zip(
            prompts_at(prompts, width, args.latency_prompts), outputs))
    plain.shutdown()
    spec: dict[str, Any] = {"method": args.method,
                            "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "reference":
        spec["force_acceptance"] = True
    if args.method == "draft_model":
        spec["model"] = args.draft_model
    llm = LLM(args.model, load_format=load_format, **base_args, speculative_config=spec)
    recorded_args = {**base_args, "speculative_config": spec}
    try:
        if args.method == "draft_model":
            timer = DraftTimer(llm.engine.core.runner)
            policy = llm.engine.core.scheduler.speculator.policy
            policy.mean_accepted = policy.mean_trials = 1.0  # acceptance 1
            policy.record = lambda *_: None
            for width in args.widths:
                row = _measure(llm, "spec-draft_model", prompts_at(
                    prompts, width, args.latency_prompts), args.osl, width, args.model,
                    recorded_args, ignore_eos, {"spec_draft_forced": True},
                    after_warm_up=timer.take)
                row.update(timer.take())
                append_row(row, out)
                rows.append(row)
                print(f"spec-draft_model W={width}: step {row['spec_step_ms']:.3f} ms, draft "
                      f"catch-up {row['spec_catch_up_ms']:.3f} ms + proposals "
                      f"{row['spec_propose_ms']:.3f} ms ({row['spec_draft_share']:.0%} of the "
                      f"step)", flush=True)
            return
        if args.method != "reference":
            for width in args.widths:
                measure(llm, f"spec-{args.method}", width, recorded_args, {})
            return
        proposer = llm.engine.core.scheduler.speculator.proposer
        for width in args.widths:
            for length in args.acceptance_lengths:
                c = corrupt_probability(length, args.num_speculative_tokens)
                proposer.set_reference(references, c)
                measure(llm, "spec-reference", width, recorded_args,
                        {"spec_target_acceptance_length": length,
                         "spec_corrupt_probability": c})
    finally:
        llm.shutdown()
        print(f"{len(rows)} row(s) appended to {out}")


def add_spec_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("spec", help="speculative decoding against plain decoding",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a model with real weights (ngram, suffix) or a config (reference)")
    p.add_argument("--method", choices=("ngram", "suffix", "reference", "draft_model"),
                   default="ngram")
    p.add_argument("--draft-model", default="llama-3.2-1b-instruct",
                   help="draft_model: the draft (dummy weights where the model has them)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--acceptance-lengths", type=float, nargs="+", default=[1.5, 2.5, 3.5],
                   help="reference: the mean accepted lengths to measure at")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--isl", type=int, default=128, help="reference: prompt length")
    p.add_argument("--osl", type=int, default=256, help="output length (at most, for real "
                                                        "weights)")
    p.add_argument("--latency-prompts", type=int, default=8,
                   help="prompts run one at a time (a width of W runs 2W)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=min(BENCH_MAX_MODEL_LEN, 4096))
    p.add_argument("--tokens-out", type=Path, help="write the prompts' token ids (JSON) here")
    p.add_argument("--out", type=Path,
                   help=f"results .jsonl file or directory (default: {SPEC_DIR})")
    p.set_defaults(func=cmd_spec)
