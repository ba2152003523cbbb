"""Triton kernels: paged KV cache writes (with fused RoPE), paged decode and packed prefill
attention, RMSNorm and SiLU-and-mul. Import the submodules directly; importing this package
pulls in nothing heavy."""
