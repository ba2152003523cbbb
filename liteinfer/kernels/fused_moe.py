"""The mixture-of-experts MLP in Triton: the router, and each token's experts as SwiGLU GEMMs.

- `moe_router`: each token's router logits (x W_gate^T), its top-k experts and their weights:
  the softmax over all experts' logits, renormalized over the chosen ones when the family asks
  (which is the softmax of the chosen logits alone). The RMSNorm in front of the block can run
  in it: each program normalizes its columns of x and the first experts' programs store them
  for the experts, so the norm costs no launch of its own. A wide step computes a tile of tokens'
  logits and their top-k in one program. A step of few tokens would leave that to one or two
  programs streaming the whole router weight, so its logits are split over programs by experts
  and by K (ROUTER_SPLITS parts, summed in a second launch that picks the top-k); either way
  the logits are ROUTER_SPLITS partial sums added in split order.
- `fused_moe`: the experts of every (token, choice) row. Wide steps (prefill, many decoding
  rows) group the rows by expert (`moe_align`: one program counts each expert's rows and writes
  them, padded to a multiple of BLOCK_M, in expert order) so that every program multiplies one
  tile of one expert's rows as a GEMM; experts that received no row get no work. Their tiles
  (`grouped_tiles`) follow the rows: few rows an expert at decode widths, so narrow N tiles
  and deep pipelines keep enough programs streaming weights. A step of a few tokens skips the
  grouping: each row streams its expert's gate/up weights as a GEMV, and each token's down
  program streams all its experts' rows at once and sums them.
- The sum over a token's choices is written once per token, never accumulated by atomics: the
  down GEMV sums them in registers; the grouped down GEMM writes each (token, choice) row and
  a last launch sums each token's rows. Given the residual stream, that write adds to it in
  place (rounded as `residual + y` in the model dtype), so the block adds no launch of its own.

Weights are stacked per expert, [E, 2I, H] (gate rows, then up rows) and [E, H, I], in the model
dtype or e4m3 with one fp32 scale per row (FP8 experts): e4m3 tiles are widened in registers
and the scale applied to the accumulator, the activations staying in the model dtype. Nothing
reads back to the host, so a step with experts can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from liteinfer.kernels import FP8_DTYPE, dot_precision, num_sms, supports_pdl

# Rows (tokens x top_k) up to which fused_moe streams each row's expert as a GEMV instead of
# grouping rows by expert: at one to a few tokens the grouping costs more than it saves.
GEMV_MAX_ROWS = 32
# Weight elements an expert GEMV program holds a K step of (gemv_tiles).
GEMV_TILE_ELEMENTS = 8192
# Parts of K the router's logits are summed in, on both of its paths (so that a token's experts
# do not depend on how many tokens share its step), and the tokens and experts of a program.
ROUTER_SPLITS = 4
ROUTER_BLOCK_T = 16
ROUTER_SPLIT_BLOCK_E = 16
# Rows up to which moe_align groups in one Triton program, whose passes over the rows are
# serial; long prompts' rows go through a device sort instead (the crossover is not measured).
ALIGN_MAX_ROWS = 4096
ALIGN_BLOCK_R = 64  # a chunk of rows against every expert: [64, 128] int32 over 8 warps


@triton.jit
def _wait_for_inputs(USE_PDL: tl.constexpr):
    """Every kernel here is a programmatic dependent launch on Hopper and later, started while
    the kernel before it finishes: it waits for that one before it reads or writes anything a
    step produces, then lets the next kernel launch early in turn."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _top_k(logits, experts, rows, row_ok, weights_ptr, ids_ptr, TOP_K: tl.constexpr,
           RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
           K_PAD: tl.constexpr):
    """Stores each row's TOP_K experts and weights from its logits [rows, BLOCK_E] (-inf past
    the last expert): the softmax over all logits, or over the chosen ones (RENORMALIZE)."""
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


@triton.jit
def _inv_rms(x_ptr, rows, row_ok, hidden, stride_x, eps, BLOCK_T: tl.constexpr,
             BLOCK_H: tl.constexpr):
    """1 / RMS of each row of x, for the RMSNorm fused in front of the router: a pass over
    the rows (from L2) in wide steps, each step's loads a latency of their own."""
    squares = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        xf = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                     mask=row_ok[:, None] & (ks < hidden)[None, :], other=0.0).to(tl.float32)
        squares += xf * xf
    return tl.rsqrt(tl.sum(squares, 1) / hidden + eps)


