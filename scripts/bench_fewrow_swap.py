"""Experiment: the few-row GEMM with the weight as the MMA's row operand, at 64-128 rows.

kernels/fewrow_gemm.py multiplies x [M, K] by W^T with the input rows as wgmma's M side (a tile
of 64 or 128 rows) and 32-64 output features as its N side. At 128 rows that kernel reads the
8B's weights at 0.44-0.58 of the copy bandwidth (qkv 12.3 us, o 9.9, down 25.5; item 87).
Here y^T = W x^T: a tile of 64 or 128 weight rows is wgmma's M operand and the 64-128 input rows
its N (m64n128k32 instead of m64n32k32), weights and inputs by TMA or by pointer loads, and K
optionally cut among SPLITS programs a tile (fp32 partials red.added into a workspace, the last
program to arrive applies the scales and the residual). Times each against cuBLAS(Lt) and the
engine's kernel at the 1B and 8B projections; writes $OUT/fewrow-swap.json.

    python scripts/bench_fewrow_swap.py [--rows 128 64] [--dtypes fp8 bf16] [--models 8b 1b]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from liteinfer.kernels import supports_pdl


@dataclass(frozen=True)
class SwapTiles:
    block_n: int  # weight rows a program (wgmma M: 64 a warpgroup)
    block_k_bytes: int
    num_stages: int
    splits: int = 1
    tma: bool = False

    @property
    def num_warps(self) -> int:
        return 4 if self.block_n == 64 else 8


@triton.jit
def _swap_kernel(x_ptr, w_ptr, x_desc, w_desc, x_scale_ptr, w_scale_ptr, out_ptr, ws_ptr,
                 count_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLITS: tl.constexpr, TMA: tl.constexpr, SCALED: tl.constexpr,
                 ADD: tl.constexpr, USE_PDL: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // SPLITS  # the splits of a tile are launch neighbours: their partials meet in L2
    split = pid % SPLITS
    n0 = tile * BLOCK_N
    chunks = K // (SPLITS * BLOCK_K)
    k_start = split * chunks * BLOCK_K
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c in tl.range(0, chunks, num_stages=NUM_STAGES):
        if TMA:
            k = k_start + c * BLOCK_K
            w = w_desc.load([n0, k])
            x = x_desc.load([0, k])
        else:
            w = tl.load(w_ptrs + c * BLOCK_K, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs + c * BLOCK_K, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS > 1:
        ws = ws_ptr + offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.atomic_add(ws, acc, mask=mask, sem="relaxed", scope="gpu")
        # Every thread's adds before the counter's release; the last to arrive owns the tile.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived < SPLITS - 1:
            return
        tl.store(count_ptr + tile, 0)
        acc = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(ws, tl.zeros_like(acc), mask=mask)
    if SCALED:
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
        acc = acc * w_scale[:, None] * x_scale[None, :]
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if ADD:
        acc = acc.to(dtype).to(tl.float32) + tl.load(out_ptrs, mask=mask).to(tl.float32)
    tl.store(out_ptrs, acc.to(dtype), mask=mask)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_DESCS: dict[tuple, TensorDescriptor] = {}


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    key = (t.data_ptr(), tuple(t.shape), t.dtype, tuple(block))
    if key not in _DESCS:
        _DESCS[key] = TensorDescriptor(t, list(t.shape), list(t.stride()), block)
    return _DESCS[key]


def swap_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: SwapTiles, *,
              x_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
              residual: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = tiles.block_k_bytes // weight.element_size()
    assert rows <= 128 and k % (tiles.splits * block_k) == 0
    out = residual if residual is not None else torch.empty(rows, n, dtype=out_dtype,
                                                            device=x.device)
    key = (x.device, n, block_m)
    if tiles.splits > 1 and key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros(n, block_m, dtype=torch.float32, device=x.device),
                            torch.zeros(triton.cdiv(n, 64), dtype=torch.int32, device=x.device))
    ws, counts = _WORKSPACES[key] if tiles.splits > 1 else (out, out)
    x_desc = w_desc = None
    if tiles.tma:
        x_desc, w_desc = _desc(x, [block_m, block_k]), _desc(weight, [tiles.block_n, block_k])
    scaled = weight_scale is not None
    pdl = supports_pdl(x.device)
    _swap_kernel[(triton.cdiv(n, tiles.block_n) * tiles.splits,)](
        x, weight, x_desc, w_desc, x_scale if scaled else x, weight_scale if scaled else x, out,
        ws, counts, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, SPLITS=tiles.splits,
        TMA=tiles.tma, SCALED=scaled, ADD=residual is not None, USE_PDL=pdl,
        NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps, launch_pdl=pdl)
    return out


# (model, projection, in features, out features)
PROJECTIONS = {"8b": (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                      ("down", 14336, 4096)),
               "1b": (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384),
                      ("down", 8192, 2048))}
SMEM_BUDGET = 200 << 10


def grid(rows: int, n: int, splits_ok: bool) -> list[SwapTiles]:
    block_m = max(16, triton.next_power_of_2(rows))
    out = []
    for bn, bk, st, sp, tma in itertools.product((64, 128), (128, 256), (3, 4, 5), (1, 2, 4),
                                                 (False, True)):
        if (bn + block_m) * bk * st > SMEM_BUDGET or (sp > 1 and not splits_ok):
            continue
        out.append(SwapTiles(bn, bk, st, sp, tma))
    return out


def main() -> None:
    from bench_fp8 import COPY_BW, _copies, graph_us

    from liteinfer.kernels.fewrow_gemm import fewrow_gemm, fewrow_tiles
    from liteinfer.kernels.quant_fp8 import per_token_quant_fp8
    from liteinfer.layers.quantization.fp8 import Fp8Activation, fp8_matmul, quantize_weight

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--dtypes", nargs="+", default=["fp8", "bf16"])
    ap.add_argument("--models", nargs="+", default=["8b", "1b"])
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "rows": []}
    path = os.path.join(os.environ.get("OUT", "."), "fewrow-swap.json")
    for dtype, rows, model in itertools.product(args.dtypes, args.rows, args.models):
        for name, k, n in PROJECTIONS[model]:
            if time.time() - t0 > args.budget_s:
                break
            wbytes = 1 if dtype == "fp8" else 2
            copies = _copies(n * k * wbytes)
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            xq, xs = per_token_quant_fp8(x)
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                  for _ in range(copies)]
            if dtype == "fp8":
                ws = [quantize_weight(w) for w in ws]
            floor = (n * k * wbytes + rows * (k + n) * 2) / COPY_BW * 1e6
            found = []

            def record(impl: str, us: float, tiles: SwapTiles | None = None,
                       err: float | None = None) -> None:
                row = {"model": model, "proj": name, "rows": rows, "dtype": dtype,
                       "impl": impl, "us": us, "of_floor": floor / us, "max_rel_err": err,
                       **(asdict(tiles) if tiles else {})}
                found.append(row)
                report["rows"].append(row)

            if dtype == "fp8":
                ref = fp8_matmul(Fp8Activation(xq, xs), *ws[0]).float()
                record("cublas", graph_us([lambda w=w: fp8_matmul(Fp8Activation(xq, xs), *w)
                                           for w in ws]))
                rule = fewrow_tiles(rows, n, 1)
                if rule is not None:
                    record("fewrow", graph_us([lambda w=w: fewrow_gemm(
                        xq, w[0], x_scale=xs, weight_scale=w[1], out_dtype=torch.bfloat16,
                        tiles=rule) for w in ws]))
            else:
                ref = torch.nn.functional.linear(x, ws[0]).float()
                record("cublas", graph_us([lambda w=w: torch.nn.functional.linear(x, w)
                                           for w in ws]))
            for tiles in grid(rows, n, splits_ok=n <= 8192):
                try:
                    if dtype == "fp8":
                        def call(w, t=tiles):
                            return swap_gemm(xq, w[0], t, x_scale=xs, weight_scale=w[1])
                    else:
                        def call(w, t=tiles):
                            return swap_gemm(x, w, t)
                    got = call(ws[0]).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    record("swap", graph_us([lambda w=w, c=call: c(w) for w in ws]), tiles, err)
                except Exception as e:  # a tile that does not compile (shared memory)
                    print(f"{model} {name} {rows} {dtype} {tiles}: {type(e).__name__} {e}"[:300],
                          flush=True)
            base = {r["impl"]: r for r in found if r["impl"] != "swap"}
            swaps = sorted((r for r in found if r["impl"] == "swap"), key=lambda r: r["us"])
            best = swaps[0] if swaps else None
            print(f"{model} {name:7s} rows {rows:3d} {dtype}: "
                  + " ".join(f"{i} {r['us']:.1f} ({r['of_floor']:.2f})" for i, r in base.items())
                  + (f" | swap {best['us']:.1f} ({best['of_floor']:.2f}) err "
                     f"{best['max_rel_err']:.1e} bn{best['block_n']} bk{best['block_k_bytes']} "
                     f"st{best['num_stages']} sp{best['splits']} tma{int(best['tma'])}"
                     if best else ""), flush=True)
            del ws
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
