"""Fixtures of the benchmark-harness tests: a tiny model directory and the bench/report CLI."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from liteinfer.bench.cli import add_bench_parser, add_report_parser

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "bfloat16",
}


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A Llama config small enough for CPU, without weights (benchmarks load dummy weights)."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


@pytest.fixture
def cli():
    """Runs `liteinfer bench|report ...` through the parsers the liteinfer CLI mounts."""
    parser = argparse.ArgumentParser(prog="liteinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_report_parser(sub)

    def run(*argv: str) -> None:
        args = parser.parse_args([str(a) for a in argv])
        args.func(args)

    return run
