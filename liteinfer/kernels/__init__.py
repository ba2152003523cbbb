"""Triton kernels: paged KV cache writes (with fused RoPE), paged decode attention (which also
rotates and writes the step's own K/V), packed prefill attention, RMSNorm and SiLU-and-mul.
Import the submodules directly; importing this package pulls in nothing heavy."""
