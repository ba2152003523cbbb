"""RMSNorm, rounding exactly as Hugging Face's LlamaRMSNorm (normalize in fp32, round to the
input dtype, then multiply by the weight in that dtype). The residual add in front of it happens
in the output projection before (layers/linear.py), so the norm reads one tensor."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import supports_pdl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, hidden, eps,
                     BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H] (rows may be strided, last dim contiguous). Returns out (which may alias x)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == x.shape[1:]
    num_rows, hidden = x.shape
    out = torch.empty_like(x) if out is None else out
    block = triton.next_power_of_2(hidden)
    pdl = supports_pdl(x.device)
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            x, weight, out, x.stride(0), out.stride(0), hidden, eps, BLOCK=block, USE_PDL=pdl,
            num_warps=min(16, max(4, block // 512)), launch_pdl=pdl)
    return out
