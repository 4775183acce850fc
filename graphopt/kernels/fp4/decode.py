"""FP4 decode kernels (the "gemv" path, 1-64 tokens per call) on the kernel layout (format.py).

Kernels (CUDA; on CPU they run under TRITON_INTERPRET=1 for tests):
  * `_fp4_gemv_words_kernel`, decode, 1-4 tokens per program on CUDA cores: each program streams
    a (BLOCK_N rows x K-range) strip of the codes as tiles of int32 words, prefetching the next
    tile in registers. A word right-shifted by 0/4/8/12 holds two codes at bits 0 and 16, so four
    integer ops place both into fp16 bit patterns (sign << 15 | magnitude << 9 = value * 2^-14,
    exact; the 2^14 and the scale decode's 2^8 are folded into one per-call multiplier; on the
    GPU one PTX cvt per half turns them into fp32, with no 16-bit extraction first). A word's
    eight activations are two 4-element vector loads shared by every row of the tile; w * x is
    summed per word in-thread (one FMA chain), times the word's block scale, and rows are reduced
    across threads once at the end. Split-K adds into a zeroed fp32 buffer allocated per call
    (split_k.split_buffers); the split that finishes a tile last (arrival counter) writes the
    output with bias: one launch per call, no sum or cast kernel.
  * `_fp4_gemv_words_mma_kernel`, decode on tensor cores, 16, 32 or 64 tokens per program: the same
    word tiles, one MMA per code position of a word (tokens are the narrow MMA dimension: out^T
    = W x^T), so no shuffles build a contiguous K tile; split-K as above.
  * `_fp4_gemv_int_kernel`, decode on CUDA cores with integer dot products, 1, 2 or 4 tokens per
    program (`KernelConfig.int_dots`): a word's codes as int8 lanes, the activations rounded to int16
    per K tile, dp2a.
  The Gluon TMA decode (fp4_tma.py) reads the same layout.
Activations: bf16 or fp16. Accumulation is fp32. Bias optional.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None

if triton is not None:
    from graphopt.kernels.fp4.common import (E2M1_INT8_LANES_PTX, E2M1_NEG_HI, E2M1_NEG_LO, E2M1_POS_HI, E2M1_POS_LO,
                                             _block_scales, _code_words, _decode_multiplier, _decode_power, _mma,
                                             _scale_bytes)
    from graphopt.kernels.split_k import arrival_counters, finish_split_tile

    # --- e2m1 decode on 32-bit words -------------------------------------------------------
    # A kernel-layout word (4 bytes of one scale block, little endian) holds 8 codes. Shifting it
    # right by SHIFT in {0, 4, 8, 12} puts one code at bits 0-3 and another at bits 16-19, so
    # 4 integer ops give TWO fp16 bit patterns at once (value * 2^-14, exact). Which elements:
    # byte j of a block = element j (low nibble) | element j + BS/2 (high nibble), so for word q
    # of a block (bytes 4q..4q+3) the (low, high) halves are elements
    #   SHIFT 0: (4q, 4q+2)  4: (4q+H, 4q+2+H)  8: (4q+1, 4q+3)  12: (4q+1+H, 4q+3+H),  H = BS/2.
    @triton.jit
    def _e2m1_pair_bits(words, SHIFT: tl.constexpr, MANTISSA_LSB: tl.constexpr):
        """int32 words -> int32 with two 16-bit float bit patterns: the code at bit SHIFT (low half)
        and at bit SHIFT + 16 (high half), each as sign << 15 | magnitude << MANTISSA_LSB. fp16
        (MANTISSA_LSB 9) gives value * 2^-14, bf16 (6) value * 2^-126, exactly."""
        # magnitude bits (code bits 0-2) to bits MANTISSA_LSB.., sign (code bit 3) to bit 15, each
        # with one shift of the word (an arithmetic right shift's extended bits are masked off)
        if SHIFT <= MANTISSA_LSB:
            magnitude = words << (MANTISSA_LSB - SHIFT)
        else:
            magnitude = words >> (SHIFT - MANTISSA_LSB)
        if SHIFT == 12:
            sign = words
        else:
            sign = words << (12 - SHIFT)
        magnitude_mask: tl.constexpr = (7 << MANTISSA_LSB) | (7 << (MANTISSA_LSB + 16))
        return (magnitude & magnitude_mask) | (sign & -2147450880)  # -2147450880 == 0x80008000

    @triton.jit
    def _fp16_halves(bits, USE_ASM: tl.constexpr):
        """int32 holding two fp16 bit patterns -> (low, high) as fp32. USE_ASM: one PTX cvt per
        half straight from the 32-bit register (sm_90: one HADD2.F32 each; the int16 casts cost
        an extra PRMT/shift per half). The interpreter cannot run PTX."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                "=f,=f,r", [bits], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return lo, hi

    @triton.jit
    def _decode_shift(words, SHIFT: tl.constexpr, USE_ASM: tl.constexpr):
        return _fp16_halves(_e2m1_pair_bits(words, SHIFT, 9), USE_ASM)

    @triton.jit
    def _finish_row(acc, token, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """SPLIT_K == 1: out = acc + bias, stored in out's dtype. Otherwise add into the fp32
        workspace row (the last split copies it out, see _fp4_gemv_words_kernel). Tokens >= M are skipped."""
        n_mask = n_mask & ((offs_n * 0 + token) < M)
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += bias
            tl.store(out_ptr + token * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
        else:
            tl.atomic_add(ws_ptr + token * N + offs_n, acc, mask=n_mask, sem="relaxed")

    @triton.jit
    def _drain_row(token, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS: tl.constexpr):
        n_mask = n_mask & ((offs_n * 0 + token) < M)
        ws_row = ws_ptr + token * N + offs_n
        zero = tl.zeros((offs_n.shape[0],), dtype=tl.float32)
        total = tl.atomic_add(ws_row, zero, mask=n_mask, sem="relaxed")  # read at L2, where the adds landed
        if HAS_BIAS:
            total += bias
        tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _store_token_tile(acc, offs_n, n_mask, rows, offs_m, m_mask, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr,
                          bias_ptr, counter_ptr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The output of a decode program that owns several token rows (the tensor-core and
        integer-dot kernels): acc (BLOCK_N, BLOCK_M) fp32 for columns offs_n and tokens offs_m.
        One K split: + bias, stored in out's dtype. Otherwise split_k.finish_split_tile, on the
        (M, N) sums buffer and the counter of tile (pid_m, pid_n)."""
        out_mask = n_mask[:, None] & m_mask[None, :]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # (BN, BM)
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            finish_split_tile(acc, ws_ptr + offs_m[None, :] * N + offs_n[:, None], out_ptrs, out_mask,
                              bias_ptr + rows[:, None], n_mask[:, None],
                              counter_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_BIAS)

    @triton.jit
    def _split4(x):
        """(R, 4) -> its four columns, each (R,)."""
        even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # (x0, x2), (x1, x3)
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3

    @triton.jit
    def _word_column_sums(x_row, k_lo, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF: tl.constexpr):
        """sum of w * x over the 8 codes of every word for one token: (BN, W) decoded words ->
        (BN, W). k_lo (W,): element index of each word's first low-nibble element; the word's
        codes are elements k_lo + 0..3 (low nibbles) and k_lo + HALF + 0..3 (high nibbles), so x
        is read as two 4-element vectors per word and shared by all BN rows of the tile."""
        offs4 = tl.arange(0, 4)
        k_a = k_lo[:, None] + offs4[None, :]
        k_b = k_a + HALF
        x0, x1, x2, x3 = _split4(tl.load(x_row + k_a, mask=k_a < K, other=0.0).to(tl.float32))
        x8, x9, x10, x11 = _split4(tl.load(x_row + k_b, mask=k_b < K, other=0.0).to(tl.float32))
        # one dependent FMA chain: 1 FMUL + 7 FFMA (pairwise sums cost 4 FMUL + 4 FFMA + 3 FADD)
        part = w0a * x0[None, :]
        part += w0b * x2[None, :]
        part += w8a * x1[None, :]
        part += w8b * x3[None, :]
        part += w4a * x8[None, :]
        part += w4b * x10[None, :]
        part += w12a * x9[None, :]
        part += w12b * x11[None, :]
        return part

    @triton.jit
    def _word_tile(N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr):
        """The (BLOCK_N rows x WORDS_PER_ITER words) tiling both decode kernels share, for program
        (pid_n = axis 0, pid_k = axis 1): output columns offs_n and their mask; word and scale
        offsets (from the weight's and the scales' base pointers, which stay out of this call:
        Inductor's mutation analysis takes every argument of a call as a source of its results, so
        a base pointer passed here would count as written wherever the output columns are) of the
        tile's first iteration (rows clamped: the hot loop needs no masks; the
        WORDS_PER_ITER // (BLOCK_SIZE // 8) scales of a tile, one per scale block); k_lo, the element
        index of each word's first low-nibble code; and this split's iterations [it_start, it_end),
        each split owning >= 1 (the launcher guarantees it)."""
        WPB: tl.constexpr = BLOCK_SIZE // 8  # int32 words per scale block
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)
        offs_w = tl.arange(0, WORDS_PER_ITER)
        word_offs = rows[:, None] * stride_wn + offs_w[None, :]  # (BN, W)
        scale_offs = rows[:, None] * stride_sn + (offs_w // WPB)[None, :]  # (BN, W): WPB words share one
        k_lo = (offs_w // WPB) * BLOCK_SIZE + (offs_w % WPB) * 4  # (W,)
        n_iters = K_PADDED // (WORDS_PER_ITER * 8)
        per_split = tl.cdiv(n_iters, SPLIT_K)
        it_start = tl.program_id(1) * per_split
        it_end = tl.minimum(it_start + per_split, n_iters)
        return offs_n, offs_n < N, rows, word_offs, scale_offs, k_lo, it_start, it_end

    @triton.jit
    def _fp4_gemv_words_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """Decode on CUDA cores, 1-4 tokens per program: out[M, N] = x[M, K] @ W[N, K]^T.
        Grid: (N / BLOCK_N, SPLIT_K, M / BLOCK_M); every split owns >= 1 K iteration.

        Per iteration a program reads a (BLOCK_N rows x WORDS_PER_ITER words) tile of int32 code
        words and their block scales, prefetched one iteration ahead in registers. The 8
        activations a word needs are two 4-element vector loads, made once per word column and
        shared by every row of the tile (a scale-block tile that reloads them element by element
        per word was slower against cuBLAS at 1 token on an H100 than this one).
        The block scale multiplies each word's partial sum, the global scale the final sum.
        SPLIT_K > 1: partial rows are added into a zeroed fp32 workspace (ws_ptr, M x N) with
        atomics; the split that arrives last (per-tile counter) copies the rows out with bias in
        the output dtype and re-zeroes the workspace and the counter, so a call is one launch."""
        WPB: tl.constexpr = BLOCK_SIZE // 8  # int32 words per scale block
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, scale_offs, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = _code_words(words_ptr) + word_offs
        scale_ptrs = _scale_bytes(scales_ptr) + scale_offs

        token0 = pid_m * BLOCK_M
        x_row0 = x_ptr + tl.minimum(token0, M - 1) * stride_xm
        x_row1 = x_ptr + tl.minimum(token0 + 1, M - 1) * stride_xm
        x_row2 = x_ptr + tl.minimum(token0 + 2, M - 1) * stride_xm
        x_row3 = x_ptr + tl.minimum(token0 + 3, M - 1) * stride_xm
        acc0 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)

        words = tl.load(word_ptrs + it_start * WORDS_PER_ITER)
        scale_bytes = tl.load(scale_ptrs + it_start * (WORDS_PER_ITER // WPB))
        for it in range(it_start, it_end):
            nxt = tl.minimum(it + 1, it_end - 1)  # prefetch; the last iteration re-reads its own tile
            next_words = tl.load(word_ptrs + nxt * WORDS_PER_ITER)
            next_scale_bytes = tl.load(scale_ptrs + nxt * (WORDS_PER_ITER // WPB))

            scale = _block_scales(scale_bytes, IS_NVFP4)  # (BN, W)
            w0a, w0b = _decode_shift(words, 0, USE_ASM)
            w4a, w4b = _decode_shift(words, 4, USE_ASM)
            w8a, w8b = _decode_shift(words, 8, USE_ASM)
            w12a, w12b = _decode_shift(words, 12, USE_ASM)
            k_it = k_lo + it * (WORDS_PER_ITER * 8)
            acc0 += scale * _word_column_sums(x_row0, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            if BLOCK_M > 1:
                acc1 += scale * _word_column_sums(x_row1, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            if BLOCK_M > 2:
                acc2 += scale * _word_column_sums(x_row2, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
                acc3 += scale * _word_column_sums(x_row3, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            words = next_words
            scale_bytes = next_scale_bytes

        multiplier = _decode_multiplier(global_scale_ptr, IS_NVFP4)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        _finish_row(tl.sum(acc0, axis=1) * multiplier, token0, offs_n, n_mask, M, N, bias, out_ptr, stride_om,
                    ws_ptr, HAS_BIAS, SPLIT_K)
        if BLOCK_M > 1:
            _finish_row(tl.sum(acc1, axis=1) * multiplier, token0 + 1, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
        if BLOCK_M > 2:
            _finish_row(tl.sum(acc2, axis=1) * multiplier, token0 + 2, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
            _finish_row(tl.sum(acc3, axis=1) * multiplier, token0 + 3, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
        if SPLIT_K > 1:
            tl.debug_barrier()  # every thread's workspace atomics precede the counter's release
            counter = arrival_counters(counter_ptr) + pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last split of this tile: copy out
                _drain_row(token0, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                if BLOCK_M > 1:
                    _drain_row(token0 + 1, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                if BLOCK_M > 2:
                    _drain_row(token0 + 2, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                    _drain_row(token0 + 3, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)

    # --- integer dot products for one token (the "int_dots" configs) -----------------------
    # Twice an e2m1 value is an integer, {0, 1, 2, 3, 4, 6, 8, 12} and negatives, so a code word
    # becomes signed int8 lanes and one token's activations, rounded to int16 per K tile, meet
    # them in dp2a (two 16 x 8-bit products per instruction, int32 sums): no fp16/fp32
    # conversion and no FMA per code.

    @triton.jit
    def _doubled_e2m1(nibble):
        """Codes (int32, 0-15) -> twice their e2m1 value as int32 (the interpreter's decode)."""
        mag = nibble & 7
        e = mag >> 1
        v = tl.where(e == 0, mag, (2 + (mag & 1)) << tl.maximum(e - 1, 0))
        return tl.where(nibble >= 8, -v, v)

    @triton.jit
    def _e2m1_int8_lanes(words, USE_ASM: tl.constexpr):
        """int32 code words -> (lo, hi): lane i (byte i) of lo holds twice the e2m1 value of nibble
        i, of hi that of nibble 4 + i, as signed int8. USE_ASM: 11 instructions per word. PRMT
        looks up each magnitude in a positive and a negative byte table (twice the e2m1 values
        0, 1, 2, 3, 4, 6, 8, 12 and their negatives, indexed by the magnitude bits; ptxas moves
        one table word in from a uniform register at each use); a third PRMT per half
        replicates each code's sign bit over its lane (bit 7 of a byte of the word is an odd
        nibble's sign, bit 7 of a byte of word << 4 an even one's); LOP3 picks per lane."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                E2M1_INT8_LANES_PTX,
                "=r,=r,r,r,r,r,r", [words, tl.full(words.shape, E2M1_POS_LO, tl.int32),
                                    tl.full(words.shape, E2M1_POS_HI, tl.int32),
                                    tl.full(words.shape, E2M1_NEG_LO, tl.int32),
                                    tl.full(words.shape, E2M1_NEG_HI, tl.int32)],
                dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo = tl.zeros_like(words)
            hi = tl.zeros_like(words)
            for t in tl.static_range(4):
                lo |= (_doubled_e2m1((words >> (4 * t)) & 15) & 255) << (8 * t)
                hi |= (_doubled_e2m1((words >> (16 + 4 * t)) & 15) & 255) << (8 * t)
            return lo, hi

    @triton.jit
    def _dp2a(a, b, c, HI: tl.constexpr, USE_ASM: tl.constexpr):
        """c + a.h0 * b.byte(i) + a.h1 * b.byte(i + 1), signed, i = 2 if HI else 0 (PTX dp2a)."""
        if USE_ASM:
            if HI:
                return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
        else:
            SHIFT: tl.constexpr = 16 if HI else 0
            b0 = (b << (24 - SHIFT)) >> 24
            b1 = (b << (16 - SHIFT)) >> 24
            return c + ((a << 16) >> 16) * b0 + (a >> 16) * b1

    @triton.jit
    def _rint(v):
        """Round to nearest even, for |v| < 2^22 (adding and removing 1.5 * 2^23)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _int16_activation_pairs(x_row, k_a, K, HALF: tl.constexpr):
        """One token's 8 W activations of a word tile (elements k_a + 0..3 and k_a + HALF + 0..3 of
        word column w) rounded to int16 with one step, (tile max) / 32766: an error of at most half a
        step, 2^-16 of the tile's largest activation. Returns the four (W,) int16 pairs in the lane
        order of _e2m1_int8_lanes (nibble 2i of a word is element 4q + i, nibble 2i + 1 is
        4q + i + HALF) and the step."""
        x_a = tl.load(x_row + k_a, mask=k_a < K, other=0.0).to(tl.float32)
        x_b = tl.load(x_row + k_a + HALF, mask=k_a + HALF < K, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x_a), axis=1), axis=0), tl.max(tl.max(tl.abs(x_b), axis=1), axis=0))
        step = tl.where(amax > 0, amax * (1.0 / 32766.0), 1.0)
        inv = tl.where(amax > 0, 32766.0 / amax, 0.0)
        q_a = _rint(x_a * inv).to(tl.int32)
        q_b = _rint(x_b * inv).to(tl.int32)
        a0, a1, a2, a3 = _split4((q_a & 0xFFFF) | (q_b << 16))  # (W,) each
        return a0, a1, a2, a3, step

    @triton.jit
    def _int_block_sums(a0, a1, a2, a3, step, lo, hi, scale_bytes, IS_NVFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                        NB: tl.constexpr, WPB: tl.constexpr, USE_ASM: tl.constexpr):
        """One token's part of a word tile, (BLOCK_N, NB) fp32 per scale block: its int16 pairs meet
        the words' int8 lanes (lo, hi) in four chained dp2a; each block's int32 sum is exact
        (|sum| <= 32 * 12 * 32767 < 2^24) and scaled once."""
        dots = _dp2a(tl.broadcast_to(a0[None, :], lo.shape), lo, tl.zeros_like(lo), False, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a1[None, :], lo.shape), lo, dots, True, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a2[None, :], lo.shape), hi, dots, False, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a3[None, :], lo.shape), hi, dots, True, USE_ASM)
        block_dots = tl.sum(tl.reshape(dots, (BLOCK_N, NB, WPB)), axis=2)  # exact int32
        return _block_scales(scale_bytes, IS_NVFP4) * (block_dots.to(tl.float32) * step)

    @triton.jit
    def _fp4_gemv_int_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
    ):
        """Decode on CUDA cores with integer dot products, BLOCK_M (1, 2 or 4) tokens per program
        (grid as _fp4_gemv_words_kernel's). Each word's eight codes become int8 lanes once
        (_e2m1_int8_lanes) and meet every token's int16 activations in four dp2a per token
        (_int16_activation_pairs, _int_block_sums). Split-K and the output as in _fp4_gemv_words_mma_kernel."""
        WPB: tl.constexpr = BLOCK_SIZE // 8
        HALF: tl.constexpr = BLOCK_SIZE // 2
        NB: tl.constexpr = WORDS_PER_ITER // WPB  # scale blocks per tile row
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, _, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = _code_words(words_ptr) + word_offs
        scale_ptrs = _scale_bytes(scales_ptr) + rows[:, None] * stride_sn + tl.arange(0, NB)[None, :]  # (BN, NB)
        token0 = pid_m * BLOCK_M
        # rows >= M (not stored) read row token0 again; token0 < M. A clamp with tl.minimum costs the
        # one-token kernel 24 registers at 16 x 256 (offline sm_90: 96 -> 120)
        x_row0 = x_ptr + token0 * stride_xm
        x_row1 = x_ptr + (token0 + (token0 + 1 < M).to(tl.int32)) * stride_xm
        x_row2 = x_ptr + (token0 + 2 * (token0 + 2 < M).to(tl.int32)) * stride_xm
        x_row3 = x_ptr + (token0 + 3 * (token0 + 3 < M).to(tl.int32)) * stride_xm
        offs4 = tl.arange(0, 4)
        acc0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)

        words = tl.load(word_ptrs + it_start * WORDS_PER_ITER)
        scale_bytes = tl.load(scale_ptrs + it_start * NB)
        for it in range(it_start, it_end):
            # prefetch; the last iteration re-reads its own tile. (Staging the loop through shared
            # memory instead, Triton's pipeliner with num_stages 2-3, gave no faster best tile.)
            nxt = tl.minimum(it + 1, it_end - 1)
            next_words = tl.load(word_ptrs + nxt * WORDS_PER_ITER)
            next_scale_bytes = tl.load(scale_ptrs + nxt * NB)

            # the word's codes are elements k_lo + 0..3 (low nibbles) and k_lo + HALF + 0..3 (high)
            k_a = (k_lo + it * (WORDS_PER_ITER * 8))[:, None] + offs4[None, :]  # (W, 4)
            # activations first, then the lanes: they are consumed right after they are decoded
            # (the other order keeps them live through the rounding: 96 -> 122 registers at 16 x 256)
            p0, p1, p2, p3, step0 = _int16_activation_pairs(x_row0, k_a, K, HALF)
            if BLOCK_M > 1:
                r0, r1, r2, r3, step1 = _int16_activation_pairs(x_row1, k_a, K, HALF)
            if BLOCK_M > 2:
                s0, s1, s2, s3, step2 = _int16_activation_pairs(x_row2, k_a, K, HALF)
                t0, t1, t2, t3, step3 = _int16_activation_pairs(x_row3, k_a, K, HALF)
            lo, hi = _e2m1_int8_lanes(words, USE_ASM)  # (BN, W), shared by the tokens
            acc0 += _int_block_sums(p0, p1, p2, p3, step0, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            if BLOCK_M > 1:
                acc1 += _int_block_sums(r0, r1, r2, r3, step1, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            if BLOCK_M > 2:
                acc2 += _int_block_sums(s0, s1, s2, s3, step2, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
                acc3 += _int_block_sums(t0, t1, t2, t3, step3, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            words = next_words
            scale_bytes = next_scale_bytes

        # the 2 of the doubled codes, and (NVFP4) the 2^-8 of the e4m3 decode
        if BLOCK_M == 1:  # (BN, BLOCK_M) row sums, tokens in order
            sums = tl.sum(acc0, axis=1)[:, None]
        elif BLOCK_M == 2:
            sums = tl.join(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1))
        else:
            sums = tl.reshape(tl.join(tl.join(tl.sum(acc0, axis=1), tl.sum(acc2, axis=1)),
                                      tl.join(tl.sum(acc1, axis=1), tl.sum(acc3, axis=1))), (BLOCK_N, 4))
        offs_m = token0 + tl.arange(0, BLOCK_M)
        _store_token_tile(sums * (tl.load(global_scale_ptr) * (128.0 if IS_NVFP4 else 0.5)), offs_n, n_mask, rows,
                          offs_m, offs_m < M, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr, bias_ptr, counter_ptr,
                          SPLIT_K, HAS_BIAS)

    @triton.jit
    def _bf16_scale_pair(block_scale):
        """NVFP4 block scales from _block_scales (e4m3 value * 2^-8, fp32) -> int32 holding the
        bf16 of e4m3 value * 2^119 in both halves: exact, so the fp32 bits' low half is zero."""
        high = (block_scale * 1.7014118346046923e38).to(tl.int32, bitcast=True)  # * 2^127
        return high | (high.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)

    @triton.jit
    def _bf16_scaled_pair(words, SHIFT: tl.constexpr, scale_pair, USE_ASM: tl.constexpr):
        """Two codes (bits SHIFT and SHIFT + 16) times their NVFP4 block scale, as bf16 (low, high):
        the codes' bf16 bit placement (value * 2^-126) times scale_pair (bf16 e4m3 value * 2^119 in
        both halves) in one bf16x2 multiply. Exact: value * scale * 2^-7 has at most 6
        significant bits and lies in bf16's normal range (e4m3 <= 448 keeps the factor < 2^128)."""
        bits = _e2m1_pair_bits(words, SHIFT, 6)
        if USE_ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [bits, scale_pair], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:  # a bf16 half is the top of an fp32; the product is exact in fp32 too
            scale = (scale_pair & -65536).to(tl.float32, bitcast=True)
            lo = (bits << 16).to(tl.float32, bitcast=True) * scale
            hi = (bits & -65536).to(tl.float32, bitcast=True) * scale
            return lo.to(tl.bfloat16), hi.to(tl.bfloat16)

    @triton.jit
    def _split_positions(x, BLOCK_SIZE: tl.constexpr):
        """(BM, 8 W) activations of a word tile, in element order -> for each shift s in
        (0, 4, 8, 12), the (BM, W) pieces that the low and high codes of _decode_shift(words, s)
        multiply. Element e of a scale block is 4 q + 2 r1 + r0 + BS/2 h for word q: the pieces
        are (r0, h) = (0, 0), (0, 1), (1, 0), (1, 1), and r1 = 0 / 1 within a piece pair."""
        BM: tl.constexpr = x.shape[0]
        WPB: tl.constexpr = BLOCK_SIZE // 8
        NB: tl.constexpr = x.shape[1] // BLOCK_SIZE
        x = tl.reshape(x, (BM, NB, 2, WPB, 2, 2))  # (m, block, h, q, r1, r0)
        x = tl.reshape(tl.permute(x, (0, 1, 3, 2, 4, 5)), (BM, NB * WPB, 2, 2, 2))  # (m, word, h, r1, r0)
        even, odd = tl.split(x)
        s0_or_s4, s8_or_s12 = tl.split(even), tl.split(odd)  # each (r1 = 0, r1 = 1), (m, word, h)
        s0_lo, s4_lo = tl.split(s0_or_s4[0])
        s0_hi, s4_hi = tl.split(s0_or_s4[1])
        s8_lo, s12_lo = tl.split(s8_or_s12[0])
        s8_hi, s12_hi = tl.split(s8_or_s12[1])
        return s0_lo, s0_hi, s4_lo, s4_hi, s8_lo, s8_hi, s12_lo, s12_hi

    @triton.jit
    def _interleaved(x_lo, x_hi):
        """(BM, W) pieces of the activations -> (BM, 2W), column 2w + j from x_lo (j = 0) or x_hi."""
        return tl.reshape(tl.join(x_lo, x_hi), (x_lo.shape[0], 2 * x_lo.shape[1]))

    @triton.jit
    def _scaled_code_pairs(words, SHIFT: tl.constexpr, block_scale, IS_NVFP4: tl.constexpr,
                           DIRECT_BF16: tl.constexpr, dtype: tl.constexpr, USE_ASM: tl.constexpr):
        """The (low, high) codes of _decode_shift(words, SHIFT) times their block scale in the
        activation dtype, as the tensor-core kernel's two decodes compute them (DIRECT_BF16: times
        2^-7, which the kernel undoes on the sums). DIRECT_BF16: one bf16x2 multiply per code pair
        (_bf16_scaled_pair); otherwise fp32 products rounded to the activation dtype, with the power
        of two in the scale before the rounding, so code * e4m3 (NVFP4) is exact in fp16 and MXFP4
        weights keep their size."""
        if DIRECT_BF16:
            return _bf16_scaled_pair(words, SHIFT, _bf16_scale_pair(block_scale), USE_ASM)
        else:
            scale = block_scale * _decode_power(IS_NVFP4)
            lo, hi = _decode_shift(words, SHIFT, USE_ASM)
            return (lo * scale).to(dtype), (hi * scale).to(dtype)

    @triton.jit
    def _joined_pair_dot(lo, hi, x, acc, UPCAST_DOT: tl.constexpr):
        """acc += [lo | hi] @ x^T with lo and hi interleaved along K, x (BM, 2W) column 2w + j meeting
        word w's low (j = 0) or high (j = 1) code: the two halves of one bf16x2 register stay one
        register of the MMA operand (the K order of a dot is free)."""
        BN: tl.constexpr = lo.shape[0]
        W: tl.constexpr = lo.shape[1]
        return _mma(tl.reshape(tl.join(lo, hi), (BN, 2 * W)), x, acc, UPCAST_DOT)

    @triton.jit
    def _fp4_gemv_words_mma_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
        UPCAST_DOT: tl.constexpr, USE_ASM: tl.constexpr, DIRECT_BF16: tl.constexpr, X_PERMUTED: tl.constexpr = False,
    ):
        """Decode on tensor cores, up to BLOCK_M (16, 32 or 64) tokens per program, on the word tile of
        _fp4_gemv_words_kernel. Per shift of the words, the two decoded codes of each word are one
        MMA operand register (_joined_pair_dot): four MMAs per tile, each with K = 2 WORDS_PER_ITER. The
        activations are loaded once per tile, contiguous, and split into the matching pieces in
        registers. DIRECT_BF16 (NVFP4, bf16 activations): codes times block scale in one bf16x2
        multiply (_bf16_scaled_pair), otherwise fp32 products rounded to the activation dtype.
        The weights are decoded in the MMA's register layout; num_stages must stay 1, since
        Triton's pipeliner would stage the decoded tile through shared memory (on the H100 at 1-16
        tokens that ran slower than cuBLAS, this kernel faster). Split-K as in _fp4_gemv_words_kernel.
        X_PERMUTED: x_ptr holds permuted_activations(x) (zero-padded to K_PADDED, each tile's four
        MMA operands contiguous), loaded as they are: no split in registers, whose 2-byte shared
        stores and shuffles grow with BLOCK_M."""
        WPB: tl.constexpr = BLOCK_SIZE // 8
        W: tl.constexpr = WORDS_PER_ITER
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, scale_offs, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = _code_words(words_ptr) + word_offs
        scale_ptrs = _scale_bytes(scales_ptr) + scale_offs
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        if X_PERMUTED:  # rows >= M read row M - 1 (never stored), so the loads need no mask
            x_ptrs = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + tl.arange(0, 2 * W)[None, :]  # (BM, 2W)
        else:
            offs_k = tl.arange(0, 8 * W)
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # (BM, 8W)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(it_start, it_end):
            k0 = it * (8 * W)
            # the tile's four MMA operands of activations, one per shift of the words
            if X_PERMUTED:
                xs0 = tl.load(x_ptrs + k0)
                xs4 = tl.load(x_ptrs + k0 + 2 * W)
                xs8 = tl.load(x_ptrs + k0 + 4 * W)
                xs12 = tl.load(x_ptrs + k0 + 6 * W)
            else:
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (offs_k[None, :] + k0 < K), other=0.0)
                x0, x1, x2, x3, x4, x5, x6, x7 = _split_positions(x, BLOCK_SIZE)
            words = tl.load(word_ptrs + it * W)
            block_scale = _block_scales(tl.load(scale_ptrs + it * (W // WPB)), IS_NVFP4)
            # split pieces are interleaved at their dot: all four up front, the 16-token bf16 build
            # took 22 more instructions per step (offline sm_90)
            lo, hi = _scaled_code_pairs(words, 0, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs0 if X_PERMUTED else _interleaved(x0, x1), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 4, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs4 if X_PERMUTED else _interleaved(x2, x3), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 8, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs8 if X_PERMUTED else _interleaved(x4, x5), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 12, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs12 if X_PERMUTED else _interleaved(x6, x7), acc, UPCAST_DOT)
        acc = acc * (tl.load(global_scale_ptr) * (128.0 if DIRECT_BF16 else 1.0))  # DIRECT_BF16: undo 2^-7

        _store_token_tile(acc, offs_n, n_mask, rows, offs_m, m_mask, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr,
                          bias_ptr, counter_ptr, SPLIT_K, HAS_BIAS)

