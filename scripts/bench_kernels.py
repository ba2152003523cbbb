"""GPU microbenchmark of the liteinfer Triton kernels at the 1B Llama model's shapes
(Hq=32, Hkv=8, D=64, hidden 2048, intermediate 8192, bf16, KV block size 16); `--head-dim 128`
gives the attention kernels the 8B's heads (Hq=32, Hkv=8, D=128), `--kv-dtype fp8` an e4m3 KV
pool (kv_cache_dtype="fp8").

Each kernel is first checked against a torch reference at the benchmarked shape, then timed
with triton.testing.do_bench (median; L2 flushed between runs). Decode is also timed as a
CUDA-graph replay, which is how the engine runs it, at 1, the engine's and 4x the engine's split
width, and with this step's RoPE + KV write fused in (`decode+newkv`, the engine's path). Prefill
is also timed as a graph replay, and compared with torch's SDPA (the engine's path for a lone
prompt with nothing cached) and with PyTorch's varlen FlashAttention-2 on the packed projections.
`--only verify` times speculative verifications (1 + k queries over a long context) in the
prefill launch, split along their keys as the engine sizes them and in one program a KV head.
`--only moe` times one Qwen3-30B-A3B sparse layer instead (router and experts, 128 experts of
2048 x 768, top-8; `--moe-dtype fp8` for e4m3 experts) at 1, 8, 32 and 128 tokens: a CUDA graph
of MOE_LAYERS such layers (each its own weights, as a decode step walks through them) against
the floor of the bytes their routing touches at the measured copy bandwidth, and each kernel's
time a layer under torch.profiler; with `--sweep`, the expert GEMV and grouped GEMM tiles.
`--only wna16` times the 8B's projections (qkv, o, gate_up, down) with 4-bit weights (groups of
128) at 1, 8, 32 and 128 rows as the engine runs them (kernels/wna16.py: the fused GEMV at one
row, the few-row kernel above; also the dequantize-then-cuBLAS path), against the bf16 weight
the engine multiplies (the fused GEMV at one row, cuBLAS above); `vs_bf16` is bf16's time over
the row's. Weight bytes (codes, scales and mins) give the rate. `--only invariant` times the
batch-invariant GEMM at the 1B's and 8B's projections and the 1B's LM head, at 1, 32, 128 and
2,048 rows, with its norm / SwiGLU inside and with them apart, against the default's path.
`--only wna16-fused` times the 4-bit few-row kernel at SmolLM2's and the 8B's shapes at
several tile widths, gate/up with the SwiGLU inside and beside.
Prints a table; with $OUT set, also writes $OUT/kernels-<pool layout>-<kv dtype>-d<D>.json.
`--sweep` additionally times alternative tile configurations, prefill also at the sizes of mixed
steps' prompt pieces; `--decode-shapes` names the decode shapes (BATCHxCTX) timed and swept, and the
decode sweep then times the engine's path alone (split policy, this step's K/V fused in).

    python scripts/bench_kernels.py [--sweep] [--pool token-major] [--head-dim 128]
                                    [--only decode prefill verify elementwise moe wna16
                                            wna16-fused invariant]
                                    [--moe-dtype fp8]
                                    [--decode-shapes 1x256 128x256 ...] [--kv-dtype fp8]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench, do_bench_cudagraph

from liteinfer.attention import allocate_kv_pool
from liteinfer.attention.torch_backend import gather_kv
from liteinfer.kernels import FP8_DTYPE, num_sms, wna16
from liteinfer.kernels import decode_attention as dec
from liteinfer.kernels import decode_splits as splits
from liteinfer.kernels import fused_moe as moe
from liteinfer.kernels import invariant_gemm as inv
from liteinfer.kernels import prefill_attention as pre
from liteinfer.kernels.activation import silu_and_mul
from liteinfer.kernels.argmax import argmax_rows
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.kernels.gemv import gemv
from liteinfer.kernels.kv_cache import rope_store_kv
from liteinfer.kernels.norm import rms_norm
from liteinfer.kernels.prefill_tiles import (
    PrefillTiles,
    prefill_tile_map,
    prefill_tile_tokens,
    split_counts,
    split_entries,
)
from liteinfer.layers.fused_moe import fused_moe_torch
from liteinfer.layers.quantization.fp8 import quantize_weight
from liteinfer.layers.quantization.wna16 import quantize_rtn

HQ, HKV, D, BLOCK_SIZE, HIDDEN, INTER = 32, 8, 64, 16, 2048, 8192
DTYPE = torch.bfloat16
KV_DTYPES = {"bf16": DTYPE, "fp8": FP8_DTYPE}
kv_dtype = DTYPE  # --kv-dtype: the KV pool's element type
VOCAB = 128256
PEAK_GBS = 4300.0  # measured H200 copy bandwidth
SCALE = 1 / math.sqrt(D)
DEV = "cuda"
POOL_LAYOUTS = ("head-major", "token-major")
pool_layout = POOL_LAYOUTS[0]  # --pool: head-major is the engine's (allocate_kv_pool)


def timed(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Max abs error relative to max|ref|; raises past tol so a wrong kernel is never timed."""
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1)).item()
    if not math.isfinite(err) or err > tol:
        raise AssertionError(f"kernel disagrees with the torch reference: {err:.3g} > {tol}")
    return err


