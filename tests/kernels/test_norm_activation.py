"""rms_norm and silu_and_mul vs float64 references."""
import pytest
import torch

from liteinfer.kernels.activation import silu_and_mul
from liteinfer.kernels.norm import rms_norm

DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 300, 2048])
def test_rms_norm(assert_close, device, full, hidden, dtype):
    num_rows = 4096 if full else 5
    # A strided row view, as a slice of a wider activation would be.
    x = torch.randn(num_rows, hidden + 8, dtype=dtype, device=device)[:, :hidden]
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_before = x.clone()
    out = torch.full((num_rows, hidden), float("nan"), dtype=dtype, device=device)
    assert rms_norm(x, weight, 1e-5, out=out) is out
    assert_close(out, _rms_norm_ref(x, weight, 1e-5))
    assert torch.equal(x, x_before)


def test_rms_norm_in_place(assert_close, device):
    x = torch.randn(3, 128, device=device)
    ref = _rms_norm_ref(x, torch.ones(128, device=device), 1e-6)
    assert rms_norm(x, torch.ones(128, device=device), 1e-6, out=x) is x
    assert_close(x, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 1500, 8192])
def test_silu_and_mul(assert_close, device, full, inter, dtype):
    num_rows = 4096 if full else 3
    x = 3 * torch.randn(num_rows, 2 * inter, dtype=dtype, device=device)
    out = torch.full((num_rows, inter), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    gate, up = x.double().chunk(2, dim=-1)
    assert_close(out, torch.nn.functional.silu(gate) * up)
