"""Compile fewrow_gemm's kernel for sm_90 on a machine without a GPU, with triton 3.6 (the GPU
box's version), and report per config: wgmma (ttng.warp_group_dot in TTGIR, wgmma.mma_async in
PTX), how the loop's loads are pipelined (cp.async / TMA copies, buffers), the weight loads
issued before griddepcontrol.wait, shared memory, registers and spills (ptxas).

    PYTHONPATH=<triton 3.6 copy>:$PWD python scripts/fewrow_gemm/compile_sm90.py [--dump DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import bench_fewrow  # noqa: E402
from fewrow_gemm import WS_M, FewRowTiles, _fewrow_kernel, block_m_for  # noqa: E402

ARGS = ["x_ptr", "w_ptr", "x_desc", "w_desc", "out_ptr", "ws_ptr", "count_ptr", "M", "N",
        "stride_xm", "stride_wn", "stride_om"]


def compile_config(n: int, k: int, rows: int, t: FewRowTiles, pdl: bool = True):
    bm = block_m_for(rows)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32" if t.splits > 1 else "*bf16",
           "count_ptr": "*i32" if t.splits > 1 else "*bf16",
           "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    constexprs = {"BLOCK_M": bm, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
                  "SPLITS": t.splits, "CPS": k // (t.splits * t.block_k), "PRE": t.pre,
                  "PRE_LAST": t.pre_last and 0 < t.pre < k // (t.splits * t.block_k),
                  "TMA": t.tma, "REDUCE_ATOMIC": t.reduce == "atomic", "WS_ROWS": WS_M,
                  "USE_PDL": pdl}
    if t.tma:
        if k // (t.splits * t.block_k) > t.pre:
            sig["x_desc"] = f"tensordesc<bf16[{bm}, {t.block_k}]>"
            sig["w_desc"] = f"tensordesc<bf16[{t.block_n}, {t.block_k}]>"
        if t.pre:
            sig["xp_desc"] = f"tensordesc<bf16[{bm}, {t.pre * t.block_k}]>"
            sig["wp_desc"] = f"tensordesc<bf16[{t.block_n}, {t.pre * t.block_k}]>"
    for name in ("x_desc", "w_desc", "xp_desc", "wp_desc"):
        if name not in sig:
            sig[name] = "constexpr"
            constexprs[name] = None
    for name in constexprs:
        if name not in sig:
            sig[name] = "constexpr"
    order = _fewrow_kernel.arg_names
    sig = {a: sig[a] for a in order}
    # what the JIT would specialize: 16-aligned pointers, ints divisible by 16 (M is not)
    attrs = {}
    for a in ("x_ptr", "w_ptr", "out_ptr", "ws_ptr", "count_ptr", "N", "stride_xm", "stride_wn",
              "stride_om"):
        if a == "stride_om" and n % 16:
            continue
        attrs[(order.index(a),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=_fewrow_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": t.num_warps, "num_stages": t.num_stages,
                                   "launch_pdl": pdl})


def resource_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        txt = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", txt, re.S)
    return {"regs": int(m.group(1)), "static_smem": int(m.group(2)),
            "local": int(m.group(3))} if m else {"raw": txt}


def inspect(n: int, k: int, rows: int, t: FewRowTiles, dump: str | None = None) -> dict:
    c = compile_config(n, k, rows, t)
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    wait_pos = ptx.find("griddepcontrol.wait")
    pre_ptx = ptx[:wait_pos] if wait_pos >= 0 else ""
    info = {
        "n": n, "k": k, "rows": rows, "block_m": block_m_for(rows), "tiles": t.name(),
        "warp_group_dot": ttgir.count("ttng.warp_group_dot "),
        "warp_group_dot_async": len(re.findall(r"ttng.warp_group_dot .*isAsync = true", ttgir)),
        "mma_v2": ttgir.count("versionMajor = 2"),
        "wgmma_ptx": ptx.count("wgmma.mma_async"),
        "cp_async_ttgir": ttgir.count("ttg.async_copy_global_to_local"),
        "tma_copy_ttgir": ttgir.count("ttng.async_tma_copy_global_to_local"),
        "ld_global_before_gdc_wait": len(re.findall(r"ld\.global", pre_ptx)),
        "ld_global_bytes_before_wait": sum(
            int(v or 1) * int(b) // 8 for v, b in
            re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.b(\d+)", pre_ptx)),
        "shared_bytes": c.metadata.shared,
        "num_stages": t.num_stages, "num_warps": t.num_warps,
        **resource_usage(c.asm["cubin"]),
    }
    info["programs_per_sm_by_smem"] = (227 * 1024) // max(1, info["shared_bytes"])
    info["programs_per_sm_by_regs"] = 65536 // (info["regs"] * 32 * t.num_warps)
    if dump:
        os.makedirs(dump, exist_ok=True)
        base = os.path.join(dump, f"n{n}k{k}m{rows}_{t.name()}")
        for ext in ("ttgir", "ptx"):
            with open(f"{base}.{ext}", "w") as f:
                f.write(c.asm[ext])
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None, help="write TTGIR/PTX of every config here")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    args = ap.parse_args()
    print(f"triton {triton.__version__} from {triton.__file__}")
    for name, (n, k) in bench_fewrow.SHAPES.items():
        for rows in args.rows:
            for t in bench_fewrow.candidate_tiles(name, rows, sms=132):
                try:
                    info = inspect(n, k, rows, t, args.dump)
                except Exception as e:  # noqa: BLE001
                    info = {"op": name, "rows": rows, "tiles": t.name(),
                            "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps({"op": name, **info}), flush=True)


if __name__ == "__main__":
    main()
