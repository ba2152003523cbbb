"""Per-token FP8 quantization kernels (the RMSNorm and SwiGLU epilogues, and the standalone
pass) against float64: each row's scale is max |row| / 448 (or the static one), and every value
is its row's e4m3 rounding of value / scale, clamped to +-448."""
import pytest
import torch

from liteinfer.kernels.activation import silu_and_mul_fp8
from liteinfer.kernels.norm import rms_norm_fp8
from liteinfer.kernels.quant_fp8 import per_token_quant_fp8

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check_quantized(q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                     static: torch.Tensor | None = None) -> None:
    """q, scale from a kernel; y the float64 rows they quantize."""
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (y.shape[0], 1)
    if static is None:
        expected = y.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448
    else:
        expected = static.double().expand(y.shape[0], 1)
    assert torch.allclose(scale.double(), expected, rtol=1e-6, atol=0)
    scaled = (y / expected).clamp(-448, 448)
    got = q.double()
    # Rounding to nearest e4m3: within half a step (2^-4 of the value, 2^-10 among subnormals).
    assert ((got - scaled).abs() <= scaled.abs() * 2 ** -4 + 2 ** -10).all()
    # Away from rounding ties, exactly torch's rounding. The kernels divide in fp32: a value
    # within fp32's rounding of a tie can round the other way (0.11% of the values of one
    # fresh H200 draw of the RMSNorm case).
    same = got == scaled.float().to(torch.float8_e4m3fn).double()
    assert same.float().mean() > 0.998
    if static is None:  # each row's largest value lands on 448 (all-zero rows stay zero)
        nonzero = y.abs().amax(-1) > 0
        assert (got.abs().amax(-1)[nonzero] == 448).all() and (got[~nonzero] == 0).all()


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_quant(device, full, needs_fp8_store, dtype, static):
    rows, width = (300, 4096) if full else (5, 96)
    x = torch.randn(rows, width, dtype=dtype, device=device) * 3
    x[1] = 0  # an all-zero row keeps a finite scale
    scale_in = torch.tensor([0.01], device=device) if static else None
    q, scale = per_token_quant_fp8(x, scale_in)
    _check_quantized(q, scale, x.double(), scale_in)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fp8(device, full, needs_fp8_store, dtype):
    """The normalized row, rounded to the model dtype as Hugging Face's norm leaves it."""
    rows, hidden = (300, 4096) if full else (5, 96)
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    q, scale = rms_norm_fp8(x, weight, 1e-5)
    h = x.double()
    normed = _rounded(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5), dtype)
    _check_quantized(q, scale, _rounded(weight.double() * normed, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_fp8(device, full, needs_fp8_store, dtype):
    rows, inter = (300, 14336) if full else (5, 80)
    x = torch.randn(rows, 2 * inter, dtype=dtype, device=device)
    q, scale = silu_and_mul_fp8(x)
    gate, up = x.double().chunk(2, -1)
    y = _rounded(_rounded(torch.nn.functional.silu(gate), dtype) * up, dtype)
    _check_quantized(q, scale, y)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_per_token_quantization(dtype, static):
    """The torch path's quantization (layers/quantization/fp8.py: the CPU's, and CUDA's with the
    torch attention backend), to the same rule, its scales contiguous for `_scaled_mm`."""
    from liteinfer.layers.quantization.fp8 import quantize_per_token
    torch.manual_seed(0)
    x = torch.randn(7, 300, dtype=dtype) * 3
    x[2] = 0
    x[4, 5] = 1e4 if static else 0  # clamped at +448 with the static scale
    scale_in = torch.tensor([0.01]) if static else None
    q = quantize_per_token(x, scale_in)
    assert q.scale.is_contiguous()
    _check_quantized(q.data, q.scale, x.double(), scale_in)
