"""The mixture-of-experts kernels against float64 references: the router (logits, top-k, softmax
weights with and without renormalization; split over experts for few tokens, whole for many),
the grouping of rows by expert (one program, or a device sort for many rows), and the experts'
SwiGLU GEMMs on both paths (GEMVs for a few tokens, grouped GEMMs for wide steps), with experts
that receive no token, experts shared by many tokens, e4m3 experts, and the sum added to the
residual stream."""
import pytest
import torch

from liteinfer.kernels import fused_moe as fused_moe_module
from liteinfer.kernels.fused_moe import (
    GEMV_MAX_ROWS,
    fused_moe,
    moe_align,
    moe_router,
    router_splits_experts,
)
from liteinfer.layers.quantization.fp8 import quantize_weight

# (hidden, intermediate, experts, top_k): Qwen3-30B-A3B's and Mixtral-8x7B's experts on the
# GPU, small ones with widths that are not powers of two interpreted.
GPU_SHAPES = [(2048, 768, 128, 8), (4096, 14336, 8, 2)]
CPU_SHAPES = [(48, 40, 6, 2), (64, 24, 8, 3)]
GPU_TOKENS = [1, 3, 32, 300, 1100]  # 1,100 tokens: the router's whole-expert programs
CPU_TOKENS = [1, 5, 40]  # 40 x top_k rows take the grouped path
CPU_ROUTER_TOKENS = [1, 40, 70]  # 70: the router's whole-expert programs under 8 "SMs"


