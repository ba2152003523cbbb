"""Benchmark prompt sets and shapes, drawn exactly as benchmarks/WORKLOADS.md prescribes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

MODEL = "llama-3.2-1b-instruct"
SEED = 1234
WARMUP_SEED = 4321  # warm-up prompts must differ from the measured ones
MIXED = "mixed2048"
_MIXED_LENGTHS = (64, 2048)
_TOKEN_IDS = (128, 128000)  # [low, high) of the drawn ids


@dataclass(frozen=True)
class Shape:
    """Prompt length (an int, or MIXED for lengths drawn from 64..2048) and output length."""

    isl: int | str
    osl: int

    def __post_init__(self) -> None:
        if not (self.isl == MIXED or (isinstance(self.isl, int) and self.isl > 0)) or self.osl < 1:
            raise ValueError(f"bad shape {self.isl}/{self.osl}: ISL is a positive int or {MIXED!r}")

    @classmethod
    def parse(cls, isl: str | int, osl: str | int) -> Shape:
        isl = isl if isl == MIXED else int(isl)
        return cls(isl, int(osl))

    @property
    def max_isl(self) -> int:
        return _MIXED_LENGTHS[1] if self.isl == MIXED else int(self.isl)

    @property
    def label(self) -> str:
        """Column heading of the across-shapes tables."""
        isl = f"mix{_MIXED_LENGTHS[1]}" if self.isl == MIXED else str(self.isl)
        return f"{isl} / {self.osl}"

    @property
    def title(self) -> str:
        isl = f"mixed, up to {_MIXED_LENGTHS[1]}" if self.isl == MIXED else str(self.isl)
        return f"ISL={isl} OSL={self.osl}"

    @property
    def sort_key(self) -> tuple[int, int, int]:
        # Canonical shapes keep the original page's order; others follow by size.
        canon = LATENCY_SHAPES + THROUGHPUT_SHAPES
        rank = canon.index(self) if self in canon else len(canon)
        return rank, self.max_isl, self.osl


LATENCY_SHAPES = (Shape(128, 256), Shape(3584, 128), Shape(15360, 128))
THROUGHPUT_SHAPES = (Shape(128, 256), Shape(128, 1024), Shape(1024, 256), Shape(1024, 1024),
                     Shape(2048, 128), Shape(MIXED, 16), Shape(MIXED, 128))
HEADLINE = Shape(128, 256)
_LATENCY_PROMPTS = {128: 50, 3584: 20, 15360: 10}
THROUGHPUT_PROMPTS = 200


def default_prompts(kind: str, shape: Shape) -> int:
    """Prompt count of WORKLOADS.md; latency at other ISLs uses the nearest longer row's count."""
    if kind == "throughput":
        return THROUGHPUT_PROMPTS
    for isl, n in sorted(_LATENCY_PROMPTS.items()):
        if shape.max_isl <= isl:
            return n
    return min(_LATENCY_PROMPTS.values())


def make_prompts(isl: int | str, n: int, seed: int = SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if isl == MIXED:
        lengths = rng.integers(_MIXED_LENGTHS[0], _MIXED_LENGTHS[1] + 1, size=n)
    else:
        lengths = [int(isl)] * n
    return [rng.integers(*_TOKEN_IDS, size=int(length)).tolist() for length in lengths]


def fold_into_vocab(prompts: list[list[int]],
                    vocab_size: int) -> tuple[list[list[int]], int | None]:
    """Maps ids into a small model's vocabulary (id % vocab); returns the modulus used, if any."""
    if vocab_size >= _TOKEN_IDS[1]:
        return prompts, None
    return [[t % vocab_size for t in p] for p in prompts], vocab_size


def fingerprint(prompts: list[list[int]]) -> str:
    """sha256 over each prompt's length then its ids, all as little-endian int64."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(np.asarray([len(p)], dtype="<i8").tobytes())
        h.update(np.asarray(p, dtype="<i8").tobytes())
    return h.hexdigest()
