"""The fused one-token linear kernel vs float64 references: plain, with the residual add
epilogue, RMSNorm prologue and the SwiGLU-gated [gate; up] projection."""
import pytest
import torch

from liteinfer.kernels import gemv as gemv_kernels
from liteinfer.kernels.gemv import gemv

DTYPES = [torch.float32, torch.bfloat16]
# (in features, out features): the 1B model's projections on the GPU, small ones interpreted;
# non-power-of-two widths exercise the masks; the 8B model's down (K 14,336) takes the chunked
# kernel in every dtype.
GPU_SHAPES = [(2048, 3072), (2048, 2048), (8192, 2048), (3072, 1000), (2048, 128256),
              (14336, 4096)]
CPU_SHAPES = [(64, 40), (96, 37)]


def _inputs(k: int, n: int, dtype: torch.dtype, device: str, gated: bool = False):
    x = torch.randn(1, k, dtype=dtype, device=device)
    weight = torch.randn(2 * n if gated else n, k, dtype=dtype, device=device) * k ** -0.5
    poisoned = torch.full((1, n), float("nan"), dtype=dtype, device=device)
    return x, weight, poisoned


def _shapes(full: bool) -> list[tuple[int, int]]:
    return GPU_SHAPES if full else CPU_SHAPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_plain(assert_close, device, full, dtype):
    for k, n in _shapes(full):
        x, weight, out = _inputs(k, n, dtype, device)
        assert gemv(x, weight, out=out) is out
        assert_close(out, x.double() @ weight.double().T)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_adds_to_the_residual(assert_close, device, full, dtype, rounded):
    """An output projection: residual + x W^T in place, the product rounded to the model dtype
    first as Hugging Face's separate add sees it."""
    for k, n in _shapes(full):
        x, weight, _ = _inputs(k, n, dtype, device)
        residual = torch.randn(1, n, dtype=dtype, device=device)
        before = residual.clone()
        assert gemv(x, weight, residual=residual) is residual
        assert_close(residual, before.double() + rounded(x.double() @ weight.double().T, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_normed(assert_close, device, full, dtype, gated, rounded, normed_ref):
    for k, n in _shapes(full):
        x, weight, out = _inputs(k, n, dtype, device, gated)
        norm_weight = torch.rand(k, dtype=dtype, device=device) + 0.5
        x_before = x.clone()
        got = gemv(x, weight, norm_weight=norm_weight, eps=1e-5, gated=gated, out=out)
        assert got is out and torch.equal(x, x_before)
        y = normed_ref(x, norm_weight, 1e-5) @ weight.double().T
        if gated:
            gate, up = rounded(y[:, :n], dtype), rounded(y[:, n:], dtype)
            y = rounded(torch.nn.functional.silu(gate), dtype) * up
        assert_close(out, y)


def _fp8_weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows with per-row scales, and their float64 value."""
    w = torch.randn(n, k, device=device) * k ** -0.5
    scale = w.abs().amax(1) / 448
    q = (w / scale[:, None]).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-rows", "chunked"])
def test_gemv_fp8_weight(assert_close, device, full, dtype, gated, chunked, monkeypatch,
                         rounded, normed_ref):
    """e4m3 weights with a scale per row, the input in the model dtype: plain, with the
    residual add, and normed (SwiGLU-gated or not), against float64 over the e4m3 values.
    `chunked`: every shape through the chunked kernel (on the CPU in chunks of 32, so that each
    row takes several)."""
    if chunked:
        monkeypatch.setattr(gemv_kernels, "CHUNKED_MIN_K", 0)
        if not full:
            monkeypatch.setattr(gemv_kernels, "CHUNKED_TILE", (8, 32, 4, 3))
    for k, n in _shapes(full):
        x = torch.randn(1, k, dtype=dtype, device=device)
        weight, scale = _fp8_weight(2 * n if gated else n, k, device)
        w64 = weight.double() * scale.double()[:, None]
        norm_weight = torch.rand(k, dtype=dtype, device=device) + 0.5
        out = gemv(x, weight, norm_weight=norm_weight, eps=1e-5, gated=gated,
                   weight_scale=scale)
        y = normed_ref(x, norm_weight, 1e-5) @ w64.T
        if gated:
            gate, up = rounded(y[:, :n], dtype), rounded(y[:, n:], dtype)
            y = rounded(torch.nn.functional.silu(gate), dtype) * up
        assert_close(out, y)
        if gated:
            continue
        residual = torch.randn(1, n, dtype=dtype, device=device)
        before = residual.clone()
        gemv(x, weight, residual=residual, weight_scale=scale)
        assert_close(residual, before.double() + rounded(x.double() @ w64.T, dtype))
