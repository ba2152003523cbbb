"""Weight-only integer linear layers (W4A16 / W8A16) over the packed layout of
layers/quantization/wna16.py: codes int32 [N, K * bits / 32], fp32 scales and mins per group.

A step of up to FEWROW_MAX rows (decode) is bound by reading the weight, so `wna16_gemm` streams
the packed words and dequantizes them in registers (q * scale - min, in fp32), a program owning
BLOCK_N output features of every row: the weight is read once a step at a quarter (4-bit) of
bf16's bytes. The rows are multiplied on the CUDA cores: at a few rows tensor-core tiles would
sit mostly empty. With `residual` the product is added to it in place (an output projection).
Wider steps (prefill) are compute-bound: the weight is dequantized into a scratch tensor in the
activation dtype (`dequantize_weight`) and multiplied by cuBLAS, whose tiles no dequantizing
kernel of ours beats there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows up to which the in-register kernel runs; wider steps dequantize and call cuBLAS. Its
# broadcast product holds BLOCK_M x BLOCK_N x BLOCK_K fp32 values in registers, which caps it.
# (Tensor-core tiles for 5-16 rows are left out: the Triton interpreter's bf16 tl.dot returns
# garbage, so CPU tests could not check them.)
FEWROW_MAX = 8


@triton.jit
def _dequantized_tile(qw_ptr, s_ptr, m_ptr, rn, k0, N, K, BITS: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows rn, columns k0..k0 + BLOCK_K, as fp32 [BLOCK_N, BLOCK_K] (0 outside)."""
    PER: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    words = K // PER
    rw = k0 // PER + tl.arange(0, BLOCK_K // PER)
    packed = tl.load(qw_ptr + rn[:, None] * words + rw[None, :],
                     mask=(rn < N)[:, None] & (rw < words)[None, :], other=0)
    shifts = tl.arange(0, PER) * BITS
    q = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    rg = k0 // GROUP + tl.arange(0, GROUPS)
    gmask = (rn < N)[:, None] & (rg < K // GROUP)[None, :]
    scale = tl.load(s_ptr + rn[:, None] * (K // GROUP) + rg[None, :], mask=gmask, other=0.0)
    low = tl.load(m_ptr + rn[:, None] * (K // GROUP) + rg[None, :], mask=gmask, other=0.0)
    q = tl.reshape(q, (BLOCK_N, GROUPS, GROUP)).to(tl.float32)
    w = q * scale[:, :, None] - low[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _wna16_gemm_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, out_ptr, M, N, K, stride_x, stride_o,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _dequantized_tile(qw_ptr, s_ptr, m_ptr, rn, k0, N, K, BITS, GROUP, BLOCK_N, BLOCK_K)
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :],
                    mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + rm[:, None] * stride_o + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, m_ptr, w_ptr, N, K, BITS: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequantized_tile(qw_ptr, s_ptr, m_ptr, rn, k0, N, K, BITS, GROUP, BLOCK_N, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None] * K + rk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(rn < N)[:, None] & (rk < K)[None, :])


def _block_k(group: int, k: int) -> int:
    """Columns a tile: whole groups, at least 128 codes (a 4-bit row's 64 bytes)."""
    return max(group, min(128, triton.next_power_of_2(k)))


def _group(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> int:
    return qweight.shape[1] * (32 // bits) // scales.shape[1]


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= FEWROW_MAX) times the packed weight [N, K], transposed: [M, N] in x's
    dtype, or residual += it in place (returning residual)."""
    m, k = x.shape
    n = qweight.shape[0]
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype,
                                                            device=x.device)
    group = _group(qweight, scales, bits)
    block_m = triton.next_power_of_2(max(m, 1))
    block_n = 32 if block_m <= 2 else 16
    _wna16_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, mins, out, m, n, k, x.stride(0), out.stride(0), BITS=bits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(group, k),
        ADD=residual is not None, num_warps=4 if block_m <= 2 else 8)
    return out


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight as [N, K] in dtype."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (32 // bits)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    group = _group(qweight, scales, bits)
    block_k = _block_k(group, k)
    _dequantize_kernel[(triton.cdiv(n, 16), triton.cdiv(k, block_k))](
        qweight, scales, mins, w, n, k, BITS=bits, GROUP=group, BLOCK_N=16, BLOCK_K=block_k)
    return w


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, bits: int,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T for any number of rows (or residual += x W^T in place)."""
    if x.shape[0] <= FEWROW_MAX:
        return wna16_gemm(x, qweight, scales, mins, bits, residual)
    w = dequantize_weight(qweight, scales, mins, bits, x.dtype)
    if residual is None:
        return torch.nn.functional.linear(x, w)
    return residual.addmm_(x, w.t())
