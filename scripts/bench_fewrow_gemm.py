"""The few-row GEMM (kernels/fewrow_gemm.py) against cuBLAS on the 1B and 8B models' decode
projections, in e4m3 (`torch._scaled_mm`) and bf16 (`F.linear`), over a grid of tiles: each
call timed in a captured graph of distinct weights that do not fit in L2, as in a decode step.
Also one row's decode attention at the 8B model's heads over short contexts, at several
`min_split_tokens`. Writes $OUT/fewrow-gemm.json; about 4 minutes on one H200.

    python scripts/bench_fewrow_gemm.py [--rows 4 16 32 64 128] [--dtypes fp8 bf16]
                                        [--skip-attention] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from typing import Any

import torch
from bench_fp8 import COPY_BW, _copies, graph_us

from liteinfer.attention import allocate_kv_pool
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_attention import paged_decode_attention
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for
from liteinfer.kernels.fewrow_gemm import FewRowTiles, fewrow_gemm, fewrow_tiles
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.kernels.quant_fp8 import per_token_quant_fp8
from liteinfer.layers.quantization.fp8 import Fp8Activation, fp8_matmul, quantize_weight

# (model, projection, in features, out features)
PROJECTIONS = (("8b", "qkv", 4096, 6144), ("8b", "o", 4096, 4096), ("8b", "gate_up", 4096, 28672),
               ("8b", "down", 14336, 4096), ("1b", "qkv", 2048, 3072), ("1b", "o", 2048, 2048),
               ("1b", "gate_up", 2048, 16384), ("1b", "down", 8192, 2048))


def tiles_for(rows: int) -> list[FewRowTiles]:
    """The grid at `rows`: row tiles of 16 (up to 16 rows), 64 and 128 (wgmma); over 64 rows
    the swapped kernel too, with 64 or 128 weight rows a tile, K cut among 1-4 programs."""
    block_ms = [m for m in (16, 64, 128) if m >= rows]
    grid = [FewRowTiles(block_m=m, block_n=bn, block_k_bytes=bk, num_stages=st)
            for m, bn, (bk, st) in itertools.product(block_ms, (16, 32, 64),
                                                    ((256, 3), (256, 5), (512, 3)))]
    if rows > 64:
        grid += [FewRowTiles(block_m=128, block_n=bn, block_k_bytes=bk, num_stages=st,
                             num_warps=bn // 16, swapped=True, splits=sp)
                 for bn, (bk, st), sp in itertools.product(
                     (64, 128), ((128, 4), (128, 5), (256, 3), (256, 4)), (1, 2, 4))
                 if (bn + 128) * bk * st <= 200 << 10]
    return grid


def gemm_rows(rows: int, dtypes: list[str], quick: bool) -> list[dict[str, Any]]:
    out = []
    dev = torch.device("cuda")
    for model, name, k, n in PROJECTIONS:
        copies = _copies(n * k)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        xq, xs = per_token_quant_fp8(x)
        bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_weight(w) for w in bf16]
        for dtype in dtypes:
            wbytes = 1 if dtype == "fp8" else 2
            floor = (n * k * wbytes + rows * (k + n) * 2) / COPY_BW * 1e6

            def record(impl: str, us: float, t: FewRowTiles | None = None) -> None:
                row = {"model": model, "proj": name, "rows": rows, "dtype": dtype, "impl": impl,
                       "us": us, "of_floor": floor / us}
                if t is not None:
                    row.update(block_m=t.block_m, block_n=t.block_n,
                               block_k_bytes=t.block_k_bytes, num_stages=t.num_stages,
                               swapped=t.swapped, splits=t.splits)
                out.append(row)

            if dtype == "fp8":
                cublas = [lambda w=w, s=s: fp8_matmul(Fp8Activation(xq, xs), w, s)
                          for w, s in fp8]
            else:
                cublas = [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16]
            record("cublas", graph_us(cublas))
            rule = fewrow_tiles(rows, n, k, wbytes, num_sms(dev))
            # One workspace for every launch, as the engine's runner shares one.
            ws = SplitKWorkspace.allocate([(n, 4)], dev)  # the grid cuts K in 4 at most
            for t in [rule] if quick else [rule, *tiles_for(rows)]:
                if t is None:
                    continue
                if dtype == "fp8":
                    fns = [lambda w=w, s=s, t=t: fewrow_gemm(xq, w, x_scale=xs, weight_scale=s,
                                                             out_dtype=torch.bfloat16, tiles=t,
                                                             workspace=ws)
                           for w, s in fp8]
                else:
                    fns = [lambda w=w, t=t: fewrow_gemm(x, w, tiles=t, workspace=ws)
                           for w in bf16]
                try:
                    record("fewrow-rule" if t is rule else "fewrow", graph_us(fns), t)
                except Exception as e:  # a tile that does not compile (shared memory)
                    print(f"{model} {name} {rows} {dtype} {t}: {type(e).__name__}", flush=True)
            mine = [r for r in out if r["impl"] != "cublas" and r["model"] == model
                    and r["proj"] == name and r["rows"] == rows and r["dtype"] == dtype]
            base = next(r for r in out if r["impl"] == "cublas" and r["model"] == model
                        and r["proj"] == name and r["rows"] == rows and r["dtype"] == dtype)
            best = min(mine, key=lambda r: r["us"]) if mine else base
            print(f"{model} {name:7s} rows {rows:3d} {dtype}: cublas {base['us']:7.1f} us "
                  f"({base['of_floor']:.2f})  best {best['impl']} {best['us']:7.1f} us "
                  f"({best['of_floor']:.2f}) {best.get('block_m')} {best.get('block_n')} "
                  f"{best.get('block_k_bytes')} {best.get('num_stages')} "
                  f"{'swapped' if best.get('swapped') else ''} {best.get('splits', '')}",
                  flush=True)
        del bf16, fp8
    return out


def attention_split_rows() -> list[dict[str, Any]]:
    """One row of the 8B model's decode attention (32 / 8 heads of 128) over bf16 pools."""
    dev = torch.device("cuda")
    hq, hkv, d, bs = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for ctx in (128, 256, 384, 512, 1024):
        blocks = math.ceil(ctx / bs)
        tables = torch.randperm(blocks, device=dev, dtype=torch.int32).reshape(1, -1)
        lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(1, hq, d, device=dev, dtype=torch.bfloat16)
        pools = [allocate_kv_pool(2, num_blocks=blocks, block_size=bs, num_kv_heads=hkv,
                                  head_dim=d, dtype=torch.bfloat16, device=dev) for _ in range(32)]
        for pool in pools:
            pool.copy_(torch.randn(pool.shape, device=dev))
        width = max_splits_for(1, hkv, sms)
        ws = DecodeWorkspace.allocate(1, hq, d, width, dev)
        o = torch.empty_like(q)
        for min_tokens in (16, 32, 64, 128, 256):
            fns = [lambda p=p, m=min_tokens: paged_decode_attention(
                q, p[0], p[1], tables, lens, d ** -0.5, o, width, ws, min_tokens=m)
                for p in pools]
            row = {"ctx": ctx, "min_split_tokens": min_tokens, "us": graph_us(fns)}
            print(row, flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32, 64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewrow_tiles' choice only")
    args = ap.parse_args()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "gemm": []}
    path = os.path.join(os.environ.get("OUT", "."), "fewrow-gemm.json")
    with torch.inference_mode():
        if not args.skip_attention:
            report["decode_attention_one_row"] = attention_split_rows()
        for rows in args.rows:
            report["gemm"] += gemm_rows(rows, args.dtypes, args.quick)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
