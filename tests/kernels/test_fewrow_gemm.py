"""The few-row GEMMs vs float64 references: e4m3 operands with per-token and per-channel scales,
model-dtype operands, the residual epilogue, and every tile the engine's rule picks (both
kernels, K cut among programs or not)."""
from dataclasses import replace

import pytest
import torch

from liteinfer.kernels.fewrow_gemm import FEWROW_MAX_ROWS, FewRowTiles, fewrow_gemm, fewrow_tiles
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.layers.quantization.fp8 import quantize_per_token, quantize_weight

# (in features, out features): the 8B model's projections on the GPU (a K that is not a multiple
# of the tile, an N that is not of BLOCK_N, too), small ones interpreted.
GPU_SHAPES = [(4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672), (2000, 1000)]
CPU_SHAPES = [(300, 37), (512, 96), (1040, 72)]
SMS = {"cpu": 8, "cuda": 132}  # the H200's, whatever the GPU: its split rule is the one checked
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


def _tiles(rows: int, k: int, n: int, device: str) -> list[FewRowTiles]:
    """The engine's tile where it has one, else (over 64 rows: a wide projection, which cuBLAS
    takes, or rows too short for TMA) the swapped kernel's or the other's; at 65-128 rows the
    swapped kernel with K cut in two too, wherever the shape allows it (the rule splits only
    long rows of a narrow projection)."""
    swapped = FewRowTiles(block_m=128, block_n=64, block_k_bytes=256 if device == "cuda"
                          else 128, num_stages=4, swapped=True)
    fallback = swapped if k % 16 == 0 else FewRowTiles(block_m=128, block_n=64,
                                                        block_k_bytes=256, num_stages=3)
    tiles = [fewrow_tiles(rows, n, k, 1, SMS[device]) or fallback]
    if tiles[0].swapped and tiles[0].splits == 1 and k >= 512:
        tiles.append(replace(swapped, splits=2))
    return tiles


def test_e4m3(assert_close, device, full):
    """Every launch, split or not, through one workspace sized for the largest, as the model
    runner shares one among its layers: each split launch leaves its arrival counters at zero
    for the next, whatever its shape."""
    cases = [(rows, k, n, tiles) for rows, k, n in _cases(full)
             for tiles in _tiles(rows, k, n, device)]
    workspace = SplitKWorkspace.allocate([(n, t.splits) for _, _, n, t in cases], device)
    for rows, k, n, tiles in cases:
        x, weight, scale, ref = _e4m3_inputs(rows, k, n, device)
        for _ in range(2):
            out = fewrow_gemm(x.data, weight, x_scale=x.scale, weight_scale=scale,
                              out_dtype=torch.bfloat16, tiles=tiles, workspace=workspace)
            assert out.shape == (rows, n) and out.dtype == torch.bfloat16
            assert_close(out, ref)
    assert not workspace.counters.any()


def test_split_launch_needs_room_in_the_workspace(device):
    """A workspace sized for narrower launches is refused, not overrun."""
    tiles = FewRowTiles(block_m=128, block_n=64, block_k_bytes=128, num_stages=4, swapped=True,
                        splits=2)
    x, weight, scale, _ = _e4m3_inputs(70, 512, 96, device)
    small = SplitKWorkspace.allocate([(64, 2)], device)
    with pytest.raises(AssertionError, match="no room for 2 x 96"):
        fewrow_gemm(x.data, weight, x_scale=x.scale, weight_scale=scale,
                    out_dtype=torch.bfloat16, tiles=tiles, workspace=small)


def test_e4m3_adds_to_the_residual(assert_close, device, full):
    """An output projection: residual + (x W^T rounded to bf16), in place."""
    for rows, k, n in _cases(full):
        x, weight, scale, ref = _e4m3_inputs(rows, k, n, device)
        for tiles in _tiles(rows, k, n, device):
            residual = torch.randn(rows, n, dtype=torch.bfloat16, device=device)
            before = residual.clone()
            assert fewrow_gemm(x.data, weight, x_scale=x.scale, weight_scale=scale,
                               residual=residual, tiles=tiles) is residual
            assert_close(residual, before.double() + ref.to(torch.bfloat16).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_dtype(assert_close, device, full, needs_dot, dtype):
    needs_dot(dtype)
    tiles = [FewRowTiles(block_m=m, block_n=32, block_k_bytes=256, num_stages=3)
             for m in (16, 64, 128)]
    swapped = [FewRowTiles(block_m=128, block_n=64, block_k_bytes=256, num_stages=3,
                           swapped=True, splits=s) for s in (1, 2)]
    for rows, k, n in _cases(full):
        x = torch.randn(rows, k, dtype=dtype, device=device)
        weight = torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
        ref = x.double() @ weight.double().T
        assert_close(fewrow_gemm(x, weight, tiles=next(t for t in tiles if t.block_m >= rows)),
                     ref)
        if rows > 64 and k * x.element_size() % 16 == 0:
            for tile in swapped:
                assert_close(fewrow_gemm(x, weight, tiles=tile), ref)


def test_tile_rule():
    """e4m3 only, up to FEWROW_MAX_ROWS; wide projections (gate/up) leave 65-128 rows to
    cuBLAS; each tile holds its rows and cuts the projection into at least 32 programs; 65-128
    rows take the swapped kernel, which cuts K only for long rows of a narrow projection (the
    8B's down in two, the 1B's in two), and never past the SMs."""
    assert fewrow_tiles(32, 4096, 4096, 2, 132) is None
    assert fewrow_tiles(FEWROW_MAX_ROWS + 1, 4096, 4096, 1, 132) is None
    assert fewrow_tiles(128, 28672, 4096, 1, 132) is None
    assert fewrow_tiles(64, 28672, 4096, 1, 132) is not None
    for rows in (2, 16, 17, 64, 65, 128):
        for n, k in ((2048, 8192), (3072, 2048), (4096, 14336), (6144, 4096)):
            tiles = fewrow_tiles(rows, n, k, 1, 132)
            assert tiles.block_m >= rows and tiles.swapped == (rows > 64)
            programs = -(-n // tiles.block_n) * tiles.splits
            assert programs >= 32 and (tiles.splits == 1 or programs <= 132)
    assert [fewrow_tiles(128, n, k, 1, 132).splits
            for n, k in ((4096, 14336), (2048, 8192), (4096, 4096), (6144, 4096))] == [2, 2, 1, 1]
