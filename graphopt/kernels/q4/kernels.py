"""The Q4_0 x Q8_1 Triton kernels (formats and the formula: format.py).

Kernels:
  _quantize_q8_1_kernel  bf16/fp16/fp32 [M, K] -> ggml block_q8_1 bytes [M, K/32, 36] (byte-exact on
                         the GPU too: x * (1/d) is rounded by an explicit mul_rn, see _q8_1_quantize).
  _q4_gemm_kernel        tensor-core int8 tl.dot of depth 32 per block, int32 per block, fp32 across
                         blocks, with the activation source a constexpr: ACT_PREQUANTIZED (block_q8_1
                         bytes; the "separate" path), ACT_FUSED (bf16/fp16 in, Q8_1 quantization of
                         each K tile in registers: the fused kernel), ACT_STATIC (the fake-quant idiom
                         round(x / s).clamp(qmin, qmax) with a per-tensor or per-row scale s).
  _q4_gemv_kernel        decode (1-8 tokens): streaming split-K GEMV on CUDA cores, fused Q8_1
                         quantization, nibbles -> fp32 by bit tricks, fp32 FMAs (exact products).
  Both kernels split K over programs when the config asks (TileConfig.split_k; 0 = enough programs
  for PROGRAMS_PER_SM per SM) and combine the fp32 partials through a [SPLIT_K, M, N] workspace or
  atomics into a zeroed [M, N] buffer, then _splitk_sum_kernel (+ bias, cast); they can also reduce
  without a sum kernel ("last": the split that finishes a tile last writes the output). Every
  buffer is allocated per call, so nothing outlives a call (CUDA graphs own their own).
_quantize_q8_1_kernel, and the Q8_1 rounding the kernels share (_q8_1_quantize), are in
graphopt/kernels/q8_1.py.

Caveats: inference only (no autograd). Activations must be contiguous in their last dim (the
launchers make them so). The fused kernels re-quantize the activation tile once per N tile (and
the gemv once per token row and N tile): redundant CUDA-core work that grows with M*K*N/BLOCK_N;
at large token counts the separate path (quantize once) or dense bf16 wins, and the q4_linear
pass's cost model says so. Split-K sums in a different fp32 order than the unsplit kernel, and
the atomic and "last" reductions are not bitwise deterministic run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphopt.kernels.q8_1 import _q8_1_quantize, _round_half_even_tl
from graphopt.kernels.split_k import finish_split_tile

ACT_PREQUANTIZED = 0  # block_q8_1 bytes from _quantize_q8_1_kernel (the separate path)
ACT_FUSED = 1  # bf16/fp16/fp32 activations, Q8_1 quantization in registers (the fused kernel)
ACT_STATIC = 2  # round(x / s).clamp(qmin, qmax) with a per-row scale s (the fake-quant idiom)

REDUCE_NONE, REDUCE_ATOMIC, REDUCE_WORKSPACE, REDUCE_LAST = 0, 1, 2, 3

# Float tricks used below (all exact, valid for |integer| < 2^22):
#   int -> float:  bitcast(i + 0x4B400000) - 1.5*2^23   (IADD + FADD instead of a slow I2F)
#   rint(v):       (v + 1.5*2^23) - 1.5*2^23             (round half to even; the integer is also in
#                                                          the low bits of v + 1.5*2^23)
#   nibble -> float: bitcast(nibble | 0x4B000000) - 2^23  (LOP3 + FADD)



@triton.jit
def _load_act_block(
    a_ptr, ad_ptr, offs_m, m_mask, kb, K, stride_am, stride_adm,
    ACT_MODE: tl.constexpr, QUOT_DTYPE: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Activation block kb (values 32*kb .. 32*kb+31) of rows offs_m: (q int32 [BM, 32], scale fp32
    [BM], scale * sum q fp32 [BM])."""
    j = tl.arange(0, 32)
    if ACT_MODE == 0:  # block_q8_1 bytes: a_ptr is the int8 view at byte 4, ad_ptr the fp16 view
        mask = m_mask[:, None] & (kb * 32 + j < K)[None, :]
        q = tl.load(a_ptr + offs_m[:, None] * stride_am + kb * 36 + j[None, :], mask=mask, other=0).to(tl.int32)
        d = tl.load(ad_ptr + offs_m * stride_adm + kb * 18, mask=m_mask & (offs_m * 0 + kb * 32 < K), other=0.0)
        d = d.to(tl.float32)
        return q, d, d * tl.sum(q, axis=1).to(tl.float32)
    else:
        k = kb * 32 + j
        x = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :],
                    mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        if ACT_MODE == 1:
            q, qi, _, d16 = _q8_1_quantize(x, EXACT)
            return qi, d16, d16 * tl.sum(q, axis=1)
        else:  # static scale per row (ad_ptr: fp32 [M])
            s = tl.load(ad_ptr + offs_m, mask=m_mask, other=1.0)
            v = tl.math.div_rn(x, s[:, None]).to(QUOT_DTYPE).to(tl.float32)
            q = tl.minimum(tl.maximum(_round_half_even_tl(v), QMIN), QMAX)
            return q, s, s * tl.sum(q, axis=1).to(tl.float32)


