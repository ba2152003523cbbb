"""Whether the swapped tensor-core product (y^T = W x^T: 64 weight rows as wgmma's M side, the
input rows its N) gives every row the same bits at every row count, and whether those bits are
the batch-invariant GEMM's (kernels/invariant_gemm.py, x as the M side); and each form's time.

If both hold, the batch-invariant mode could run decode steps on the swapped kernel, which
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
from liteinfer.kernels.gemv import gemv
from liteinfer.kernels.invariant_gemm import invariant_gemm, num_splits

ROWS = (1, 2, 7, 16, 33, 64, 100, 128)
# (name, features, columns): the 1B's projections, and the 8B's gate/up, which the invariant
# GEMM does not split along K (the two forms then sum in the same order).
SHAPES = (("1B qkv", 3072, 2048), ("1B o", 2048, 2048), ("1B gate_up", 16384, 2048),
          ("1B down", 2048, 8192), ("8B gate_up", 28672, 4096))


def swapped(x: torch.Tensor, w: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    rows = x.shape[0]
    tiles = FewRowTiles(block_m=block_m or max(16, triton.next_power_of_2(rows)), block_n=64,
                        block_k_bytes=256, num_stages=4, swapped=True)
    return fewrow_gemm(x, w, tiles=tiles)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        full = swapped(x, w)
        same_n = all(torch.equal(swapped(x[:r], w), full[:r]) for r in ROWS)
        same_tile = all(torch.equal(swapped(x[:r], w, 128), full[:r]) for r in ROWS)
        line = f"{name}: rows' bits the same at every row count: {same_n} (tile 128: {same_tile})"
        if num_splits(k, n, sms)[0] == 1:
            line += f"; equal to invariant_gemm's: {torch.equal(full, invariant_gemm(x, w))}"
        print(line, flush=True)
        for r in (1, 32, 128):
            xr = x[:r].contiguous()
            forms = {"swapped": lambda xr=xr: swapped(xr, w),
                     "invariant_gemm": lambda xr=xr: invariant_gemm(xr, w, serial=True),
                     "default": (lambda xr=xr: gemv(xr, w)) if r == 1
                     else (lambda xr=xr: torch.nn.functional.linear(xr, w))}
            times = {f: do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
                     for f, fn in forms.items()}
            print(f"  {r} rows: " + ", ".join(f"{f} {us:.1f} us" for f, us in times.items()),
                  flush=True)


if __name__ == "__main__":
    main()
