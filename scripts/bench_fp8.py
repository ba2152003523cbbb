"""FP8 on the GPU: engine latency and throughput in bf16, fp8 and fp8 + fp8 KV for the 1B and 8B
dummy models, and the kernels of one 8B decode step at 1 / 32 / 128 rows against their byte
floors. Writes $OUT/bench-fp8.json (and prints each row), and the engine's bench rows in
benchmarks/results/'s format to $OUT/bench-fp8-rows.jsonl; about 4 minutes on one H200.

    python scripts/bench_fp8.py [--models llama-3.2-1b-instruct llama-3.1-8b-instruct]
                                [--modes bf16 fp8 fp8-kv8]
                                [--skip-engine] [--skip-kernels] [--sweep]

--sweep also times the one-token projections (GEMV) of the 8B model at other weight-tile sizes
and bytes per thread than kernels/gemv.py's.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from liteinfer.attention import allocate_kv_pool
from liteinfer.bench.floor import COPY_BANDWIDTH
from liteinfer.bench.registry import DEFAULT
from liteinfer.bench.runner import engine_args_for, make_llm, run_latency, run_throughput
from liteinfer.bench.store import append_row
from liteinfer.bench.workloads import Shape
from liteinfer.kernels import gemv as gemv_kernels
from liteinfer.kernels.activation import silu_and_mul, silu_and_mul_fp8
from liteinfer.kernels.decode_attention import paged_decode_attention
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for
from liteinfer.kernels.gemv import gemv
from liteinfer.kernels.norm import rms_norm, rms_norm_fp8
from liteinfer.kernels.quant_fp8 import per_token_quant_fp8
from liteinfer.layers.quantization.fp8 import Fp8Activation, fp8_matmul, quantize_weight
from liteinfer.utils import free_device_memory

MODELS = ("llama-3.2-1b-instruct", "llama-3.1-8b-instruct")
MODES = {"bf16": {}, "fp8": {"quantization": "fp8"},
         "fp8-kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
SHAPE = Shape(128, 256)
COPY_BW = COPY_BANDWIDTH["NVIDIA H200"]
# 8B decode-step operands: (name, in features, out features).
PROJECTIONS_8B = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                  ("down", 14336, 4096))
L2_BYTES = 256 << 20  # distinct operands per timed graph so that none stays in the 50 MB L2


def engine_rows(model: str, results: Path | None, modes: list[str]) -> list[dict[str, Any]]:
    """One summary row per mode; with `results`, the bench rows themselves are appended there
    too, in benchmarks/results/'s format, for the report."""
    rows = []
    for mode in modes:
        engine_args = engine_args_for(DEFAULT, {"max_model_len": 1024, **MODES[mode]})
        llm = make_llm(model, engine_args)
        row = {"model": model, "mode": mode}
        lat = run_latency(llm, DEFAULT, SHAPE, 3, model, engine_args)
        row["itl_p50_ms"], row["ttft_p50_ms"] = lat["itl_p50"], lat["ttft_p50"]
        bench_rows = [lat]
        for width, prompts in ((32, 64), (128, 128)):
            tput = run_throughput(llm, DEFAULT, SHAPE, width, prompts, model,
                                  engine_args)
            row[f"tok_s_w{width}"] = tput["tok_s"]
            bench_rows.append(tput)
        if results is not None:
            for bench_row in bench_rows:
                append_row(bench_row, results)
        row["kv_blocks"] = llm.engine.core.block_manager.num_blocks
        print(row, flush=True)
        rows.append(row)
        del llm
        gc.collect()
        free_device_memory()
    return rows


