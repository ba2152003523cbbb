"""The W4A16 / W8A16 kernels against a float64 dequantize-then-matmul reference, on fresh random
packed weights (every code, scale and min drawn)."""
import pytest
import torch

from liteinfer.kernels.wna16 import FEWROW_MAX, dequantize_weight, wna16_linear
from liteinfer.layers.quantization.wna16 import dequantize, pack_codes

# fp32 sums of K products in another order; the bf16 slack is its output rounding (2^-8),
# which the interpreter does by truncation.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _packed(n: int, k: int, bits: int, group: int, device: str):
    codes = torch.randint(0, 1 << bits, (n, k), device=device)
    scales = torch.rand(n, k // group, device=device) * 0.02 + 1e-3
    mins = torch.randn(n, k // group, device=device) * 0.05
    return pack_codes(codes, bits), scales, mins


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * want.abs().max().item(), err


@pytest.mark.parametrize("bits, group", [(4, 128), (4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("rows", [1, 3, 7, FEWROW_MAX, FEWROW_MAX + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_float64(device, full, bits, group, rows, dtype):
    n, k = (4096, 4096) if full else (40, 256)  # n not a multiple of the tile's rows
    qweight, scales, mins = _packed(n, k, bits, group, device)
    x = torch.randn(rows, k, device=device).to(dtype)
    want = x.double() @ dequantize(qweight, scales, mins, bits, torch.float64).t()
    _check(wna16_linear(x, qweight, scales, mins, bits), want, dtype)
    residual = torch.randn(rows, n, device=device).to(dtype)
    expected = residual.double() + want
    out = wna16_linear(x, qweight, scales, mins, bits, residual)
    assert out.data_ptr() == residual.data_ptr()
    _check(out, expected, dtype)


@pytest.mark.parametrize("bits, group", [(4, 128), (8, 16)])
def test_dequantize_is_exact(device, bits, group):
    """q * scale - min in fp32 within the rounding of its two steps: the CPU path rounds the
    product and the difference, a GPU may fuse them into one FMA."""
    qweight, scales, mins = _packed(24, 384, bits, group, device)
    got = dequantize_weight(qweight, scales, mins, bits, torch.float32).double()
    exact = dequantize(qweight, scales, mins, bits, torch.float64)
    product = dequantize(qweight, scales, torch.zeros_like(mins), bits, torch.float64)
    assert ((got - exact).abs() <= 2.0 ** -24 * (product.abs() + exact.abs())).all()
