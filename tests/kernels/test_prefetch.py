"""The L2 weight prefetch: how many lines a launch may put in flight, and that the instruction
is emitted, stays inside its tensor at ragged edges, and leaves the data read after it intact."""
import pytest
import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_DTYPE, prefetch
from liteinfer.kernels.prefetch import prefetch_lines, prefetch_weight


def test_prefetch_lines_fit_the_budget(monkeypatch):
    budget = 16 << 20
    monkeypatch.setattr(prefetch, "prefetch_budget", lambda device: budget)
    cpu = torch.device("cpu")
    for rows, row_bytes in [(6144, 4096), (4096, 4096), (8192, 7168), (28672, 4096),
                            (4096, 14336 * 2), (3, 100), (1 << 20, 4096)]:
        lines = prefetch_lines(rows, row_bytes, cpu)
        if rows * 128 > budget:
            assert lines == 0
            continue
        assert lines & (lines - 1) == 0 and lines >= 1  # a power of two
        assert lines <= triton.cdiv(row_bytes, 128)
        assert rows * lines * 128 <= budget
        # the largest such power of two
        assert 2 * lines > min(triton.cdiv(row_bytes, 128), budget // (rows * 128))
    # Off CUDA there is no budget, so the interpreter never meets the instruction.
    monkeypatch.undo()
    assert prefetch_lines(4, 4096, cpu) == 0


@triton.jit
def _prefetch_then_copy(w_ptr, out_ptr, N, K, stride, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, LINES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_weight(w_ptr, rows, N, K, stride, LINES)  # lines past K and rows past N clamp
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    tile = tl.load(w_ptr + rows[:, None] * stride + cols[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], tile, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
def test_prefetch_emits_and_stays_in_bounds(dtype):
    torch.manual_seed(0)
    n, k = 37, 300  # neither a multiple of the program's rows nor of a line; 8 lines pass K
    w = torch.randn(n, k + 4, device="cuda").to(dtype)[:, :k]  # rows with a stride
    out = torch.empty(n, k, device="cuda", dtype=dtype)
    compiled = _prefetch_then_copy[(triton.cdiv(n, 8),)](w, out, n, k, w.stride(0), BLOCK_N=8,
                                                         BLOCK_K=512, LINES=8)
    torch.cuda.synchronize()
    assert "prefetch.global.L2" in compiled.asm["ptx"]
    assert torch.equal(out.view(torch.uint8), w.contiguous().view(torch.uint8))
