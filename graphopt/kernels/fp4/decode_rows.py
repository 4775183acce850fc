"""FP4 one-token decode with the rows of a program held per thread (Gluon, sm_80+).

`_fp4_gemv_int_kernel` (decode.py) leaves its register layout to Triton, which spreads a tile's
rows over threads: every thread then converts the activations of its own word columns for one or
two rows only, and that conversion, with the cross-thread max of each tile's activations, costs
about as many instructions as the integer dot products themselves. Here the layout is explicit:

- a program owns ROWS weight rows and streams them along K in chunks of 128 * num_warps code
  words per row; each thread holds 4 consecutive words (32 consecutive K positions) of every one
  of the ROWS rows, so one 16-byte load per row and thread;
- the 32 activations a thread needs are one contiguous 64-byte read, rounded to int16 with the
  thread's own step (its max / 32767, like llama.cpp's Q8_1 blocks of 32, but 16 bits), and reused
  by all ROWS rows;
- codes become int8 lanes (decode._e2m1_int8_lanes' PRMT table lookup) and meet the int16 pairs
  in four dp2a per word; the int32 sum of each scale block is exact and is scaled once per block
  (block scale times the thread's step); rows are reduced across threads once per program.

The weight is the kernel layout of format.py (NVFP4 or MXFP4) unchanged. Gluon runs only on a
GPU: on the CPU the kernel is built offline for sm_90 by the tests (tests/kernels/test_fp4_rows.py).
"""

from __future__ import annotations

import torch

from graphopt.kernels.launch import cdiv, launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - no Gluon in this Triton
    gluon = None