def random_pool(num_blocks: int) -> torch.Tensor:
    """Normal K or V values in a pool of kv_dtype (e4m3 has no random fill: cast from bf16)."""
    values = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, dtype=DTYPE, device=DEV)
    if pool_layout == "token-major":
        return values.to(kv_dtype)
    return allocate_kv_pool(num_blocks=num_blocks, block_size=BLOCK_SIZE, num_kv_heads=HKV,
                            head_dim=D, dtype=kv_dtype, device=DEV).copy_(values)


def paged_pool(lens: list[int]):
    """Pool holding sequences of the given lengths in shuffled blocks, with their block
    tables and lengths."""
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(per_seq)
    k_cache, v_cache = random_pool(num_blocks), random_pool(num_blocks)
    perm = torch.randperm(num_blocks, device=DEV, dtype=torch.int32)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


RAGGED = "mixed2048"  # a shape's context: 64-2,048 prompt tokens + 0-128 decoded, drawn per row
DECODE_SHAPES = [(b, c) for b in (1, 4, 32, 128) for c in (128, 384, 3712, 15488)] + [
    (28, 1024), (32, 2048), (28, RAGGED), (32, RAGGED)]  # the decoding rows of W=32 runs
PREFILL_SHAPES = [(1, 15360), (32, 128), (8, 2048), (1, 2016), (2, 1008)]  # + mixed-step pieces
# Verifications (sequences, 1 + k query tokens, context) as a speculative step has them alone
VERIFY_SHAPES = [(1, 5, 4096), (1, 5, 16384), (4, 5, 16384), (1, 17, 16384), (16, 5, 8192)]
ELEMENTWISE_TOKENS = (1, 32, 128, 4096)
# Llama-3.1-8B's projections (name, out features, in features, the engine's fusion at one row)
WNA16_SHAPES = (("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "residual"),
                ("gate_up", 28672, 4096, "gated"), ("down", 4096, 14336, "residual"))
WNA16_ROWS = (1, 8, 32, 128)
# Projections behind a norm, and gate/up (model, name, out features, in features, fusion),
# and the rows of verifications and narrow decode steps, for `--only wna16-fused`.
WNA16_FUSED_SHAPES = (("smollm2", "qkv", 960, 576, "norm"),
                      ("smollm2", "gate_up", 3072, 576, "gated"),
                      ("8b", "qkv", 6144, 4096, "norm"), ("8b", "gate_up", 28672, 4096, "gated"))
WNA16_FUSED_ROWS = (2, 5, 16, 32)
# (model, projection, N, K, fusion) of the 1B's and 8B's linears, for the invariant GEMM.
INVARIANT_SHAPES = tuple((model, name, n, k, fusion) for model, h, i, q in (
    ("1b", 2048, 8192, 3072), ("8b", 4096, 14336, 6144)) for name, n, k, fusion in (
    ("qkv", q, h, "norm"), ("o", h, h, "residual"), ("gate_up", 2 * i, h, "gated"),
    ("down", h, i, "residual"))) + (("1b", "lm_head", VOCAB, 2048, "norm"),)
INVARIANT_ROWS = (1, 32, 128, 2048)  # decode steps, and a prompt step
INVARIANT_STREAM_BYTES = 256 * 2**20  # weight bytes a timed graph streams: several L2s' worth


def decode_lens(batch: int, ctx: int | str) -> list[int]:
    if ctx == RAGGED:
        rng = torch.Generator().manual_seed(batch)
        return (torch.randint(64, 2049, (batch,), generator=rng)
                + torch.randint(0, 129, (batch,), generator=rng)).tolist()
    return [ctx] * batch


def decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """fp32 attention of q [B, Hq, D] over each row's first lens[b] pool tokens."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, ctx in enumerate(lens):
        k, v = (gather_kv(c, tables[b:b + 1], ctx, torch.float32).transpose(1, 2)
                for c in (k_cache, v_cache))
        qg = q[b:b + 1].float().view(1, HKV, HQ // HKV, D)
        p = torch.einsum("bhgd,bhnd->bhgn", qg, k).mul_(SCALE).softmax(-1)
        out[b] = torch.einsum("bhgn,bhnd->bhgd", p, v).reshape(HQ, D)
    return out


def bench_decode(rows: list[dict], num_sms: int, shapes=DECODE_SHAPES, label: str = "",
                 waves: int = 2, engine_only: bool = False) -> None:
    ws = splits.DecodeWorkspace.allocate(128, HQ, D, splits.MAX_SPLITS_CAP, DEV)
    for batch, ctx in shapes:
        lens_list = decode_lens(batch, ctx)
        k_cache, v_cache, tables, lens = paged_pool(lens_list)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEV)
        out = torch.empty_like(q)
        ref = decode_ref(q, k_cache, v_cache, tables, lens_list)
        gbytes = 2 * sum(lens_list) * HKV * D * k_cache.element_size() / 1e9
        policy = splits.max_splits_for(batch, HKV, num_sms, splits.rows_may_split(lens_list, D),
                                       waves=waves)
        # The engine's path also rotates q and writes this step's K/V (already in the pool
        # here: the last position of each row is rewritten with the same values).
        last = lens.long() - 1
        blocks = tables[torch.arange(batch, device=DEV), last // BLOCK_SIZE].long()
        slots = blocks * BLOCK_SIZE + last % BLOCK_SIZE
        new_kv = dec.NewKV(*(c[blocks, last % BLOCK_SIZE].to(DTYPE) for c in (k_cache, v_cache)),
                           torch.zeros_like(last), slots, cos_sin_zero_rotation())
        widths = {1, policy, splits.max_splits_for(batch, HKV, num_sms, waves=4 * waves)}
        variants = [] if engine_only else [(m, None) for m in sorted(widths)]
        variants.append((policy, new_kv))
        for max_splits, fused in variants:
            def run() -> torch.Tensor:
                return dec.paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE,
                                                  out, max_splits, ws, fused)
            err = check(run(), ref, 2e-2)
            ms, graph_ms = timed(run), do_bench_cudagraph(run, return_mode="median")
            rows.append(dict(kernel="decode" + ("+newkv" if fused else "") + label,
                             batch=batch, ctx=ctx, max_splits=max_splits, us=ms * 1e3,
                             graph_us=graph_ms * 1e3, err=err, gbps=gbytes / (ms / 1e3),
                             pct_peak=100 * gbytes / (ms / 1e3) / PEAK_GBS))


def cos_sin_zero_rotation() -> torch.Tensor:
    """A RoPE table whose position 0 is the identity (cos 1, sin 0), so that the fused decode
    path's output can be checked against the same reference as the plain one."""
    return torch.cat([torch.ones(1, D // 2), torch.zeros(1, D // 2)], dim=-1).to(DEV)


def bench_prefill(rows: list[dict], shapes=PREFILL_SHAPES, label: str = "",
                  tile_tokens: int | None = None) -> None:
    for nseq, length in shapes:
        k_cache, v_cache, tables, lens = paged_pool([length] * nseq)
        q = torch.randn(nseq * length, HQ, D, dtype=DTYPE, device=DEV)
        out = torch.empty_like(q)
        cu = torch.arange(nseq + 1, device=DEV, dtype=torch.int32) * length
        m = tile_tokens or prefill_tile_tokens(length, HQ // HKV)
        tile_map = torch.from_numpy(prefill_tile_map([length] * nseq, [length] * nseq, m)).to(DEV)

        def run() -> torch.Tensor:
            return pre.packed_prefill_attention(q, k_cache, v_cache, cu, lens, tables, tile_map,
                                                m, SCALE, out)
        # SDPA as the engine calls it (KV heads repeated up front), and varlen FlashAttention-2
        # on the packed projections with grouped heads as they are.
        q4 = q.view(nseq, length, HQ, D).transpose(1, 2)
        k4, v4 = (gather_kv(c, tables, length, DTYPE).transpose(1, 2)
                  .repeat_interleave(HQ // HKV, 1) for c in (k_cache, v_cache))
        k, v = (gather_kv(c, tables, length, DTYPE).reshape(-1, HKV, D)
                for c in (k_cache, v_cache))

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE)

        def flash_varlen() -> torch.Tensor:
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, length, length, 0.0, True, False, scale=SCALE)[0]
        err = check(run(), sdpa().transpose(1, 2).reshape_as(q), 2e-2)
        check(flash_varlen(), sdpa().transpose(1, 2).reshape_as(q), 2e-2)
        ms, sdpa_ms, flash_ms = timed(run), timed(sdpa), timed(flash_varlen)
        # Replayed as a graph, as the engine's captured steps run it: at a few thousand tokens
        # an eager launch's host time is no longer small next to the kernel.
        graph_ms = do_bench_cudagraph(run, return_mode="median")
        tflop = 4 * nseq * length * (length + 1) / 2 * HQ * D / 1e12
        rows.append(dict(kernel="prefill" + label, batch=nseq, ctx=length, us=ms * 1e3,
                         graph_us=graph_ms * 1e3, err=err, tflops=tflop / (ms / 1e3),
                         graph_tflops=tflop / (graph_ms / 1e3),
                         sdpa_tflops=tflop / (sdpa_ms / 1e3),
                         flash_varlen_tflops=tflop / (flash_ms / 1e3)))


def bench_verify(rows: list[dict], num_sms: int, shapes=VERIFY_SHAPES) -> None:
    """Verification steps' attention in the prefill launch, each query in one program a KV head
    (`verify-whole`, as before it split) and split along its keys as the engine sizes it alone
    in the launch (`verify`), both as graph replays; the rate is KV bytes read."""
    max_splits = splits.max_splits_for(1, HKV, num_sms)
    for nseq, q_len, ctx in shapes:
        k_cache, v_cache, tables, lens = paged_pool([ctx] * nseq)
        q = torch.randn(nseq * q_len, HQ, D, dtype=DTYPE, device=DEV)
        cu = torch.arange(nseq + 1, device=DEV, dtype=torch.int32) * q_len
        m = prefill_tile_tokens(q_len, HQ // HKV)
        counts = split_counts([ctx - q_len + 1] * nseq, split_entries(0) + nseq, max_splits,
                              alone=True)
        ws = splits.DecodeWorkspace.allocate(nseq * q_len, HQ, D, max_splits, DEV)
        outs = {}
        for label, prompt_splits in (("verify-whole", None), ("verify", counts)):
            tile_map = torch.from_numpy(prefill_tile_map(
                [q_len] * nseq, [ctx] * nseq, m, prompt_splits=prompt_splits)).to(DEV)
            out = outs[label] = torch.empty_like(q)

            def run(tile_map=tile_map, out=out) -> torch.Tensor:
                return pre.packed_prefill_attention(q, k_cache, v_cache, cu, lens, tables,
                                                    tile_map, m, SCALE, out, ws)
            run()
            err = check(out, outs["verify-whole"], 2e-2)
            us = do_bench_cudagraph(run, return_mode="median") * 1e3
            kv_bytes = 2 * nseq * ctx * HKV * D * k_cache.element_size()
            rows.append(dict(kernel=label, batch=nseq, ctx=f"{q_len}/{ctx}",
                             max_splits=int(max(prompt_splits if prompt_splits is not None
                                                else [1])),
                             graph_us=us, gbps=kv_bytes / 1e3 / us, err=err))


def bench_elementwise(rows: list[dict]) -> None:
    cos_sin = torch.randn(16384, D, device=DEV)
    norm_w = torch.randn(HIDDEN, dtype=DTYPE, device=DEV)
    for tokens in ELEMENTWISE_TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=DEV)
        h = x.float()
        ref = norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE)
        err = check(rms_norm(x, norm_w, 1e-5), ref, 2e-2)
        rows.append(dict(kernel="rms_norm", batch=tokens, err=err,
                         **_bandwidth(lambda: rms_norm(x, norm_w, 1e-5), 2 * x.nbytes)))

        gu = torch.randn(tokens, 2 * INTER, dtype=DTYPE, device=DEV)
        ref = F.silu(gu[:, :INTER]) * gu[:, INTER:]
        err = check(silu_and_mul(gu), ref, 2e-2)
        rows.append(dict(kernel="silu_and_mul", batch=tokens, err=err,
                         **_bandwidth(lambda: silu_and_mul(gu), gu.nbytes * 3 // 2)))

        qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, dtype=DTYPE, device=DEV)
        q, k, v = (t.view(tokens, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], -1))
        k_cache, v_cache = (random_pool(tokens // BLOCK_SIZE + 1) for _ in range(2))
        pos = torch.randint(0, 16384, (tokens,), device=DEV)
        slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=DEV)[:tokens]
        cos, sin = cos_sin[pos].unsqueeze(1).chunk(2, -1)
        q1, q2 = q.float().chunk(2, -1)
        ref = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)
        rope_store_kv(q, k, v, pos, cos_sin, k_cache, v_cache, slots)
        err = check(q, ref, 2e-2)
        moved = 2 * q.nbytes + 5 * k.nbytes  # q in/out; k in/out/pool; v in/pool
        rows.append(dict(kernel="rope_store_kv", batch=tokens, err=err, **_bandwidth(
            lambda: rope_store_kv(q, k, v, pos, cos_sin, k_cache, v_cache, slots), moved)))
    for batch in (1, 32, 128):  # greedy sampling over Llama-3's vocabulary
        logits = torch.randn(batch, VOCAB, dtype=DTYPE, device=DEV)
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))
        for kernel, fn in (("argmax_rows", argmax_rows), ("torch.argmax", torch.argmax)):
            rows.append(dict(kernel=kernel, batch=batch, **_bandwidth(
                lambda fn=fn, logits=logits: fn(logits, -1) if fn is torch.argmax else fn(logits),
                logits.nbytes)))


# Qwen3-30B-A3B's sparse layer: hidden, expert channels, experts, choices a token.
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K = 2048, 768, 128, 8
MOE_TOKENS = (1, 8, 32, 128)
MOE_LAYERS = 8  # 8 layers' experts (9.7 GB in bf16) in each timed graph: none stays in L2
GEMV_SWEEP_ROWS = 64  # the sweep's 8 tokens through the GEMVs


def copy_gbps() -> float:
    """The device's copy bandwidth (bytes read + written a second) over 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / 1e9 / (timed(lambda: dst.copy_(src)) / 1e3)


class MoeLayers:
    """MOE_LAYERS sparse layers of random weights (bf16, or e4m3 experts with row scales)."""

    def __init__(self, fp8: bool):
        self.layers = []
        self.norm_weight = torch.ones(MOE_HIDDEN, dtype=DTYPE, device=DEV)
        for _ in range(MOE_LAYERS):
            gate = torch.randn(MOE_EXPERTS, MOE_HIDDEN, device=DEV).mul_(0.02).to(DTYPE)
            w13 = torch.randn(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN, device=DEV).mul_(0.02)
            w2 = torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, device=DEV).mul_(0.02)
            experts = []
            for w in (w13, w2):
                if fp8:
                    q, scale = quantize_weight(w.reshape(-1, w.shape[-1]))
                    experts += [q.reshape(w.shape), scale.reshape(w.shape[:2])]
                else:
                    experts += [w.to(DTYPE), None]
                del w
            self.layers.append((gate, *experts))
        self.expert_bytes = sum(w[0].nbytes for w in (experts[0], experts[2])) + sum(
            s[0].nbytes for s in (experts[1], experts[3]) if s is not None)

    def step(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """Every layer's RMSNorm and router over x (one kernel, as the model runs them) and its
        experts, added to the residual stream (another tensor, so the routing stays put)."""
        for gate, w13, s13, w2, s2 in self.layers:
            weights, ids, h = moe.moe_router(x, gate, MOE_TOP_K, True,
                                             norm_weight=self.norm_weight, eps=1e-6)
            moe.fused_moe(h, w13, w2, weights, ids, s13, s2, residual=residual)

    def floor_bytes(self, x: torch.Tensor) -> int:
        """Bytes a step must read: each layer's router and the experts its routing touches."""
        total = 0
        for gate, *_ in self.layers:
            ids = moe.moe_router(x, gate, MOE_TOP_K, True, norm_weight=self.norm_weight,
                                 eps=1e-6)[1]
            total += gate.nbytes + ids.unique().numel() * self.expert_bytes
        return total

    def check(self, h: torch.Tensor) -> float:
        """The first layer's experts against the torch path in fp32 on the same weights: the
        relative norm of the error (raises past 2e-2, so a wrong kernel is never timed)."""
        gate, w13, s13, w2, s2 = self.layers[0]
        weights, ids, _ = moe.moe_router(h, gate, MOE_TOP_K, True)
        w13f = w13.float() if s13 is None else w13.float() * s13[..., None]
        w2f = w2.float() if s2 is None else w2.float() * s2[..., None]
        out = moe.fused_moe(h, w13, w2, weights, ids, s13, s2).double()
        ref = fused_moe_torch(h.float(), w13f, w2f, weights, ids.long()).double()
        err = ((out - ref).norm() / ref.norm()).item()
        if not math.isfinite(err) or err > 2e-2:
            raise AssertionError(f"experts disagree with the torch path: {err:.3g}")
        return err


def moe_kernels_per_layer(layers: MoeLayers, h: torch.Tensor, residual: torch.Tensor,
                          steps: int = 5) -> dict[str, float]:
    """Each CUDA kernel's microseconds a layer, run eagerly under torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            layers.step(h, residual)
        torch.cuda.synchronize()
    return {ev.key[:48]: ev.device_time_total / (steps * MOE_LAYERS)
            for ev in prof.key_averages() if ev.device_type.name == "CUDA"}


def bench_moe(rows: list[dict], fp8: bool, label: str = "", tokens=MOE_TOKENS,
              breakdown: bool = True, layers: MoeLayers | None = None) -> MoeLayers:
    layers = layers or MoeLayers(fp8)
    gbps = copy_gbps()
    dtype = "fp8" if fp8 else "bf16"
    for t in tokens:
        h = torch.randn(t, MOE_HIDDEN, device=DEV).to(DTYPE)
        residual = torch.zeros(t, MOE_HIDDEN, dtype=DTYPE, device=DEV)
        err = layers.check(h)
        graph_us = do_bench_cudagraph(lambda: layers.step(h, residual),
                                      return_mode="median") * 1e3 / MOE_LAYERS
        floor_us = layers.floor_bytes(h) / MOE_LAYERS / (gbps * 1e3)
        rows.append(dict(kernel=f"moe layer {dtype}{label}", batch=t, graph_us=graph_us,
                         floor_us=floor_us, pct_peak=100 * floor_us / graph_us, err=err))
        if breakdown:
            for name, us in moe_kernels_per_layer(layers, h, residual).items():
                rows.append(dict(kernel=f"  {name}", batch=t, us=us))
    return layers


def sweep_moe(rows: list[dict], fp8: bool, layers: MoeLayers) -> None:
    """The expert GEMVs' tile elements and K widths at 1 and 4 tokens, the grouped GEMMs' tiles
    (each with N of 64 and more also swapped) at 32 and 128, and at 8 tokens the GEMVs against
    the grouped GEMMs (the kernels read their tile functions and GEMV_MAX_ROWS at call
    time)."""
    gemv_tiles, grouped_tiles = moe.gemv_tiles, moe.grouped_tiles
    try:
        for elements, block_k in itertools.product((4096, 8192, 16384), (128, 256, 512)):
            def tiles(k, rows_per_program, elements=elements, block_k=block_k):
                bk = min(block_k, 1 << (k - 1).bit_length())
                bn = max(1, elements // (rows_per_program * bk))
                return bn, bk, max(4, rows_per_program * bn * bk // 2048)
            moe.gemv_tiles = tiles
            bench_moe(rows, fp8, f" gemv {elements // 1024}k k{block_k}", (1, 4), False, layers)
        moe.gemv_tiles = gemv_tiles
        for gemv_rows in (GEMV_SWEEP_ROWS, moe.GEMV_MAX_ROWS):
            moe.GEMV_MAX_ROWS, max_rows = gemv_rows, moe.GEMV_MAX_ROWS
            bench_moe(rows, fp8, f" gemv up to {gemv_rows} rows", (8,), False, layers)
            moe.GEMV_MAX_ROWS = max_rows
        for m, n, k, w, s in ((16, 32, 128, 4, 4), (16, 32, 128, 4, 5), (16, 32, 256, 4, 3),
                              (16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 128, 8, 3),
                              (16, 64, 256, 4, 2), (16, 128, 64, 8, 3), (16, 128, 128, 8, 2),
                              (32, 64, 128, 4, 3), (32, 128, 64, 8, 3), (64, 64, 64, 4, 3)):
            for swapped in (False, True) if n >= 64 else (False,):
                moe.grouped_tiles = lambda rows, e4m3, t=(m, n, k, w, s, swapped): t
                label = f" m{m} n{n} k{k} w{w} s{s}{' swapped' if swapped else ''}"
                try:
                    bench_moe(rows, fp8, label, (32, 128), False, layers)
                except OutOfResources:
                    rows.append(dict(kernel=f"moe{label}: out of resources"))
    finally:
        moe.gemv_tiles, moe.grouped_tiles = gemv_tiles, grouped_tiles
def bench_wna16(rows: list[dict], label: str = "", row_counts=WNA16_ROWS) -> None:
    """Each 8B projection in 4-bit and in bf16 at WNA16_ROWS rows, with the fusions the engine
    uses at one row (norm / SwiGLU / residual add) in both; the 4-bit result is first checked
    against the bf16 path over the dequantized weight."""
    for name, n, k, fusion in WNA16_SHAPES:
        weight = torch.randn(n, k, dtype=DTYPE, device=DEV) * k ** -0.5
        packed = (*quantize_rtn(weight, 4, 128), 4)
        deq = wna16.dequantize_weight(*packed, DTYPE)
        norm_w = torch.rand(k, dtype=DTYPE, device=DEV) + 0.5
        int4_bytes = sum(t.nbytes for t in packed[:3])
        add = fusion == "residual"
        ws = SplitKWorkspace.allocate([(n, wna16.MAX_SPLITS)], DEV)  # as the runner's, shared
        for m in row_counts:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            if m == 1:
                kw = dict(norm_weight=None if add else norm_w, eps=1e-5, gated=fusion == "gated")
                res = torch.zeros(1, n // 2 if kw["gated"] else n, dtype=DTYPE, device=DEV)
                ref = gemv(x, deq, **kw)
                kw["residual"] = res if add else None
                paths = {"int4": lambda x=x, kw=kw: wna16.wna16_gemv(x, *packed, **kw),
                         "bf16": lambda x=x, kw=kw, w=weight: gemv(x, w, **kw)}
            else:
                res = torch.zeros(m, n, dtype=DTYPE, device=DEV)
                ref = F.linear(x, deq)
                r = res if add else None
                paths = {
                    "int4": lambda x=x, r=r: wna16.wna16_gemm(x, *packed, residual=r,
                                                              workspace=ws),
                    "int4 deq+cublas": lambda x=x: F.linear(
                        x, wna16.dequantize_weight(*packed, DTYPE)),
                    "bf16": lambda x=x, w=weight, r=r: F.linear(x, w) if r is None
                    else r.addmm_(x, w.t())}
            err = check(paths["int4"](), ref, 2e-2)  # the residual starts at zero
            times = {path: timed(fn) for path, fn in paths.items()}
            for path, ms in times.items():
                nbytes = weight.nbytes if path == "bf16" else int4_bytes
                rows.append(dict(kernel=f"{path} {name}{label}", batch=m, us=ms * 1e3,
                                 gbps=nbytes / 1e9 / (ms / 1e3), vs_bf16=times["bf16"] / ms,
                                 **({"err": err} if path == "int4" else {})))
        del weight, deq


def bench_wna16_fused(rows: list[dict]) -> None:
    """The 4-bit few-row kernel at the rule's tile and at 16, 32 and 64 features: for a
    projection behind a norm, with the norm's kernel before it; for gate/up, with the SwiGLU's
    kernel after it ('unfused') and with the SwiGLU inside ('fused', 16-64 features of each of
    gate and up). CUDA graphs, as a decode step replays them."""
    from liteinfer.kernels.activation import silu_and_mul
    from liteinfer.kernels.norm import rms_norm
    for model, name, n, k, fusion in WNA16_FUSED_SHAPES:
        weight = torch.randn(n, k, dtype=DTYPE, device=DEV) * k ** -0.5
        packed = (*quantize_rtn(weight, 4, math.gcd(128, k)), 4)
        norm_w = torch.rand(k, dtype=DTYPE, device=DEV) + 0.5
        gated = fusion == "gated"
        ws = SplitKWorkspace.allocate([(n, wna16.MAX_SPLITS)], DEV)
        sms = num_sms(torch.device(DEV))
        for m in WNA16_FUSED_ROWS:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)

            def unfused(tiles, x=x):
                y = wna16.wna16_gemm(rms_norm(x, norm_w, 1e-5), *packed, tiles=tiles,
                                     workspace=ws)
                return silu_and_mul(y) if gated else y

            def fused(tiles, x=x):
                return wna16.wna16_gemm(rms_norm(x, norm_w, 1e-5), *packed, gated=True,
                                        tiles=tiles, workspace=ws)
            variants = [("unfused", unfused, False)] + ([("fused", fused, True)] if gated else [])
            paths = {}
            for label, fn, fuses in variants:
                rule = wna16.wna16_tiles(m, n, k, 4, 2, sms, fuses)
                paths[f"{label} (rule n{rule.block_n} s{rule.splits})"] = (
                    lambda fn=fn, t=rule: fn(t))
                for block_n in (16, 32, 64):
                    tiles = dataclasses.replace(rule, block_n=block_n)
                    paths[f"{label} n{block_n}"] = lambda fn=fn, t=tiles: fn(t)
            ref = next(iter(paths.values()))()
            err = max(check(fn(), ref, 2e-2) for fn in paths.values())
            times = {path: do_bench_cudagraph(fn, rep=40, return_mode="median")
                     for path, fn in paths.items()}
            first = next(iter(times.values()))
            for path, ms in times.items():
                rows.append(dict(kernel=f"int4 {model} {name} {path}", batch=m, us=ms * 1e3,
                                 vs_rule=first / ms, err=err))
        del weight


def bench_invariant(rows: list[dict], num_sms: int, label: str = "",
                    row_counts=INVARIANT_ROWS) -> None:
    """The batch-invariant GEMM (kernels/invariant_gemm.py) at each INVARIANT_SHAPES projection
    and INVARIANT_ROWS rows as the mode runs it (the norm's kernel first, the SwiGLU or the
    residual add inside), against the default's path (the fused GEMV at one row, cuBLAS with
    the norm's and SwiGLU's kernels above). Each is timed as a CUDA graph that runs it over
    distinct copies of the weight, INVARIANT_STREAM_BYTES in all, as a decode step streams its
    layers: a one-row launch is shorter than its host launch, and one weight read again would
    come from L2. `graph_us` is a launch's share; `vs_default` is the default's time over the
    row's; weight bytes give the rate."""
    for model, name, n, k, fusion in INVARIANT_SHAPES:
        copies = max(1, min(16, INVARIANT_STREAM_BYTES // (n * k * DTYPE.itemsize)))
        weights = [torch.randn(n, k, dtype=DTYPE, device=DEV) * k ** -0.5
                   for _ in range(copies)]
        norm_w = torch.rand(k, dtype=DTYPE, device=DEV) + 0.5
        launch = inv.split_launch(n, k, num_sms)
        ws = SplitKWorkspace.allocate([launch] if launch else [], DEV)
        normed, gated = fusion in ("norm", "gated"), fusion == "gated"
        out_n = n // 2 if gated else n
        for m in row_counts:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            res = torch.zeros(m, out_n, dtype=DTYPE, device=DEV)
            r = res if fusion == "residual" else None
            gemv_kw = dict(norm_weight=norm_w if normed else None, eps=1e-5, gated=gated)

            def invariant(w, x=x, r=r) -> torch.Tensor:
                h = rms_norm(x, norm_w, 1e-5) if normed else x
                return inv.invariant_gemm(h, w, r, workspace=ws, gated=gated)

            def default(w, x=x, r=r, m=m) -> torch.Tensor:
                if m == 1:
                    return gemv(x, w, **({"residual": r} if r is not None else gemv_kw))
                h = rms_norm(x, norm_w, 1e-5) if normed else x
                y = F.linear(h, w) if r is None else r.addmm_(h, w.t())
                return silu_and_mul(y) if gated else y

            paths = {"invariant": invariant, "default": default}
            errs = {path: check(fn(weights[0]), default(weights[0]), 2e-2)
                    for path, fn in paths.items()
                    if r is None}  # a residual grows with each call: checked on fresh ones
            times = {path: do_bench_cudagraph(lambda fn=fn: [fn(w) for w in weights],
                                              return_mode="median") / copies
                     for path, fn in paths.items()}
            for path, ms in times.items():
                rows.append(dict(kernel=f"{path} {model} {name}{label}", batch=m,
                                 graph_us=ms * 1e3,
                                 gbps=weights[0].nbytes / 1e9 / (ms / 1e3),
                                 vs_default=times["default"] / ms,
                                 **({"err": errs[path]} if path in errs else {})))


def _bandwidth(fn: Callable[[], object], nbytes: int) -> dict:
    ms = timed(fn)
    return dict(us=ms * 1e3, gbps=nbytes / 1e9 / (ms / 1e3))


def sweep(rows: list[dict], num_sms: int, parts: list[str], decode_shapes=None) -> None:
    """Alternative tile configurations (the kernels read their config functions at call time)."""
    decode_tiles, prefill_tiles = dec.decode_tiles, pre.prefill_tiles
    gemv_tile = wna16.GEMV_TILE
    invariant_tile = (inv.BLOCK_K, inv.NUM_STAGES, inv.SWAPPED_STAGES, inv.MIN_K_PER_SPLIT)
    wide_block_m = inv.WIDE_BLOCK_M
    fewrow_tile = (wna16.FEWROW_BLOCK_N, wna16.FEWROW_BLOCK_K_BYTES, wna16.SPLIT_MAX_WAVES)
    try:
        if "invariant" in parts:
            # (the serial kernel's K a step and stages, the swapped kernel's stages, fewest K a
            # split): each one setting for every row count, so rows still agree
            for tile in ((128, 3, 4, 512), (64, 4, 3, 512), (64, 3, 5, 512), (64, 3, 4, 1024),
                         (64, 3, 4, 256), (128, 4, 6, 512)):
                inv.BLOCK_K, inv.NUM_STAGES, inv.SWAPPED_STAGES, inv.MIN_K_PER_SPLIT = tile
                try:
                    bench_invariant(rows, num_sms, " k{} s{} ss{} min{}".format(*tile),
                                    row_counts=(1, 128))
                except OutOfResources:  # deep pipelines of wide tiles: more shared memory
                    rows.append(dict(kernel=f"invariant {tile}: out of resources"))
            inv.BLOCK_K, inv.NUM_STAGES, inv.SWAPPED_STAGES, inv.MIN_K_PER_SPLIT = invariant_tile
            inv.WIDE_BLOCK_M = inv.BLOCK_M  # serial launches in 64-row tiles, as before item 134
            bench_invariant(rows, num_sms, " narrow serial", row_counts=(128, 2048))
            inv.WIDE_BLOCK_M = wide_block_m
        if "wna16" in parts:
            # More bytes in flight an SM: more programs (fewer rows each), longer steps, deeper
            # pipelines (1: none) (NOTES.md, "4-bit weights").
            changes = ({}, {"rows": 16}, {"min_programs_per_sm": 3}, {"min_programs_per_sm": 6},
                       {"codes": 32768, "num_warps": 8})
            for change, stages in itertools.product(changes, (1, 2, 3, 4)):
                tile = wna16.GemvTile(**change, num_stages=stages)
                wna16.GEMV_TILE = tile
                label = (f" gemv r{tile.rows} c{tile.codes} w{tile.num_warps} "
                         f"p{tile.min_programs_per_sm} s{stages}")
                bench_wna16(rows, label, row_counts=(1,))
            wna16.GEMV_TILE = gemv_tile
            # (features, bytes a row a step, programs an SM that K is cut towards)
            for tile in ((64, 128, 8), (32, 128, 4), (64, 64, 4), (64, 256, 4), (128, 64, 4)):
                (wna16.FEWROW_BLOCK_N, wna16.FEWROW_BLOCK_K_BYTES,
                 wna16.SPLIT_MAX_WAVES) = tile
                label = f" n{tile[0]} kb{tile[1]} w{tile[2]}"
                try:
                    bench_wna16(rows, label, row_counts=(8, 32, 128))
                except OutOfResources:  # wide tiles: more shared memory than an SM has
                    rows.append(dict(kernel=f"int4{label}: out of resources"))
        if "decode" in parts:
            shapes = decode_shapes or [(1, 15488), (32, 3712)]
            for n, w, s in itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4)):
                dec.decode_tiles = lambda *_, n=n, w=w, s=s: dec.DecodeTiles(n, w, s)
                try:
                    bench_decode(rows, num_sms, shapes, f" n{n} w{w} s{s}",
                                 engine_only=decode_shapes is not None)
                except OutOfResources:  # wide tiles of wide heads: more shared memory than an SM
                    rows.append(dict(kernel=f"decode+newkv n{n} w{w} s{s}: out of resources"))
            dec.decode_tiles = decode_tiles
            bench_decode(rows, num_sms, decode_shapes or [(1, 384), (1, 15488)], " 4 waves",
                         waves=4, engine_only=decode_shapes is not None)
        if "prefill" not in parts:
            return
        for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)):
            pre.prefill_tiles = lambda *_, m=m, n=n, w=w, s=s: PrefillTiles(m, n, w, s)
            bench_prefill(rows, [(1, 15360), (8, 2048), (1, 2048), (2, 1024)],
                          f" m{m} n{n} w{w} s{s}", tile_tokens=m // (HQ // HKV))
    finally:
        dec.decode_tiles, pre.prefill_tiles = decode_tiles, prefill_tiles
        wna16.GEMV_TILE = gemv_tile
        wna16.FEWROW_BLOCK_N, wna16.FEWROW_BLOCK_K_BYTES, wna16.SPLIT_MAX_WAVES = fewrow_tile
        inv.BLOCK_K, inv.NUM_STAGES, inv.SWAPPED_STAGES, inv.MIN_K_PER_SPLIT = invariant_tile
        inv.WIDE_BLOCK_M = wide_block_m


def print_table(rows: list[dict]) -> None:
    cols = ["kernel", "batch", "ctx", "max_splits", "us", "graph_us", "floor_us", "gbps",
            "pct_peak", "vs_bf16", "vs_default", "vs_rule",
            "tflops", "graph_tflops", "sdpa_tflops", "flash_varlen_tflops", "err"]
    cols = [c for c in cols if any(c in r for r in rows)]
    fmt = {float: "{:.3g}", int: "{}", str: "{}"}
    cells = [[fmt[type(r[c])].format(r[c]) if c in r else "" for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    parser.add_argument("--pool", choices=POOL_LAYOUTS, default=POOL_LAYOUTS[0],
                        help="memory order of the KV pool the attention kernels read")
    parser.add_argument("--only", nargs="+",
                        choices=("decode", "prefill", "verify", "elementwise", "moe", "wna16",
                                 "wna16-fused", "invariant"),
                        help="time only these kernels (default: all)")
    parser.add_argument("--head-dim", type=int, default=64, help="attention head size")
    parser.add_argument("--decode-shapes", nargs="+", metavar="BATCHxCTX",
                        help="decode shapes to time (and sweep) instead of the defaults")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                        help="element type of the KV pool")
    parser.add_argument("--moe-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="element type of the experts in the moe part")
    args = parser.parse_args()
    global pool_layout, kv_dtype, D, SCALE
    pool_layout, kv_dtype = args.pool, KV_DTYPES[args.kv_dtype]
    D, SCALE = args.head_dim, 1 / math.sqrt(args.head_dim)
    decode_shapes = args.decode_shapes and [tuple(int(v) for v in shape.split("x"))
                                            for shape in args.decode_shapes]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    start = time.time()
    rows: list[dict] = []
    parts = {"decode": lambda: bench_decode(rows, props.multi_processor_count,
                                            decode_shapes or DECODE_SHAPES),
             "prefill": lambda: bench_prefill(rows),
             "verify": lambda: bench_verify(rows, props.multi_processor_count),
             "elementwise": lambda: bench_elementwise(rows),
             "moe": lambda: moe_layers.append(bench_moe(rows, fp8)),
             "wna16": lambda: bench_wna16(rows),
             "wna16-fused": lambda: bench_wna16_fused(rows),
             "invariant": lambda: bench_invariant(rows, props.multi_processor_count)}
    fp8, moe_layers = args.moe_dtype == "fp8", []
    for name in args.only or parts:
        parts[name]()
    if args.sweep and moe_layers:
        sweep_moe(rows, fp8, moe_layers[0])
    if args.sweep:
        sweep(rows, props.multi_processor_count, args.only or list(parts), decode_shapes)
    print_table(rows)
    print(f"# {props.name}, {props.multi_processor_count} SMs, {pool_layout} {args.kv_dtype} "
          f"pool, D={D}, {time.time() - start:.0f} s")
    if os.environ.get("OUT"):
        name = f"kernels-{pool_layout}-{args.kv_dtype}-d{D}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(dict(device=props.name, pool=pool_layout, kv_dtype=args.kv_dtype,
                           head_dim=D, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
