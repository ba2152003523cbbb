"""Skinny GEMM for decode-time linears: out[M, N] = x[M, K] @ weight[N, K]^T with M <= 64.

At decode the weight stream is the whole cost, so the kernel is built around it: one program
per BLOCK_N output columns walks K in BLOCK_K chunks. Each [BLOCK_N, BLOCK_K] weight tile is
the dot's first operand: its rows are contiguous along K, so Triton's pipeliner streams it
with 16-byte async copies `num_stages` deep into shared memory, and from BLOCK_N = 64 on
Hopper's wgmma reads it from there directly. The few token rows are the dot's narrow side,
padded to BLOCK_M >= 16 (clamped onto real rows, never stored); M itself is not specialized,
so a decode batch size costs no recompile within its BLOCK_M. No split-K: every output
element belongs to exactly one program, which keeps the residual epilogue safe in place and
the result deterministic.

Optional fusions, each rounding exactly as the unfused model code does:
- RMSNorm prologue (Hugging Face LlamaRMSNorm): each program first sums x^2 over its rows
  (x is tiny and stays in L2), then normalizes each x tile as it is loaded.
- SiLU-and-mul prologue: x is [M, 2K] = [gate | up], combined per tile as activation.py does.
- Residual epilogue: out = round(x @ W^T) + residual, rounded again; out may alias residual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels.decode_attention import dot_precision

MAX_M = 64
# Steps of up to this many tokens run the model through the fused skinny-GEMM path (the
# crossover with cuBLAS on the H200, scripts/bench_skinny_gemm.py).
FUSED_MAX_TOKENS = 32
NUM_SMS = 132  # H200; the default tiles aim at filling about one wave of programs
_PLAIN, _NORM, _SILU = 0, 1, 2  # the kernel's PROLOGUE


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_m_for(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def skinny_config(m: int, n: int, k: int, itemsize: int = 2) -> SkinnyConfig:
    """Default tiles (to be replaced by scripts/bench_skinny_gemm.py results): the widest
    BLOCK_N that still gives ~one program per SM, ~16 KiB weight tiles, 4 stages (3 tiles in
    flight), BLOCK_K halved until 4 full stages fit in 200 KiB of shared memory even with
    SiLU-and-mul's two x tiles per stage."""
    block_n = 16
    while block_n < 128 and triton.cdiv(n, 2 * block_n) >= NUM_SMS:
        block_n *= 2
    block_k = min(512, max(16, 16384 // (block_n * itemsize)), max(16, triton.next_power_of_2(k)))
    num_stages, rows = 4, block_n + 2 * block_m_for(m)
    while block_k > 32 and num_stages * rows * block_k * itemsize > 200 << 10:
        block_k //= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=num_stages)


@triton.jit
def _load(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["M"])  # M changes every decode step: one compile per BLOCK_M
def _skinny_kernel(x_ptr, w_ptr, nw_ptr, res_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                   stride_rm, stride_om, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Padding rows/columns are clamped onto real ones, so loads need no row mask; their
    # results are dropped at the store. int64: lm_head-sized weights pass 2^31 elements.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    dtype = w_ptr.dtype.element_ty

    if PROLOGUE == 1:  # _NORM needs each row's full sum of squares before the first tile
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k[None, :]
            xf = _load(x_rows + kk, kk < K, EVEN_K).to(tl.float32)
            sumsq += tl.sum(xf * xf, 1)
        rstd = tl.rsqrt(sumsq / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k[None, :]
        k_ok = kk < K
        w = _load(w_rows + kk, k_ok, EVEN_K)
        if PROLOGUE == 2:  # _SILU
            gate = _load(x_rows + kk, k_ok, EVEN_K).to(tl.float32)
            up = _load(x_rows + K + kk, k_ok, EVEN_K).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up).to(dtype)
        else:
            x = _load(x_rows + kk, k_ok, EVEN_K)
            if PROLOGUE == 1:  # _NORM, rounded as LlamaRMSNorm
                nw = _load(nw_ptr + kk, k_ok, EVEN_K).to(tl.float32)
                normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
                x = (nw * normed).to(dtype)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)

    # acc is [BLOCK_N, BLOCK_M]: store it transposed into out[M, N].
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y = acc.to(dtype)
    if HAS_RESIDUAL:  # read and written by this program only: out may alias residual
        r = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  silu_mul: bool = False, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x @ weight.T for M <= 64 rows, fp32 accumulation, result in x.dtype.

    weight: [N, K] contiguous. x: [M, K], or [M, 2K] = [gate | up] with silu_mul (rows may be
    strided, last dim contiguous). norm_weight: [K], applies RMSNorm (eps) to x first.
    residual: [M, N], added after rounding the product. out: [M, N] (new by default; may be
    residual itself for an in-place add). Returns out."""
    assert weight.dim() == 2 and weight.is_contiguous(), "weight must be a contiguous [N, K]"
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with a contiguous last dim"
    assert x.dtype == weight.dtype, f"x is {x.dtype} but weight is {weight.dtype}"
    assert not (silu_mul and norm_weight is not None), "norm and silu_mul prologues exclude"
    (m, k_in), (n, k) = x.shape, weight.shape
    assert k_in == (2 * k if silu_mul else k), f"x has {k_in} columns for weight K={k}"
    assert m <= MAX_M, f"skinny_linear takes at most {MAX_M} rows, got {m}"
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1
        assert norm_weight.dtype == x.dtype, "norm weight must be in the model dtype"
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
        assert residual.dtype == x.dtype
    out = x.new_empty(m, n) if out is None else out
    assert out.shape == (m, n) and out.stride(-1) == 1 and out.dtype == x.dtype
    if m == 0:
        return out
    cfg = config or skinny_config(m, n, k, x.element_size())
    assert cfg.block_n >= 16 and cfg.block_k >= 16, "tl.dot needs tiles of at least 16"
    prologue = _NORM if norm_weight is not None else _SILU if silu_mul else _PLAIN
    res = residual if residual is not None else out  # unread placeholders when unused
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, norm_weight if norm_weight is not None else weight, res, out, m, n, k,
        x.stride(0), weight.stride(0), res.stride(0), out.stride(0), eps,
        BLOCK_M=block_m_for(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
