"""FP8 (e4m3) activation quantization, one scale per token (row).

A row y is stored as q = clamp(y / s, -448, 448) in e4m3 with s = max(|y|) / 448 (dynamic), or
with a checkpoint's static scale s. `quantize_row` is the epilogue the RMSNorm and SwiGLU kernels
end with when their output feeds an FP8 GEMM (norm.py, activation.py), so no pass of its own
reads the activation again; `per_token_quant_fp8` serves inputs no kernel of ours produces (the
attention output in front of o_proj).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_DTYPE, FP8_MAX, MIN_AMAX, supports_pdl

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def quantize_row(y, mask, q_ptrs, scale_ptr, static_scale_ptr, STATIC: tl.constexpr):
    """Stores fp32 row y (masked lanes ignored) at q_ptrs as e4m3 and its scale at scale_ptr."""
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), 0)
        scale = tl.maximum(amax, _MIN_AMAX) / _FP8_MAX
    tl.store(scale_ptr, scale)
    q = tl.clamp(y / scale, -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, stride_x, width,
                            BLOCK: tl.constexpr, STATIC: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    quantize_row(y, mask, q_ptr + row * width + cols, scale_ptr + row, static_scale_ptr, STATIC)


def fp8_outputs(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 [rows, width] values and fp32 [rows, 1] scales."""
    return (torch.empty(rows, width, dtype=FP8_DTYPE, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


def row_warps(block: int) -> int:
    return min(16, max(4, block // 512))


def per_token_quant_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] (last dim contiguous) -> (e4m3 [T, K], fp32 scales [T, 1]); with static_scale
    (fp32 [1]) every row uses it."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, width = x.shape
    q, scale = fp8_outputs(rows, width, x.device)
    block = triton.next_power_of_2(width)
    pdl = supports_pdl(x.device)
    if rows > 0:
        _per_token_quant_kernel[(rows,)](
            x, q, scale, static_scale if static_scale is not None else scale, x.stride(0),
            width, BLOCK=block, STATIC=static_scale is not None, USE_PDL=pdl,
            num_warps=row_warps(block), launch_pdl=pdl)
    return q, scale