@triton.jit
def _int_to_float(i):
    """Exact int32 -> fp32 for |i| < 2^22 without the (quarter-rate) I2F conversion."""
    return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _write_output(acc, out_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_os, stride_om,
                  HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr):
    """acc (BM, BN) fp32 of output rows offs_m, columns offs_n. REDUCE_NONE: (+ bias) stored in out's
    dtype; REDUCE_ATOMIC: added into the zeroed fp32 (M, N) buffer; REDUCE_WORKSPACE: stored in slice
    pid_k of the fp32 (SPLIT_K, M, N) workspace (the bias is added when the slices are summed)."""
    mask = m_mask[:, None] & n_mask[None, :]
    offs = offs_m[:, None] * stride_om + offs_n[None, :]
    if REDUCE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif REDUCE == 1:
        tl.atomic_add(out_ptr + offs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + pid_k * stride_os + offs, acc, mask=mask)


@triton.jit
def _nibble_planes(wb, USE_ASM: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as int8 in [0, 15]. USE_ASM: one 32-bit op per
    four bytes (the operation is bytewise, so any four elements may share a register; plain int8
    arithmetic is scalarized into byte extracts and inserts)."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [wb], dtype=tl.int8,
                                       is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                                       [wb], dtype=tl.int8, is_pure=True, pack=4)
        return lo, hi
    else:
        return (wb & 0xF).to(tl.int8), (wb >> 4).to(tl.int8)


@triton.jit
def _pair_scales(scales, I: tl.constexpr, PAIRS: tl.constexpr):
    """(BN, 2 * PAIRS) scales of a K step -> the (BN,) scales of blocks 2I and 2I + 1 (PAIRS 1, 2
    or 4; register splits, no memory traffic)."""
    BN: tl.constexpr = scales.shape[0]
    if PAIRS == 1:
        pair = scales
    else:
        by_pair = tl.permute(tl.reshape(scales, (BN, PAIRS, 2)), (0, 2, 1))  # (BN, block of the pair, pair)
        if PAIRS == 4:
            even, odd = tl.split(tl.reshape(by_pair, (BN, 2, 2, 2)))  # pairs 0, 2 and pairs 1, 3
            first, second = tl.split(odd if I % 2 == 1 else even)
            pair = second if I // 2 == 1 else first
        else:
            first, second = tl.split(by_pair)
            pair = second if I == 1 else first
    return tl.split(pair)


