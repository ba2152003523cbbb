"""GPU microbenchmark of the fused one-token linear layers (liteinfer/kernels/gemv.py) against
what they replace: cuBLAS (F.linear) plus the separate RMSNorm and
SiLU-and-mul kernels, at the 1B Llama model's shapes, bf16, one token. Each op is checked
against the unfused path, then timed as a CUDA-graph replay (median), with and without
programmatic dependent launch. `chain` is what a decode step's projections cost: 16 layers of
qkv, o, gate/up and down and the LM head in one graph; a lone op's weight stays in L2 between
replays, the chain's do not. `--sweep` also times other weight-tile sizes.
Prints the rows; with $OUT set, also writes $OUT/gemv.json.

    python scripts/bench_gemv.py [--sweep]
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

import liteinfer.kernels.gemv as gemv_kernels
from liteinfer.kernels.activation import silu_and_mul
from liteinfer.kernels.norm import rms_norm

HIDDEN, INTER, VOCAB, QKV, LAYERS, EPS = 2048, 8192, 128256, 3072, 16, 1e-5
DTYPE, DEV = torch.bfloat16, "cuda"
# name: (weight rows, in features, RMSNorm in front, SwiGLU behind)
SHAPES = {"qkv": (QKV, HIDDEN, True, False), "o": (HIDDEN, HIDDEN, False, False),
          "gate_up": (2 * INTER, HIDDEN, True, True), "down": (HIDDEN, INTER, False, False),
          "lm_head": (VOCAB, HIDDEN, True, False)}


def make_op(name: str) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(unfused, fused, weight bytes) for one projection, checked against each other."""
    rows, k, normed, gated = SHAPES[name]
    w = torch.randn(rows, k, dtype=DTYPE, device=DEV) * k ** -0.5
    x = torch.randn(1, k, dtype=DTYPE, device=DEV)
    norm_w = torch.rand(k, dtype=DTYPE, device=DEV) + 0.5

    def unfused() -> torch.Tensor:
        y = F.linear(rms_norm(x, norm_w, EPS) if normed else x, w)
        return silu_and_mul(y) if gated else y

    def fused() -> torch.Tensor:
        if not normed:
            return gemv_kernels.gemv(x, w)
        return gemv_kernels.gemv(x, w, norm_weight=norm_w, eps=EPS, gated=gated)

    ref = unfused().float()
    err = ((fused().float() - ref).abs().max() / ref.abs().max()).item()
    if not err < 2e-2:
        raise AssertionError(f"{name}: gemv disagrees with the unfused path ({err:.3g})")
    return unfused, fused, w.numel() * w.element_size()


def graph_us(fn: Callable[[], object]) -> float:
    return 1000 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def with_pdl(enabled: bool, fn: Callable[[], float]) -> float:
    """Runs fn with gemv's programmatic dependent launch forced on or off (captured graphs
    keep the launch attributes they were captured with)."""
    saved = gemv_kernels.supports_pdl
    gemv_kernels.supports_pdl = lambda device: enabled and saved(device)
    try:
        return fn()
    finally:
        gemv_kernels.supports_pdl = saved


def bench_ops(rows: list[dict]) -> None:
    for name in SHAPES:
        unfused, fused, nbytes = make_op(name)
        mine = with_pdl(False, lambda: graph_us(fused))
        rows.append({"kind": "op", "name": name, "unfused_us": graph_us(unfused),
                     "gemv_us": mine, "gemv_pdl_us": with_pdl(True, lambda: graph_us(fused)),
                     "gemv_tb_s": nbytes / mine / 1e6})


def bench_chain(rows: list[dict]) -> None:
    """A decode step's projections: LAYERS x (qkv, o, gate/up, down) + LM head, each layer
    with its own weights."""
    ops = [make_op(name) for _ in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")]
    ops.append(make_op("lm_head"))
    unfused, fused = [op[0] for op in ops], [op[1] for op in ops]
    rows.append({"kind": "chain", "unfused_us": graph_us(lambda: [f() for f in unfused]),
                 "gemv_us": with_pdl(False, lambda: graph_us(lambda: [f() for f in fused])),
                 "gemv_pdl_us": with_pdl(True, lambda: graph_us(lambda: [f() for f in fused]))})


def bench_sweep(rows: list[dict]) -> None:
    saved = gemv_kernels.TILE_BYTES
    try:
        for tile in (8192, 16384, 32768, 65536):
            gemv_kernels.TILE_BYTES = tile
            for name in SHAPES:
                _, fused, nbytes = make_op(name)
                us = graph_us(fused)
                rows.append({"kind": "sweep", "name": name, "tile_bytes": tile, "gemv_us": us,
                             "tb_s": nbytes / us / 1e6})
    finally:
        gemv_kernels.TILE_BYTES = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    rows: list[dict] = []
    bench_ops(rows)
    bench_chain(rows)
    if args.sweep:
        bench_sweep(rows)
    for r in rows:
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    if os.environ.get("OUT"):
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "commit": os.environ.get("LITEINFER_COMMIT", "")}
        with open(os.path.join(os.environ["OUT"], "gemv.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
