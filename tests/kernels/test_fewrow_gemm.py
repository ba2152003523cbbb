"""The few-row GEMM vs float64 references: e4m3 operands with per-token and per-channel scales,
model-dtype operands, the residual epilogue, and every row tile the engine's rule picks."""
import pytest
import torch

from liteinfer.kernels.fewrow_gemm import FEWROW_MAX_ROWS, FewRowTiles, fewrow_gemm, fewrow_tiles
from liteinfer.layers.quantization.fp8 import quantize_per_token, quantize_weight

# (in features, out features): the 8B model's projections on the GPU (a K that is not a multiple
# of the tile, an N that is not of BLOCK_N, too), small ones interpreted.
GPU_SHAPES = [(4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672), (2000, 1000)]
CPU_SHAPES = [(300, 37), (512, 96)]
GPU_ROWS = [2, 5, 16, 17, 32, 64, 65, 100, 128]
CPU_ROWS = [3, 16, 20, 70]


def _e4m3_inputs(rows: int, k: int, n: int, device: str):
    x = quantize_per_token(torch.randn(rows, k, device=device) * 3)
    weight, scale = quantize_weight(torch.randn(n, k, device=device) * k ** -0.5)
    ref = (x.data.double() * x.scale.double()) @ (weight.double() * scale.double()[:, None]).T
    return x, weight, scale, ref


def _cases(full: bool):
    shapes, rows = (GPU_SHAPES, GPU_ROWS) if full else (CPU_SHAPES, CPU_ROWS)
    return [(m, k, n) for k, n in shapes for m in rows]


def _tiles(rows: int, n: int) -> FewRowTiles:
    """The engine's tile where it has one, else one of the 65-128-row tiles it never picks for
    such a wide projection, so that every row tile is checked on every shape."""
    return fewrow_tiles(rows, n, 1) or FewRowTiles(block_m=128, block_n=64, block_k_bytes=256,
                                                   num_stages=3)


def test_e4m3(assert_close, device, full):
    for rows, k, n in _cases(full):
        x, weight, scale, ref = _e4m3_inputs(rows, k, n, device)
        out = fewrow_gemm(x.data, weight, x_scale=x.scale, weight_scale=scale,
                          out_dtype=torch.bfloat16, tiles=_tiles(rows, n))
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        assert_close(out, ref)


def test_e4m3_adds_to_the_residual(assert_close, device, full):
    """An output projection: residual + (x W^T rounded to bf16), in place."""
    for rows, k, n in _cases(full):
        x, weight, scale, ref = _e4m3_inputs(rows, k, n, device)
        residual = torch.randn(rows, n, dtype=torch.bfloat16, device=device)
        before = residual.clone()
        assert fewrow_gemm(x.data, weight, x_scale=x.scale, weight_scale=scale,
                           residual=residual, tiles=_tiles(rows, n)) is residual
        assert_close(residual, before.double() + ref.to(torch.bfloat16).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_dtype(assert_close, device, full, needs_dot, dtype):
    needs_dot(dtype)
    tiles = [FewRowTiles(block_m=m, block_n=32, block_k_bytes=256, num_stages=3)
             for m in (16, 64, 128)]
    for rows, k, n in _cases(full):
        x = torch.randn(rows, k, dtype=dtype, device=device)
        weight = torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
        tile = next(t for t in tiles if t.block_m >= rows)
        assert_close(fewrow_gemm(x, weight, tiles=tile), x.double() @ weight.double().T)


def test_tile_rule():
    """e4m3 only, up to FEWROW_MAX_ROWS; wide projections leave 65-128 rows to cuBLAS; each
    tile holds its rows and cuts the projection into at least 64 programs."""
    assert fewrow_tiles(32, 4096, 2) is None and fewrow_tiles(FEWROW_MAX_ROWS + 1, 4096, 1) is None
    assert fewrow_tiles(128, 28672, 1) is None and fewrow_tiles(64, 28672, 1) is not None
    for rows in (2, 16, 17, 64, 65, 128):
        for n in (2048, 3072, 4096, 6144):
            tiles = fewrow_tiles(rows, n, 1)
            assert tiles.block_m >= rows and -(-n // tiles.block_n) >= 64