@triton.jit
def _router_part(x_ptr, w_ptr, norm_ptr, h_ptr, inv_rms, rows, row_ok, experts, expert_ok,
                 hidden, stride_x, k_start, k_end, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The logits [rows, experts] over the columns k_start..k_end of x and the router. NORM: x
    is RMS-normalized first (rounded as kernels/norm.py rounds), and the programs of the first
    experts store those columns of it to h [T, hidden] for the experts."""
    dtype = x_ptr.dtype.element_ty
    part = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < hidden
        mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
        if NORM:
            norm_w = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
            x = (norm_w[None, :] * normed).to(dtype)
            first_experts = (tl.zeros((BLOCK_T,), tl.int32) + tl.program_id(1)) == 0
            tl.store(h_ptr + rows[:, None] * hidden + ks[None, :], x,
                     mask=mask & first_experts[:, None])
        w = tl.load(w_ptr + experts[:, None] * hidden + ks[None, :],
                    mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w), part, input_precision=DOT_PRECISION)
    return part


@triton.jit
def _router_kernel(x_ptr, w_ptr, norm_ptr, h_ptr, partial_ptr, weights_ptr, ids_ptr,
                   num_tokens, hidden, stride_x, split_k, eps, NUM_EXPERTS: tl.constexpr,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SPLITS: tl.constexpr,
                   FUSED_TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_RMS: tl.constexpr,
                   K_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Logits of BLOCK_T tokens against BLOCK_E experts. FUSED_TOP_K: the program holds every
    expert, sums all SPLITS parts of split_k columns in order and picks the top-k; else it
    stores the part of axis 2 to partial [SPLITS, T, E]."""
    _wait_for_inputs(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    expert_ok = experts < NUM_EXPERTS
    inv_rms = tl.zeros((BLOCK_T,), tl.float32)
    if NORM:
        inv_rms = _inv_rms(x_ptr, rows, row_ok, hidden, stride_x, eps, BLOCK_T, BLOCK_RMS)
    if FUSED_TOP_K:
        logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
        for split in tl.static_range(SPLITS):
            logits += _router_part(x_ptr, w_ptr, norm_ptr, h_ptr, inv_rms, rows, row_ok,
                                   experts, expert_ok, hidden, stride_x, split * split_k,
                                   tl.minimum((split + 1) * split_k, hidden), NORM, BLOCK_T,
                                   BLOCK_E, BLOCK_H, DOT_PRECISION)
        logits = tl.where(expert_ok[None, :], logits, float("-inf"))
        _top_k(logits, experts, rows, row_ok, weights_ptr, ids_ptr, TOP_K, RENORMALIZE,
               BLOCK_T, BLOCK_E, K_PAD)
    else:
        split = tl.program_id(2)
        part = _router_part(x_ptr, w_ptr, norm_ptr, h_ptr, inv_rms, rows, row_ok, experts,
                            expert_ok, hidden, stride_x, split * split_k,
                            tl.minimum((split + 1) * split_k, hidden), NORM, BLOCK_T, BLOCK_E,
                            BLOCK_H, DOT_PRECISION)
        out = (split * num_tokens + rows)[:, None] * NUM_EXPERTS + experts[None, :]
        tl.store(partial_ptr + out, part, mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit
def _router_top_k_kernel(partial_ptr, weights_ptr, ids_ptr, num_tokens,
                         NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Sums BLOCK_T tokens' partial logits in split order and picks their top-k."""
    _wait_for_inputs(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (experts < NUM_EXPERTS)[None, :]
    logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for split in tl.static_range(SPLITS):
        at = (split * num_tokens + rows)[:, None] * NUM_EXPERTS + experts[None, :]
        logits += tl.load(partial_ptr + at, mask=mask, other=0.0)
    logits = tl.where((experts < NUM_EXPERTS)[None, :], logits, float("-inf"))
    _top_k(logits, experts, rows, row_ok, weights_ptr, ids_ptr, TOP_K, RENORMALIZE, BLOCK_T,
           BLOCK_E, K_PAD)


def router_splits_experts(num_tokens: int, device: torch.device) -> bool:
    """Whether moe_router splits the logits over experts and K: when its token tiles alone
    would give fewer programs than half the SMs."""
    return triton.cdiv(num_tokens, ROUTER_BLOCK_T) < num_sms(device) // 2


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, *,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's top_k experts of x [T, H] under the router gate_weight [E, H]: fp32 weights
    [T, top_k] (the softmax over all E logits, renormalized over the chosen ones when
    `renormalize`), int32 expert ids [T, top_k], best first, and the experts' input: x, or,
    given norm_weight, x RMS-normalized (with eps) before the router, as a new [T, H]."""
    num_tokens, hidden = x.shape
    assert x.stride(-1) == 1
    num_experts = gate_weight.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    h = x if norm_weight is None else torch.empty(num_tokens, hidden, dtype=x.dtype,
                                                  device=x.device)
    block_h = 64
    split_k = triton.cdiv(triton.cdiv(hidden, ROUTER_SPLITS), block_h) * block_h
    all_experts = max(16, triton.next_power_of_2(num_experts))
    pdl = supports_pdl(x.device)
    common = dict(NUM_EXPERTS=num_experts, TOP_K=top_k, RENORMALIZE=renormalize,
                  SPLITS=ROUTER_SPLITS, BLOCK_T=ROUTER_BLOCK_T,
                  K_PAD=triton.next_power_of_2(top_k), USE_PDL=pdl, launch_pdl=pdl)
    args = (x, gate_weight, gate_weight if norm_weight is None else norm_weight, h)
    router = dict(NORM=norm_weight is not None, BLOCK_H=block_h,
                  BLOCK_RMS=min(512, triton.next_power_of_2(hidden)),
                  DOT_PRECISION=dot_precision(x.dtype), **common)
    token_tiles = triton.cdiv(num_tokens, ROUTER_BLOCK_T)
    if not router_splits_experts(num_tokens, x.device):
        _router_kernel[(token_tiles, 1, 1)](
            *args, weights, weights, ids, num_tokens, hidden, x.stride(0), split_k, eps,
            FUSED_TOP_K=True, BLOCK_E=all_experts, **router)
        return weights, ids, h
    partial = torch.empty(ROUTER_SPLITS, num_tokens, num_experts, dtype=torch.float32,
                          device=x.device)
    block_e = min(ROUTER_SPLIT_BLOCK_E, all_experts)
    _router_kernel[(token_tiles, triton.cdiv(num_experts, block_e), ROUTER_SPLITS)](
        *args, partial, weights, ids, num_tokens, hidden, x.stride(0), split_k, eps,
        FUSED_TOP_K=False, BLOCK_E=block_e, **router)
    _router_top_k_kernel[(token_tiles,)](partial, weights, ids, num_tokens, BLOCK_E=all_experts,
                                         **common)
    return weights, ids, h


@triton.jit
def _align_kernel(ids_ptr, sorted_ids_ptr, tile_experts_ptr, num_rows, num_tiles,
                  NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    """moe_align in one program: count each expert's rows, lay the experts' padded tiles out in
    order, fill every slot with the padding value, then write each row at its expert's start
    plus the rows of that expert before it; last, each tile's expert."""
    _wait_for_inputs(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    r = tl.arange(0, BLOCK_R)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for r0 in range(0, num_rows, BLOCK_R):
        ids = tl.load(ids_ptr + r0 + r, mask=r0 + r < num_rows, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    seen = ends - padded  # each expert's next free slot
    for p0 in range(0, num_tiles * BLOCK_M, BLOCK_R):
        tl.store(sorted_ids_ptr + p0 + r, tl.zeros((BLOCK_R,), tl.int32) + num_rows,
                 mask=p0 + r < num_tiles * BLOCK_M)
    # The padding's stores and the rows' stores below may hit the same slots from other threads.
    tl.debug_barrier()
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + r
        ids = tl.load(ids_ptr + rows, mask=rows < num_rows, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, 0) - hit  # the chunk's earlier rows of the same expert
        slot = tl.sum(hit * (before + seen[None, :]), 1)
        tl.store(sorted_ids_ptr + slot, rows, mask=rows < num_rows)
        seen += tl.sum(hit, 0)
    for t0 in range(0, num_tiles, BLOCK_R):
        tiles = t0 + r
        # A tile's expert: how many experts' tiles end at or before its first slot.
        e = tl.sum((ends[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(tile_experts_ptr + tiles, tl.where(e < NUM_EXPERTS, e, -1), mask=tiles < num_tiles)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) rows grouped by expert for tiles of block_m rows: row ids [P] (index
    into topk_ids.flatten(); the padding of each expert's last tile holds the row count, which
    no row has) and each tile's expert [P / block_m] (-1 past the last tile in use). P is the
    most the rows can pad to, so that nothing is read back to the host. Within an expert the
    rows keep their order."""
    rows = topk_ids.numel()
    tiles = triton.cdiv(rows, block_m) + min(num_experts, rows)
    if rows > ALIGN_MAX_ROWS:
        return _align_sort(topk_ids, num_experts, block_m, tiles)
    pdl = supports_pdl(topk_ids.device)
    sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=topk_ids.device)
    tile_experts = torch.empty(tiles, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](topk_ids, sorted_ids, tile_experts, rows, tiles,
                        NUM_EXPERTS=num_experts, BLOCK_M=block_m,
                        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_R=ALIGN_BLOCK_R,
                        USE_PDL=pdl, num_warps=8, launch_pdl=pdl)
    return sorted_ids, tile_experts


def _align_sort(topk_ids: torch.Tensor, num_experts: int, block_m: int, tiles: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align through a stable device sort, for more rows than one program groups fast."""
    flat = topk_ids.flatten().long()
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    expert_of = flat[order]
    rank = torch.arange(rows, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((tiles * block_m,), rows, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, tiles * block_m, block_m, device=flat.device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_ids, tile_experts


@triton.jit
def _gate_up_epilogue(gate, up, rows, ns, n_ok, row_ok, e, scale_ptr, out_ptr, N,
                      HAS_SCALE: tl.constexpr):
    """Scales and SwiGLU of an [rows, ns] tile of one expert's gate and up products, stored to
    the intermediate [rows, N], rounded to its dtype where Hugging Face's separate layers
    round."""
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:
        gate = gate * tl.load(scale_ptr + e * 2 * N + ns, mask=n_ok, other=0.0)
        up = up * tl.load(scale_ptr + e * 2 * N + N + ns, mask=n_ok, other=0.0)
    gate = gate.to(dtype).to(tl.float32)
    y = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + ns[None, :], y.to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _weighted(acc, e, routing, ns, n_ok, scale_ptr, N, dtype: tl.constexpr,
              HAS_SCALE: tl.constexpr):
    """One expert's down products (the last axis ns) scaled, rounded to the model dtype, times
    the routing weight and rounded again: each choice's term as Hugging Face adds it."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + e * N + ns, mask=n_ok, other=0.0)
    return (acc.to(dtype).to(tl.float32) * routing).to(dtype).to(tl.float32)


@triton.jit
def _store_sum(total, out_ptr, res_ptr, tokens, ns, mask, N, ADD: tl.constexpr):
    """A token's sum over its choices rounded to the output dtype, added to the residual stream
    (read from res_ptr, which is out_ptr then) when ADD."""
    dtype = out_ptr.dtype.element_ty
    at = tokens.to(tl.int64)[:, None] * N + ns[None, :]
    y = total.to(dtype)
    if ADD:
        y = (y.to(tl.float32) + tl.load(res_ptr + at, mask=mask).to(tl.float32)).to(dtype)
    tl.store(out_ptr + at, y, mask=mask)


@triton.jit
def _expert_dot(a, w, acc, SWAPPED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a w^T for rows a [M, K] and an expert's weight tile w [N, K] widened to a's dtype;
    SWAPPED: acc is [N, M] and gets the transpose, w a^T, so that the widened weight is
    the MMA's row operand (wgmma takes that one from registers, the other from shared
    memory: widened e4m3 need not go back through shared memory) and N, not the few rows,
    fills its 64-row side."""
    if SWAPPED:
        out = tl.dot(w.to(a.dtype), tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        out = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, scale_ptr, routing_ptr, out_ptr, sorted_ids_ptr,
                    tile_experts_ptr, num_rows, N, K, stride_x,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAPPED: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile of one expert's grouped rows. GATED: x is the tokens
    [T, K] (row r reads token r // TOP_K) against the expert's gate and up rows, into the
    intermediate [rows, N]; else x is the intermediate [rows, K], read by row id, and each row's
    product times its routing weight goes to out [rows, N]. SWAPPED: the tile is computed
    transposed (see _expert_dot)."""
    _wait_for_inputs(USE_PDL)
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
    w_base = w_ptr + e * (2 * N if GATED else N) * K
    if SWAPPED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = acc
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + ns[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        acc = _expert_dot(a, w, acc, SWAPPED, DOT_PRECISION)
        if GATED:
            u = tl.load(w_base + (N + ns)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            up = _expert_dot(a, u, up, SWAPPED, DOT_PRECISION)
    if SWAPPED:
        acc = tl.trans(acc)
        up = tl.trans(up)
    if GATED:
        _gate_up_epilogue(acc, up, rows, ns, n_ok, row_ok, e, scale_ptr, out_ptr, N, HAS_SCALE)
    else:
        routing = tl.load(routing_ptr + rows, mask=row_ok, other=0.0)
        y = _weighted(acc, e, routing[:, None], ns, n_ok, scale_ptr, N,
                      out_ptr.dtype.element_ty, HAS_SCALE)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + ns[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(y_ptr, out_ptr, res_ptr, N, TOP_K: tl.constexpr, ADD: tl.constexpr,
                BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = sum over j of y[t, j] (+ the residual), BLOCK_N features of one token."""
    _wait_for_inputs(USE_PDL)
    t = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * N + ns, mask=n_ok,
                         other=0.0).to(tl.float32)
    tokens = t + tl.zeros((1,), tl.int32)
    _store_sum(total[None, :], out_ptr, res_ptr, tokens, ns, n_ok[None, :], N, ADD)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, topk_ids_ptr, N, K, stride_x,
                         TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_N gate and up outputs of one (token, choice) row, its expert's weight rows
    streamed once, the products summed elementwise and reduced once at the end."""
    _wait_for_inputs(USE_PDL)
    row = tl.program_id(0)
    e = tl.load(topk_ids_ptr + row).to(tl.int64)
    src = (row // TOP_K).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    w_base = w_ptr + e * 2 * N * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + ns[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        u = tl.load(w_base + (N + ns)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        a = tl.load(x_ptr + src * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
        up += u.to(tl.float32) * a[None, :]
    rows = row + tl.zeros((1,), tl.int32)
    _gate_up_epilogue(tl.sum(acc, 1)[None, :], tl.sum(up, 1)[None, :], rows, ns, n_ok,
                      rows >= 0, e, scale_ptr, out_ptr, N, HAS_SCALE)


@triton.jit
def _down_weights(w_ptr, w_rows, w_ok, ks, K):
    """A [K_PAD, BLOCK_N, BLOCK_K] tile of a token's experts' down rows, columns ks."""
    return tl.load(w_ptr + w_rows[:, :, None] * K + ks[None, None, :],
                   mask=w_ok[:, :, None] & (ks < K)[None, None, :], other=0.0)


@triton.jit
def _down_step(acc, w, h_ptr, rows, choice_ok, ks, K):
    """acc plus the tile w times the token's intermediate rows, columns ks, elementwise."""
    h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                mask=choice_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
    return acc + w.to(tl.float32) * h[:, None, :]


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, scale_ptr, routing_ptr, out_ptr, topk_ids_ptr, N, K,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SCALE: tl.constexpr,
                      ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """BLOCK_N outputs of one token: all its choices' down rows streamed together as one
    [K_PAD, BLOCK_N, BLOCK_K] tile, each choice weighted, summed over the choices. The experts
    were chosen two launches back, before the gate/up launch it follows let it start (that one
    does so only past its own wait), so their first tile is loaded before the wait."""
    t = tl.program_id(0)
    choices = tl.arange(0, K_PAD)
    choice_ok = choices < TOP_K
    rows = t * TOP_K + choices
    e = tl.load(topk_ids_ptr + rows, mask=choice_ok, other=0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = (e * N)[:, None] + ns[None, :]  # [K_PAD, BLOCK_N]
    w_ok = choice_ok[:, None] & n_ok[None, :]
    w = _down_weights(w_ptr, w_rows, w_ok, kk, K)
    _wait_for_inputs(USE_PDL)
    acc = _down_step(tl.zeros((K_PAD, BLOCK_N, BLOCK_K), tl.float32), w, h_ptr, rows,
                     choice_ok, kk, K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + kk
        acc = _down_step(acc, _down_weights(w_ptr, w_rows, w_ok, ks, K), h_ptr, rows,
                         choice_ok, ks, K)
    routing = tl.load(routing_ptr + rows, mask=choice_ok, other=0.0)
    y = _weighted(tl.sum(acc, 2), e[:, None], routing[:, None], ns[None, :], w_ok, scale_ptr,
                  N, out_ptr.dtype.element_ty, HAS_SCALE)
    tokens = t + tl.zeros((1,), tl.int32)
    _store_sum(tl.sum(y, 0)[None, :], out_ptr, out_ptr, tokens, ns, n_ok[None, :], N, ADD)


def gemv_tiles(k: int, rows_per_program: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of an expert GEMV whose programs stream rows_per_program
    weight rows for each output (gate and up: 2; a token's down: its choices, padded). The
    products are summed elementwise in fp32 over the tile, so the tile's elements (not its
    bytes) are bounded: 8k, 64 accumulators a thread at 4 warps, as the dense chunked GEMV."""
    block_k = min(256, triton.next_power_of_2(k))
    block_n = max(1, GEMV_TILE_ELEMENTS // (rows_per_program * block_k))
    return block_n, block_k, max(4, rows_per_program * block_n * block_k // 2048)


def grouped_tiles(rows: int, e4m3: bool) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAPPED) of the grouped GEMMs over
    `rows` (token, choice) rows. Decode widths give an expert a few rows (Qwen3-30B-A3B: 2 at 32
    tokens, 8 at 128), so a tile is 16 rows, and narrow N tiles with deep pipelines give the
    weight streams enough programs; prompts fill 64-row tiles. e4m3 weights, widened in
    registers, are the MMA's row operand (SWAPPED), which needs 64 of them a tile."""
    if rows <= 512:
        tiles = (16, 64 if e4m3 else 32, 128, 4, 4)
    elif rows <= ALIGN_MAX_ROWS:
        tiles = (16, 64, 128, 4, 3)
    else:
        tiles = (64, 64, 64, 4, 3)
    return (*tiles, e4m3 and tiles[0] < 64)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None
              ) -> torch.Tensor:
    """sum over each token's choices j of topk_weights[t, j] * expert_e(x[t]), e = topk_ids[t, j],
    expert_e(x) = (silu(x G_e^T) * (x U_e^T)) D_e^T with w13[e] = [G_e; U_e] [2I, H] and
    w2[e] = D_e [H, I]: [T, H] in x's dtype, or, given the residual stream [T, H], added to it
    in place and returned. e4m3 weights come with fp32 per-row scales (w13_scale [E, 2I],
    w2_scale [E, H])."""
    num_tokens, hidden = x.shape
    rows, top_k = topk_ids.numel(), topk_ids.shape[1]
    inter = w2.shape[2]
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.is_contiguous()
    out = residual if residual is not None else x.new_empty(num_tokens, hidden)
    add = residual is not None
    s13 = w13 if w13_scale is None else w13_scale  # a placeholder pointer the kernel never reads
    s2 = w2 if w2_scale is None else w2_scale
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    pdl = dict(USE_PDL=supports_pdl(x.device), launch_pdl=supports_pdl(x.device))
    if rows <= GEMV_MAX_ROWS:
        block_n, block_k, warps = gemv_tiles(hidden, 2)
        _gate_up_gemv_kernel[(rows, triton.cdiv(inter, block_n))](
            x, w13, s13, h, topk_ids, inter, hidden, x.stride(0), TOP_K=top_k,
            HAS_SCALE=w13_scale is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=3, **pdl)
        k_pad = triton.next_power_of_2(top_k)
        block_n, block_k, warps = gemv_tiles(inter, k_pad)
        _down_gemv_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
            h, w2, s2, topk_weights, out, topk_ids, hidden, inter, TOP_K=top_k, K_PAD=k_pad,
            HAS_SCALE=w2_scale is not None, ADD=add, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=3, **pdl)
        return out
    block_m, block_n, block_k, warps, stages, swapped = grouped_tiles(
        rows, w13.dtype == FP8_DTYPE)
    sorted_ids, tile_experts = moe_align(topk_ids, w13.shape[0], block_m)
    tiles = tile_experts.numel()
    common = dict(TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  SWAPPED=swapped, DOT_PRECISION=dot_precision(x.dtype), num_warps=warps,
                  num_stages=stages, **pdl)
    _grouped_kernel[(tiles * triton.cdiv(inter, block_n),)](
        x, w13, s13, topk_weights, h, sorted_ids, tile_experts, rows, inter, hidden,
        x.stride(0), GATED=True, HAS_SCALE=w13_scale is not None, **common)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _grouped_kernel[(tiles * triton.cdiv(hidden, block_n),)](
        h, w2, s2, topk_weights, y, sorted_ids, tile_experts, rows, hidden, inter,
        h.stride(0), GATED=False, HAS_SCALE=w2_scale is not None, **common)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](y, out, out, hidden, TOP_K=top_k,
                                                           ADD=add, BLOCK_N=block_h, **pdl)
    return out
