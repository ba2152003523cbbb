"""Instructions a 4-bit code in the W4A16 kernels' main loops, without a GPU.

Compiles kernels/wna16.py's GEMV (the 8B's qkv, o and gate_up launches, with their fusions) and
few-row kernel (16 and 128 rows) ahead of time for sm_90 with the Triton wheel's ptxas,
pointers and sizes specialized as 16-divisible as a launch specializes them, disassembles the
cubin with its cuobjdump and divides the longest loop's instructions (a backward branch's body)
by the codes a thread takes a step (NOTES.md, "4-bit weights"), and whether ptxas waits for each
of the few-row kernel's wgmmas before the next. Triton's versions differ there (3.6, the CUDA
machine's, serialized the kernel that 3.9 did not; journal item 159), so put the CUDA machine's
Triton first on PYTHONPATH. Run from the repository root: `python scripts/count_sass.py`.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from liteinfer.kernels import wna16

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TYPES = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp32", "m_ptr": "*fp32",
         "out_ptr": "*bf16", "norm_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
         "eps": "fp32"}
GROUP = 128


def compiled(fn: triton.JITFunction, constants: dict, num_warps: int, num_stages: int):
    """fn for sm_90: its non-constant integer arguments and pointers 16-divisible. Every
    constexpr parameter must be given: one left out would compile as a runtime argument, both
    sides of its branches in the loop."""
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constants]
    if missing:
        raise ValueError(f"{fn.__name__}: constexpr parameters not given: {missing}")
    signature = {name: "constexpr" if name in constants else TYPES.get(name, "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constants and name != "eps" and name != "M"}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def serialized_wgmmas(kernel) -> str:
    """The reason ptxas gives for waiting on every wgmma before the next (its C7515 advisory,
    which Triton's own compile does not show), or "" where it keeps several in flight."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o",
                               os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True).stderr
    found = re.search(r"C7515\).*serialized due to (.*) in the function", info)
    return found[1] if found else ""


def loop_and_registers(kernel) -> tuple[int, int]:
    """(instructions in the longest loop, registers a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    longest = 0
    for address, op in code:
        target = re.search(r"BRA\b.*0x([0-9a-f]+)", op)
        if target and int(target[1], 16) <= address:
            longest = max(longest, sum(int(target[1], 16) <= a <= address for a, _ in code))
    return longest, int(re.search(r"REG:(\d+)", usage)[1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    tile = wna16.GEMV_TILE
    for (name, norm, add, gated), stages in itertools.product(
            (("qkv", True, False, False), ("o", False, True, False),
             ("gate_up", True, False, True)), (1, 3)):
        block_k = tile.codes // (tile.rows * (1 + gated))
        kernel = compiled(wna16._wna16_gemv_kernel, dict(
            BITS=4, GROUP=GROUP, GROUP_TILE=min(GROUP, block_k), BLOCK_N=tile.rows,
            BLOCK_K=block_k, NORM=norm, ADD=add, GATED=gated, USE_PDL=True, PREFETCH_LINES=4,
            NUM_STAGES=stages), tile.num_warps, stages)
        loop, registers = loop_and_registers(kernel)
        per_thread = tile.rows * block_k * (1 + gated) // (32 * tile.num_warps)
        print(f"GEMV {name} {tile.rows} x {block_k}, {stages} stages: {loop} instructions a "
              f"step of {per_thread} codes a thread, {loop / per_thread:.2f} a code, "
              f"{registers} registers, {kernel.metadata.shared} bytes of shared memory")
    for m in (16, 128):
        tiles = wna16.wna16_tiles(m, 4096, 4096, 4, 2, 132)
        kernel = compiled(wna16._wna16_fewrow_kernel, dict(
            BITS=4, GROUP=GROUP, GROUP_TILE=min(GROUP, tiles.block_k), BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLITS=tiles.splits, PART_ROWS=128,
            ADD=False, GATED=False, DOT_PRECISION="tf32", USE_PDL=True), tiles.num_warps,
            tiles.num_stages)
        loop, registers = loop_and_registers(kernel)
        per_thread = tiles.block_n * tiles.block_k // (32 * tiles.num_warps)
        serialized = serialized_wgmmas(kernel)
        print(f"few-row {m} rows {tiles.block_n} x {tiles.block_k}, {tiles.num_warps} warps: "
              f"{loop} instructions a step of {per_thread} codes a thread, "
              f"{loop / per_thread:.2f} a code, {registers} registers; wgmmas "
              + (f"serialized ({serialized})" if serialized else "in flight together"))


if __name__ == "__main__":
    main()
