"""The W4A16 / W8A16 kernels against a float64 dequantize-then-matmul reference, on fresh random
packed weights (every code, scale and min drawn): the one-row GEMV (plain, residual add, RMSNorm
and SwiGLU fused in), the few-row tensor-core GEMM (K cut among programs or not, SwiGLU fused in
or not) and its tile rule, the scratch dequantization, and `wna16_linear`'s choice among them
by rows."""
import pytest
import torch

from liteinfer.kernels import wna16
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.kernels.wna16 import (
    FEWROW_MAX,
    MAX_SPLITS,
    GemvTile,
    WNA16Tiles,
    dequantize_weight,
    fuses_swiglu,
    wna16_gemm,
    wna16_gemv,
    wna16_linear,
    wna16_tiles,
)
from liteinfer.layers.quantization.wna16 import dequantize, pack_codes

# (bits, group size) the layout holds: AWQ / GPTQ / int4-at-load groups, GGUF's small ones, a
# group wider than a tile (one scale a row).
FORMATS = [(4, 128), (4, 32), (8, 16), (2, 64), (4, 1024)]
# (in features, out features): the 8B's projections on the GPU (every format on the first,
# AWQ's on the others), small ones interpreted; N not a multiple of any tile, and a K (576 = 9
# groups of 64) that is not a multiple of the tile.
GPU_SHAPES = [(4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672)]
# SmolLM2's qkv in its GGUF Q4_1 groups: so narrow a projection takes 16-feature tiles.
GPU_NARROW = (576, 960, 4, 32)
CPU_SHAPES = [(1024, 40), (576, 136)]
GPU_ROWS = [2, 17, 64, 128]
CPU_ROWS = [3, 33]


