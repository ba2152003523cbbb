"""Weight-only integer linear layers (W4A16 / W8A16) over the packed layout of
layers/quantization/wna16.py: codes int32 [N, K * bits / 32], fp32 scales and mins per group.

A decode step is bound by reading the weight, a quarter (4-bit) of bf16's bytes here, so the
kernels stream the packed words and dequantize them in registers, q * scale - min in fp32. At
copy bandwidth an SM takes in codes nearly as fast as its lanes issue instructions (NOTES.md,
"4-bit weights"), so the instructions a code costs decide whether a kernel keeps up. A code
masked in place in its word is already the bits of the fp32 denormal q 2^a 2^-149 (a its place
in the word's half), so one AND makes it a float, exactly, with no integer-to-float conversion
(a fraction of the fp32 rate) and no offset to subtract (`_code_float`). Three paths, by the
rows of a step:

- one row, `wna16_gemv`: kernels/gemv.py's chunked GEMV over the packed rows. Each program owns
  BLOCK_N output features and walks their rows in chunks, a chunk's words loaded as it comes
  to them (pipelined, the loop measured slower: `GemvTile.num_stages`). A code's own work is
  two instructions: the AND, and one FMA with its input (scaled by 2^(149 - a) once a step)
  into its word's sum; the words' sums add up by group, and scales and mins apply once
  a group (`_gemv_step`). The RMSNorm before a projection, the SwiGLU after gate/up and
  the residual add of an output projection are fused in as there, and under PDL the start of
  the program's rows is put in flight into L2 before the wait.
- 2 to FEWROW_MAX rows, `wna16_gemm`: kernels/fewrow_gemm.py's few-row GEMM, swapped as its
  wide kernel is (y^T = W x^T). Each program dequantizes a [BLOCK_N, BLOCK_K] weight tile to
  the activation dtype (the AND and one FMA a code, the tile times 2^-64 undone on the
  accumulator; `_dequantized`), the MMA's row operand, and multiplies it with the rows' tile
  on the tensor cores (tl.dot, fp32 accumulation). A 4-bit tile holds a quarter of a bf16
  tile's bytes, so projections are cut along K too (`wna16_tiles`) until every SM has several
  programs streaming; the last split of a tile to arrive sums the partials
  (fewrow_gemm.split_total). A small model's projections (SmolLM2's 576 to 3,072 features)
  would leave most SMs idle in 64-feature tiles: they take narrower ones, and their gate/up
  takes the SwiGLU as its epilogue (gate's and up's tiles side by side in a program,
  `fuses_swiglu`), a launch fewer where every launch is latency. (Fused, the RMSNorm before a
  projection cost more than its own kernel at every shape measured, and the SwiGLU of a wide
  gate/up broke even at best: NOTES.md, "Speculative decoding".)
- wider steps (prefill) are compute-bound: the weight is dequantized into a scratch tensor in
  the activation dtype (`dequantize_weight`) and multiplied by cuBLAS, whose tiles no
  dequantizing kernel of ours beats there.

Every kernel multiplies in the activation dtype (fp32 and fp16 too: the CPU tests run the
tensor-core path under the interpreter in those, whose bf16 tl.dot is wrong).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liteinfer.kernels import dot_precision, num_sms, supports_pdl
from liteinfer.kernels.fewrow_gemm import scale_add_store, split_arrive, split_total
from liteinfer.kernels.gemm_splits import FEWROW_MAX_ROWS, SplitKWorkspace, split_buffers
from liteinfer.kernels.gemv import gemv_prologue, normalize, store_outputs, swiglu
from liteinfer.kernels.prefetch import prefetch_lines

# Rows up to which a step runs the in-register kernels; wider steps dequantize and call cuBLAS.
FEWROW_MAX = FEWROW_MAX_ROWS


@dataclass(frozen=True)
class GemvTile:
    """The one-row kernel's tile: `rows` features a program owns (halved while the projection
    would give fewer than `min_programs_per_sm` programs an SM), `codes` a loop step multiplies
    over all its rows (gate's and up's together), and the steps whose packed words are in
    flight at once (`num_stages`: above 1 the loop is pipelined through shared memory by
    cp.async; at 1 each step loads its words when it reaches them).
    8 rows x 2048 4-bit codes are 8 KiB a step, 128 codes a thread in under 100 registers; as
    many bytes a step as 16 x 1024 from twice the programs, and the 8B's captured one-request
    step 0.85x as long (3.22 -> 2.72 ms on an H100). Pipelined 2-4 deep the same step took
    1-3% longer (2.76 ms at 3 against 2.70 unpipelined, one H100; `scripts/profile_decode.py
    --tiles`): the GEMV is not short of bytes in flight."""

    rows: int = 8
    codes: int = 16384
    num_warps: int = 4
    num_stages: int = 1
    min_programs_per_sm: int = 1


GEMV_TILE = GemvTile()

# The few-row kernel's tile: BLOCK_N features by FEWROW_BLOCK_K_BYTES of packed words a row
# (256 4-bit codes) a step, fewer where the rows' tile would pass X_TILE_BYTES (it is pipelined
# in shared memory beside the weight's). K is cut among up to MAX_SPLITS programs a tile while
# the grid stays within SPLIT_MAX_WAVES programs an SM and each keeps SPLIT_MIN_K codes.
FEWROW_BLOCK_N = 64
# A projection whose grid (its tiles, each cut into its K splits) has fewer programs than this
# takes narrower tiles, down to tl.dot's 16 features: SmolLM2's 576 to 1,536 features would
# otherwise run on 9 to 24 SMs, each program walking four times the codes that the one-row
# GEMV's do. (Every projection of the 1B and the 8B has this many at 64 features.)
FEWROW_MIN_PROGRAMS = 64
FEWROW_BLOCK_K_BYTES = 128
X_TILE_BYTES = 32768
# Rows up to which a program has four warps (more codes a thread, so fewer instructions a code
# for the tile's layout changes), eight above (the MMA's share grows with the rows).
FOUR_WARPS_MAX_ROWS = 32
MAX_SPLITS = 8
# The GEMV's products carry 2^-PRODUCT_POWER: its inputs times 2^(149 - a) (what undoes a code's
# denormal exponent) would pass fp32's range, and x 2^(85 - a) stays within it below 2^42. The
# FMAs keep denormals (Triton emits no .ftz), which the exactness test checks on the GPU.
PRODUCT_POWER: tl.constexpr = tl.constexpr(64)
PRODUCT_SCALE: tl.constexpr = tl.constexpr(2.0 ** 64)
SPLIT_MAX_WAVES = 4
SPLIT_MIN_K = 1024


@dataclass(frozen=True)
class WNA16Tiles:
    """A few-row launch: rows padded to block_m (tl.dot's 16 at least), block_n features and
    block_k codes a tile, K cut among `splits` programs a tile."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 8
    num_stages: int = 3


def wna16_tiles(rows: int, n: int, k: int, bits: int, itemsize: int, sms: int,
                gated: bool = False) -> WNA16Tiles:
    """The few-row tile for `rows` rows (of `itemsize` bytes an element) of a projection [n, k]
    of `bits`-bit codes on a GPU of `sms` SMs: the widest tile (64 features, halved down to 16)
    whose grid has FEWROW_MIN_PROGRAMS programs, each tile cut along K into the most splits (a
    power of two) that keep the grid and each split's K within their bounds. Gated ([gate; up]
    = n rows, SwiGLU'd), a tile is that many features of each."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = min(FEWROW_BLOCK_K_BYTES * 8 // bits, X_TILE_BYTES // (block_m * itemsize),
                  triton.next_power_of_2(k))
    features = n // 2 if gated else n
    block_n = FEWROW_BLOCK_N
    while True:
        tiles = triton.cdiv(features, block_n)
        splits = 1
        while (splits < MAX_SPLITS and tiles * splits * 2 <= SPLIT_MAX_WAVES * sms
               and k // (splits * 2) >= SPLIT_MIN_K):
            splits *= 2
        if block_n == 16 or tiles * splits >= FEWROW_MIN_PROGRAMS:
            break
        block_n //= 2
    return WNA16Tiles(block_m=block_m, block_n=block_n, block_k=block_k, splits=splits,
                      num_warps=4 if block_m <= FOUR_WARPS_MAX_ROWS else 8)


@functools.cache  # asked at every eager few-row launch of a gate/up
def fuses_swiglu(n: int, k: int, bits: int, sms: int) -> bool:
    """Whether a gate/up projection [n, k] ([gate; up]) runs its few-row launches with the
    SwiGLU inside: where its unfused launch would take narrower tiles than FEWROW_BLOCK_N
    (latency-bound, one launch fewer pays; measured where wider ones break even at best)."""
    return wna16_tiles(2, n, k, bits, 2, sms).block_n < FEWROW_BLOCK_N


@triton.jit
def _half_scales(BITS: tl.constexpr, LENGTH: tl.constexpr, POWER: tl.constexpr):
    """2^(POWER - BITS * (i % HALF)) for i < LENGTH: what undoes `_code_float`'s power of two
    of code i of a word, times 2^POWER (exact: built from its exponent bits)."""
    HALF: tl.constexpr = 16 // BITS
    exponent = 127 + POWER - (tl.arange(0, LENGTH) % HALF) * BITS
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_params(s_ptr, m_ptr, offs_n, n_mask, k0, K, GROUP: tl.constexpr,
                  GROUPS: tl.constexpr):
    """Scales and mins [BLOCK_N, GROUPS] of the groups from column k0 on (0 past N and K)."""
    groups = K // GROUP
    offs_g = k0 // GROUP + tl.arange(0, GROUPS)
    g = offs_n[:, None] * groups + offs_g[None, :]
    g_mask = n_mask[:, None] & (offs_g < groups)[None, :]
    return (tl.load(s_ptr + g, mask=g_mask, other=0.0),
            tl.load(m_ptr + g, mask=g_mask, other=0.0))


@triton.jit
def _packed_words(qw_ptr, offs_n, n_mask, k0, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed words [BLOCK_N, BLOCK_K * BITS / 32] of weight rows offs_n from column k0 on
    (0 past N and K)."""
    PER: tl.constexpr = 32 // BITS
    # K is whole groups, each whole words: telling Triton lets it load several words at once.
    ALIGN: tl.constexpr = (GROUP & -GROUP) // PER
    words = tl.multiple_of(K // PER, ALIGN)
    offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
    return tl.load(qw_ptr + offs_n.to(tl.int64)[:, None] * words + offs_w[None, :],
                   mask=n_mask[:, None] & (offs_w < words)[None, :], other=0)


@triton.jit
def _code_float(packed, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of each packed word as the fp32 denormal q 2^a 2^-149, a = BITS * (J % HALF) and
    HALF the codes of 16 bits: the code masked in place is that float's bits, so a code costs
    one AND (the upper half's shift is one a word), exactly, with no conversion or offset."""
    HALF: tl.constexpr = 16 // BITS
    mask: tl.constexpr = ((1 << BITS) - 1) << (BITS * (J % HALF))
    word = packed
    if J >= HALF:
        word = packed >> 16
    return (word & mask).to(tl.float32, bitcast=True)


@triton.jit
def _dequantized_codes(packed, scale, low, J: tl.constexpr, STRIDE: tl.constexpr,
                       BITS: tl.constexpr, GROUPS: tl.constexpr, POWER: tl.constexpr):
    """Codes J, J + STRIDE, ... of each packed word [BLOCK_N, WORDS] dequantized with their
    groups' scale and low [BLOCK_N, GROUPS], times 2^-POWER, as fp32 [BLOCK_N, WORDS * PER /
    STRIDE] in the order of K, the codes of a word interleaved in registers. At POWER 64 a code
    is an AND and one FMA, q 2^(a - 149) (scale 2^(85 - a)) - min 2^-64; at 0, where 2^(149 - a)
    would leave no room for the scale, an exact multiplication by 2^126 first makes the denormal
    the normal q 2^(a - 23)."""
    PER: tl.constexpr = 32 // BITS
    if STRIDE == PER:
        HALF: tl.constexpr = PER // 2
        BLOCK_N: tl.constexpr = packed.shape[0]
        WORDS: tl.constexpr = packed.shape[1]
        NORMAL: tl.constexpr = 126 if POWER == 0 else 0
        q = _code_float(packed, J, BITS)
        if NORMAL != 0:
            q = q * 2.0 ** NORMAL
        code_scale = scale * 2.0 ** (149 - NORMAL - POWER - BITS * (J % HALF))
        w = (tl.reshape(q, (BLOCK_N, GROUPS, WORDS // GROUPS)) * code_scale[:, :, None]
             - (low * 2.0 ** -POWER)[:, :, None])
        return tl.reshape(w, (BLOCK_N, WORDS))
    else:
        return tl.interleave(
            _dequantized_codes(packed, scale, low, J, 2 * STRIDE, BITS, GROUPS, POWER),
            _dequantized_codes(packed, scale, low, J + STRIDE, 2 * STRIDE, BITS, GROUPS, POWER))


@triton.jit
def _dequantized(qw_ptr, s_ptr, m_ptr, offs_n, n_mask, k0, K, BITS: tl.constexpr,
                 GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, POWER: tl.constexpr):
    """Weight rows offs_n, columns k0..k0 + BLOCK_K, times 2^-POWER (0 or 64), as fp32
    [BLOCK_N, BLOCK_K] (0 past N and K), the tile's groups GROUP_TILE columns each."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP_TILE
    packed = _packed_words(qw_ptr, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_N, BLOCK_K)
    scale, low = _group_params(s_ptr, m_ptr, offs_n, n_mask, k0, K, GROUP, GROUPS)
    return _dequantized_codes(packed, scale, low, 0, 1, BITS, GROUPS, POWER)


@triton.jit
def _column(t, J: tl.constexpr, WIDTH: tl.constexpr):
    """Column J of t [rows, WIDTH] (a power of two), split off in halves."""
    if WIDTH == 1:
        return tl.reshape(t, (t.shape[0],))
    else:
        even, odd = tl.split(tl.reshape(t, (t.shape[0], WIDTH // 2, 2)))
        if J % 2 == 1:
            even = odd
        return _column(even, J // 2, WIDTH // 2)


@triton.jit
def _group_dot(sums, s_ptr, m_ptr, offs_n, n_mask, k0, K, x_sums, GROUP: tl.constexpr,
               GROUPS: tl.constexpr):
    """The words' sums of q x 2^-PRODUCT_POWER [BLOCK_N, WORDS] as sum w x by group [BLOCK_N,
    GROUPS]: scaled once a group, the min times the group's sum of x."""
    scale, low = _group_params(s_ptr, m_ptr, offs_n, n_mask, k0, K, GROUP, GROUPS)
    group_sums = tl.sum(tl.reshape(sums, (sums.shape[0], GROUPS, sums.shape[1] // GROUPS)), 2)
    return group_sums * (scale * PRODUCT_SCALE) - low * x_sums[None, :]


@triton.jit
def _step_words(qw_ptr, up_w, offs_n, n_mask, k0, K, BITS: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GATED: tl.constexpr):
    """A GEMV step's packed words from column k0 on: gate's (or the projection's), and up's
    (`up_w` words on) when GATED, else the same again."""
    packed = _packed_words(qw_ptr, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_N, BLOCK_K)
    packed_up = packed
    if GATED:
        packed_up = _packed_words(qw_ptr + up_w, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_N,
                                  BLOCK_K)
    return packed, packed_up


@triton.jit
def _gemv_step(packed, packed_up, s_ptr, m_ptr, offs_n, n_mask, k0, K, x_ptr, norm_ptr,
               inv_rms, up_g, BITS: tl.constexpr, GROUP: tl.constexpr,
               GROUP_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NORM: tl.constexpr, GATED: tl.constexpr):
    """sum over k in k0..k0 + BLOCK_K of w[n, k] x[k] for the rows offs_n (gate's and up's
    when GATED), their packed words given (`_step_words`), by group of the tile (GROUP_TILE
    columns each): [BLOCK_N, BLOCK_K // GROUP_TILE] fp32 each. Code j of a word is the
    denormal q 2^a 2^-149 and multiplies x 2^(149 - a - PRODUCT_POWER) of the word's column j,
    one FMA a code into the word's sum; the words' sums add up by group, a group is scaled
    once, and its min multiplies the group's sum of x instead of every code."""
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    GROUPS: tl.constexpr = BLOCK_K // GROUP_TILE
    # x as [WORDS, PER]: a thread loads its words' inputs whole and takes column j in registers
    k = tl.arange(0, WORDS)[:, None] * PER + tl.arange(0, PER)[None, :]
    k_mask = k0 + k < K
    xf = tl.load(x_ptr + k0 + k, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        xf = normalize(xf, norm_ptr + k0, k, k_mask, inv_rms, x_ptr.dtype.element_ty)
    x_sums = tl.sum(tl.reshape(xf, (GROUPS, GROUP_TILE)), 1)
    x_in_place = xf * _half_scales(BITS, PER, 149 - PRODUCT_POWER)[None, :]
    sums = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    sums_up = sums
    for j in tl.static_range(PER):
        x_j = _column(x_in_place, j, PER)[None, :]
        sums = tl.fma(_code_float(packed, j, BITS), x_j, sums)
        if GATED:
            sums_up = tl.fma(_code_float(packed_up, j, BITS), x_j, sums_up)
    y = _group_dot(sums, s_ptr, m_ptr, offs_n, n_mask, k0, K, x_sums, GROUP, GROUPS)
    y_up = y
    if GATED:
        y_up = _group_dot(sums_up, s_ptr + up_g, m_ptr + up_g, offs_n, n_mask, k0, K, x_sums,
                          GROUP, GROUPS)
    return y, y_up


@triton.jit
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, out_ptr, norm_ptr, eps, N, K,
                       BITS: tl.constexpr, GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                       ADD: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr,
                       PREFETCH_LINES: tl.constexpr, NUM_STAGES: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_K // GROUP_TILE
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs < N
    words = K // (32 // BITS)
    # gate's rows, then up's: up's words, scales and mins start N rows on
    up_w = N * words
    up_g = N * (K // GROUP)
    inv_rms = gemv_prologue(qw_ptr, up_w, offs, N, words, words, x_ptr, K, eps, USE_PDL,
                            PREFETCH_LINES, GATED, NORM, BLOCK_K)
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    acc_up = acc
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        packed, packed_up = _step_words(qw_ptr, up_w, offs, n_mask, k0, K, BITS, GROUP,
                                        BLOCK_N, BLOCK_K, GATED)
        y, y_up = _gemv_step(packed, packed_up, s_ptr, m_ptr, offs, n_mask, k0, K, x_ptr,
                             norm_ptr, inv_rms, up_g, BITS, GROUP, GROUP_TILE, BLOCK_N,
                             BLOCK_K, NORM, GATED)
        acc += y
        acc_up += y_up
    y = tl.sum(acc, 1)
    res = y
    if ADD:
        res = tl.load(out_ptr + offs, mask=n_mask).to(tl.float32)
    store_outputs(y, tl.sum(acc_up, 1), y, y, res, out_ptr, offs, n_mask, GATED, ADD, False)


@triton.jit
def _wna16_fewrow_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                         stride_xm, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLITS: tl.constexpr, PART_ROWS: tl.constexpr, ADD: tl.constexpr,
                         GATED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         USE_PDL: tl.constexpr):
    # The splits of a tile are launch neighbours, so their partials meet in L2.
    tile = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    chunks = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS)
    k_start = split * chunks * BLOCK_K
    k_end = tl.minimum(K, k_start + chunks * BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # gate's rows, then up's: up's words, scales and mins start N rows on
    up_w = N * (K // (32 // BITS))
    up_g = N * (K // GROUP)
    if USE_PDL:  # the rows may be the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    # The tile is dequantized times 2^-64 (a code's AND and one FMA, `_dequantized_codes`)
    # where the activation dtype has fp32's exponent range; fp16's would underflow.
    POWER: tl.constexpr = 0 if dtype == tl.float16 else 64
    # y^T = W x^T: the dequantized tile is the MMA's row operand, taken from registers
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = acc
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_rows + k0 + offs_k[None, :],
                    mask=m_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        w = _dequantized(qw_ptr, s_ptr, m_ptr, offs_n, n_mask, k0, K, BITS, GROUP, GROUP_TILE,
                         BLOCK_N, BLOCK_K, POWER)
        acc = tl.dot(w.to(dtype), tl.trans(x), acc, input_precision=DOT_PRECISION)
        if GATED:
            w = _dequantized(qw_ptr + up_w, s_ptr + up_g, m_ptr + up_g, offs_n, n_mask, k0, K,
                             BITS, GROUP, GROUP_TILE, BLOCK_N, BLOCK_K, POWER)
            acc_up = tl.dot(w.to(dtype), tl.trans(x), acc_up, input_precision=DOT_PRECISION)
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS > 1:
        # Each split's partials (gate's, then up's N features on) in the slots of 2N features
        # when gated; the last of the tile's splits to arrive sums them in split order.
        parts = part_ptr + offs_n[:, None] * PART_ROWS + offs_m[None, :]
        split_stride = N * PART_ROWS * (1 + GATED)
        tl.store(parts + split * split_stride, acc, mask=mask)
        if GATED:
            tl.store(parts + N * PART_ROWS + split * split_stride, acc_up, mask=mask)
        if not split_arrive(count_ptr + tile, SPLITS):
            return
        acc = split_total(parts, mask, split_stride, SPLITS)
        if GATED:
            acc_up = split_total(parts + N * PART_ROWS, mask, split_stride, SPLITS)
    acc = acc * 2.0 ** POWER
    if GATED:
        acc = swiglu(acc, acc_up * 2.0 ** POWER, dtype)
    scale_add_store(acc, out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], mask, None,
                    None, False, ADD)


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, m_ptr, w_ptr, N, K, BITS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    w = _dequantized(qw_ptr, s_ptr, m_ptr, offs_n, n_mask, k0, K, BITS, GROUP, GROUP_TILE,
                     BLOCK_N, BLOCK_K, 0)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


def _fit_group(qweight: torch.Tensor, scales: torch.Tensor, bits: int,
               block_k: int) -> tuple[int, int]:
    """(block_k, the group size): whole groups in a tile (a power of two, as every format's
    small groups are), or whole tiles in a group, block_k shrunk to a power of two that divides
    it (a per-channel group of an odd-sized row)."""
    assert bits in (2, 4, 8) and qweight.dtype == torch.int32
    k = qweight.shape[1] * (32 // bits)
    group = k // scales.shape[1]
    assert group * scales.shape[1] == k and group % (32 // bits) == 0
    if group >= block_k:
        return min(block_k, group & -group), group
    assert group & (group - 1) == 0, f"group size {group} with {block_k}-code tiles"
    return block_k, group


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/gemv.py's `gemv` over a packed weight: x [1, K]; the weight [N, K], or [2N, K] =
    [gate; up] when gated. Returns f(x) W^T [1, N] in x's dtype, f the RMSNorm with norm_weight
    and eps when given, or with residual ([1, N]) adds it to residual in place and returns it."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1
    k = x.shape[1]
    tile = GEMV_TILE
    assert qweight.shape[1] * (32 // bits) == k and qweight.is_contiguous()
    n = qweight.shape[0] // 2 if gated else qweight.shape[0]
    rows = tile.rows
    while rows > 1 and triton.cdiv(n, rows) < tile.min_programs_per_sm * num_sms(x.device):
        rows //= 2
    block_k, group = _fit_group(qweight, scales, bits, min(tile.codes // (rows * (1 + gated)),
                                                           triton.next_power_of_2(k)))
    if residual is not None:
        assert residual.shape == (1, n) and residual.dtype == x.dtype
    out = residual if residual is not None else x.new_empty(1, n)
    pdl = supports_pdl(x.device)
    lines = prefetch_lines(qweight.shape[0], qweight.shape[1] * 4, x.device) if pdl else 0
    _wna16_gemv_kernel[(triton.cdiv(n, rows),)](
        x, qweight, scales, mins, out, norm_weight if norm_weight is not None else x, eps, n, k,
        BITS=bits, GROUP=group, GROUP_TILE=min(group, block_k), BLOCK_N=rows, BLOCK_K=block_k,
        NORM=norm_weight is not None,
        ADD=residual is not None, GATED=gated, USE_PDL=pdl, PREFETCH_LINES=lines,
        NUM_STAGES=tile.num_stages, num_warps=tile.num_warps, num_stages=tile.num_stages,
        launch_pdl=pdl)
    return out


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, residual: torch.Tensor | None = None, *, gated: bool = False,
               tiles: WNA16Tiles | None = None,
               workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x [M, K] (M <= FEWROW_MAX) times the packed weight [N, K], transposed: [M, N] in x's
    dtype, or residual += it in place (returning residual); for a weight [2N, K] = [gate; up]
    SwiGLU'd to [M, N] when gated. `tiles`: by default `wna16_tiles`'s; `workspace`: where a
    tile cut along K sums its splits (fewrow_gemm.split_buffers)."""
    m, k = x.shape
    rows = qweight.shape[0]
    n = rows // 2 if gated else rows
    assert 1 <= m <= FEWROW_MAX and x.stride(-1) == 1 and qweight.is_contiguous()
    assert qweight.shape[1] * (32 // bits) == k and not (gated and residual is not None)
    tiles = tiles or wna16_tiles(m, rows, k, bits, x.element_size(), num_sms(x.device), gated)
    block_k, group = _fit_group(qweight, scales, bits, tiles.block_k)
    assert m <= tiles.block_m and block_k >= 16  # (tl.dot's least K)
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts, counts = (split_buffers(workspace, rows, tiles.splits, x.device) if tiles.splits > 1
                     else (out, out))
    pdl = supports_pdl(x.device)
    _wna16_fewrow_kernel[(triton.cdiv(n, tiles.block_n) * tiles.splits,)](
        x, qweight, scales, mins, out, parts, counts, m, n, k, x.stride(0), out.stride(0),
        BITS=bits, GROUP=group, GROUP_TILE=min(group, block_k), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, SPLITS=tiles.splits, PART_ROWS=FEWROW_MAX_ROWS,
        ADD=residual is not None, GATED=gated, DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=pdl)
    return out


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight as [N, K] in dtype."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (32 // bits)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_k, group = _fit_group(qweight, scales, bits, min(128, triton.next_power_of_2(k)))
    _dequantize_kernel[(triton.cdiv(n, 16), triton.cdiv(k, block_k))](
        qweight, scales, mins, w, n, k, BITS=bits, GROUP=group, GROUP_TILE=min(group, block_k),
        BLOCK_N=16, BLOCK_K=block_k)
    return w


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, bits: int, residual: torch.Tensor | None = None,
                 workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x W^T for any number of rows (or residual += x W^T in place); `workspace` as
    `wna16_gemm` takes it."""
    if x.shape[0] <= FEWROW_MAX:
        return wna16_gemm(x, qweight, scales, mins, bits, residual, workspace=workspace)
    w = dequantize_weight(qweight, scales, mins, bits, x.dtype)
    if residual is None:
        return torch.nn.functional.linear(x, w)
    return residual.addmm_(x, w.t())
