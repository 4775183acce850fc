"""FP4 one-token decode, persistent over row groups, with the activations held in registers (Gluon, sm_80+).

The integer-dot Triton kernel (decode.py, `_fp4_gemv_int_kernel`) leaves its register layout to
Triton, which spreads a tile's rows over threads: each program then re-reads and re-rounds the
activations of its K range, with a cross-thread max per tile. Here the layout is explicit:

- every thread holds 4 consecutive code words (32 consecutive K positions) of each of a group's ROWS
  rows in each of CHUNKS chunks of 128 * num_warps words, one 16-byte load per row and chunk;
- a program rounds the whole activation row once, each thread its own 32 K positions per chunk to
  int16 with its own step (max / 32767, llama.cpp's Q8_1 blocks of 32 at 16 bits), and keeps them
  in registers for every group it owns (groups p, p + P, ... of a grid of P programs);
- the next group's words and scale bytes are loaded before the current group is decoded;
- codes become int8 lanes (PRMT table lookups, the tables held in registers) and meet the int16
  pairs in four dp2a per word; the int32 sum of each scale block is exact and scaled once.

The weight is format.py's kernel layout (NVFP4 or MXFP4) unchanged. It is not among the tuner's
candidates; bench/bench_fp4_persistent.py times it against them. Gluon runs only on a GPU: on the
CPU the tests build it offline for sm_90 (tests/kernels/test_fp4_persistent.py).
"""

from __future__ import annotations

import torch

from graphopt.kernels.launch import cdiv, launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - no Gluon in this Triton
    gluon = None
else:
    from graphopt.kernels.fp4.common import (E2M1_INT8_LANES_PTX, E2M1_NEG_HI, E2M1_NEG_LO, E2M1_POS_HI,
                                             E2M1_POS_LO)

WARPS_CHOICES = (4, 8)
MAX_WORDS_PER_THREAD = 32  # ROWS x CHUNKS x 4 words in registers, twice (the prefetch): past this, spills


def supports(x: torch.Tensor) -> bool:
    """A CUDA device of compute capability 8.0 or newer (dp2a, PRMT and cvt.rni are older still;
    Gluon's distributed layouts need 8.0) and bf16 or fp16 activations."""
    return (gluon is not None and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 8
            and x.dtype in (torch.bfloat16, torch.float16))