ROWS_CHOICES = (4, 8, 16)
WARPS_CHOICES = (2, 4)


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
        """decode._e2m1_int8_lanes (PTX path) on a Gluon tensor: lane i of lo = twice the e2m1
        value of nibble i, of hi that of nibble 4 + i, signed int8. opaque_zero: a runtime 0 OR-ed
        into the four table words, so that they are computed once and stay in registers (as
        constants ptxas moves each one in again at every use: 4 more instructions per word)."""
        layout: gl.constexpr = words.type.layout
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 sel_lo, sel_hi, w_hi, w4, pos_lo, pos_hi, neg_lo, neg_hi, m_lo, m_hi;
            and.b32 sel_lo, $2, 0x7777;
            shr.u32 w_hi, $2, 16;
            and.b32 sel_hi, w_hi, 0x7777;
            prmt.b32 pos_lo, $3, $4, sel_lo;
            prmt.b32 pos_hi, $3, $4, sel_hi;
            prmt.b32 neg_lo, $5, $6, sel_lo;
            prmt.b32 neg_hi, $5, $6, sel_hi;
            shl.b32 w4, $2, 4;
            prmt.b32 m_lo, $2, w4, 0x9D8C;
            prmt.b32 m_hi, $2, w4, 0xBFAE;
            lop3.b32 $0, pos_lo, neg_lo, m_lo, 0xD8;
            lop3.b32 $1, pos_hi, neg_hi, m_hi, 0xD8;
            }""",
            "=r,=r,r,r,r,r,r", [words, gl.full(words.shape, 0x03020100, gl.int32, layout) | opaque_zero,
                                gl.full(words.shape, 0x0C080604, gl.int32, layout) | opaque_zero,
                                gl.full(words.shape, -33620224, gl.int32, layout) | opaque_zero,  # 0xFDFEFF00
                                gl.full(words.shape, -185009412, gl.int32, layout) | opaque_zero],  # 0xF4F8FAFC
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _dp2a(a, b, c, HI: gl.constexpr):
        """c + a.h0 * b.byte(i) + a.h1 * b.byte(i + 1), signed, i = 2 if HI else 0."""
        if HI:
            return gl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=gl.int32, is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _round_to_int(v):
        """fp32 -> int32, to nearest even (one cvt)."""
        return gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,f", [v], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _activation_pairs(x_ptr, chunk_k0, K, IS_NVFP4: gl.constexpr, THREADS: gl.constexpr, WARPS: gl.constexpr):
        """The chunk's activations as each thread's 32 consecutive K positions, rounded to int16
        with the thread's step (max |x| / 32767): returns a0..a3, each (4 * THREADS,) int32 pairs per
        code word (the lane order of _int8_lanes: pair i = elements (4q + i, 4q + i + BS/2) of word
        q of a scale block), and the step per thread (THREADS,)."""
        XL: gl.constexpr = gl.BlockedLayout([1, 32], [32, 1], [WARPS, 1], [1, 0])
        t = gl.arange(0, THREADS, layout=gl.SliceLayout(1, XL))
        e = gl.arange(0, 32, layout=gl.SliceLayout(0, XL))
        k = chunk_k0 + t[:, None] * 32 + e[None, :]
        x = gl.load(x_ptr + k, mask=k < K, other=0.0).to(gl.float32)  # (THREADS, 32)
        amax = gl.reduce(gl.abs(x), 1, _larger)
        step = gl.where(amax > 0, amax * (1.0 / 32767.0), 1.0)
        inv = gl.where(amax > 0, 32767.0 / amax, 0.0)
        q = _round_to_int(x * inv[:, None])
        if IS_NVFP4:  # e = 16 * (word // 2) + 8 * half + 4 * (word % 2) + i
            q = gl.permute(gl.reshape(q, [THREADS, 2, 2, 2, 4]), [0, 1, 3, 4, 2])  # (t, word // 2, word % 2, i, half)
        else:  # MXFP4: e = 16 * half + 4 * word + i
            q = gl.permute(gl.reshape(q, [THREADS, 2, 4, 4]), [0, 2, 3, 1])  # (t, word, i, half)
        low, high = gl.split(gl.reshape(q, [4 * THREADS, 4, 2]))
        pairs = (low & 0xFFFF) | (high << 16)  # (words, 4)
        p01, p23 = gl.split(gl.permute(gl.reshape(pairs, [4 * THREADS, 2, 2]), [0, 2, 1]))  # by i // 2
        a0, a1 = gl.split(p01)
        a2, a3 = gl.split(p23)
        return a0, a1, a2, a3, step

    @gluon.jit
    def _fp4_gemv_rows_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr,
        N, K, K_WORDS, stride_wn, stride_sn,
        IS_NVFP4: gl.constexpr, HAS_BIAS: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
    ):
        """out[0, n] = x[0, :] @ W[n, :]^T (+ bias) for rows n of this program; grid (N / ROWS,);
        launched with num_warps = WARPS."""
        WPB: gl.constexpr = 2 if IS_NVFP4 else 4  # code words per scale block
        THREADS: gl.constexpr = 32 * WARPS
        CW: gl.constexpr = 4 * THREADS  # code words per row and chunk
        NB: gl.constexpr = CW // WPB  # scale blocks per row and chunk
        WL: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [1, WARPS], [1, 0])
        BL: gl.constexpr = gl.BlockedLayout([ROWS, 4 // WPB], [1, 32], [1, WARPS], [1, 0])
        rows_w = gl.minimum(gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, WL)), N - 1)
        cols_w = gl.arange(0, CW, layout=gl.SliceLayout(0, WL))
        word_ptrs = words_ptr.to(gl.pointer_type(gl.int32)) + rows_w[:, None] * stride_wn + cols_w[None, :]
        rows_b = gl.minimum(gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BL)), N - 1)
        cols_b = gl.arange(0, NB, layout=gl.SliceLayout(0, BL))
        scale_ptrs = scales_ptr.to(gl.pointer_type(gl.uint8)) + rows_b[:, None] * stride_sn + cols_b[None, :]
        acc = gl.zeros([ROWS, NB], gl.float32, BL)
        opaque_zero = N >> 31  # N >= 1
        for c in range(0, gl.cdiv(K_WORDS, CW)):
            w0 = c * CW
            live_w = (w0 + cols_w) < K_WORDS
            words = gl.load(word_ptrs + w0, mask=live_w[None, :], other=0)
            live_b = (c * NB + cols_b) < K_WORDS // WPB
            scale_bytes = gl.load(scale_ptrs + c * NB, mask=live_b[None, :], other=0)
            a0, a1, a2, a3, step = _activation_pairs(x_ptr, w0 * 8, K, IS_NVFP4, THREADS, WARPS)
            lo, hi = _int8_lanes(words, opaque_zero)
            a0, _ = gl.broadcast(gl.convert_layout(a0, gl.SliceLayout(0, WL))[None, :], lo)
            a1, _ = gl.broadcast(gl.convert_layout(a1, gl.SliceLayout(0, WL))[None, :], lo)
            a2, _ = gl.broadcast(gl.convert_layout(a2, gl.SliceLayout(0, WL))[None, :], lo)
            a3, _ = gl.broadcast(gl.convert_layout(a3, gl.SliceLayout(0, WL))[None, :], lo)
            dots = _dp2a(a0, lo, gl.zeros([ROWS, CW], gl.int32, WL), False)
            dots = _dp2a(a1, lo, dots, True)
            dots = _dp2a(a2, hi, dots, False)
            dots = _dp2a(a3, hi, dots, True)
            block_dots = gl.convert_layout(gl.reduce(gl.reshape(dots, [ROWS, NB, WPB]), 2, _add), BL)  # exact int32
            if IS_NVFP4:  # e4m3 -> value * 2^-8 by bit placement; a thread's step covers its 2 blocks
                b16 = scale_bytes.to(gl.uint16)
                block_scale = (((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)).to(gl.float16, bitcast=True).to(gl.float32)
                step_b = gl.reshape(gl.join(step, step), [NB])
            else:  # e8m0 -> 2^(byte - 127); one block per thread
                block_scale = (scale_bytes.to(gl.uint32) << 23).to(gl.float32, bitcast=True)
                step_b = step
            step_b = gl.convert_layout(step_b, gl.SliceLayout(0, BL))
            acc += block_dots.to(gl.float32) * (block_scale * step_b[None, :])
        # the 2 of the doubled codes, and (NVFP4) the 2^-8 of the e4m3 decode
        total = gl.reduce(acc, 1, _add) * (gl.load(global_scale_ptr) * (128.0 if IS_NVFP4 else 0.5))
        offs_n = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BL))
        if HAS_BIAS:
            total += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        gl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def fp4_gemv_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int, in_features: int, format: str, rows: int = 8,
                  num_warps: int = 4) -> torch.Tensor:
    """(1, K) x -> (1, N) in x's dtype for a kernel-layout FP4 weight (format.to_kernel_layout)."""
    if format not in ("nvfp4", "mxfp4"):
        raise ValueError(f"format {format!r}: expected 'nvfp4' or 'mxfp4'")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != in_features:
        raise ValueError(f"x of shape {tuple(x.shape)}: expected (1, {in_features})")
    if rows not in ROWS_CHOICES or num_warps not in WARPS_CHOICES:
        raise ValueError(f"rows {rows}, num_warps {num_warps}: expected rows in {ROWS_CHOICES}, "
                         f"num_warps in {WARPS_CHOICES}")
    x = x.contiguous()
    k_words = codes.shape[1] // 4
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    launch(_fp4_gemv_rows_kernel, (cdiv(out_features, rows),), x, codes, scales, global_scale,
           bias if bias is not None else out, out, out_features, in_features, k_words, k_words,
           scales.stride(0), IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, ROWS=rows, WARPS=num_warps,
           num_warps=num_warps)
    return out
