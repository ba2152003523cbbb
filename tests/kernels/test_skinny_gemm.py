"""The few-row GEMM vs float64 references: each dtype and row count with the default tiles and
with forced split counts (the in-kernel split-K reduction), repeated calls sharing a workspace
(the arrival counters must be reset) and strided rows."""
import pytest
import torch

from liteinfer.kernels import skinny_gemm as skinny_module
from liteinfer.kernels.skinny_gemm import skinny_gemm, skinny_tiles

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 5, 16, 33, 64]
# (in features, out features): the 1B model's projections on the GPU, small ones interpreted;
# non-power-of-two widths exercise the masks.
GPU_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)]
CPU_SHAPES = [(64, 40), (96, 37), (256, 48)]


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str):
    x = torch.randn(m, k, dtype=dtype, device=device)
    weight = torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
    poisoned = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    return x, weight, poisoned


def _shapes(full: bool) -> list[tuple[int, int]]:
    return GPU_SHAPES if full else CPU_SHAPES


@pytest.mark.parametrize("splits", [None, 1, 2, 3], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skinny_gemm(assert_close, needs_dot, device, full, dtype, rows, splits):
    needs_dot(dtype)
    for k, n in _shapes(full):
        x, weight, out = _inputs(rows, k, n, dtype, device)
        tiles = skinny_tiles(rows, n, k, dtype, x.device, splits=splits)
        assert splits is None or tiles.splits == splits
        assert skinny_gemm(x, weight, out=out, tiles=tiles) is out
        assert_close(out, x.double() @ weight.double().T)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeated_calls(assert_close, needs_dot, device, full, dtype):
    """Two weights of one shape share the workspace and counters, as a model's layers do; a
    launch that left a counter raised would make the next one finish its tiles early with stale
    partials (on the GPU: the interpreter runs programs in order, so there the last writer is
    right anyway and the counters are checked). The sum runs in split order, so a repeated call
    is bit-exact."""
    needs_dot(dtype)
    k, n = (2048, 3072) if full else (96, 37)
    x, weight, first = _inputs(33, k, n, dtype, device)
    other = torch.randn_like(weight)
    tiles = skinny_tiles(33, n, k, dtype, x.device, splits=None if full else 3)
    assert tiles.splits > 1
    skinny_gemm(x, weight, out=first, tiles=tiles)
    assert_close(first, x.double() @ weight.double().T)
    for w, ref in ((other, None), (weight, first), (other, None), (weight, first)):
        out = skinny_gemm(x, w, out=torch.full_like(first, float("nan")), tiles=tiles)
        if ref is None:
            assert_close(out, x.double() @ w.double().T)
        else:
            assert torch.equal(out, ref)
    counters = skinny_module._workspace(x.device, n, tiles.splits)[1]
    assert not counters.any(), "arrival counters must be zero between launches"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(assert_close, needs_dot, device, full, dtype):
    """x, weight and out as column slices of wider tensors whose other columns are NaN: any read
    past K poisons the result, any write past N shows in out's padding."""
    needs_dot(dtype)
    k, n = (2048, 3072) if full else (96, 37)
    for rows in (5, 64):
        x_wide = torch.full((rows, k + 24), float("nan"), dtype=dtype, device=device)
        w_wide = torch.full((n, k + 8), float("nan"), dtype=dtype, device=device)
        out_wide = torch.full((rows, n + 40), float("nan"), dtype=dtype, device=device)
        x, weight, out = x_wide[:, :k], w_wide[:, :k], out_wide[:, :n]
        x.copy_(torch.randn(rows, k, dtype=dtype, device=device))
        weight.copy_(torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5)
        for splits in (1, 2):
            tiles = skinny_tiles(rows, n, k, dtype, x.device, splits=splits)
            assert skinny_gemm(x, weight, out=out, tiles=tiles) is out
            assert_close(out, x.double() @ weight.double().T)
            assert out_wide[:, n:].isnan().all()
