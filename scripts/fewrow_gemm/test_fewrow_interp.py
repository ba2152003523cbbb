"""CPU check of fewrow_gemm under the Triton interpreter:
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/fewrow_gemm/test_fewrow_interp.py
Small shapes, every mode (pre/loop, pointer/TMA, split-K atomic/ordered), two calls each so the
split-K workspace and counters must be back to zero after a launch."""
from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import fewrow_gemm as fg  # noqa: E402
from fewrow_gemm import FewRowTiles, fewrow_linear_tiles  # noqa: E402

fg.patch_interpreter_bf16_dot()  # the interpreter's bf16 tl.dot multiplies raw bits otherwise

CASES = [
    # (rows, N, K, tiles)
    (1, 128, 256, FewRowTiles(block_n=64, block_k=64, splits=1, pre=1)),
    (8, 128, 256, FewRowTiles(block_n=64, block_k=64, splits=2, pre=2)),
    (5, 192, 256, FewRowTiles(block_n=64, block_k=32, splits=4, pre=1, reduce="ordered")),
    (16, 256, 512, FewRowTiles(block_n=128, block_k=64, splits=2, pre=0, tma=True)),
    (28, 128, 512, FewRowTiles(block_n=64, block_k=64, splits=4, pre=1, tma=True)),
    (32, 128, 256, FewRowTiles(block_n=128, block_k=64, splits=1, pre=4)),
    (64, 128, 256, FewRowTiles(block_n=64, block_k=32, splits=2, pre=1, tma=True,
                               reduce="ordered")),
    (3, 100, 256, FewRowTiles(block_n=64, block_k=64, splits=2, pre=1)),  # N not a tile multiple
]


def main() -> None:
    torch.manual_seed(0)
    for rows, n, k, tiles in CASES:
        w = torch.randn(n, k, dtype=torch.bfloat16) * k ** -0.5
        for call in range(2):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            out = fewrow_linear_tiles(x, w, tiles=tiles)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            ok = err < 1e-2
            print(f"rows={rows:2d} N={n} K={k} {tiles.name():28s} call {call}: rel err {err:.2e}"
                  f" {'ok' if ok else 'FAIL'}")
            assert ok
        for (dev, nn, kind), (ws, cnt) in fg._WORKSPACES.items():
            # ordered partial slots are overwritten, not reset; the atomic tile must be zero
            assert not cnt.any(), f"counters of N={nn} ({kind}) not reset"
            assert kind != "atomic" or not ws.any(), f"atomic workspace of N={nn} not reset"
    print("all interpreter checks passed; workspaces and counters are zero after every launch")


if __name__ == "__main__":
    main()
