"""SwiGLU activation: silu(gate) * up over the fused [gate | up] projection output.

Matches Hugging Face's `act_fn(gate) * up` rounding: silu runs in fp32 and is rounded to the
input dtype (as torch does for a bf16/fp16 tensor), then the product is taken in fp32 and
rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (last dim contiguous) -> [T, I]."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(num_rows, inter) if out is None else out
    assert out.shape == (num_rows, inter) and out.stride(-1) == 1
    pdl = supports_pdl(x.device)
    if num_rows > 0:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, _BLOCK))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK, USE_PDL=pdl, num_warps=4,
            launch_pdl=pdl)
    return out
