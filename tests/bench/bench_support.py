"""Helpers of the benchmark-harness tests: the `liteinfer-bench` command line, and a fake engine
with the interface the harness drives (add_request / step / has_unfinished_requests,
model_config.vocab_size). Tiny models come from ../conftest.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from liteinfer.bench.cli import build_parser
from liteinfer.bench.lineage import load_lineage

REPO = Path(__file__).resolve().parents[2]
LINEAGE = load_lineage(REPO / "benchmarks" / "lineage.toml")  # the report's, as committed


def cli(*argv: object) -> None:
    """Runs `liteinfer-bench run|report ...`, letting its ValueErrors through."""
    args = build_parser().parse_args([str(a) for a in argv])
    args.func(args)


class FakeEngine:
    """One token per running request per step; records what the harness asked of it."""

    def __init__(self, vocab_size: int = 512):
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.remaining: dict[str, int] = {}
        self.added: list[tuple[str, list[int], int]] = []  # (id, prompt, max_tokens)
        self.max_in_flight = 0
        self.resets_at: list[int] = []  # requests added before each prefix-cache reset

    def reset_prefix_cache(self) -> None:
        self.resets_at.append(len(self.added))

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        assert params.temperature == 0.0 and params.ignore_eos
        assert all(0 <= t < self.model_config.vocab_size for t in prompt_token_ids)
        assert request_id not in self.remaining
        self.remaining[request_id] = params.max_tokens
        self.added.append((request_id, prompt_token_ids, params.max_tokens))
        self.max_in_flight = max(self.max_in_flight, len(self.remaining))

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def step(self):
        outputs = []
        for rid in list(self.remaining):
            self.remaining[rid] -= 1
            done = self.remaining[rid] == 0
            if done:
                del self.remaining[rid]
            outputs.append(SimpleNamespace(request_id=rid, new_token_ids=[7], finished=done))
        return outputs


class FakeLLM:
    def __init__(self, **engine_args):
        self.engine = FakeEngine()
        self.engine_args = engine_args
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True
