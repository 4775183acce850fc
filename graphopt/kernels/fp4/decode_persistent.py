"""FP4 one-token decode, persistent, each warp owning whole rows (Gluon, sm_80+).

The integer-dot Triton kernel (decode.py, `_fp4_gemv_int_kernel`) leaves its register layout to
Triton: a tile's rows are spread over warps (a barrier and a shared-memory reduction per tile), and
every program re-reads and re-rounds the activations of its K range. Here the layout is explicit:

- a program rounds the activation row once, into shared memory: each 32 consecutive K positions
  to int16 with their own step (max / 32767, llama.cpp's Q8_1 blocks of 32 at 16 bits), stored as
  the int16 pairs that meet each code word;
- each warp owns ROWS rows of a group of ROWS x num_warps, and walks K in chunks of 128 code words
  (4 per lane: one 16-byte load per row), so a row's sum is reduced inside its warp;
- the chunk loop is unrolled (shared memory is read at constant offsets) and the words and scale
  bytes DEPTH chunks ahead are loaded before a chunk is decoded, across the end of a group into the
  program's next one (programs p, p + P, ... of a persistent grid of P); the first DEPTH chunks are
  requested before the activations are rounded, so a short row (K = 4096 is 4 chunks) is in flight
  whole while the program's prologue runs;
- codes become int8 lanes of their magnitudes (PRMT lookups in one table held in registers) and
  the same lanes kept where the sign is set; both meet the int16 pairs in dp2a (eight per word), and
  a block's value is dot(magnitudes) - 2 dot(negative ones): the integer pipe, which bounds this
  kernel, does two PRMT a word fewer than with a signed table (its two selects become two ANDs),
  and the four extra dp2a run on the FMA pipe. The int32 sum of each scale block is exact and scaled once; NVFP4's
  e4m3 block scales are converted two at a time by cvt (sm_89+);
- where the rows fill whole groups and K whole chunks (LLaMA's layers), the tiles are loaded
  without masks: the look-ahead past a program's last group re-reads the last group instead.

The weight is format.py's kernel layout (NVFP4 or MXFP4) unchanged. The FP4 tuner times it for one token
where Gluon tiles are allowed (KernelConfig.programs_per_sm; under CUDA graphs), and graphopt::fp4_gluon_linear
launches it: Inductor cannot emit a Gluon kernel from its generated code. Gluon runs only on a GPU: on
the CPU the tests build it offline for sm_90 (tests/kernels/test_fp4_persistent.py).
"""

from __future__ import annotations

import torch

from graphopt.hardware import compute_capability, sm_count
from graphopt.kernels.dependent_launch import dependent_launch
from graphopt.kernels.launch import cdiv, launch
from graphopt.kernels.linear_fusion import NO_FUSION, LinearFusion

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - no Gluon in this Triton
    gluon = None
else:
    from graphopt.kernels.fp4.common import E2M1_MAGNITUDES_PTX, E2M1_POS_HI, E2M1_POS_LO
    from graphopt.kernels.dependent_launch import release_next_grid, wait_for_previous_grid
    from graphopt.kernels.fp4_tma import _cta_barrier

ROWS_CHOICES = (1, 2, 4, 8)
WARPS_CHOICES = (1, 2, 4, 8)
DEPTH_CHOICES = (1, 2, 3, 4, 5, 6, 7)
CHUNK_WORDS = 128  # code words per chunk: 4 per lane
MAX_ROWS_IN_FLIGHT = 8  # rows x (depth + 1) chunks of words in registers: past this, ptxas spills at K = 14336


def supports(x: torch.Tensor) -> bool:
    """A CUDA device of compute capability 8.0 or newer (dp2a, PRMT and cvt.rni are older still;
    Gluon's distributed layouts need 8.0) and bf16 or fp16 activations."""
    return (gluon is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and compute_capability(x.get_device())[0] >= 8)