@triton.jit
def _q4_gemm_kernel(
    a_ptr, ad_ptr,  # activations (see _load_act_block)
    w_ptr, ws_ptr,  # qweight (N, Kp/2) uint8, scales (Kp/32, N) fp16
    bias_ptr, out_ptr,  # bias (N,); out (M, N), or the fp32 buffers of REDUCE (see _write_output)
    acc_ptr, counter_ptr,  # REDUCE_LAST: the zeroed fp32 (M, N) sums and per-tile arrival counters
    M, N, K, pairs_per_split,
    stride_am, stride_adm, stride_wn, stride_wsb, stride_os, stride_om,
    ACT_MODE: tl.constexpr, QUOT_DTYPE: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
    SWAP_AB: tl.constexpr, USE_ASM: tl.constexpr,
):
    """out[m, n] = sum_b d4[b, n] * (a_scale[m, b] * dot(q8, q4u)[m, n] - 8 * a_sum[m, b]), one int8
    tl.dot of depth 32 per block, int32 per block, fp32 across blocks. Program (i, j, s) owns the
    output tile (i, j) and the block pairs [s * pairs_per_split, (s + 1) * pairs_per_split).
    SWAP_AB (the "swap" configs, few tokens): the transposed product dot(q4u, q8^T), so the weight
    rows fill the MMA's M side (wgmma's 64 rows per warpgroup) and the few tokens its N side (8 or
    16), and the unpacked nibbles stay in registers as wgmma's A operand (no shared-memory round
    trip for the weights); the accumulator is (BLOCK_N, BLOCK_M) until the store."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_j = tl.arange(0, 32)
    if SWAP_AB:
        w_rows = w_ptr + offs_n[:, None] * stride_wn + offs_j[None, :]  # (BN, 32): byte j of row n
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        w_rows = w_ptr + offs_n[None, :] * stride_wn + offs_j[:, None]  # (32, BN)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_pairs = tl.cdiv(K, 64)
    p_begin = pid_k * pairs_per_split
    p_end = tl.minimum(p_begin + pairs_per_split, num_pairs)
    # The K step's 2 * PAIRS block scales per row, one (BN, 2 * PAIRS) load prefetched a step ahead
    # in registers: Triton's pipeliner stages only loads that feed a dot, and synchronous scale
    # loads exposed one memory latency per K step.
    offs_c = tl.arange(0, 2 * PAIRS)
    scale_tile = ws_ptr + offs_c[None, :] * stride_wsb + offs_n[:, None]  # (BN, 2 PAIRS): blocks 2 p0 + c
    d4_step = tl.load(scale_tile + 2 * p_begin * stride_wsb,
                      mask=n_mask[:, None] & (2 * p_begin + offs_c < 2 * p_end)[None, :], other=0.0)
    for p0 in range(p_begin, p_end, PAIRS):
        nxt = p0 + PAIRS  # past the split's last pair: masked, no traffic
        d4_next = tl.load(scale_tile + 2 * nxt * stride_wsb,
                          mask=n_mask[:, None] & (2 * nxt + offs_c < 2 * p_end)[None, :], other=0.0)
        d4_f32 = d4_step.to(tl.float32)
        for i in tl.static_range(PAIRS):
            p = p0 + i
            live = n_mask & (offs_n * 0 + p < p_end)  # (BN,): past the last pair, load nothing
            if SWAP_AB:
                wb = tl.load(w_rows + p * 32, mask=live[:, None], other=0)  # (BN, 32) uint8
            else:
                wb = tl.load(w_rows + p * 32, mask=live[None, :], other=0)  # (32, BN) uint8
            w_lo, w_hi = _nibble_planes(wb, USE_ASM)  # blocks 2p and 2p + 1
            d4_lo, d4_hi = _pair_scales(d4_f32, i, PAIRS)
            q_lo, sc_lo, sum_lo = _load_act_block(a_ptr, ad_ptr, offs_m, m_mask, 2 * p, K, stride_am, stride_adm,
                                                  ACT_MODE, QUOT_DTYPE, QMIN, QMAX, EXACT)
            q_hi, sc_hi, sum_hi = _load_act_block(a_ptr, ad_ptr, offs_m, m_mask, 2 * p + 1, K, stride_am, stride_adm,
                                                  ACT_MODE, QUOT_DTYPE, QMIN, QMAX, EXACT)
            # |dot| <= 32 * 15 * 128 < 2^22: the exact integer -> float trick applies
            if SWAP_AB:
                dot_lo = _int_to_float(tl.dot(w_lo, tl.trans(q_lo.to(tl.int8)), out_dtype=tl.int32))  # (BN, BM)
                dot_hi = _int_to_float(tl.dot(w_hi, tl.trans(q_hi.to(tl.int8)), out_dtype=tl.int32))
                acc += d4_lo[:, None] * (sc_lo[None, :] * dot_lo - 8.0 * sum_lo[None, :])
                acc += d4_hi[:, None] * (sc_hi[None, :] * dot_hi - 8.0 * sum_hi[None, :])
            else:
                dot_lo = _int_to_float(tl.dot(q_lo.to(tl.int8), w_lo, out_dtype=tl.int32))  # (BM, BN)
                dot_hi = _int_to_float(tl.dot(q_hi.to(tl.int8), w_hi, out_dtype=tl.int32))
                acc += d4_lo[None, :] * (sc_lo[:, None] * dot_lo - 8.0 * sum_lo[:, None])
                acc += d4_hi[None, :] * (sc_hi[:, None] * dot_hi - 8.0 * sum_hi[:, None])
        d4_step = d4_next
    if SWAP_AB:
        acc = tl.trans(acc)
    if REDUCE == 3:  # REDUCE_LAST
        tile = offs_m[:, None] * N + offs_n[None, :]
        finish_split_tile(acc, acc_ptr + tile, out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                          m_mask[:, None] & n_mask[None, :], bias_ptr + offs_n[None, :], n_mask[None, :],
                          counter_ptr + pid_m * tl.num_programs(1) + pid_n, tl.num_programs(2), HAS_BIAS)
    else:
        _write_output(acc, out_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_os, stride_om,
                      HAS_BIAS, REDUCE)


@triton.jit
def _dp4a(a, b, USE_ASM: tl.constexpr):
    """Elementwise sum over the four byte lanes of int32 a and b of signed int8 products (PTX
    dp4a.s32.s32 with a zero addend). USE_ASM=False computes the same with shifts (the
    interpreter cannot run PTX)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        total = ((a << 24) >> 24) * ((b << 24) >> 24)
        total += ((a << 16) >> 24) * ((b << 16) >> 24)
        total += ((a << 8) >> 24) * ((b << 8) >> 24)
        total += (a >> 24) * (b >> 24)
        return total


