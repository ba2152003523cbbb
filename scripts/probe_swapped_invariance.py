"""Whether the swapped tensor-core product (y^T = W x^T: 64 weight rows as wgmma's M side, the
input rows its N) gives every row the same bits at every row count, with K cut into 1-8 splits
that the last program of a tile sums in order; whether, uncut, those bits are the
batch-invariant GEMM's (kernels/invariant_gemm.py, x as the M side); and each form's time.

If they hold, the batch-invariant mode could run decode steps on the swapped kernel, which
streams a weight at one row the way the default's few-row kernels do, instead of 64-row tiles
of which one row is used (docs/notes/batch_invariance.md, "Cost"). One GPU, bf16:
`python scripts/probe_swapped_invariance.py`.
"""
from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench_cudagraph

from liteinfer.kernels.fewrow_gemm import FewRowTiles, fewrow_gemm
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.kernels.gemv import gemv
from liteinfer.kernels.invariant_gemm import invariant_gemm, num_splits

ROWS = (1, 2, 7, 16, 33, 64, 100, 128)
TIMED_ROWS = (1, 32, 128)
SPLITS = (1, 2, 4, 8)
MIN_SPLIT_K = 512
# (name, features, columns): the 1B's and the 8B's projections.
SHAPES = (("1B qkv", 3072, 2048), ("1B o", 2048, 2048), ("1B gate_up", 16384, 2048),
          ("1B down", 2048, 8192), ("8B qkv", 6144, 4096), ("8B o", 4096, 4096),
          ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336))


def swapped(x: torch.Tensor, w: torch.Tensor, splits: int, workspace: SplitKWorkspace | None,
            block_m: int | None = None) -> torch.Tensor:
    rows = x.shape[0]
    tiles = FewRowTiles(block_m=block_m or max(16, triton.next_power_of_2(rows)), block_n=64,
                        block_k_bytes=256, num_stages=4, swapped=True, splits=splits)
    return fewrow_gemm(x, w, tiles=tiles, workspace=workspace)


def probe(name: str, n: int, k: int, sms: int) -> None:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
    for splits in (s for s in SPLITS if k // s >= MIN_SPLIT_K):
        ws = SplitKWorkspace.allocate([(n, splits)], x.device) if splits > 1 else None
        full = swapped(x, w, splits, ws)
        same_n = all(torch.equal(swapped(x[:r], w, splits, ws), full[:r]) for r in ROWS)
        same_tile = all(torch.equal(swapped(x[:r], w, splits, ws, 128), full[:r])
                        for r in ROWS)
        line = (f"{name}, {splits} splits: rows' bits the same at every row count: {same_n} "
                f"(tile 128: {same_tile})")
        if splits == 1 and num_splits(k, n, sms)[0] == 1:
            line += f"; equal to invariant_gemm's: {torch.equal(full, invariant_gemm(x, w))}"
        times = [do_bench_cudagraph(lambda r=r: swapped(x[:r], w, splits, ws), rep=30,
                                    return_mode="median") * 1e3 for r in TIMED_ROWS]
        line += "; us at 1/32/128 rows: " + " / ".join(f"{t:.1f}" for t in times)
        print(line, flush=True)
    xs = {r: x[:r].contiguous() for r in TIMED_ROWS}
    forms = {"invariant_gemm": lambda r: invariant_gemm(xs[r], w),
             "default": lambda r: gemv(xs[r], w) if r == 1
             else torch.nn.functional.linear(xs[r], w)}
    for form, fn in forms.items():
        times = [do_bench_cudagraph(lambda r=r: fn(r), rep=30, return_mode="median") * 1e3
                 for r in TIMED_ROWS]
        print(f"  {form}: us at 1/32/128 rows: " + " / ".join(f"{t:.1f}" for t in times),
              flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name, n, k in SHAPES:
        probe(name, n, k, sms)


if __name__ == "__main__":
    main()
