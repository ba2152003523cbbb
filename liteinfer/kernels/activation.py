"""SwiGLU activation: silu(gate) * up over the fused [gate | up] projection output.

Matches Hugging Face's `act_fn(gate) * up` rounding: silu runs in fp32 and is rounded to the
input dtype (as torch does for a bf16/fp16 tensor), then the product is taken in fp32 and
rounded again. In front of an FP8 down projection the product is quantized per token on its way
out (`silu_and_mul_fp8`): one program then holds a whole row, for its max.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl
from liteinfer.kernels.quant_fp8 import fp8_outputs, quantize_row, row_warps

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, inter,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # launched while the previous kernel finishes: wait for it before any read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    if QUANT:
        quantize_row(y.to(gate.dtype).to(tl.float32), mask, out_ptr + row * stride_o + cols,
                     scale_ptr + row, scale_ptr, False)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None) -> None:
    num_rows, inter = x.shape[0], x.shape[1] // 2
    assert out.shape == (num_rows, inter) and out.stride(-1) == 1
    quant = scale is not None
    block = triton.next_power_of_2(inter) if quant else _BLOCK
    pdl = supports_pdl(x.device)
    if num_rows > 0:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x, out, scale if quant else x, x.stride(0), out.stride(0), inter, BLOCK=block,
            QUANT=quant, USE_PDL=pdl,
            num_warps=row_warps(block) if quant else 4, launch_pdl=pdl)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (last dim contiguous) -> [T, I]."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    out = x.new_empty(x.shape[0], x.shape[1] // 2) if out is None else out
    _launch(x, out, None)
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of x [T, 2I], quantized per token: (e4m3 [T, I], fp32 scales [T, 1]). A static
    input scale of down_proj is applied by down_proj's own quantization instead."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    out, scale = fp8_outputs(x.shape[0], x.shape[1] // 2, x.device)
    _launch(x, out, scale)
    return out, scale
