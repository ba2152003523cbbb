"""Triton kernels: paged KV cache writes (with fused RoPE), paged decode attention (which also
rotates and writes the step's own K/V), packed prefill attention, one-token linear layers with
RMSNorm and SiLU-and-mul fused in, few-row linear layers, the standalone RMSNorm and
SiLU-and-mul, FP8 activation quantization, greedy sampling's argmax, the L2 weight
prefetch a kernel issues before its PDL wait, and the mixture-of-experts router and experts.
Import the submodules directly; importing this package pulls in nothing heavy."""
from __future__ import annotations

import functools

import torch

# FP8 (e4m3) as the kernels and the torch paths store it: values clamped to +-FP8_MAX, a row's
# scale max|row| / FP8_MAX with max|row| at least MIN_AMAX (an all-zero row gets a finite one).
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-10


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel launched while the previous one finishes, waiting
    in-kernel with griddepcontrol) needs a Hopper-or-later CUDA device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 stands in elsewhere, as for Triton's CPU
    interpreter): what split-K decode sizes its grid against."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 operands get exact fp32 products (tf32 would cost ~1e-3
    relative error); the others multiply exactly anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"