if gluon is not None:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _larger(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _magnitudes(words, opaque_zero):
        """E2M1_MAGNITUDES_PTX on a Gluon tensor: (lo, hi, neg_lo, neg_hi), lane i of lo twice the e2m1
        magnitude of nibble i, of hi that of nibble 4 + i; neg_lo / neg_hi those lanes where the
        nibble is negative, 0 elsewhere. opaque_zero: a runtime 0 OR-ed into the two table words, so
        that they are computed once and stay in registers (as constants ptxas moves each one in
        again at every use)."""
        layout: gl.constexpr = words.type.layout
        return gl.inline_asm_elementwise(
            E2M1_MAGNITUDES_PTX,
            "=r,=r,=r,=r,r,r,r", [words, gl.full(words.shape, E2M1_POS_LO, gl.int32, layout) | opaque_zero,
                                  gl.full(words.shape, E2M1_POS_HI, gl.int32, layout) | opaque_zero],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _dp2a(a, b, c, HI: gl.constexpr):
        """decode._dp2a's PTX on Gluon tensors: c + a.h0 * b.byte(i) + a.h1 * b.byte(i + 1), i = 2 if HI else 0."""
        asm: gl.constexpr = "dp2a.hi.s32.s32 $0, $1, $2, $3;" if HI else "dp2a.lo.s32.s32 $0, $1, $2, $3;"
        return gl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, c], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _round_to_int(v):
        """fp32 -> int32, to nearest even (one cvt)."""
        return gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,f", [v], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _activation_pairs(x_ptr, norm_ptr, K, IS_NVFP4: gl.constexpr, CHUNKS: gl.constexpr, WARPS: gl.constexpr,
                          NORM: gl.constexpr):
        """CHUNKS x 32 x WARPS units of 32 consecutive K positions, one per thread and chunk, rounded to
        int16 with the unit's step (max |x| / 32767): a0..a3, each (CHUNKS, 4 x THREADS) int32 pairs per
        code word (the lane order of _magnitudes: pair i = elements (4q + i, 4q + i + BS/2) of word q
        of a scale block), the steps (CHUNKS, THREADS), and the sum of the squares of x (0.0 unless
        NORM). NORM: x is x * norm (the norm weight), its squares summed before; the row's 1 / rms, a
        common factor of every unit, is left to the caller."""
        THREADS: gl.constexpr = 32 * WARPS
        XL: gl.constexpr = gl.BlockedLayout([CHUNKS, 1, 32], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
        c = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        t = gl.arange(0, THREADS, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        k = c[:, None, None] * (32 * THREADS) + t[None, :, None] * 32 + e[None, None, :]
        x = gl.load(x_ptr + k, mask=k < K, other=0.0).to(gl.float32)  # (CHUNKS, THREADS, 32)
        squares = 0.0
        if NORM:
            squares = gl.reduce(gl.reduce(gl.reduce(x * x, 2, _add), 1, _add), 0, _add)
            x = x * gl.load(norm_ptr + k, mask=k < K, other=0.0).to(gl.float32)
        amax = gl.reduce(gl.abs(x), 2, _larger)
        step = gl.where(amax > 0, amax * (1.0 / 32767.0), 1.0)
        inv = gl.where(amax > 0, 32767.0 / amax, 0.0)
        q = _round_to_int(x * inv[:, :, None])
        if IS_NVFP4:  # e = 16 * (word // 2) + 8 * half + 4 * (word % 2) + i
            q = gl.permute(gl.reshape(q, [CHUNKS, THREADS, 2, 2, 2, 4]), [0, 1, 2, 4, 5, 3])
        else:  # MXFP4: e = 16 * half + 4 * word + i
            q = gl.permute(gl.reshape(q, [CHUNKS, THREADS, 2, 4, 4]), [0, 1, 3, 4, 2])
        low, high = gl.split(gl.reshape(q, [CHUNKS, 4 * THREADS, 4, 2]))
        pairs = (low & 0xFFFF) | (high << 16)  # (CHUNKS, words, 4)
        p01, p23 = gl.split(gl.permute(gl.reshape(pairs, [CHUNKS, 4 * THREADS, 2, 2]), [0, 1, 3, 2]))  # by i // 2
        a0, a1 = gl.split(p01)
        a2, a3 = gl.split(p23)
        return a0, a1, a2, a3, step, squares

    @gluon.jit
    def _chunk_tile(ptrs, rows, cols, row0, col0, stride, N, COLS, live, EVEN: gl.constexpr):
        """The (rows, cols) tile at ptrs + row0 * stride + col0: rows past N, columns past COLS, and
        every element when `live` is false, read as 0. EVEN: the caller guarantees that the tile lies
        inside (N, COLS) and wants it whole, so it is loaded without a mask."""
        if EVEN:
            return gl.load(ptrs + row0 * stride + col0)
        else:
            mask = (rows[:, None] + row0 < N) & (cols[None, :] + col0 < COLS) & live
            return gl.load(ptrs + row0 * stride + col0, mask=mask, other=0)

    @gluon.jit
    def _word_slots(t, NB: gl.constexpr, WPB: gl.constexpr):
        """(GROUP, NB x WPB) -> WPB tensors (GROUP, NB): the words of every scale block at one
        position (in some order; the block sums do not depend on it)."""
        GROUP: gl.constexpr = t.shape[0]
        if WPB == 2:
            first, second = gl.split(gl.reshape(t, [GROUP, NB, 2]))
            return (first, second)
        else:
            even, odd = gl.split(gl.reshape(t, [GROUP, NB, 2, 2]))
            w0, w2 = gl.split(even)
            w1, w3 = gl.split(odd)
            return (w0, w1, w2, w3)

    @gluon.jit
    def _chunk_sums(words, scale_bytes, a0, a1, a2, a3, step, opaque_zero, IS_NVFP4: gl.constexpr,
                    E4M3_CVT: gl.constexpr, BL: gl.constexpr):
        """(GROUP, NB) fp32 block sums of one chunk: words (GROUP, CW) and scale bytes (GROUP, NB) in their
        layouts, the chunk's activation pairs (1, CW) and steps (1, NB) in the same ones. NVFP4's scales
        come out as their value (E4M3_CVT) or as value * 2^-8 (bit placement, before sm_89)."""
        GROUP: gl.constexpr = words.shape[0]
        WPB: gl.constexpr = 2 if IS_NVFP4 else 4
        NB: gl.constexpr = words.shape[1] // WPB
        a0, _ = gl.broadcast(a0, words)
        a1, _ = gl.broadcast(a1, words)
        a2, _ = gl.broadcast(a2, words)
        a3, _ = gl.broadcast(a3, words)
        # one dp2a chain per scale block, over its words (a thread holds whole blocks): no zeroed
        # accumulator per word and no sum of the words' dots after
        slots, s0, s1, s2, s3 = _word_slots(words, NB, WPB), _word_slots(a0, NB, WPB), _word_slots(a1, NB, WPB), \
            _word_slots(a2, NB, WPB), _word_slots(a3, NB, WPB)
        dots = gl.full(slots[0].shape, 0, gl.int32, slots[0].type.layout)
        negatives = gl.full(slots[0].shape, 0, gl.int32, slots[0].type.layout)
        for j in gl.static_range(WPB):
            lo, hi, neg_lo, neg_hi = _magnitudes(slots[j], opaque_zero)
            dots = _dp2a(s0[j], lo, dots, False)
            dots = _dp2a(s1[j], lo, dots, True)
            dots = _dp2a(s2[j], hi, dots, False)
            dots = _dp2a(s3[j], hi, dots, True)
            negatives = _dp2a(s0[j], neg_lo, negatives, False)
            negatives = _dp2a(s1[j], neg_lo, negatives, True)
            negatives = _dp2a(s2[j], neg_hi, negatives, False)
            negatives = _dp2a(s3[j], neg_hi, negatives, True)
        block_dots = gl.convert_layout(dots - 2 * negatives, BL)  # exact
        if IS_NVFP4 and E4M3_CVT:  # two e4m3 bytes -> two fp16 values in one instruction
            block_scale = gl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [scale_bytes],
                                                    dtype=gl.float16, is_pure=True, pack=2).to(gl.float32)
        elif IS_NVFP4:  # e4m3 -> value * 2^-8 by bit placement
            b16 = scale_bytes.to(gl.uint16)
            block_scale = (((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)).to(gl.float16, bitcast=True).to(gl.float32)
        else:  # e8m0 -> 2^(byte - 127)
            block_scale = (scale_bytes.to(gl.uint32) << 23).to(gl.float32, bitcast=True)
        return block_dots.to(gl.float32) * (block_scale * step)

    @gluon.jit
    def _fp4_gemv_persistent_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
        N, K, K_WORDS, stride_wn, stride_sn, norm_eps,
        IS_NVFP4: gl.constexpr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
        K_CHUNKS: gl.constexpr, CHUNKS_PAD: gl.constexpr, DEPTH: gl.constexpr, EVEN: gl.constexpr,
        E4M3_CVT: gl.constexpr, GATED: gl.constexpr, NORM: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
        DEPENDENT: gl.constexpr,
    ):
        """out[0, n] = x[0, :] @ W[n, :]^T (+ bias) (+ residual[0, n]), with linear_fusion's neighbours:
        NORM, x -> rms_norm(x) * norm (the 1 / rms scales the dot, not the bias or the residual); GATED,
        rows 2j and 2j + 1 of W are gate j and up j -> out[0, j] = silu(gate) * up (N / 2 outputs; a
        warp's ROWS >= 2 rows hold whole pairs, so a thread has both values). Program p owns the groups p, p + P, ... of
        ROWS x WARPS rows; warp w the rows w * ROWS ... of each. K_CHUNKS chunks of CW words cover a row; the
        activations' shared memory holds CHUNKS_PAD >= K_CHUNKS of them (`chunks`: a power of two, at
        least WARPS). EVEN: N is a multiple of the group and K_WORDS of CW (tiles unmasked; look-ahead
        rows past the last group clamped to it). E4M3_CVT: NVFP4 scales by cvt (sm_89+). DEPENDENT: launched
        as a dependent of the kernel before it (dependent_launch): only the weights are read before the wait."""
        WPB: gl.constexpr = 2 if IS_NVFP4 else 4  # code words per scale block
        CW: gl.constexpr = 128  # code words per chunk (CHUNK_WORDS)
        NB: gl.constexpr = CW // WPB  # scale blocks per chunk
        GROUP: gl.constexpr = ROWS * WARPS
        WL: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [WARPS, 1], [1, 0])
        BL: gl.constexpr = gl.BlockedLayout([ROWS, 4 // WPB], [1, 32], [WARPS, 1], [1, 0])
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        pairs_smem = gl.allocate_shared_memory(gl.int32, [4 * CHUNKS_PAD, CW], PLAIN)  # a0 chunks, a1 chunks, ...
        steps_smem = gl.allocate_shared_memory(gl.float32, [CHUNKS_PAD, NB], PLAIN)
        r_w = gl.arange(0, GROUP, layout=gl.SliceLayout(1, WL))
        w_w = gl.arange(0, CW, layout=gl.SliceLayout(0, WL))
        r_b = gl.arange(0, GROUP, layout=gl.SliceLayout(1, BL))
        b_b = gl.arange(0, NB, layout=gl.SliceLayout(0, BL))
        word_ptrs = words_ptr.to(gl.pointer_type(gl.int32)) + r_w[:, None] * stride_wn + w_w[None, :]
        scale_ptrs = scales_ptr.to(gl.pointer_type(gl.uint8)) + r_b[:, None] * stride_sn + b_b[None, :]
        groups = gl.cdiv(N, GROUP)
        last_row = (groups - 1) * GROUP
        programs = gl.num_programs(0)
        first = gl.program_id(0)  # the grid has at most `groups` programs
        # the first DEPTH chunks of the program's flattened (group, chunk) sequence (chunk t: group
        # first + (t // K_CHUNKS) * programs), issued before the activations are rounded so that
        # their loads overlap it
        ring = ()
        for t in gl.static_range(DEPTH):
            row = (first + t // K_CHUNKS * programs) * GROUP
            if EVEN:
                row = gl.minimum(row, last_row)
            ring = ring + ((_chunk_tile(word_ptrs, r_w, w_w, row, t % K_CHUNKS * CW, stride_wn, N, K_WORDS, row < N,
                                        EVEN),
                            _chunk_tile(scale_ptrs, r_b, b_b, row, t % K_CHUNKS * NB, stride_sn, N, K_WORDS // WPB,
                                        row < N, EVEN)),)
        if DEPENDENT:  # x, the residual and out's memory belong to the kernels around this one
            wait_for_previous_grid()
            release_next_grid()
        # WARPS chunks at a time (a chunk per warp), to bound the registers
        squares = 0.0
        for s in gl.static_range(CHUNKS_PAD // WARPS):
            offset = s * WARPS * CW * 8
            p0, p1, p2, p3, unit_step, part = _activation_pairs(x_ptr + offset, norm_ptr + offset, K - offset,
                                                                IS_NVFP4, 1, WARPS, NORM)
            squares += part
            pairs_smem.slice(0 * CHUNKS_PAD + s * WARPS, WARPS).store(gl.reshape(p0, [WARPS, CW]))
            pairs_smem.slice(1 * CHUNKS_PAD + s * WARPS, WARPS).store(gl.reshape(p1, [WARPS, CW]))
            pairs_smem.slice(2 * CHUNKS_PAD + s * WARPS, WARPS).store(gl.reshape(p2, [WARPS, CW]))
            pairs_smem.slice(3 * CHUNKS_PAD + s * WARPS, WARPS).store(gl.reshape(p3, [WARPS, CW]))
            if IS_NVFP4:  # a unit's step covers its 2 blocks
                steps_smem.slice(s * WARPS, WARPS).store(gl.reshape(gl.join(unit_step, unit_step), [WARPS, NB]))
            else:
                steps_smem.slice(s * WARPS, WARPS).store(gl.reshape(unit_step, [WARPS, NB]))
        _cta_barrier()
        # doubled codes; the 2^-8 of e4m3 by bit placement
        multiplier = gl.load(global_scale_ptr) * (128.0 if IS_NVFP4 and not E4M3_CVT else 0.5)
        if NORM:
            multiplier = multiplier * gl.rsqrt(squares / K + norm_eps)
        opaque_zero = N >> 31  # N >= 1
        for g in range(first, groups, programs):
            acc = gl.full([GROUP, NB], 0.0, gl.float32, BL)
            for c in gl.static_range(K_CHUNKS):
                ahead_row = (g + (c + DEPTH) // K_CHUNKS * programs) * GROUP  # c is a constant here
                if EVEN:
                    ahead_row = gl.minimum(ahead_row, last_row)
                ahead = (_chunk_tile(word_ptrs, r_w, w_w, ahead_row, (c + DEPTH) % K_CHUNKS * CW, stride_wn, N,
                                     K_WORDS, ahead_row < N, EVEN),
                         _chunk_tile(scale_ptrs, r_b, b_b, ahead_row, (c + DEPTH) % K_CHUNKS * NB, stride_sn, N,
                                     K_WORDS // WPB, ahead_row < N, EVEN))
                a0 = pairs_smem.slice(0 * CHUNKS_PAD + c, 1).load(WL)
                a1 = pairs_smem.slice(1 * CHUNKS_PAD + c, 1).load(WL)
                a2 = pairs_smem.slice(2 * CHUNKS_PAD + c, 1).load(WL)
                a3 = pairs_smem.slice(3 * CHUNKS_PAD + c, 1).load(WL)
                step = steps_smem.slice(c, 1).load(BL)
                acc += _chunk_sums(ring[0][0], ring[0][1], a0, a1, a2, a3, step, opaque_zero, IS_NVFP4, E4M3_CVT, BL)
                ring = ring[1:] + (ahead,)
            if GATED:  # a thread's rows 2j, 2j + 1 (gate j, up j) -> its two (GROUP / 2, NB) halves
                gate_acc, up_acc = gl.split(gl.permute(gl.reshape(acc, [GROUP // 2, 2, NB]), [0, 2, 1]))
                gate = gl.reduce(gate_acc, 1, _add) * multiplier
                up = gl.reduce(up_acc, 1, _add) * multiplier
                offs_n = g * (GROUP // 2) + gl.arange(0, GROUP // 2, layout=gate.type.layout)
                n_out = N // 2
                if HAS_BIAS:
                    gate += gl.load(bias_ptr + 2 * offs_n, mask=offs_n < n_out, other=0.0).to(gl.float32)
                    up += gl.load(bias_ptr + 2 * offs_n + 1, mask=offs_n < n_out, other=0.0).to(gl.float32)
                total = gate / (1.0 + gl.exp(-gate)) * up  # the model's act_fn(gate_proj(x)) * up_proj(x)
            else:
                offs_n = g * GROUP + r_b
                n_out = N
                total = gl.reduce(acc, 1, _add) * multiplier
                if HAS_BIAS:
                    total += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            if HAS_RESIDUAL:
                total += gl.load(residual_ptr + offs_n, mask=offs_n < n_out, other=0.0).to(gl.float32)
            gl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < n_out)


def chunks(k_padded: int, num_warps: int) -> tuple[int, int]:
    """(chunks of CHUNK_WORDS code words that cover a row of k_padded codes, the chunks the activations'
    shared memory holds: a power of two (a shape Gluon lays out) and at least num_warps (the warps
    round them num_warps chunks at a time))."""
    k_chunks = cdiv(k_padded // 8, CHUNK_WORDS)
    return k_chunks, max(1 << (k_chunks - 1).bit_length(), num_warps)


def tile_problem(rows: int, num_warps: int, depth: int, programs_per_sm: int) -> str | None:
    """What makes a tile one the persistent kernels (FP4 and Q4) do not take, or None: the launchers
    raise it, the tuners' tile rules (fp4 and q4 configs) leave such tiles out."""
    if rows not in ROWS_CHOICES or num_warps not in WARPS_CHOICES or depth not in DEPTH_CHOICES or programs_per_sm < 1:
        return (f"rows {rows}, num_warps {num_warps}, depth {depth}, programs_per_sm {programs_per_sm}: expected rows "
                f"in {ROWS_CHOICES}, num_warps in {WARPS_CHOICES}, depth in {DEPTH_CHOICES}, programs_per_sm >= 1")
    if rows * (depth + 1) > MAX_ROWS_IN_FLIGHT:
        return (f"rows {rows} at depth {depth} keep {rows * (depth + 1)} rows of words in registers, at most "
                f"{MAX_ROWS_IN_FLIGHT}: fewer rows or a smaller depth")
    return None


def check_tile(x: torch.Tensor, rows: int, num_warps: int, depth: int, programs_per_sm: int) -> None:
    """The launch checks the persistent kernels share: a tile the kernels take, and x where they run.
    `supports` is this module's (bf16 / fp16 on an sm_80+ GPU), which the Q4 kernel shares."""
    if (problem := tile_problem(rows, num_warps, depth, programs_per_sm)) is not None:
        raise ValueError(problem)
    if not supports(x):
        raise ValueError(f"x on {x.device} as {x.dtype}: this Gluon kernel needs a CUDA GPU of compute capability 8.0 "
                         "or newer and bf16 or fp16 activations")


def persistent_grid(device_index: int, out_features: int, rows: int, num_warps: int, programs_per_sm: int):
    """One program per group of rows x num_warps rows, at most programs_per_sm per SM of CUDA device
    `device_index`."""
    sms = sm_count(device_index)
    return (min(cdiv(out_features, rows * num_warps), sms * programs_per_sm),)


def fp4_gemv_persistent(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_features: int, in_features: int, format: str, rows: int = 4,
                        num_warps: int = 4, programs_per_sm: int = 4, depth: int = 1,
                        fusion: LinearFusion = NO_FUSION, max_registers: int = 0,
                        dependent: bool = False) -> torch.Tensor:
    """(1, K) x -> (1, N) in x's dtype for a kernel-layout FP4 weight (format.to_kernel_layout): each warp
    owns `rows` rows, min(N / (rows x num_warps), SMs x programs_per_sm) programs; `depth`: chunks loaded
    ahead of the one decoded. `fusion`: the neighbours taken in (linear_fusion; gated: the weight's rows
    interleave gate and up, the output is (1, N / 2), and `rows` must be even). `max_registers` > 0:
    ptxas's register cap per thread. `dependent`: x is another one-token call's output (the passes say
    so): launched as the dependent of the kernel before it (dependent_launch), where the GPU allows."""
    if format not in ("nvfp4", "mxfp4"):
        raise ValueError(f"format {format!r}: expected 'nvfp4' or 'mxfp4'")
    if max_registers and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers {max_registers}: expected 0 (no cap) or 24..255")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != in_features:
        raise ValueError(f"x of shape {tuple(x.shape)}: expected (1, {in_features})")
    check_tile(x, rows, num_warps, depth, programs_per_sm)
    if fusion.gated and (rows % 2 or out_features % 2):
        raise ValueError(f"a gated epilogue needs whole (gate, up) row pairs in a warp: rows {rows} and out_features "
                         f"{out_features} must be even")
    k_words = codes.shape[1] // 4
    k_chunks, chunks_pad = chunks(codes.shape[1] * 2, num_warps)
    x = x.contiguous()
    out = torch.empty((1, fusion.output_width(out_features)), dtype=x.dtype, device=x.device)
    norm_weight = fusion.norm_weight.contiguous() if fusion.norm_weight is not None else x
    residual = fusion.residual.contiguous() if fusion.residual is not None else out
    device = x.get_device()
    grid = persistent_grid(device, out_features, rows, num_warps, programs_per_sm)
    launch(_fp4_gemv_persistent_kernel, grid, x, codes, scales, global_scale, bias if bias is not None else out,
           norm_weight, residual, out, out_features, in_features, k_words, k_words, scales.stride(0), fusion.norm_eps,
           IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, ROWS=rows, WARPS=num_warps, K_CHUNKS=k_chunks,
           CHUNKS_PAD=chunks_pad, DEPTH=depth,
           EVEN=out_features % (rows * num_warps) == 0 and k_words == k_chunks * CHUNK_WORDS,
           E4M3_CVT=compute_capability(device) >= (8, 9), GATED=fusion.gated, NORM=fusion.norm_weight is not None,
           HAS_RESIDUAL=fusion.residual is not None, DEPENDENT=(dependent := dependent and dependent_launch(device)),
           num_warps=num_warps, launch_pdl=dependent, **({"maxnreg": max_registers} if max_registers else {}))
    return out
