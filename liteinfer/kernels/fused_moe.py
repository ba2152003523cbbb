"""The mixture-of-experts MLP in Triton: the router, and each token's experts as SwiGLU GEMMs.

- `moe_router`: one kernel computes a tile of tokens' router logits (x W_gate^T), picks each
  token's top-k experts and their weights: the softmax over all experts' logits, renormalized
  over the chosen ones when the family asks (which is the softmax of the chosen logits alone).
- `fused_moe`: the experts of every (token, choice) row. Wide steps (prefill, many decoding
  rows) group the rows by expert (`moe_align`: a stable sort, each expert's rows padded to a
  multiple of BLOCK_M) so that every program multiplies one tile of one expert's rows as a GEMM;
  experts that received no row get no program. A step of a few tokens skips the grouping:
  each row streams its expert's weights as a GEMV, as kernels/gemv.py does for dense layers.
  Either way two launches: gate/up with SwiGLU in the epilogue into an [rows, I] intermediate,
  then down, scaled by the routing weight, into [tokens, top_k, H], summed over the choices.

Weights are stacked per expert, [E, 2I, H] (gate rows, then up rows) and [E, H, I], in the model
dtype or e4m3 with one fp32 scale per row (FP8 experts): e4m3 tiles are widened in registers
and the scale applied to the accumulator, the activations staying in the model dtype. Nothing
reads back to the host, so a step with experts can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision

# Rows (tokens x top_k) up to which fused_moe streams each row's expert as a GEMV instead of
# grouping rows by expert: at one to a few tokens the grouping's sort costs more than it saves.
GEMV_MAX_ROWS = 32


@triton.jit
def _router_kernel(x_ptr, w_ptr, weights_ptr, ids_ptr, num_tokens, hidden, stride_x,
                   NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                   K_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    expert_ok = experts < NUM_EXPERTS
    logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < hidden
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + experts[:, None] * hidden + ks[None, :],
                    mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
        logits = tl.dot(x, tl.trans(w), logits, input_precision=DOT_PRECISION)
    logits = tl.where(expert_ok[None, :], logits, float("-inf"))
    top = tl.max(logits, 1)
    total = tl.sum(tl.exp(logits - top[:, None]), 1)  # the softmax's denominator, all experts
    choices = tl.arange(0, K_PAD)
    weights = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    chosen = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(logits, 1)
        # The lowest index among equal logits, as torch.topk keeps.
        idx = tl.min(tl.where(logits == best[:, None], experts[None, :], BLOCK_E), 1)
        p = tl.exp(best - top)
        chosen += p
        weights = tl.where(choices[None, :] == j, p[:, None], weights)
        ids = tl.where(choices[None, :] == j, idx[:, None], ids)
        logits = tl.where(experts[None, :] == idx[:, None], float("-inf"), logits)
    denominator = chosen if RENORMALIZE else total
    weights = weights / denominator[:, None]
    out = rows[:, None] * TOP_K + choices[None, :]
    mask = row_ok[:, None] & (choices[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts of x [T, H] under the router gate_weight [E, H]: fp32 weights
    [T, top_k] (the softmax over all E logits, renormalized over the chosen ones when
    `renormalize`) and int32 expert ids [T, top_k], best first."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    block_t = 16
    _router_kernel[(triton.cdiv(num_tokens, block_t),)](
        x, gate_weight, weights, ids, num_tokens, hidden, x.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)), BLOCK_H=64,
        K_PAD=triton.next_power_of_2(top_k), DOT_PRECISION=dot_precision(x.dtype))
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) rows grouped by expert for tiles of block_m rows: row ids [P] (index
    into topk_ids.flatten(); the padding of each expert's last tile holds the row count, which
    no row has) and each tile's expert [P / block_m] (-1 past the last tile in use). P is the
    most the rows can pad to, so that nothing is read back to the host."""
    flat = topk_ids.flatten().long()
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    expert_of = flat[order]
    rank = torch.arange(rows, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    tiles = triton.cdiv(rows, block_m) + min(num_experts, rows)
    sorted_ids = torch.full((tiles * block_m,), rows, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, tiles * block_m, block_m, device=flat.device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_ids, tile_experts


@triton.jit
def _epilogue(acc, up, rows, ns, n_ok, row_ok, e, scale_ptr, routing_ptr, out_ptr, out_stride,
              N, GATED: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Scales, SwiGLU (GATED: acc is the gate, `up` the up projection) or the routing weight,
    and the store of an [rows, ns] tile of one expert's output, rounded to the output dtype
    where Hugging Face's separate layers round."""
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + e * (2 * N if GATED else N) + ns, mask=n_ok, other=0.0)
        if GATED:
            up = up * tl.load(scale_ptr + e * 2 * N + N + ns, mask=n_ok, other=0.0)
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    else:
        routing = tl.load(routing_ptr + rows, mask=row_ok, other=0.0)
        y = acc.to(dtype).to(tl.float32) * routing[:, None]
    mask = row_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride + ns[None, :], y.to(dtype),
             mask=mask)


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, scale_ptr, routing_ptr, out_ptr, sorted_ids_ptr,
                    tile_experts_ptr, num_rows, N, K, stride_x,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile of one expert's grouped rows. GATED: x is the tokens
    [T, K] (row r reads token r // TOP_K) against the expert's gate and up rows; else x is the
    intermediate [rows, K], read by row id."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile, pid_n = pid // num_n, pid % num_n
    e = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if e < 0:
        return
    rows = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    src = (rows // TOP_K if GATED else rows).to(tl.int64)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    w_rows = 2 * N if GATED else N
    w_base = w_ptr + e * w_rows * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + ns[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(w_base + (N + ns)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            up = tl.dot(a, tl.trans(u.to(a.dtype)), up, input_precision=DOT_PRECISION)
    _epilogue(acc, up, rows, ns, n_ok, row_ok, e, scale_ptr, routing_ptr, out_ptr, N, N,
              GATED, HAS_SCALE)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, routing_ptr, out_ptr, topk_ids_ptr, N, K, stride_x,
                 TOP_K: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_N outputs of one (token, choice) row, its expert's weight rows streamed once."""
    row = tl.program_id(0)
    e = tl.load(topk_ids_ptr + row).to(tl.int64)
    src = (row // TOP_K if GATED else row).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    w_base = w_ptr + e * (2 * N if GATED else N) * K
    acc = tl.zeros((BLOCK_N,), tl.float32)
    up = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + src * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + ns[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], 1)
        if GATED:
            u = tl.load(w_base + (N + ns)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            up += tl.sum(u.to(tl.float32) * a[None, :], 1)
    # One row as a [1, BLOCK_N] tile, so that the grouped kernel's epilogue serves it.
    rows = row + tl.zeros((1,), tl.int32)
    _epilogue(acc[None, :], up[None, :], rows, ns, n_ok, rows >= 0, e, scale_ptr, routing_ptr,
              out_ptr, N, N, GATED, HAS_SCALE)


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
            routing: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor,
            grouping: tuple[torch.Tensor, torch.Tensor, int] | None, gated: bool) -> None:
    """One of fused_moe's two GEMMs (gated: gate/up into `out` [rows, I]; else down into
    `out` [rows, H]) over the rows grouped by `grouping` (sorted ids, tile experts, BLOCK_M), or
    one row at a time when it is None."""
    n, k = out.shape[1], x.shape[1]
    top_k = topk_ids.shape[1]
    common = dict(TOP_K=top_k, GATED=gated, HAS_SCALE=scale is not None)
    scale = w if scale is None else scale  # a placeholder pointer the kernel never reads
    if grouping is None:
        block_n = 32
        _gemv_kernel[(topk_ids.numel(), triton.cdiv(n, block_n))](
            x, w, scale, routing, out, topk_ids, n, k, x.stride(0), BLOCK_N=block_n,
            BLOCK_K=128, **common)
        return
    sorted_ids, tile_experts, block_m = grouping
    block_n = 64
    grid = (tile_experts.numel() * triton.cdiv(n, block_n),)
    _grouped_kernel[grid](x, w, scale, routing, out, sorted_ids, tile_experts, topk_ids.numel(),
                          n, k, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                          DOT_PRECISION=dot_precision(x.dtype), **common)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's choices j of topk_weights[t, j] * expert_e(x[t]), e = topk_ids[t, j],
    expert_e(x) = (silu(x G_e^T) * (x U_e^T)) D_e^T with w13[e] = [G_e; U_e] [2I, H] and
    w2[e] = D_e [H, I]: [T, H] in x's dtype. e4m3 weights come with fp32 per-row scales
    (w13_scale [E, 2I], w2_scale [E, H])."""
    num_tokens, hidden = x.shape
    rows = topk_ids.numel()
    inter = w2.shape[2]
    grouping = None
    if rows > GEMV_MAX_ROWS:
        block_m = 16 if rows <= 256 else 64
        grouping = (*moe_align(topk_ids, w13.shape[0], block_m), block_m)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, w13_scale, topk_weights, h, topk_ids, grouping, gated=True)
    y = torch.empty(num_tokens, topk_ids.shape[1], hidden, dtype=x.dtype, device=x.device)
    _launch(h, w2, w2_scale, topk_weights, y.view(rows, hidden), topk_ids, grouping, gated=False)
    return y.sum(1)
