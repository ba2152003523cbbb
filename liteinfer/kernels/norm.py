"""RMSNorm, rounding exactly as Hugging Face's LlamaRMSNorm (normalize in fp32, round to the
input dtype, then multiply by the weight in that dtype). The residual add in front of it happens
in the output projection before (layers/linear.py), so the norm reads one tensor. In front of an
FP8 projection the normalized row, rounded to the input dtype, is quantized per token on its way
out (`rms_norm_fp8`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl
from liteinfer.kernels.quant_fp8 import fp8_outputs, quantize_row, row_warps


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, scale_ptr, static_scale_ptr, stride_x, stride_o,
                     hidden, eps, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                     STATIC: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # launched while the previous kernel finishes: only the weight is read before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    y = w * normed
    if QUANT:
        quantize_row(y.to(x.dtype).to(tl.float32), mask, out_ptr + row * stride_o + cols,
                     scale_ptr + row, static_scale_ptr, STATIC)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
            scale: torch.Tensor | None, static_scale: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == x.shape[1:]
    num_rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    pdl = supports_pdl(x.device)
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            x, weight, out, scale if scale is not None else x,
            static_scale if static_scale is not None else x, x.stride(0), out.stride(0), hidden,
            eps, BLOCK=block, QUANT=scale is not None, STATIC=static_scale is not None,
            USE_PDL=pdl, num_warps=row_warps(block), launch_pdl=pdl)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H] (rows may be strided, last dim contiguous). Returns out (which may alias x)."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, weight, eps, out, None, None)
    return out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, H], quantized per token: (e4m3 [T, H], fp32 scales [T, 1]); with
    static_scale (fp32 [1]) every row uses it (kernels/quant_fp8.py)."""
    out, scale = fp8_outputs(x.shape[0], x.shape[1], x.device)
    _launch(x, weight, eps, out, scale, static_scale)
    return out, scale
