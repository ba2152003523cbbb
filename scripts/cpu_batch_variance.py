"""Which torch CPU ops give a row different bits depending on how many rows are computed with it
or where it sits: the findings behind batch_invariant's CPU path (docs/notes/batch_invariance.md).

    python scripts/cpu_batch_variance.py
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

ROW_COUNTS = (1, 2, 3, 8, 16, 17, 32, 64, 128, 300)


def matmuls() -> None:
    """Row 0 of x @ W^T computed among M rows, against M = 1; and at one fixed M (16), with
    the row at every position of the block."""
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((576, 1536), (1536, 576), (576, 49152), (2048, 8192)):
            w = torch.randn(n, k).to(dtype) * 0.02
            x = torch.randn(max(ROW_COUNTS), k).to(dtype)
            alone = F.linear(x[:1], w)
            differ = [m for m in ROW_COUNTS if not torch.equal(F.linear(x[:m], w)[:1], alone)]
            fixed = []
            for j in range(16):
                block = torch.randn(16, k).to(dtype)
                block[j] = x[0]
                fixed.append(F.linear(block, w)[j])
            same = all(torch.equal(f, fixed[0]) for f in fixed)
            print(f"linear {dtype} K={k} N={n}: differs from M=1 at M={differ}; "
                  f"at M=16 the same wherever the row sits: {same}")


def elementwise() -> None:
    """An element computed alone (the scalar tail) against inside a long tensor (SIMD)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.rand(4099).to(dtype) * 4 + 0.01
        for name, fn in (("exp", torch.exp), ("silu", F.silu), ("sigmoid", torch.sigmoid),
                         ("rsqrt", torch.rsqrt), ("sqrt", torch.sqrt), ("1/x", torch.reciprocal)):
            full = fn(x)
            alone = torch.stack([fn(x[i:i + 1])[0] for i in range(256)])
            print(f"{name} {dtype}: alone == in a long tensor: {torch.equal(alone, full[:256])}")


def row_reductions() -> None:
    """Row-wise reductions over the last dimension: one row alone against 64 rows."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 49152).to(dtype)
        for name, fn in (("mean of squares", lambda t: t.float().pow(2).mean(-1)),
                         ("softmax", lambda t: t.float().softmax(-1)),
                         ("log_softmax", lambda t: t.float().log_softmax(-1))):
            full = fn(x)
            alone = torch.cat([fn(x[i:i + 1]) for i in range(64)])
            print(f"{name} {dtype}: row alone == among 64: {torch.equal(alone, full)}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.manual_seed(0)
    print(torch.__version__, f"{torch.get_num_threads()} threads")
    matmuls()
    elementwise()
    row_reductions()