if gluon is not None:

    # Reductions through combine functions of this module: gl.sum / gl.max use triton.language's own
    # @jit combines, which TRITON_INTERPRET=1 (the CPU tests) turns into interpreter functions that
    # the offline sm_90 build cannot compile.
    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _larger(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _int8_lanes(words, opaque_zero):
        """decode._e2m1_int8_lanes (its PTX) on a Gluon tensor: lane i of lo = twice the e2m1
        value of nibble i, of hi that of nibble 4 + i, signed int8. opaque_zero: a runtime 0 OR-ed
        into the four table words, so that they are computed once and stay in registers (as
        constants ptxas moves each one in again at every use: 4 more instructions per word)."""
        layout: gl.constexpr = words.type.layout
        return gl.inline_asm_elementwise(
            E2M1_INT8_LANES_PTX,
            "=r,=r,r,r,r,r,r", [words, gl.full(words.shape, E2M1_POS_LO, gl.int32, layout) | opaque_zero,
                                gl.full(words.shape, E2M1_POS_HI, gl.int32, layout) | opaque_zero,
                                gl.full(words.shape, E2M1_NEG_LO, gl.int32, layout) | opaque_zero,
                                gl.full(words.shape, E2M1_NEG_HI, gl.int32, layout) | opaque_zero],
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

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
    def _activation_pairs(x_ptr, K, IS_NVFP4: gl.constexpr, CHUNKS: gl.constexpr, WARPS: gl.constexpr):
        """The whole activation row as each thread's 32 consecutive K positions per chunk, rounded to
        int16 with the thread's step (max |x| / 32767): a0..a3, each (CHUNKS, CW) int32 pairs per code
        word (the lane order of _int8_lanes: pair i = elements (4q + i, 4q + i + BS/2) of word q of a
        scale block), and the steps (CHUNKS, THREADS)."""
        THREADS: gl.constexpr = 32 * WARPS
        XL: gl.constexpr = gl.BlockedLayout([CHUNKS, 1, 32], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
        c = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        t = gl.arange(0, THREADS, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        k = c[:, None, None] * (32 * THREADS) + t[None, :, None] * 32 + e[None, None, :]
        x = gl.load(x_ptr + k, mask=k < K, other=0.0).to(gl.float32)  # (CHUNKS, THREADS, 32)
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
        return a0, a1, a2, a3, step

    @gluon.jit
    def _group_sums(words, scale_bytes, a0, a1, a2, a3, step_b, opaque_zero, IS_NVFP4: gl.constexpr,
                    BL: gl.constexpr):
        """One group's (ROWS,) fp32 sums: words (ROWS, CHUNKS, CW), scale_bytes (ROWS, CHUNKS, NB) in
        BL, the activation pairs (CHUNKS, CW) and per-block steps (CHUNKS, NB)."""
        ROWS: gl.constexpr = words.shape[0]
        CHUNKS: gl.constexpr = words.shape[1]
        WPB: gl.constexpr = 2 if IS_NVFP4 else 4
        NB: gl.constexpr = words.shape[2] // WPB
        lo, hi = _int8_lanes(words, opaque_zero)
        a0, _ = gl.broadcast(a0[None, :, :], lo)
        a1, _ = gl.broadcast(a1[None, :, :], lo)
        a2, _ = gl.broadcast(a2[None, :, :], lo)
        a3, _ = gl.broadcast(a3[None, :, :], lo)
        dots = _dp2a(a0, lo, gl.zeros(words.shape, gl.int32, words.type.layout), False)
        dots = _dp2a(a1, lo, dots, True)
        dots = _dp2a(a2, hi, dots, False)
        dots = _dp2a(a3, hi, dots, True)
        block_dots = gl.convert_layout(gl.reduce(gl.reshape(dots, [ROWS, CHUNKS, NB, WPB]), 3, _add), BL)  # exact
        if IS_NVFP4:  # e4m3 -> value * 2^-8 by bit placement
            b16 = scale_bytes.to(gl.uint16)
            block_scale = (((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)).to(gl.float16, bitcast=True).to(gl.float32)
        else:  # e8m0 -> 2^(byte - 127)
            block_scale = (scale_bytes.to(gl.uint32) << 23).to(gl.float32, bitcast=True)
        part = block_dots.to(gl.float32) * (block_scale * step_b[None, :, :])
        return gl.reduce(gl.reduce(part, 2, _add), 1, _add)

    @gluon.jit
    def _group_tile(ptrs, rows, cols_live, row0, stride, N, live):
        """The tile at ptrs (a group's first row at row 0) for the group whose first row is row0: rows
        past N, columns past the row's end, and every element when `live` is false, read as 0."""
        return gl.load(ptrs + row0 * stride, mask=cols_live & (rows + row0 < N) & live, other=0)

    @gluon.jit
    def _fp4_gemv_persistent_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr,
        N, K, K_WORDS, stride_wn, stride_sn,
        IS_NVFP4: gl.constexpr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr, CHUNKS: gl.constexpr,
        WARPS: gl.constexpr,
    ):
        """out[0, n] = x[0, :] @ W[n, :]^T (+ bias). Persistent: program p owns the row groups p, p + P,
        ... (P programs, ROWS rows each), with the whole K range (CHUNKS chunks of CW words) per
        group. The activations are rounded once per program and stay in registers; the next
        group's words and scales are loaded before the current group is reduced. Launched with
        num_warps = WARPS and K_WORDS <= CHUNKS * CW."""
        WPB: gl.constexpr = 2 if IS_NVFP4 else 4  # code words per scale block
        THREADS: gl.constexpr = 32 * WARPS
        CW: gl.constexpr = 4 * THREADS  # code words per chunk
        NB: gl.constexpr = CW // WPB  # scale blocks per chunk
        WL: gl.constexpr = gl.BlockedLayout([ROWS, CHUNKS, 4], [1, 1, 32], [1, 1, WARPS], [2, 1, 0])
        BL: gl.constexpr = gl.BlockedLayout([ROWS, CHUNKS, 4 // WPB], [1, 1, 32], [1, 1, WARPS], [2, 1, 0])
        OL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, BL))
        a0, a1, a2, a3, step = _activation_pairs(x_ptr, K, IS_NVFP4, CHUNKS, WARPS)
        a0 = gl.convert_layout(a0, gl.SliceLayout(0, WL))
        a1 = gl.convert_layout(a1, gl.SliceLayout(0, WL))
        a2 = gl.convert_layout(a2, gl.SliceLayout(0, WL))
        a3 = gl.convert_layout(a3, gl.SliceLayout(0, WL))
        if IS_NVFP4:  # a thread's step covers its 2 blocks
            step_b = gl.reshape(gl.join(step, step), [CHUNKS, NB])
        else:
            step_b = step
        step_b = gl.convert_layout(step_b, gl.SliceLayout(0, BL))
        # word and scale offsets of a group's first row, in the words' and the blocks' layouts
        r_w = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
        c_w = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
        w_w = gl.arange(0, CW, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
        col_w = c_w[None, :, None] * CW + w_w[None, None, :]
        word_offs = r_w[:, None, None] * stride_wn + col_w
        r_b = gl.arange(0, ROWS, layout=OL)
        c_b = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
        b_b = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
        col_b = c_b[None, :, None] * NB + b_b[None, None, :]
        scale_offs = r_b[:, None, None] * stride_sn + col_b
        word_ptrs = words_ptr.to(gl.pointer_type(gl.int32)) + word_offs
        scale_ptrs = scales_ptr.to(gl.pointer_type(gl.uint8)) + scale_offs
        word_rows, word_cols_live = r_w[:, None, None], col_w < K_WORDS
        scale_rows, scale_cols_live = r_b[:, None, None], col_b < K_WORDS // WPB
        multiplier = gl.load(global_scale_ptr) * (128.0 if IS_NVFP4 else 0.5)  # doubled codes; e4m3's 2^-8
        opaque_zero = N >> 31  # N >= 1
        groups = gl.cdiv(N, ROWS)
        step_g = gl.num_programs(0)
        row0 = gl.program_id(0) * ROWS  # the grid has at most `groups` programs
        words = _group_tile(word_ptrs, word_rows, word_cols_live, row0, stride_wn, N, True)
        scale_bytes = _group_tile(scale_ptrs, scale_rows, scale_cols_live, row0, stride_sn, N, True)
        for g in range(gl.program_id(0), groups, step_g):
            nxt = g + step_g
            nxt0 = gl.minimum(nxt, groups - 1) * ROWS
            next_words = _group_tile(word_ptrs, word_rows, word_cols_live, nxt0, stride_wn, N, nxt < groups)
            next_scale_bytes = _group_tile(scale_ptrs, scale_rows, scale_cols_live, nxt0, stride_sn, N, nxt < groups)
            total = _group_sums(words, scale_bytes, a0, a1, a2, a3, step_b, opaque_zero, IS_NVFP4, BL) * multiplier
            offs_n = g * ROWS + r_b
            if HAS_BIAS:
                total += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            gl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)
            words = next_words
            scale_bytes = next_scale_bytes


def chunks_for(k_padded: int, num_warps: int) -> int:
    """Chunks of 128 * num_warps code words that cover a row of k_padded codes, rounded up to a
    power of two (a tensor extent)."""
    need = cdiv(k_padded // 8, 128 * num_warps)
    return 1 << (need - 1).bit_length()


def fp4_gemv_persistent(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_features: int, in_features: int, format: str, rows: int = 8,
                        num_warps: int = 4, programs_per_sm: int = 4) -> torch.Tensor:
    """(1, K) x -> (1, N) in x's dtype for a kernel-layout FP4 weight (format.to_kernel_layout):
    min(N / rows, SMs x programs_per_sm) programs, each over every rows-th group of rows."""
    if format not in ("nvfp4", "mxfp4"):
        raise ValueError(f"format {format!r}: expected 'nvfp4' or 'mxfp4'")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != in_features:
        raise ValueError(f"x of shape {tuple(x.shape)}: expected (1, {in_features})")
    if num_warps not in WARPS_CHOICES or rows < 1 or rows & (rows - 1) or programs_per_sm < 1:
        raise ValueError(f"rows {rows}, num_warps {num_warps}, programs_per_sm {programs_per_sm}: expected "
                         f"power-of-two rows, num_warps in {WARPS_CHOICES}, programs_per_sm >= 1")
    k_words = codes.shape[1] // 4
    chunks = chunks_for(codes.shape[1] * 2, num_warps)
    if rows * chunks * 4 > MAX_WORDS_PER_THREAD:
        raise ValueError(f"rows {rows} x {chunks} chunks of K {in_features} at num_warps {num_warps} hold "
                         f"{rows * chunks * 4} words per thread, at most {MAX_WORDS_PER_THREAD}: fewer rows or more "
                         f"warps")
    if not supports(x):
        raise ValueError(f"x on {x.device} as {x.dtype}: this Gluon kernel needs a CUDA GPU of compute capability 8.0 "
                         "or newer and bf16 or fp16 activations")
    x = x.contiguous()
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(cdiv(out_features, rows), sms * programs_per_sm),)
    launch(_fp4_gemv_persistent_kernel, grid, x, codes, scales, global_scale, bias if bias is not None else out, out,
           out_features, in_features, k_words, k_words, scales.stride(0), IS_NVFP4=format == "nvfp4",
           HAS_BIAS=bias is not None, ROWS=rows, CHUNKS=chunks, WARPS=num_warps, num_warps=num_warps)
    return out
