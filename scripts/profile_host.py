"""The offline engine's host time per step with the model and sampler stubbed out: what must
hide under the GPU's step time (2.0 ms for 128 decoding rows of the 1B model on an H200).

    .venv/bin/python scripts/profile_host.py --width 128 [--no-prefix-caching] [--cprofile N]
                                             [--constrained]

--constrained holds every other request to scripts/bench_structured.py's JSON schema (the
stubbed sampler takes the lowest token each grammar allows).

Runs `liteinfer.bench.runner.drive` (the benchmark's own driver: token ids, DELTA outputs) at
128/256 on CPU. The stubbed forward pass still builds the step's inputs (build_step_inputs,
which costs more than the captured decode step's own input filling), so the figure is an upper
bound of that part.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import itertools
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from liteinfer.bench import runner
from liteinfer.engine.model_runner import ModelRunner
from liteinfer.engine.sampler import SampledTokens, Sampler
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.llm import LLM
from liteinfer.structured_output import StructuredOutputsParams

MODEL = Path(__file__).resolve().parents[1] / "benchmarks/models/llama-3.2-1b-instruct"


def stub_device_work() -> None:
    def forward(self, step):
        build_step_inputs(step.batch, self.block_size, self.max_blocks_per_seq)
        rows = len(step.batch.sampling_seqs)
        return (torch.zeros(rows, 1) if rows else None), None

    def sample(self, logits, seqs, min_tok_rows, bitmask=None):
        ids = torch.tensor([1000 + (len(s) % 5000) for s in seqs])
        if bitmask is not None:  # a constrained row takes the lowest token its grammar allows
            for row in bitmask.rows:
                words = bitmask.bitmask[row]
                word = int(words.nonzero()[0])
                bits = int(words[word]) & 0xFFFFFFFF
                ids[row] = 32 * word + (bits & -bits).bit_length() - 1
        return SampledTokens(ids, ids, [s.sampling_params for s in seqs], None)

    ModelRunner._forward = forward
    Sampler.sample = sample


def two_layer_copy() -> str:
    """The model's directory with a two-layer config: the model never runs, and the host work
    does not depend on its depth."""
    out = Path(tempfile.mkdtemp(prefix="profile-host-"))
    for f in MODEL.iterdir():
        (out / f.name).symlink_to(f)
    config = json.loads((MODEL / "config.json").read_text())
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return str(out)


def constrain_every_other(engine) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"},
                                               "score": {"type": "integer"}},
              "required": ["answer", "score"]}
    held = StructuredOutputsParams(json=schema)
    add, count = engine.add_request, itertools.count()

    def add_request(rid, prompt, params):
        if next(count) % 2:
            params = dataclasses.replace(params, structured_outputs=held)
        return add(rid, prompt, params)

    engine.add_request = add_request


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--cprofile", type=int, default=0, help="print the N costliest functions")
    p.add_argument("--constrained", action="store_true")
    args = p.parse_args()
    stub_device_work()
    llm = LLM(two_layer_copy(), load_format="dummy", device="cpu", max_model_len=4096,
              num_kv_blocks=4096, enable_prefix_caching=not args.no_prefix_caching)
    engine = llm.engine
    if args.constrained:
        constrain_every_other(engine)
    prompts, _ = runner.workload(runner.Shape(128, 256), args.prompts, 1234,
                                 engine.model_config.vocab_size)
    lengths = [256] * len(prompts)
    runner.drive(engine, prompts[:args.width], [8] * args.width, args.width)  # warm up
    profiler = cProfile.Profile() if args.cprofile else None
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    runner.drive(engine, prompts, lengths, args.width)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    print(f"W={args.width}: {steps} steps, {wall / steps * 1e3:.3f} ms of host time per step, "
          f"{sum(lengths) / wall:,.0f} tok/s at most")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
