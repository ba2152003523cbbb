"""Weight-only integer linear layers (W4A16 / W8A16) over the packed layout of
layers/quantization/wna16.py (codes int32 [N, K * bits / 32], fp32 scales and mins per group),
reordered once at load (`tile_order` there) into the tile order these kernels read.

A decode step is bound by reading the weight, a quarter (4-bit) of bf16's bytes here, so the
kernels stream the packed words and dequantize them in registers, q * scale - min in fp32. At
copy bandwidth an SM takes in codes nearly as fast as its lanes issue instructions (NOTES.md,
"4-bit weights"), so the instructions a code costs decide whether a kernel keeps up. A code
masked in place in its word is already the bits of the fp32 denormal q 2^a 2^-149 (a its place
in the word), so one AND makes it a float, exactly, with no integer-to-float conversion (a
fraction of the fp32 rate) and no offset to subtract (`_code_float`).

The tile order: a row's words in blocks of BLOCK_WORDS (16), word w of a block holding the
block's columns w + 16 j as its code j. Code j of a block's words is then 16 consecutive
columns, all at one place in their words, so a code's exponent correction is a constant and
its inputs are a contiguous slice: the GEMV's threads multiply their words' code j by
consecutive inputs they load themselves, and the few-row kernel multiplies a block's code j on
the tensor cores with K = 16, dequantized in the MMA's own register layout (no trip through
shared memory). Rows are padded to whole blocks. Three paths, by the rows of a step:

- one row, `wna16_gemv`: after kernels/gemv.py's chunked GEMV. Each program owns BLOCK_N
  output features and walks their rows in steps, each thread LANE_WORDS words of every row a
  step and the inputs of those words (`GemvTile`). A code's own work is two instructions: the
  AND, and one FMA with its input (scaled by 2^(149 - a), a constant for code j) into its
  word's sum; the sums add up by thread and group, and scales and mins apply once a group
  (`_lane_group`). The RMSNorm before a projection, the SwiGLU after gate/up and the residual
  add of an output projection are fused in as there, and under PDL the start of the program's
  rows is put in flight into L2 before the wait.
- 2 to FEWROW_MAX rows, `wna16_gemm`: kernels/fewrow_gemm.py's few-row GEMM, swapped as its
  wide kernel is (y^T = W x^T). Each program dequantizes a block's code j, [BLOCK_N, 16], to
  the activation dtype (the AND and one FMA a code, the tile times 2^-64 undone on the
  accumulator; `_block_code`), the MMA's row operand from registers, and multiplies it with
  the rows' 16 columns that code j holds (tl.dot, fp32 accumulation). A 4-bit tile holds a
  quarter of a bf16 tile's bytes, so projections are cut along K too (`wna16_tiles`) until
  every SM has several programs streaming; the last split of a tile to arrive sums the
  partials (fewrow_gemm.split_total). A small model's projections (SmolLM2's 576 to 3,072
  features) would leave most SMs idle in 64-feature tiles: they take narrower ones, and their
  gate/up takes the SwiGLU as its epilogue (gate's and up's tiles side by side in a program,
  `fuses_swiglu`), a launch fewer where every launch is latency. (Fused, the RMSNorm before a
  projection cost more than its own kernel at every shape measured, and the SwiGLU of a wide
  gate/up broke even at best: NOTES.md, "Speculative decoding".)
- wider steps (prefill) are compute-bound: the weight is dequantized into a scratch tensor in
  the activation dtype and the order of K (`dequantize_weight`) and multiplied by cuBLAS,
  whose tiles no dequantizing kernel of ours beats there.

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
from liteinfer.kernels.gemv import (
    gemv_prologue,
    masked_load,
    normalize,
    store_outputs,
    swiglu,
)
from liteinfer.kernels.prefetch import prefetch_lines

# Rows up to which a step runs the in-register kernels; wider steps dequantize and call cuBLAS.
FEWROW_MAX = FEWROW_MAX_ROWS


@dataclass(frozen=True)
class GemvTile:
    """The one-row kernel's tile: `rows` features a program owns (halved while the projection
    would give fewer than `min_programs_per_sm` programs an SM), each step's LANE_WORDS words of
    each row a thread (so a step covers LANE_WORDS x 32 x num_warps words of a row), and the
    steps whose packed words are in flight at once (`num_stages`: above 1 the loop is pipelined
    through shared memory by cp.async; at 1 each step loads its words when it reaches them).
    A thread loads the inputs of its words itself: no input crosses between threads, and the
    words' layout is their inputs' with the rows added (NOTES.md, "4-bit weights").
    8 rows x 2048 4-bit codes are 8 KiB a step (16 gated). Row-ordered words in 8-row tiles
    made the 8B's captured one-request step 0.85x as long as in 16-row ones (3.22 -> 2.72 ms
    on an H100), and pipelined 2-4 deep it took 1-3% longer (2.76 ms at 3 against 2.70
    unpipelined; `scripts/profile_decode.py --tiles`): the GEMV was not short of bytes in
    flight."""

    rows: int = 8
    num_warps: int = 2
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
MAX_SPLITS = 8
# Rows up to which a K step's products are summed apart (`WNA16Tiles.step_sums`): 73-81 -> 80-96
# registers at 8-32 rows (gate/up with its SwiGLU 119-144 -> 120-158), at 64 rows gate/up 128
# -> 234 (ptxas of Triton 3.6, journal item 167).
STEP_SUMS_MAX_ROWS = 32
# The GEMV's products carry 2^-PRODUCT_POWER: its inputs times 2^(149 - a) (what undoes a code's
# denormal exponent) would pass fp32's range, and x 2^(85 - a) stays within it below 2^42. The
# FMAs keep denormals (Triton emits no .ftz), which the exactness test checks on the GPU.
PRODUCT_POWER: tl.constexpr = tl.constexpr(64)
PRODUCT_SCALE: tl.constexpr = tl.constexpr(2.0 ** 64)
SPLIT_MAX_WAVES = 4
SPLIT_MIN_K = 1024
# The tile order (layers/quantization/wna16.py `tile_order`): a row's words in blocks of
# BLOCK_WORDS, code j of a block's words its BLOCK_WORDS consecutive columns j BLOCK_WORDS on
# (tl.dot's least K); the GEMV's threads take LANE_WORDS consecutive words of a row at once.
BLOCK_WORDS: tl.constexpr = tl.constexpr(16)
LANE_WORDS: tl.constexpr = tl.constexpr(4)


@dataclass(frozen=True)
class WNA16Tiles:
    """A few-row launch: rows padded to block_m (tl.dot's 16 at least), block_n features and
    block_k codes a tile, K cut among `splits` programs a tile."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    # One warpgroup: a second would dequantize the whole slice of a block's code j again for
    # its own rows of the MMA (NOTES.md, "4-bit weights").
    num_warps: int = 4
    num_stages: int = 3
    # Each K step's products summed from its first, then added to the total: the zero-filled
    # total alone before the loop makes ptxas wait for each wgmma before the next (its C7515
    # advisory), which costs registers to avoid (`STEP_SUMS_MAX_ROWS`).
    step_sums: bool = False


def wna16_tiles(rows: int, n: int, k: int, bits: int, itemsize: int, sms: int,
                gated: bool = False) -> WNA16Tiles:
    """The few-row tile for `rows` rows (of `itemsize` bytes an element) of a projection [n, k]
    of `bits`-bit codes on a GPU of `sms` SMs: the widest tile (64 features, halved down to 16)
    whose grid has FEWROW_MIN_PROGRAMS programs, each tile cut along K into the most splits (a
    power of two) that keep the grid and each split's K within their bounds. Gated ([gate; up]
    = n rows, SwiGLU'd), a tile is that many features of each."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = max(BLOCK_WORDS.value * 32 // bits,
                  min(FEWROW_BLOCK_K_BYTES * 8 // bits, X_TILE_BYTES // (block_m * itemsize),
                      triton.next_power_of_2(k)))
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
                      step_sums=block_m <= STEP_SUMS_MAX_ROWS)


@functools.cache  # asked at every eager few-row launch of a gate/up
def fuses_swiglu(n: int, k: int, bits: int, sms: int) -> bool:
    """Whether a gate/up projection [n, k] ([gate; up]) runs its few-row launches with the
    SwiGLU inside: where its unfused launch would take narrower tiles than FEWROW_BLOCK_N
    (latency-bound, one launch fewer pays; measured where wider ones break even at best)."""
    return wna16_tiles(2, n, k, bits, 2, sms).block_n < FEWROW_BLOCK_N


def _tile_group(qweight: torch.Tensor, scales: torch.Tensor, bits: int, k: int) -> int:
    """The group size of a weight in tile order whose rows hold k columns (before padding)."""
    per = 32 // bits
    assert bits in (2, 4, 8) and qweight.dtype == torch.int32 and qweight.is_contiguous()
    codes_per_block = BLOCK_WORDS.value * per
    k_pad = qweight.shape[1] * per
    assert k_pad == triton.cdiv(k, codes_per_block) * codes_per_block, (k, k_pad)
    group = k_pad // scales.shape[1]
    assert group * scales.shape[1] == k_pad and group % BLOCK_WORDS.value == 0
    assert group % codes_per_block == 0 or codes_per_block % group == 0
    return group


@triton.jit
def _code_float(packed, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of each packed word as the fp32 denormal q 2^a 2^-149, a its place (`_place`):
    the code masked in place is that float's bits, so a code costs one AND, exactly, with no
    conversion or offset. Codes that reach fp32's exponent bits (23 on) are read from the word
    shifted right by 16, one shift a word."""
    mask = ((1 << BITS) - 1) << _place(J, BITS)
    word = packed.to(tl.uint32, bitcast=True)  # a logical shift: an arithmetic one costs more
    if BITS * (J + 1) > 23:
        word = word >> 16
    return (word & mask).to(tl.float32, bitcast=True)


@triton.jit
def _place(J: tl.constexpr, BITS: tl.constexpr):
    """Code J's lowest bit in the word `_code_float` masks it in."""
    return BITS * J - 16 * (BITS * (J + 1) > 23)


@triton.jit
def _unplaced(POWER: tl.constexpr, J: tl.constexpr, BITS: tl.constexpr):
    """2^POWER / 2^a, a code J's place (`_place`): constant once compiled (static_range's J is
    a tensor when interpreted, hence no 2.0 ** -a)."""
    return 2.0 ** POWER / (1 << _place(J, BITS))


@triton.jit
def _block_code(packed, scale, low, J: tl.constexpr, BITS: tl.constexpr,
                POWER: tl.constexpr):
    """Code J of a block's words [BLOCK_N, BLOCK_WORDS] (its columns BLOCK_WORDS J on)
    dequantized with their rows' group scale and low [BLOCK_N], times 2^-POWER, in fp32. At
    POWER 64 a code is an AND and one FMA, q 2^(a - 149) (scale 2^(85 - a)) - min 2^-64; at 0,
    where 2^(149 - a) would leave no room for the scale, an exact multiplication by 2^126 first
    makes the denormal the normal q 2^(a - 23)."""
    NORMAL: tl.constexpr = 126 if POWER == 0 else 0
    q = _code_float(packed, J, BITS)
    if NORMAL != 0:
        q = q * 2.0 ** NORMAL
    code_scale = scale * _unplaced(149 - NORMAL - POWER, J, BITS)
    return q * code_scale[:, None] - (low * 2.0 ** -POWER)[:, None]


@triton.jit
def _block_words(qw_ptr, offs_n, n_mask, words, first, COUNT: tl.constexpr):
    """COUNT packed words of rows offs_n from word `first` of a row of `words` (n_mask None
    where the rows are whole tiles; the words are then all in the row)."""
    offs_w = first + tl.arange(0, COUNT)
    mask = None
    if n_mask is not None:
        mask = n_mask[:, None] & (offs_w < words)[None, :]
    return masked_load(qw_ptr + offs_n.to(tl.int64)[:, None] * words + offs_w[None, :], mask, 0)


@triton.jit
def _code_products(packed, x, sums, J: tl.constexpr, BITS: tl.constexpr):
    """sums [BLOCK_N, WORDS] plus code J of each packed word times its input x [WORDS], times
    2^-PRODUCT_POWER: x 2^(149 - a - PRODUCT_POWER) undoes the code's denormal exponent, so a
    code is its AND and one FMA."""
    x_j = x * _unplaced(149 - PRODUCT_POWER, J, BITS)
    return tl.fma(_code_float(packed, J, BITS), x_j[None, :], sums)


@triton.jit
def _lane_group(sums, s_ptr, m_ptr, offs_n, n_mask, groups, g, x_sums, LANES: tl.constexpr):
    """The words' sums of q x 2^-PRODUCT_POWER [BLOCK_N, WORDS] of one group of each lane
    (LANE_WORDS words of a thread) as sum w x a row and lane [BLOCK_N, LANES]: scaled once,
    the min times the lane's sum of inputs, its group g [LANES]."""
    lane_sums = tl.sum(tl.reshape(sums, (sums.shape[0], LANES, LANE_WORDS)), 2)
    mask = None
    if n_mask is not None:
        mask = n_mask[:, None] & (g < groups)[None, :]
    at = offs_n[:, None] * groups + g[None, :]
    scale = masked_load(s_ptr + at, mask, 0.0)
    low = masked_load(m_ptr + at, mask, 0.0)
    return lane_sums * (scale * PRODUCT_SCALE) - low * x_sums[None, :]


@triton.jit
def _wna16_gemv_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, out_ptr, norm_ptr, eps, N, K,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                       GATED: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
                       PREFETCH_LINES: tl.constexpr, NUM_STAGES: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    CODES_PER_BLOCK: tl.constexpr = BLOCK_WORDS * PER
    WORDS: tl.constexpr = BLOCK_K // PER
    LANES: tl.constexpr = WORDS // LANE_WORDS
    # The groups of a block (1 where a group is whole blocks), each its codes j of the words.
    BLOCK_GROUPS: tl.constexpr = CODES_PER_BLOCK // GROUP if GROUP < CODES_PER_BLOCK else 1
    GROUP_CODES: tl.constexpr = PER // BLOCK_GROUPS
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = None if EVEN else offs < N
    words = tl.cdiv(K, CODES_PER_BLOCK) * BLOCK_WORDS
    groups = words * PER // GROUP
    # gate's rows, then up's: up's words, scales and mins start N rows on
    up_w = N * words
    up_g = N * groups
    inv_rms = gemv_prologue(qw_ptr, up_w, offs, N, words, words, x_ptr, K, eps, USE_PDL,
                            PREFETCH_LINES, GATED, NORM, BLOCK_K)
    w = tl.arange(0, WORDS)
    # a word's column of code 0 in the step, and a lane's block
    w_column = (w // BLOCK_WORDS) * CODES_PER_BLOCK + w % BLOCK_WORDS
    lane_block = tl.arange(0, LANES) // (BLOCK_WORDS // LANE_WORDS)
    acc = tl.zeros([BLOCK_N, LANES], dtype=tl.float32)
    acc_up = acc
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        packed = _block_words(qw_ptr, offs, n_mask, words, k0 // PER, WORDS)
        packed_up = packed
        if GATED:
            packed_up = _block_words(qw_ptr + up_w, offs, n_mask, words, k0 // PER, WORDS)
        for gi in tl.static_range(BLOCK_GROUPS):
            sums = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
            sums_up = sums
            x_sums = tl.zeros([WORDS], dtype=tl.float32)
            for jj in tl.static_range(GROUP_CODES):
                J = gi * GROUP_CODES + jj
                # a thread's LANE_WORDS words' code j: as many consecutive inputs
                k = k0 + w_column + J * BLOCK_WORDS
                k_mask = None if EVEN else k < K
                xf = masked_load(x_ptr + k, k_mask, 0.0).to(tl.float32)
                if NORM:
                    xf = normalize(xf, norm_ptr, k, k_mask, inv_rms, x_ptr.dtype.element_ty)
                x_sums += xf
                sums = _code_products(packed, xf, sums, J, BITS)
                if GATED:
                    sums_up = _code_products(packed_up, xf, sums_up, J, BITS)
            g = (k0 + lane_block * CODES_PER_BLOCK + gi * GROUP) // GROUP
            lane_x = tl.sum(tl.reshape(x_sums, (LANES, LANE_WORDS)), 1)
            acc += _lane_group(sums, s_ptr, m_ptr, offs, n_mask, groups, g, lane_x, LANES)
            if GATED:
                acc_up += _lane_group(sums_up, s_ptr + up_g, m_ptr + up_g, offs, n_mask,
                                      groups, g, lane_x, LANES)
    y = tl.sum(acc, 1)
    res = y
    store_mask = offs < N
    if ADD:
        res = tl.load(out_ptr + offs, mask=store_mask).to(tl.float32)
    store_outputs(y, tl.sum(acc_up, 1), y, y, res, out_ptr, offs, store_mask, GATED, ADD,
                  False)


@triton.jit
def _wna16_fewrow_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                         stride_xm, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLITS: tl.constexpr, PART_ROWS: tl.constexpr, ADD: tl.constexpr,
                         GATED: tl.constexpr, EVEN: tl.constexpr, STEP_SUMS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    CODES_PER_BLOCK: tl.constexpr = BLOCK_WORDS * PER
    # The splits of a tile are launch neighbours, so their partials meet in L2.
    tile = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    chunks = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS)
    k_start = split * chunks * BLOCK_K
    k_end = tl.minimum(K, k_start + chunks * BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_WORDS)
    n_mask = None if EVEN else offs_n < N
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    words = tl.cdiv(K, CODES_PER_BLOCK) * BLOCK_WORDS
    groups = words * PER // GROUP
    # gate's rows, then up's: up's words, scales and mins start N rows on
    up_w = N * words
    up_g = N * groups
    if USE_PDL:  # the rows may be the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    # The tile is dequantized times 2^-64 (a code's AND and one FMA, `_block_code`) where the
    # activation dtype has fp32's exponent range; fp16's would underflow.
    POWER: tl.constexpr = 0 if dtype == tl.float16 else 64
    # y^T = W x^T: the dequantized tile is the MMA's row operand, taken from registers. A dot
    # for each block and code j: A the block's words' code j, dequantized in the MMA's own
    # register layout, B the rows' BLOCK_WORDS consecutive columns that code j holds.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = acc
    for k0 in range(k_start, k_end, BLOCK_K):
        step = acc
        step_up = acc_up
        if STEP_SUMS:  # (the first dot of the step overwrites them)
            step = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            step_up = step
        for b in tl.static_range(BLOCK_K // CODES_PER_BLOCK):
            kb = k0 + b * CODES_PER_BLOCK
            # A block past the padded row is masked (its words past the row's, its inputs past
            # K), its groups' index kept within the row.
            packed = _block_words(qw_ptr, offs_n, n_mask, words, kb // PER, BLOCK_WORDS)
            packed_up = packed
            if GATED:
                packed_up = _block_words(qw_ptr + up_w, offs_n, n_mask, words, kb // PER,
                                         BLOCK_WORDS)
            for j in tl.static_range(PER):
                k = kb + j * BLOCK_WORDS
                if j * BLOCK_WORDS % GROUP == 0:  # the first code j of a group
                    g = k // GROUP
                    if not EVEN:
                        g = tl.minimum(g, groups - 1)
                    at = offs_n * groups + g
                    scale = masked_load(s_ptr + at, n_mask, 0.0)
                    low = masked_load(m_ptr + at, n_mask, 0.0)
                    if GATED:
                        scale_up = masked_load(s_ptr + up_g + at, n_mask, 0.0)
                        low_up = masked_load(m_ptr + up_g + at, n_mask, 0.0)
                x_mask = m_mask[:, None]
                if not EVEN:
                    x_mask = x_mask & (k + offs_c < K)[None, :]
                x = tl.load(x_rows + k + offs_c[None, :], mask=x_mask, other=0.0)
                w = _block_code(packed, scale, low, j, BITS, POWER).to(dtype)
                w_up = w
                if GATED:
                    w_up = _block_code(packed_up, scale_up, low_up, j, BITS, POWER).to(dtype)
                if STEP_SUMS and b == 0 and j == 0:  # a wgmma that defines its sums itself
                    step = tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)
                    if GATED:
                        step_up = tl.dot(w_up, tl.trans(x), input_precision=DOT_PRECISION)
                else:
                    step = tl.dot(w, tl.trans(x), step, input_precision=DOT_PRECISION)
                    if GATED:
                        step_up = tl.dot(w_up, tl.trans(x), step_up,
                                         input_precision=DOT_PRECISION)
        if STEP_SUMS:
            acc += step
            acc_up += step_up
        else:
            acc, acc_up = step, step_up
    mask = (offs_n < N)[:, None] & m_mask[None, :]
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
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (i, b): rows i BLOCK_N.., block b of the tile order, written in the order of K."""
    PER: tl.constexpr = 32 // BITS
    CODES_PER_BLOCK: tl.constexpr = BLOCK_WORDS * PER
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1) * CODES_PER_BLOCK
    offs_c = tl.arange(0, BLOCK_WORDS)
    n_mask = offs_n < N
    words = tl.cdiv(K, CODES_PER_BLOCK) * BLOCK_WORDS
    groups = words * PER // GROUP
    packed = _block_words(qw_ptr, offs_n, n_mask, words, kb // PER, BLOCK_WORDS)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    for j in tl.static_range(PER):
        k = kb + j * BLOCK_WORDS
        at = offs_n * groups + k // GROUP
        w = _block_code(packed, tl.load(s_ptr + at, mask=n_mask, other=0.0),
                        tl.load(m_ptr + at, mask=n_mask, other=0.0), j, BITS, 0)
        tl.store(rows + k + offs_c[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (k + offs_c < K)[None, :])


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/gemv.py's `gemv` over a packed weight in tile order: x [1, K]; the weight [N, K],
    or [2N, K] = [gate; up] when gated. Returns f(x) W^T [1, N] in x's dtype, f the RMSNorm
    with norm_weight and eps when given, or with residual ([1, N]) adds it to residual in place
    and returns it."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1
    k = x.shape[1]
    tile = GEMV_TILE
    group = _tile_group(qweight, scales, bits, k)
    n = qweight.shape[0] // 2 if gated else qweight.shape[0]
    rows = tile.rows
    while rows > 1 and triton.cdiv(n, rows) < tile.min_programs_per_sm * num_sms(x.device):
        rows //= 2
    per = 32 // bits
    block_k = min(LANE_WORDS.value * 32 * tile.num_warps * per,
                  triton.next_power_of_2(qweight.shape[1] * per))
    if residual is not None:
        assert residual.shape == (1, n) and residual.dtype == x.dtype
    out = residual if residual is not None else x.new_empty(1, n)
    pdl = supports_pdl(x.device)
    lines = prefetch_lines(qweight.shape[0], qweight.shape[1] * 4, x.device) if pdl else 0
    _wna16_gemv_kernel[(triton.cdiv(n, rows),)](
        x, qweight, scales, mins, out, norm_weight if norm_weight is not None else x, eps, n, k,
        BITS=bits, GROUP=group, BLOCK_N=rows, BLOCK_K=block_k, NORM=norm_weight is not None,
        ADD=residual is not None, GATED=gated, EVEN=n % rows == 0 and k % block_k == 0,
        USE_PDL=pdl, PREFETCH_LINES=lines, NUM_STAGES=tile.num_stages,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl)
    return out


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               bits: int, residual: torch.Tensor | None = None, *, gated: bool = False,
               tiles: WNA16Tiles | None = None,
               workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x [M, K] (M <= FEWROW_MAX) times the packed weight [N, K] in tile order, transposed:
    [M, N] in x's dtype, or residual += it in place (returning residual); for a weight [2N, K]
    = [gate; up] SwiGLU'd to [M, N] when gated. `tiles`: by default `wna16_tiles`'s;
    `workspace`: where a tile cut along K sums its splits (fewrow_gemm.split_buffers)."""
    m, k = x.shape
    rows = qweight.shape[0]
    n = rows // 2 if gated else rows
    assert 1 <= m <= FEWROW_MAX and x.stride(-1) == 1
    assert not (gated and residual is not None)
    group = _tile_group(qweight, scales, bits, k)
    tiles = tiles or wna16_tiles(m, rows, k, bits, x.element_size(), num_sms(x.device), gated)
    assert m <= tiles.block_m and tiles.block_k % (BLOCK_WORDS.value * 32 // bits) == 0
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts, counts = (split_buffers(workspace, rows, tiles.splits, x.device) if tiles.splits > 1
                     else (out, out))
    pdl = supports_pdl(x.device)
    _wna16_fewrow_kernel[(triton.cdiv(n, tiles.block_n) * tiles.splits,)](
        x, qweight, scales, mins, out, parts, counts, m, n, k, x.stride(0), out.stride(0),
        BITS=bits, GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, SPLITS=tiles.splits, PART_ROWS=FEWROW_MAX_ROWS,
        ADD=residual is not None, GATED=gated,
        EVEN=n % tiles.block_n == 0 and k % tiles.block_k == 0, STEP_SUMS=tiles.step_sums,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, launch_pdl=pdl)
    return out


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      bits: int, dtype: torch.dtype, k: int) -> torch.Tensor:
    """The packed weight in tile order, whose rows hold k columns, as [N, k] in dtype."""
    n = qweight.shape[0]
    group = _tile_group(qweight, scales, bits, k)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequantize_kernel[(triton.cdiv(n, 16), qweight.shape[1] // BLOCK_WORDS.value)](
        qweight, scales, mins, w, n, k, BITS=bits, GROUP=group, BLOCK_N=16)
    return w


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, bits: int, residual: torch.Tensor | None = None,
                 workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x W^T for any number of rows (or residual += x W^T in place), the weight in tile order;
    `workspace` as `wna16_gemm` takes it."""
    if x.shape[0] <= FEWROW_MAX:
        return wna16_gemm(x, qweight, scales, mins, bits, residual, workspace=workspace)
    w = dequantize_weight(qweight, scales, mins, bits, x.dtype, x.shape[1])
    if residual is None:
        return torch.nn.functional.linear(x, w)
    return residual.addmm_(x, w.t())