def _packed(n: int, k: int, bits: int, group: int, device: str):
    codes = torch.randint(0, 1 << bits, (n, k), device=device)
    scales = torch.rand(n, k // group, device=device) * 0.02 + 1e-3
    mins = torch.randn(n, k // group, device=device) * 0.05
    return pack_codes(codes, bits), scales, mins


def _cases(full: bool, formats=FORMATS):
    """(k, n, bits, group) of every shape and format that divides its K."""
    if full:
        cases = [(*GPU_SHAPES[0], bits, group) for bits, group in formats]
        cases += [(k, n, *formats[0]) for k, n in GPU_SHAPES[1:]] + [GPU_NARROW]
    else:
        cases = [(k, n, bits, group) for k, n in CPU_SHAPES for bits, group in formats]
    return [(k, n, bits, group) for k, n, bits, group in cases if k % group == 0]


def _weight64(qweight, scales, mins, bits):
    return dequantize(qweight, scales, mins, bits, torch.float64)


# The GEMV's tile, and one of several steps a row (K's last step partial at the CPU's 576) in a
# two-stage pipeline.
GEMV_TILES = [GemvTile(), GemvTile(rows=4, codes=1024, num_stages=2)]


@pytest.fixture(params=GEMV_TILES, ids=["tile", "several-steps"])
def gemv_tile(request, monkeypatch):
    monkeypatch.setattr(wna16, "GEMV_TILE", request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("gemv_tile")
def test_gemv(assert_close, device, full, dtype, rounded):
    """One row: x W^T, and residual + (x W^T rounded) in place."""
    for k, n, bits, group in _cases(full):
        packed = _packed(n, k, bits, group, device)
        x = torch.randn(1, k, device=device).to(dtype)
        ref = x.double() @ _weight64(*packed, bits).T
        assert_close(wna16_gemv(x, *packed, bits), ref)
        residual = torch.randn(1, n, dtype=dtype, device=device)
        before = residual.clone()
        assert wna16_gemv(x, *packed, bits, residual=residual) is residual
        assert_close(residual, before.double() + rounded(ref, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.usefixtures("gemv_tile")
def test_gemv_normed(assert_close, device, full, dtype, gated, rounded, normed_ref):
    """RMSNorm fused in front, and for [gate; up] SwiGLU behind, rounded where Hugging Face's
    unfused layers hold a tensor."""
    for k, n, bits, group in _cases(full, FORMATS[:3]):
        packed = _packed(2 * n if gated else n, k, bits, group, device)
        x = torch.randn(1, k, device=device).to(dtype)
        norm_weight = torch.rand(k, device=device).to(dtype) + 0.5
        got = wna16_gemv(x, *packed, bits, norm_weight=norm_weight, eps=1e-5, gated=gated)
        y = normed_ref(x, norm_weight, 1e-5) @ _weight64(*packed, bits).T
        if gated:
            gate, up = rounded(y[:, :n], dtype), rounded(y[:, n:], dtype)
            y = rounded(torch.nn.functional.silu(gate), dtype) * up
        assert got.shape == (1, n)
        assert_close(got, y)


def _tiles(rows: int, n: int, k: int, bits: int, itemsize: int, device: str,
           gated: bool = False) -> list[WNA16Tiles]:
    """The rule's tile, and K cut among 4 programs of a narrower tile (at the CPU's shapes the
    last split then has an uneven share or none)."""
    rule = wna16_tiles(rows, n, k, bits, itemsize, 132 if device == "cuda" else 8, gated)
    return [rule, WNA16Tiles(block_m=rule.block_m, block_n=32, block_k=rule.block_k, splits=4,
                             num_warps=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fewrow(assert_close, device, full, needs_dot, dtype, rounded):
    """2 to FEWROW_MAX rows on the tensor cores, in the activation dtype; each launch twice,
    through one workspace for every shape, as the model runner shares one (a split launch
    leaves its arrival counters at zero). Interpreted, fp16 and bf16 take two formats."""
    needs_dot(dtype)
    cases = _cases(full, FORMATS if full or dtype == torch.float32 else FORMATS[:2])
    workspace = SplitKWorkspace.allocate([(n, MAX_SPLITS) for _, n, _, _ in cases], device)
    for k, n, bits, group in cases:
        packed = _packed(n, k, bits, group, device)
        w64 = _weight64(*packed, bits)
        for rows in GPU_ROWS if full else CPU_ROWS:
            x = torch.randn(rows, k, device=device).to(dtype)
            # the tile is multiplied in the activation dtype: the reference's weight is too
            ref = x.double() @ w64.to(dtype).double().T
            for tiles in _tiles(rows, n, k, bits, x.element_size(), device):
                for _ in range(2):
                    assert_close(wna16_gemm(x, *packed, bits, tiles=tiles,
                                            workspace=workspace), ref)
            residual = torch.randn(rows, n, dtype=dtype, device=device)
            before = residual.clone()
            assert wna16_gemm(x, *packed, bits, residual=residual,
                              workspace=workspace) is residual
            assert_close(residual, before.double() + rounded(ref, dtype))
    assert not workspace.counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fewrow_gated(assert_close, device, full, needs_dot, dtype, rounded):
    """A few rows of [gate; up] with the SwiGLU fused behind, rounded where Hugging Face's
    unfused layers hold a tensor; K whole in a program and cut among 4 (gate's and up's
    partials side by side in the workspace, which the unfused launch of the same weight
    sizes)."""
    needs_dot(dtype)
    cases = _cases(full, FORMATS[:3])
    workspace = SplitKWorkspace.allocate([(2 * n, MAX_SPLITS) for _, n, _, _ in cases], device)
    for k, n, bits, group in cases:
        packed = _packed(2 * n, k, bits, group, device)
        w64 = _weight64(*packed, bits)
        for rows in GPU_ROWS[:2] if full else CPU_ROWS:
            x = torch.randn(rows, k, device=device).to(dtype)
            y = x.double() @ w64.to(dtype).double().T
            gate, up = rounded(y[:, :n], dtype), rounded(y[:, n:], dtype)
            y = rounded(torch.nn.functional.silu(gate), dtype) * up
            for tiles in _tiles(rows, 2 * n, k, bits, x.element_size(), device, gated=True):
                got = wna16_gemm(x, *packed, bits, gated=True, tiles=tiles,
                                 workspace=workspace)
                assert got.shape == (rows, n)
                assert_close(got, y)
    assert not workspace.counters.any()


@pytest.mark.parametrize("rows", [1, 3, FEWROW_MAX, FEWROW_MAX + 5])
def test_linear_every_path(assert_close, device, full, rows):
    """`wna16_linear` at one row, a few, the most the few-row kernel takes and past it (the
    scratch weight and cuBLAS / torch), in the input's dtype (fp16: the interpreter's tl.dot
    takes it)."""
    dtype = torch.bfloat16 if full else torch.float16
    k, n = (4096, 6144) if full else (256, 40)
    packed = _packed(n, k, 4, 128, device)
    x = torch.randn(rows, k, device=device).to(dtype)
    ref = x.double() @ _weight64(*packed, 4).to(dtype).double().T
    out = wna16_linear(x, *packed, 4)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out, ref)


@pytest.mark.parametrize("bits, group", [(4, 128), (8, 16), (4, 576)])
def test_dequantize_is_exact(device, bits, group):
    """q * scale - min in fp32 within the rounding of its two steps: the CPU path rounds the
    product and the difference, a GPU may fuse them into one FMA. (576: a per-channel group
    that no power-of-two tile divides into whole groups.)"""
    qweight, scales, mins = _packed(24, 1152, bits, group, device)
    got = dequantize_weight(qweight, scales, mins, bits, torch.float32).double()
    exact = dequantize(qweight, scales, mins, bits, torch.float64)
    product = dequantize(qweight, scales, torch.zeros_like(mins), bits, torch.float64)
    assert ((got - exact).abs() <= 2.0 ** -24 * (product.abs() + exact.abs())).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_every_code_is_exact(device, bits):
    """Every code at every place in its word comes out exactly (the kernels read a code's bits
    as a denormal float's): with a power-of-two scale and an integer min, the dequantized
    weight, the few-row product with one-hot rows and the GEMV's with a one-hot row are
    q / 2 - 3 exactly."""
    per = 32 // bits
    n, k = 1 << bits, 4 * per
    codes = (torch.arange(n, device=device)[:, None] + torch.arange(k, device=device)) % n
    qweight = pack_codes(codes, bits)
    scales = torch.full((n, 1), 0.5, device=device)
    mins = torch.full((n, 1), 3.0, device=device)
    exact = codes.float() / 2 - 3
    assert torch.equal(dequantize_weight(qweight, scales, mins, bits, torch.float32), exact)
    one_hot = torch.eye(k, device=device)
    assert torch.equal(wna16_gemm(one_hot, qweight, scales, mins, bits), exact.T)
    for column in range(per + 1):
        assert torch.equal(wna16_gemv(one_hot[column:column + 1], qweight, scales, mins, bits),
                           exact[:, column][None, :])


def test_tile_rule():
    """The 8B's projections on 132 SMs: K cut until the grid has about four programs an SM,
    each keeping at least 1,024 codes; gate/up has tiles enough uncut. A step covers 128 bytes
    of a 4-bit row, less where the rows' tile would pass 32 KiB."""
    splits = {(n, k): wna16_tiles(32, n, k, 4, 2, 132).splits
              for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
    assert splits == {(6144, 4096): 4, (4096, 4096): 4, (28672, 4096): 1, (4096, 14336): 8}
    # SmolLM2's narrow projections take narrower tiles, so that more SMs stream them; the 1B's
    # and the 8B's keep 64 features. Gated, a tile is that many features of gate and of up.
    assert [wna16_tiles(5, n, k, 4, 2, 132).block_n
            for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))] == [16, 16, 32, 16]
    assert wna16_tiles(5, 3072, 576, 4, 2, 132, gated=True).block_n == 16
    assert {wna16_tiles(5, n, k, 4, 2, 132).block_n
            for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048),
                         (2048, 2048), (16384, 2048), (2048, 8192))} == {64}
    assert {wna16_tiles(5, n, k, 4, 2, 132, gated=True).block_n
            for n, k in ((28672, 4096), (16384, 2048))} == {64}
    # The SwiGLU is fused into SmolLM2's gate/up, not into the 1B's or the 8B's.
    assert [fuses_swiglu(n, k, 4, 132) for n, k in ((3072, 576), (16384, 2048), (28672, 4096))
            ] == [True, False, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph(assert_close):
    """A decode step's projections as the runners capture them, each run once eagerly first:
    the one-row GEMV, and the few-row kernel with K cut among programs (its workspace made by
    the eager run), replayed on new rows; a replay leaves the arrival counters at zero."""
    k, n = 4096, 4096
    packed = _packed(n, k, 4, 128, "cuda")
    w64 = _weight64(*packed, 4)
    xs = [torch.randn(rows, k, device="cuda").to(torch.bfloat16) for rows in (1, 32)]
    assert wna16_tiles(32, n, k, 4, 2, torch.cuda.get_device_properties(0)
                       .multi_processor_count).splits > 1

    def step() -> list[torch.Tensor]:
        return [wna16_gemv(xs[0], *packed, 4), wna16_gemm(xs[1], *packed, 4)]
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, device="cuda"))
        graph.replay()
        for x, out in zip(xs, outs, strict=True):
            assert_close(out, x.double() @ w64.to(torch.bfloat16).double().T)