def graph_us(fns: list[Callable[[], Any]], reps: int = 10) -> float:
    """Mean time of one call in a captured graph that runs every fn in turn."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(fns))


def _copies(nbytes: int) -> int:
    return max(2, math.ceil(L2_BYTES / nbytes))


def projection_rows(rows: int) -> list[dict[str, Any]]:
    out = []
    dev = torch.device("cuda")
    for name, k, n in PROJECTIONS_8B:
        copies = _copies(n * k)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        xq = Fp8Activation(*per_token_quant_fp8(x))
        bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_weight(w) for w in bf16]
        if rows == 1:
            # The GEMV path: the norm fused into qkv and gate_up (and SwiGLU into gate_up).
            normed = name in ("qkv", "gate_up")
            norm_w = torch.ones(k, device=dev, dtype=torch.bfloat16) if normed else None
            gated = name == "gate_up"
            kw = {"norm_weight": norm_w, "eps": 1e-5, "gated": gated}
            bf16_fns = [lambda w=w, x=x, kw=kw: gemv(x, w, **kw) for w in bf16]
            fp8_fns = [lambda w=w, s=s, x=x, kw=kw: gemv(x, w, weight_scale=s, **kw)
                       for w, s in fp8]
        else:
            bf16_fns = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in bf16]
            fp8_fns = [lambda w=w, s=s, xq=xq: fp8_matmul(xq, w, s)
                       for w, s in fp8]
        for dtype, fns, wbytes in (("bf16", bf16_fns, 2), ("fp8", fp8_fns, 1)):
            nbytes = n * k * wbytes + rows * (k + n) * 2
            us = graph_us(fns)
            floor = nbytes / COPY_BW * 1e6
            out.append({"rows": rows, "kernel": f"{name}-{dtype}", "us": us, "floor_us": floor,
                        "of_floor": floor / us})
        del bf16, fp8
    return out


def gemv_sweep() -> list[dict[str, Any]]:
    saved = gemv_kernels.TILE_BYTES, gemv_kernels.BYTES_PER_THREAD
    out = []
    try:
        for tile in (8192, 16384, 32768, 65536):
            for per_thread in (64, 128, 256):
                gemv_kernels.TILE_BYTES, gemv_kernels.BYTES_PER_THREAD = tile, per_thread
                out += [{**row, "tile_bytes": tile, "bytes_per_thread": per_thread}
                        for row in projection_rows(1)]
                print(out[-8:], flush=True)
    finally:
        gemv_kernels.TILE_BYTES, gemv_kernels.BYTES_PER_THREAD = saved
    return out


def elementwise_rows(rows: int) -> list[dict[str, Any]]:
    """The activation passes around the projections: norm (bf16 out / e4m3 out), SwiGLU (bf16
    / e4m3), the per-token quantization of o_proj's input."""
    dev = torch.device("cuda")
    hidden, inter = 4096, 14336
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(rows, 2 * inter, device=dev, dtype=torch.bfloat16)
    cases = {
        "rms_norm-bf16": (lambda: rms_norm(x, w, 1e-5), rows * hidden * 4),
        "rms_norm-fp8": (lambda: rms_norm_fp8(x, w, 1e-5), rows * hidden * 3),
        "silu_and_mul-bf16": (lambda: silu_and_mul(gu), rows * inter * 6),
        "silu_and_mul-fp8": (lambda: silu_and_mul_fp8(gu), rows * inter * 5),
        "per_token_quant": (lambda: per_token_quant_fp8(x), rows * hidden * 3),
    }
    out = []
    for name, (fn, nbytes) in cases.items():
        us = graph_us([fn] * 16)
        floor = nbytes / COPY_BW * 1e6
        out.append({"rows": rows, "kernel": name, "us": us, "floor_us": floor,
                    "of_floor": floor / us})
    return out


def attention_rows(rows: int, ctx: int = 384) -> list[dict[str, Any]]:
    """Decode attention of the 8B model (32 query / 8 KV heads, D 128) at ctx tokens a row, over
    a bf16 and an e4m3 pool."""
    dev = torch.device("cuda")
    hq, hkv, d, bs = 32, 8, 128, 16
    blocks = rows * math.ceil(ctx / bs)
    tables = torch.randperm(blocks, device=dev, dtype=torch.int32).reshape(rows, -1)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    splits = max_splits_for(rows, hkv, torch.cuda.get_device_properties(dev).multi_processor_count,
                            may_split=ctx >= 512)
    ws = DecodeWorkspace.allocate(rows, hq, d, splits, dev)
    out = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        copies = _copies(2 * blocks * bs * hkv * d * dtype.itemsize)
        pools = [allocate_kv_pool(2, num_blocks=blocks, block_size=bs, num_kv_heads=hkv,
                                  head_dim=d, dtype=dtype, device=dev) for _ in range(copies)]
        for pool in pools:
            pool.copy_(torch.randn(pool.shape, device=dev))
        o = torch.empty_like(q)
        fns = [lambda p=p, o=o: paged_decode_attention(q, p[0], p[1], tables, lens, d ** -0.5,
                                                       o, splits, ws) for p in pools]
        us = graph_us(fns)
        floor = 2 * rows * ctx * hkv * d * dtype.itemsize / COPY_BW * 1e6
        out.append({"rows": rows, "kernel": f"decode_attention-{str(dtype)[6:]}-ctx{ctx}",
                    "us": us, "floor_us": floor, "of_floor": floor / us})
        del pools
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    out = os.environ.get("OUT")

    def save() -> None:  # after each part: a run cut short keeps what it measured
        if out:
            with open(os.path.join(out, "bench-fp8.json"), "w") as f:
                json.dump(report, f, indent=1)

    if not args.skip_engine:
        results = Path(out, "bench-fp8-rows.jsonl") if out else None
        report["engine"] = [row for model in args.models
                            for row in engine_rows(model, results, args.modes)]
        save()
    if not args.skip_kernels:
        kernels = []
        with torch.inference_mode():
            for rows in (1, 32, 128):
                for part in (projection_rows, elementwise_rows, attention_rows):
                    for row in part(rows):
                        print(row, flush=True)
                        kernels.append(row)
                free_device_memory()
        report["kernels_8b_decode"] = kernels
        save()
    if args.sweep:
        with torch.inference_mode():
            report["gemv_sweep_8b"] = gemv_sweep()
        save()

if __name__ == "__main__":
    main()