@triton.jit
def _dp4a_acc(a, b, c, USE_ASM: tl.constexpr):
    """c + _dp4a(a, b): dp4a's own int32 addend, so a chain of them needs no separate adds."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return c + _dp4a(a, b, False)


@triton.jit
def _split_words(x):
    """(A, B, 8) -> its eight (A, B) slices along the last axis (in a fixed order: a dot of two
    tensors split alike does not depend on it)."""
    A: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, (A, B, 4, 2)))
    even_even, even_odd = tl.split(tl.reshape(even, (A, B, 2, 2)))
    odd_even, odd_odd = tl.split(tl.reshape(odd, (A, B, 2, 2)))
    w0, w1 = tl.split(even_even)
    w2, w3 = tl.split(even_odd)
    w4, w5 = tl.split(odd_even)
    w6, w7 = tl.split(odd_odd)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _dp4a_dot8(w, x, init, USE_ASM: tl.constexpr):
    """init + sum over the last axis (8 words) of _dp4a(w, x), as one chain of accumulating dp4a:
    (A, B, 8) x (A, B, 8) + (A, B) -> (A, B) int32."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _split_words(w)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split_words(x)
    acc = _dp4a_acc(w0, x0, init, USE_ASM)
    acc = _dp4a_acc(w1, x1, acc, USE_ASM)
    acc = _dp4a_acc(w2, x2, acc, USE_ASM)
    acc = _dp4a_acc(w3, x3, acc, USE_ASM)
    acc = _dp4a_acc(w4, x4, acc, USE_ASM)
    acc = _dp4a_acc(w5, x5, acc, USE_ASM)
    acc = _dp4a_acc(w6, x6, acc, USE_ASM)
    return _dp4a_acc(w7, x7, acc, USE_ASM)


@triton.jit
def _pack_int8x4(q, CHUNK: tl.constexpr):
    """int32 (CHUNK, 32) values in [-128, 127] -> (CHUNK, 8) words, element 4i + b in byte b of word i."""
    lanes = tl.reshape(q & 0xFF, (CHUNK, 8, 4))
    shifts = tl.arange(0, 4) * 8
    return tl.sum(lanes << shifts[None, None, :], axis=2)  # disjoint bytes: the sum is an OR


