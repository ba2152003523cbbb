"""The batch-invariant GEMM and attention kernels: close to float64 references, and each row's
bits the same at every row count, in every tile position, decoding or in a prompt chunk (the
GEMM's swapped kernel up to FEWROW_MAX_ROWS rows, its serial kernel beyond)."""
import numpy as np
import pytest
import torch

from conftest import _assert_close
from liteinfer.kernels import num_sms
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace
from liteinfer.kernels.invariant_attention import invariant_attention
from liteinfer.kernels.invariant_gemm import invariant_gemm, num_splits, split_launch
from liteinfer.kernels.invariant_tiles import query_tiles

# (K, N): one K split and several, ragged N; the 8B's on the GPU.
CPU_SHAPES = [(96, 70), (1100, 40)]
GPU_SHAPES = [(4096, 6144), (14336, 4096), (2048, 128256)]
CPU_ROWS = [1, 3, 64, 70, 130]
GPU_ROWS = [1, 2, 7, 32, 65, 128, 300]


def same_kernel_rows(device: str, rows: int) -> int | None:
    """The rows of the whole whose bits a part of `rows` rows must have: all of them on the GPU,
    where the swapped kernel (up to FEWROW_MAX_ROWS rows) and the serial one agree; under the
    interpreter, whose dot is numpy's (its order over K follows the operands' layout), the
    first FEWROW_MAX_ROWS for a part the swapped kernel takes, so each kernel meets itself."""
    return None if device == "cuda" or rows > FEWROW_MAX_ROWS else FEWROW_MAX_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_float64_and_rows_agree_at_every_row_count(device, full, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 tl.dot is wrong under the Triton interpreter")
    shapes, counts = (GPU_SHAPES, GPU_ROWS) if full else (CPU_SHAPES, CPU_ROWS)
    sms = num_sms(torch.device(device))
    # One workspace for every shape's split partials, as the runner's for a model's layers.
    workspace = SplitKWorkspace.allocate(
        [launch for k, n in shapes if (launch := split_launch(n, k, sms)) is not None], device)
    assert workspace is not None
    for k, n in shapes:
        x = torch.randn(max(counts) + 5, k, device=device).to(dtype)
        w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
        res = torch.randn(x.shape[0], n, device=device).to(dtype)
        assert x.shape[0] > FEWROW_MAX_ROWS  # the whole through the serial kernel
        wholes = {}
        for rows in counts:
            whole_rows = same_kernel_rows(device, rows)
            if whole_rows not in wholes:
                xs, rs = x[:whole_rows], res[:whole_rows]
                wholes[whole_rows] = invariant_gemm(xs, w), invariant_gemm(xs, w, rs.clone())
                _assert_close(wholes[whole_rows][0], xs.double() @ w.double().T)
                _assert_close(wholes[whole_rows][1], rs.double() + xs.double() @ w.double().T)
            whole, summed = wholes[whole_rows]
            for start in (0, 5):
                part = slice(start, start + rows)
                got = invariant_gemm(x[part], w, workspace=workspace)
                assert torch.equal(got, whole[part]), (k, n, rows, start)
                got = invariant_gemm(x[part], w, res[part].clone(), workspace)
                assert torch.equal(got, summed[part]), (k, n, rows, start)


def _gated_reference(x, w):
    """float64 silu(gate) * up of x times the weight's [gate | up] rows."""
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemm_matches_float64_and_rows_agree_at_every_row_count(device, full, dtype):
    """SwiGLU in the GEMM's epilogue (gate/up): the gated launch keeps the plain GEMM's
    invariance, its splits summed by the swapped kernel's last program or serially alike."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 tl.dot is wrong under the Triton interpreter")
    # Three splits on the CPU too, whose sums have an order.
    shapes, counts = (GPU_SHAPES[:2], GPU_ROWS) if full else (CPU_SHAPES + [(1600, 48)], CPU_ROWS)
    sms = num_sms(torch.device(device))
    assert num_splits(1600, 48, 8)[0] == 3
    workspace = SplitKWorkspace.allocate(
        [launch for k, n in shapes if (launch := split_launch(n, k, sms)) is not None], device)
    for k, n in shapes:
        # Rows of different scales, up to 10 (gates far below -88 overflow exp, harmless but
        # noisy).
        rows_total = max(counts) + 5
        scale = torch.logspace(-2, 1, rows_total, device=device)
        scale = scale[torch.randperm(rows_total, device=device)]
        x = (torch.randn(rows_total, k, device=device) * scale[:, None]).to(dtype)
        w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)

        def gated(part, x=x, w=w):
            return invariant_gemm(x[part], w, workspace=workspace, gated=True)

        assert rows_total > FEWROW_MAX_ROWS  # the whole through the serial kernel
        wholes = {}
        for rows in counts:
            whole_rows = same_kernel_rows(device, rows)
            if whole_rows not in wholes:
                wholes[whole_rows] = gated(slice(whole_rows))
                _assert_close(wholes[whole_rows], _gated_reference(x[:whole_rows], w))
            whole = wholes[whole_rows]
            assert whole.shape[1] == n // 2
            for start in (0, 5):
                part = slice(start, start + rows)
                assert torch.equal(gated(part), whole[part]), (k, n, rows, start)


def _reference(q, k_cache, v_cache, table, positions, scale):
    """float64 causal attention of each query over its sequence's keys up to its position."""
    block, kv_heads = k_cache.shape[1:3]
    # The sequence's keys and values once, [L, kv_heads, D]; each query head reads its group's.
    slots = torch.arange(int(positions.max()) + 1)
    blocks = table[slots // block].long().cpu()
    keys = k_cache.cpu()[blocks, slots % block].double()
    values = v_cache.cpu()[blocks, slots % block].double()
    queries = q.cpu().double().unflatten(1, (kv_heads, -1))  # [T, kv_heads, group, D]
    out = torch.empty(queries.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        n = int(positions[t]) + 1
        scores = torch.einsum("kgd,lkd->kgl", queries[t], keys[:n]) * scale
        out[t] = torch.einsum("kgl,lkd->kgd", scores.softmax(-1), values[:n])
    return out.flatten(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 32])
def test_attention_decoding_and_in_chunks_agree_bitwise(device, full, needs_dot, dtype, group):
    needs_dot(dtype)
    block, kv_heads, head_dim = (16, 8, 128) if full else (8, 2, 16)
    length = 700 if full else 75
    num_blocks = length // block + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device=device).to(dtype)
    table = torch.randperm(num_blocks, device=device).to(torch.int32)[None]
    q = torch.randn(length, kv_heads * group, head_dim, device=device).to(dtype)
    positions = torch.arange(length, device=device)
    scale = head_dim ** -0.5

    def run(q, positions, lens, starts, tables, spare=0):
        """A prompt or mixed step of these sequences (query tokens from their starts on), its
        tile map with `spare` unused entries, as a captured step's."""
        lens, starts = np.array(lens), np.array(starts)
        used = len(query_tiles(lens, starts, group))
        tiles = torch.from_numpy(query_tiles(lens, starts, group, used + spare))
        cu = torch.from_numpy(np.concatenate([starts, [q.shape[0]]])).to(torch.int32)
        return invariant_attention(q, k_cache, v_cache, positions, tables, tiles.to(device),
                                   cu.to(device), scale, torch.full_like(q, float("nan")))

    def chunked(lens, spare=0):
        """The sequence's queries as one prompt cut into chunks of these lengths, all in one
        step (each chunk a sequence of the step with the same block table)."""
        starts = np.cumsum(lens) - np.array(lens)
        return run(q, positions, lens, starts, table.expand(len(lens), -1).contiguous(), spare)

    whole = chunked([length])
    _assert_close(whole, _reference(q, k_cache, v_cache, table[0], positions, scale))
    assert torch.equal(chunked([5, 1, length - 6]), whole)
    assert torch.equal(chunked([5, 1, length - 6], spare=3), whole)
    assert torch.equal(chunked([1] * length), whole)
    decoded = invariant_attention(q, k_cache, v_cache, positions,
                                  table.expand(length, -1).contiguous(), None, None, scale,
                                  torch.empty_like(q))
    assert torch.equal(decoded, whole)
    # A captured mixed step's layout: padding rows of one token each (position 0, a zeroed
    # block table, no tile) between a decoding row and the prompt, unused map entries after.
    pad = 3
    q_pad = torch.cat([q[:1], torch.randn_like(q[:pad]), q[1:]])
    pos_pad = torch.cat([positions[:1], positions.new_zeros(pad), positions[1:]])
    tables = torch.cat([table, table.new_zeros(pad, table.shape[1]), table])
    mixed = run(q_pad, pos_pad, [1] + [0] * pad + [length - 1],
                [0, *range(1, 1 + pad), 1 + pad], tables, spare=5)
    assert torch.equal(torch.cat([mixed[:1], mixed[1 + pad:]]), whole)


def test_splits_follow_the_weight_and_the_gpu():
    """At most one swapped-kernel program an SM (journal item 170's best split counts), each
    split's columns a whole number of SPLIT_ALIGN; never the rows."""
    assert num_splits(96, 70, 8) == (1, 128)  # too short to split
    assert num_splits(1100, 40, 8) == (2, 640)  # one tile: split as far as K allows
    assert num_splits(2048, 128256, 132) == (1, 2048)  # the LM head has tiles enough
    assert num_splits(2048, 2048, 132) == (4, 512)  # the 1B's o: 32 output tiles
    assert num_splits(8192, 2048, 132) == (4, 2048)  # its down
    assert num_splits(14336, 4096, 132) == (2, 7168)  # the 8B's down
    assert num_splits(4096, 28672, 132) == (1, 4096)  # its gate/up


def test_query_tiles_cut_each_sequence():
    assert query_tiles([5, 1, 3], [0, 5, 6], 4).tolist() == [[0, 0], [0, 4], [1, 5], [2, 6]]
    assert query_tiles([2], [0], 32).tolist() == [[0, 0], [0, 1]]
    # A captured step's: rows of no tile, tokens laid out with gaps, unused entries (-1, 0).
    assert query_tiles([1, 0, 6], [0, 1, 4], 4, 5).tolist() == [[0, 0], [2, 4], [2, 8],
                                                                   [-1, 0], [-1, 0]]