def _router_ref(x, gate_weight, top_k, renormalize):
    probs = (x.double() @ gate_weight.double().T).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _experts_ref(x, w13, w2, topk_weights, topk_ids):
    """float64, expert by expert over the rows that chose it."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    flat_ids, flat_weights = topk_ids.flatten().long(), topk_weights.flatten().double()
    for e in flat_ids.unique().tolist():
        rows = (flat_ids == e).nonzero().squeeze(1)
        gate, up = (x[rows // top_k] @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        out.index_add_(0, rows // top_k, y * flat_weights[rows, None])
    return out


def _experts(hidden, inter, num_experts, dtype, device):
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) * inter ** -0.5
    return w13.to(dtype), w2.to(dtype)


def _choices(num_tokens, num_experts, top_k, device, unused=(), crowded=()):
    """Random distinct experts per token, never one of `unused`, and `crowded` first for
    every token (so that many tokens share those experts)."""
    scores = torch.rand(num_tokens, num_experts, device=device)
    scores[:, list(unused)] = -1.0
    for rank, e in enumerate(crowded):
        scores[:, e] = 2.0 + rank
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=device)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_picks_the_top_k_with_their_softmax_weights(device, full, renormalize):
    token_counts = GPU_TOKENS if full else CPU_ROUTER_TOKENS
    assert {router_splits_experts(t, torch.device(device)) for t in token_counts} == {True, False}
    for hidden, _, num_experts, top_k in GPU_SHAPES if full else CPU_SHAPES:
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, hidden, device=device)
            gate = torch.randn(num_experts, hidden, device=device) * hidden ** -0.5
            weights, ids, h = moe_router(x, gate, top_k, renormalize)
            assert h is x
            ref_weights, ref_ids = _router_ref(x, gate, top_k, renormalize)
            assert torch.equal(ids.long(), ref_ids)
            torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-6)
            if renormalize:
                torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights[:, 0]))


def test_router_with_the_norm_in_front(assert_close, device, full):
    """Given the RMSNorm's weight, the router normalizes x itself: the experts' input it returns
    is the norm's output, and the routing is that of it, on both of the router's paths."""
    token_counts = GPU_TOKENS if full else CPU_ROUTER_TOKENS
    for hidden, _, num_experts, top_k in GPU_SHAPES if full else CPU_SHAPES:
        gate = torch.randn(num_experts, hidden, device=device) * hidden ** -0.5
        norm_weight = 1 + 0.1 * torch.randn(hidden, device=device)
        for num_tokens in token_counts:
            x = 3 * torch.randn(num_tokens, hidden, device=device)
            weights, ids, h = moe_router(x, gate, top_k, True, norm_weight=norm_weight,
                                         eps=1e-6)
            x64 = x.double()
            ref_h = norm_weight.double() * x64 * (x64.pow(2).mean(-1, keepdim=True)
                                                  + 1e-6).rsqrt()
            assert_close(h, ref_h)
            ref_weights, ref_ids = _router_ref(h, gate, top_k, True)
            assert torch.equal(ids.long(), ref_ids)
            torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("path", ["kernel", "sort"])
def test_align_groups_every_row_once_in_tiles_of_one_expert(device, block_m, path, monkeypatch):
    num_experts, top_k = 7, 2
    _, ids = _choices(123, num_experts, top_k, device, unused=(3,), crowded=(5,))
    if path == "sort":
        monkeypatch.setattr(fused_moe_module, "ALIGN_MAX_ROWS", ids.numel() - 1)
    sorted_ids, tile_experts = moe_align(ids, num_experts, block_m)
    rows = ids.numel()
    flat = ids.flatten().long()
    real = sorted_ids[sorted_ids < rows].long()
    assert sorted(real.tolist()) == list(range(rows))
    counts = torch.bincount(flat, minlength=num_experts)
    for tile, e in enumerate(tile_experts.tolist()):
        tile_rows = sorted_ids[tile * block_m:(tile + 1) * block_m].long()
        tile_rows = tile_rows[tile_rows < rows]
        if e < 0:
            assert tile_rows.numel() == 0
            continue
        assert tile_rows.numel() > 0 and (flat[tile_rows] == e).all()
    used = tile_experts[tile_experts >= 0].tolist()
    assert 3 not in used
    assert used.count(5) == -(-int(counts[5]) // block_m)
    # Tiles in use come first, in ascending expert order; an expert's rows keep their order.
    assert used == sorted(used) and tile_experts.tolist()[:len(used)] == used
    assert torch.equal(real, torch.sort(flat, stable=True).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_match_the_reference(assert_close, device, full, needs_dot, dtype):
    """Both paths (GEMV up to GEMV_MAX_ROWS rows, grouped above), one expert left without
    tokens and two shared by every token."""
    needs_dot(dtype)
    for hidden, inter, num_experts, top_k in GPU_SHAPES if full else CPU_SHAPES:
        w13, w2 = _experts(hidden, inter, num_experts, dtype, device)
        for num_tokens in GPU_TOKENS if full else CPU_TOKENS:
            x = torch.randn(num_tokens, hidden, device=device).to(dtype)
            crowded = (1, 0) if top_k > 2 else ()
            weights, ids = _choices(num_tokens, num_experts, top_k, device,
                                    unused=(num_experts - 1,), crowded=crowded)
            out = fused_moe(x, w13, w2, weights, ids)
            assert out.shape == x.shape and out.dtype == dtype
            ref = _experts_ref(x, w13, w2, weights, ids)
            assert_close(out, ref)
            # Into the residual stream: residual + the sum, rounded as adding the two.
            residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
            summed = fused_moe(x, w13, w2, weights, ids, residual=residual.clone())
            assert torch.equal(summed, residual + out)
    assert max(GPU_TOKENS if full else CPU_TOKENS) * 2 > GEMV_MAX_ROWS  # both paths ran


def test_e4m3_experts_match_their_dequantized_reference(assert_close, device, full):
    """e4m3 experts with one scale per row, widened in the kernels: the reference multiplies
    the same rounded weights."""
    dtype = torch.bfloat16 if full else torch.float32
    for hidden, inter, num_experts, top_k in GPU_SHAPES if full else CPU_SHAPES:
        w13, w2 = _experts(hidden, inter, num_experts, torch.float32, device)
        quantized = [quantize_weight(w.reshape(-1, w.shape[-1])) for w in (w13, w2)]
        (q13, s13), (q2, s2) = [(q.reshape(w.shape), s.reshape(w.shape[:2]))
                                for (q, s), w in zip(quantized, (w13, w2))]
        deq13, deq2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
        for num_tokens in GPU_TOKENS if full else CPU_TOKENS:
            x = torch.randn(num_tokens, hidden, device=device).to(dtype)
            weights, ids = _choices(num_tokens, num_experts, top_k, device)
            out = fused_moe(x, q13, q2, weights, ids, s13, s2)
            assert_close(out, _experts_ref(x, deq13, deq2, weights, ids), dtype)


def test_router_and_experts_from_the_same_tokens(assert_close, device, full):
    """Router and experts chained as the model runs them, tokens whose experts repeat
    across the batch (a few distinct tokens, each several times)."""
    hidden, inter, num_experts, top_k = (GPU_SHAPES if full else CPU_SHAPES)[0]
    w13, w2 = _experts(hidden, inter, num_experts, torch.float32, device)
    gate = torch.randn(num_experts, hidden, device=device) * hidden ** -0.5
    x = torch.randn(4, hidden, device=device).repeat(10, 1)
    weights, ids, _ = moe_router(x, gate, top_k, True)
    assert len({tuple(r) for r in ids.tolist()}) <= 4
    assert_close(fused_moe(x, w13, w2, weights, ids), _experts_ref(x, w13, w2, weights, ids))