@triton.jit
def _q8_1_words(x_row, blocks, mask, USE_ASM: tl.constexpr):
    """Blocks `blocks` (CHUNK,) of one block_q8_1 row seen as int32 words (9 per block): the 8
    packed value words (CHUNK, 8), sum(q) (CHUNK,) int32 (one dp4a with 0x01010101 per word) and
    d (CHUNK,) fp32. Masked blocks read as zeros (mask (CHUNK, 1))."""
    offs_w = tl.arange(0, 8)
    words = tl.load(x_row + blocks[:, None] * 9 + 1 + offs_w[None, :], mask=mask, other=0)
    header = tl.load(x_row + blocks[:, None] * 9, mask=mask, other=0)  # (CHUNK, 1): d | s << 16
    d = (header & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    ones = tl.full(words.shape, 0x01010101, tl.int32)
    return words, tl.sum(_dp4a(words, ones, USE_ASM), axis=1), tl.reshape(d, (blocks.shape[0],))


@triton.jit
def _q4_gemv_kernel(
    x_ptr, w_ptr, ws_ptr,  # x (M, K) bf16/fp16/fp32; qweight (N, Kp/2) uint8 (read as int32 words
    #                        when USE_DP4A, stride_wn then in words); scales (Kp/32, N) fp16
    bias_ptr, out_ptr,  # bias (N,); out (M, N) (REDUCE_NONE / _LAST), or the fp32 buffers of REDUCE (_write_output)
    acc_ptr, counter_ptr,  # REDUCE_LAST: the zeroed fp32 (M, N) sums and per-tile arrival counters
    M, N, K, pairs_per_split,
    stride_xm, stride_wn, stride_wsb, stride_os, stride_om,
    HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, EXACT: tl.constexpr,
    USE_DP4A: tl.constexpr, USE_ASM: tl.constexpr, PREQUANTIZED: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """Decode: a streaming split-K GEMV on CUDA cores. Program (j, s, i) owns weight rows
    [j * BLOCK_N, (j + 1) * BLOCK_N), the block pairs [s * pairs_per_split, ...) and token rows
    [i * ROWS, (i + 1) * ROWS). Each iteration loads 32 * CHUNK contiguous bytes per weight row
    (16-byte vector loads, a warp covering whole rows) and quantizes the matching activation
    blocks to Q8_1 in registers.

    USE_DP4A=False ("gemv"): the nibbles become fp32 (q - 8) with bit tricks and d4 * sum_j
    (q - 8) * (q8 * d8) accumulates with fp32 FMAs. Products are exact (4 x 8 x 11 bits); only the
    fp32 summation order differs from the integer formula.
    USE_DP4A=True ("dp4a"): word i of a block pair holds bytes 4i..4i+3: its low nibbles are
    elements 4i..4i+3 of block 2p, its high nibbles the same elements of block 2p + 1, so
    (w & 0x0F0F0F0F) and ((w >> 4) & 0x0F0F0F0F) are four unsigned int8 each, dotted with the
    matching packed Q8_1 word by one dp4a. Per block: d4 * d8 * (dot(q4u, q8) - 8 * sum(q8)), the
    integer formula of the reference (exact ints).
    PREQUANTIZED (dp4a only; the separate path): x_ptr is the int32 view of block_q8_1 rows (9
    words per block: d | s << 16, then the 32 int8 values), stride_xm in words. The packed words
    are loaded as they are and sum(q8) is one more dp4a against 0x01010101, so nothing is
    quantized per program: at several tokens the fused kernel repeats each row's quantization in
    every one of the N / BLOCK_N programs."""
    WORDS: tl.constexpr = 8 if USE_DP4A else 32  # loaded elements per block pair (int32 / uint8)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_c = tl.arange(0, CHUNK)
    offs_w = tl.arange(0, WORDS)
    offs_j = tl.arange(0, 32)
    offs_r = tl.arange(0, ROWS)
    row0 = pid_m * ROWS
    num_pairs = tl.cdiv(K, 64)
    p_begin = pid_k * pairs_per_split
    p_end = tl.minimum(p_begin + pairs_per_split, num_pairs)
    # (BN, CHUNK, WORDS): element w of pair c of weight row n, relative to the chunk's first pair
    if USE_DP4A:  # qweight arrives as uint8; its int32 view is taken here, not by an aten call per layer
        w_words = w_ptr.to(tl.pointer_type(tl.int32))
    else:
        w_words = w_ptr
    w_tile = w_words + offs_n[:, None, None] * stride_wn + offs_c[None, :, None] * WORDS + offs_w[None, None, :]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for p0 in range(p_begin, p_end, CHUNK):
        pairs = p0 + offs_c  # (CHUNK,)
        live = pairs < p_end
        wb = tl.load(w_tile + p0 * WORDS, mask=n_mask[:, None, None] & live[None, :, None], other=0)
        if USE_DP4A:
            w_lo = wb & 0x0F0F0F0F  # block 2p
            w_hi = (wb >> 4) & 0x0F0F0F0F  # block 2p + 1
        else:
            wi = wb.to(tl.int32)
            w_lo = ((wi & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8 (block 2p)
            w_hi = ((wi & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 16 (q - 8) (block 2p+1)
        scale_mask = n_mask[:, None] & live[None, :]
        d4_lo = tl.load(ws_ptr + (2 * pairs)[None, :] * stride_wsb + offs_n[:, None], mask=scale_mask, other=0.0)
        d4_hi = tl.load(ws_ptr + (2 * pairs + 1)[None, :] * stride_wsb + offs_n[:, None], mask=scale_mask, other=0.0)
        d4_lo = d4_lo.to(tl.float32)  # (BN, CHUNK)
        d4_hi = d4_hi.to(tl.float32)
        if not USE_DP4A:
            d4_hi = d4_hi * 0.0625  # the 1/16 of the high nibble, exact
        k_lo = pairs[:, None] * 64 + offs_j[None, :]  # (CHUNK, 32)
        for r in tl.static_range(ROWS):
            row = row0 + r
            x_row = x_ptr + row * stride_xm
            row_ok = (offs_c * 0 + row < M)[:, None]  # (CHUNK, 1)
            if PREQUANTIZED:
                xw_lo, sum_lo, d8_lo = _q8_1_words(x_row, 2 * pairs, live[:, None] & row_ok, USE_ASM)
                xw_hi, sum_hi, d8_hi = _q8_1_words(x_row, 2 * pairs + 1, live[:, None] & row_ok
                                                   & ((2 * pairs + 1) * 32 < K)[:, None], USE_ASM)
            else:
                x_lo = tl.load(x_row + k_lo, mask=(k_lo < K) & row_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(x_row + k_lo + 32, mask=(k_lo + 32 < K) & row_ok, other=0.0).to(tl.float32)
                q_lo, qi_lo, _, d8_lo = _q8_1_quantize(x_lo, EXACT)
                q_hi, qi_hi, _, d8_hi = _q8_1_quantize(x_hi, EXACT)
            if USE_DP4A:
                if not PREQUANTIZED:
                    xw_lo = _pack_int8x4(qi_lo, CHUNK)  # (CHUNK, 8)
                    xw_hi = _pack_int8x4(qi_hi, CHUNK)
                    sum_lo = tl.sum(qi_lo, axis=1)
                    sum_hi = tl.sum(qi_hi, axis=1)
                # dot - 8 sum, the -8 sum as the chain's first addend; |dot - 8 sum| <= 32 * 15 * 128
                # + 8 * 32 * 128 < 2^22: exact int -> float trick
                dot_lo = _dp4a_dot8(w_lo, tl.broadcast_to(xw_lo[None, :, :], w_lo.shape),
                                    tl.broadcast_to(-8 * sum_lo[None, :], (BLOCK_N, CHUNK)), USE_ASM)
                dot_hi = _dp4a_dot8(w_hi, tl.broadcast_to(xw_hi[None, :, :], w_hi.shape),
                                    tl.broadcast_to(-8 * sum_hi[None, :], (BLOCK_N, CHUNK)), USE_ASM)
                dot_lo = d8_lo[None, :] * _int_to_float(dot_lo)  # (BN, CHUNK)
                dot_hi = d8_hi[None, :] * _int_to_float(dot_hi)
            else:
                a_lo = q_lo * d8_lo[:, None]  # the dequantized Q8_1 values, exact in fp32
                a_hi = q_hi * d8_hi[:, None]
                dot_lo = tl.sum(w_lo * a_lo[None, :, :], axis=2)  # (BN, CHUNK)
                dot_hi = tl.sum(w_hi * a_hi[None, :, :], axis=2)
            part = tl.sum(d4_lo * dot_lo + d4_hi * dot_hi, axis=1)  # (BN,)
            acc = tl.where(offs_r[:, None] == r, acc + part[None, :], acc)
    rows = row0 + offs_r
    if REDUCE == 3:  # REDUCE_LAST
        finish_split_tile(acc, acc_ptr + rows[:, None] * N + offs_n[None, :],
                          out_ptr + rows[:, None] * stride_om + offs_n[None, :], (rows < M)[:, None] & n_mask[None, :],
                          bias_ptr + offs_n[None, :], n_mask[None, :], counter_ptr + pid_m * tl.num_programs(0) + pid_n,
                          tl.num_programs(1), HAS_BIAS)
    else:
        _write_output(acc, out_ptr, bias_ptr, rows, offs_n, rows < M, n_mask, pid_k, stride_os, stride_om,
                      HAS_BIAS, REDUCE)


@triton.jit
def _splitk_sum_kernel(
    part_ptr, bias_ptr, out_ptr,  # partials fp32 (SPLITS, M, N); bias (N,); out (M, N)
    N, SPLITS, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[m, :] = sum_s part[s, m, :] (+ bias), cast to out's dtype."""
    pid_m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + pid_m * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
