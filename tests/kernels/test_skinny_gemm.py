"""skinny_linear (plain, RMSNorm / SiLU-and-mul prologues, residual epilogue) against float64
matmuls of the model's own torch prologues."""
import pytest
import torch

from liteinfer.kernels.skinny_gemm import (
    MAX_M,
    SkinnyConfig,
    block_m_for,
    skinny_config,
    skinny_linear,
)
from liteinfer.layers.norm_act import rms_norm_torch, silu_and_mul_torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 3, 16, 17, 40]  # 17 and 40 take BLOCK_M 32 and 64
EPS = 1e-5
# name: ((N, K) on the GPU, (N, K) under the interpreter). "ragged" is ragged in N and K on
# both; the small stand-ins for the Llama-3.2-1B shapes mix ragged and whole tiles.
SHAPES = {"ragged": ((100, 72), (100, 72)), "qkv": ((3072, 2048), (96, 128)),
          "o": ((2048, 2048), (64, 256)), "gate_up": ((16384, 2048), (160, 48)),
          "down": ((2048, 8192), (48, 320))}
# Several K iterations with and without a K tail, partial N tiles, 1-8 warps.
CONFIGS = [SkinnyConfig(16, 16, 1, 1), SkinnyConfig(32, 32, 4, 2), SkinnyConfig(64, 64, 8, 3)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, silu_mul: bool = False):
    """x as a strided row view of a wider activation; weights scaled to keep outputs O(1)."""
    width = 2 * k if silu_mul else k
    x = torch.randn(m, width + 8, dtype=dtype, device=device)[:, :width]
    weight = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    return x, weight


def _reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
               silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The model's prologue in its dtype, a float64 matmul, then the residual add of the
    product rounded to the dtype (as the unfused linear + add rounds it)."""
    if norm_weight is not None:
        x = rms_norm_torch(x, norm_weight, EPS)
    elif silu_mul:
        x = silu_and_mul_torch(x)
    y = x.double() @ weight.double().T
    return y if residual is None else y.to(x.dtype).double() + residual.double()


def _run(m, n, k, dtype, device, prologue="none", with_residual=False, in_place=False,
         config=None):
    """Calls skinny_linear into a NaN-poisoned output and returns (out, float64 reference)."""
    silu_mul = prologue == "silu"
    x, weight = _inputs(m, n, k, dtype, device, silu_mul)
    norm_weight = (1 + 0.5 * torch.randn(k, device=device)).to(dtype) \
        if prologue == "norm" else None
    residual = torch.randn(m, n, dtype=dtype, device=device) if with_residual else None
    ref = _reference(x, weight, norm_weight, silu_mul, residual)
    x_before = x.clone()
    out = residual if in_place else torch.full((m, n), float("nan"), dtype=dtype, device=device)
    got = skinny_linear(x, weight, norm_weight=norm_weight, eps=EPS, silu_mul=silu_mul,
                        residual=residual, out=out, config=config)
    assert got is out
    assert torch.equal(x, x_before)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", ROWS)
def test_plain(assert_close, needs_dot, device, full, m, shape, dtype):
    needs_dot(dtype)
    n, k = SHAPES[shape][0 if full else 1]
    assert_close(*_run(m, n, k, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["ragged", "qkv", "down"])
@pytest.mark.parametrize("m", [1, 17, 40])
@pytest.mark.parametrize("prologue, with_residual", [("norm", False), ("norm", True),
                                                     ("silu", False), ("silu", True),
                                                     ("none", True)])
def test_fused(assert_close, needs_dot, device, full, prologue, with_residual, m, shape, dtype):
    needs_dot(dtype)
    n, k = SHAPES[shape][0 if full else 1]
    assert_close(*_run(m, n, k, dtype, device, prologue, with_residual))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prologue", ["norm", "silu", "none"])
def test_in_place_residual(assert_close, needs_dot, device, full, prologue, dtype):
    """out aliasing residual: every element is read before its own program writes it."""
    needs_dot(dtype)
    n, k = SHAPES["down" if full else "ragged"][0 if full else 1]
    assert_close(*_run(17, n, k, dtype, device, prologue, with_residual=True, in_place=True))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", ["ragged", "o"])
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("prologue", ["norm", "silu"])
def test_explicit_configs(assert_close, device, full, prologue, m, shape, config):
    dtype = torch.bfloat16 if full else torch.float32
    n, k = SHAPES[shape][0 if full else 1]
    assert_close(*_run(m, n, k, dtype, device, prologue, with_residual=True, config=config))


def test_zero_rows(device):
    x, weight = _inputs(0, 32, 64, torch.float32, device)
    assert skinny_linear(x, weight).shape == (0, 32)


def test_preconditions(device):
    x, weight = _inputs(4, 32, 64, torch.float32, device)
    norm_weight = torch.ones(64, device=device)
    bad_calls = [
        lambda: skinny_linear(x, weight.T.contiguous().T),  # weight not contiguous
        lambda: skinny_linear(x.T.contiguous().T, weight),  # x columns strided
        lambda: skinny_linear(x.half(), weight),  # dtype mismatch
        lambda: skinny_linear(x, weight, silu_mul=True),  # x must be [M, 2K]
        lambda: skinny_linear(torch.cat([x, x], 1), weight, silu_mul=True,
                              norm_weight=norm_weight),  # exclusive prologues
        lambda: skinny_linear(x, weight, norm_weight=norm_weight[:32]),
        lambda: skinny_linear(x, weight, norm_weight=norm_weight.half()),
        lambda: skinny_linear(x, weight, residual=torch.zeros(4, 33, device=device)),
        lambda: skinny_linear(x, weight, out=torch.zeros(4, 32, device=device).half()),
        lambda: skinny_linear(torch.zeros(MAX_M + 1, 64, device=device), weight),
    ]
    for call in bad_calls:
        with pytest.raises(AssertionError):
            call()


@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                                  (128256, 2048), (100, 72)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_config(m, n, k, itemsize):
    """Power-of-two tiles that tl.dot accepts, not wider than the problem, whose pipeline
    (num_stages weight and x tiles at most; SiLU-and-mul loads two x tiles) fits in an
    H100/H200's 227 KiB of shared memory, with enough programs for the SMs where N allows."""
    cfg = skinny_config(m, n, k, itemsize)
    for v in (cfg.block_n, cfg.block_k, cfg.num_warps):
        assert v & (v - 1) == 0
    assert cfg.block_n >= 16 and 16 <= cfg.block_k <= max(16, 2 * k)
    rows = cfg.block_n + 2 * block_m_for(m)
    assert cfg.num_stages * rows * cfg.block_k * itemsize <= 227 << 10
    assert -(-n // cfg.block_n) >= min(128, -(-n // 16))
