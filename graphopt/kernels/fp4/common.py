"""Triton helpers the FP4 kernels share: e2m1 and block-scale decode by bit placement, and the
tensor-core dot (with the interpreter's fp32 form)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None

if triton is not None:

    # Codes -> int8 lanes by table lookup (fp4.decode._e2m1_int8_lanes, which documents it), shared by
    # the Triton and Gluon decode kernels: $2 the code words, $3-$6 the four table words below.
    # One line: Inductor copies a kernel's globals into its wrapper inside a string literal, where the
    # newline escapes of a multi-line constant's repr would become newlines inside a string again
    # (tests/ops/test_inductor_source.py).
    E2M1_INT8_LANES_PTX = tl.constexpr(" ".join((
        "{",
        ".reg .b32 sel_lo, sel_hi, w4, pos_lo, pos_hi, neg_lo, neg_hi, m_lo, m_hi;",
        "and.b32 sel_lo, $2, 0x77777777;",  # PRMT reads the low 16 bits of its selector
        "shr.u32 sel_hi, sel_lo, 16;",
        "prmt.b32 pos_lo, $3, $4, sel_lo;",
        "prmt.b32 pos_hi, $3, $4, sel_hi;",
        "prmt.b32 neg_lo, $5, $6, sel_lo;",
        "prmt.b32 neg_hi, $5, $6, sel_hi;",
        "shl.b32 w4, $2, 4;",
        "prmt.b32 m_lo, $2, w4, 0x9D8C;",
        "prmt.b32 m_hi, $2, w4, 0xBFAE;",
        "lop3.b32 $0, pos_lo, neg_lo, m_lo, 0xD8;",
        "lop3.b32 $1, pos_hi, neg_hi, m_hi, 0xD8;",
        "}",
    )))
    # Codes -> (lo, hi, neg_lo, neg_hi) by one magnitude table (the persistent decode's): lo / hi
    # hold twice each nibble's e2m1 magnitude as int8 lanes, neg_lo / neg_hi the same lanes kept
    # only where the nibble's sign is set, so that a dot with the codes' values is dot(lo) -
    # 2 dot(neg_lo) (and so for hi). Two PRMT and two AND replace the four PRMT and two LOP3
    # selects of E2M1_INT8_LANES_PTX on the integer pipe, which bounds that kernel; the extra dots
    # run on the FMA pipe. $4 the code words, $5-$6 E2M1_POS_LO / HI.
    E2M1_MAGNITUDES_PTX = tl.constexpr(" ".join((
        "{",
        ".reg .b32 sel_lo, sel_hi, w4, m_lo, m_hi;",
        "and.b32 sel_lo, $4, 0x77777777;",
        "shr.u32 sel_hi, sel_lo, 16;",
        "prmt.b32 $0, $5, $6, sel_lo;",
        "prmt.b32 $1, $5, $6, sel_hi;",
        "shl.b32 w4, $4, 4;",
        "prmt.b32 m_lo, $4, w4, 0x9D8C;",
        "prmt.b32 m_hi, $4, w4, 0xBFAE;",
        "and.b32 $2, $0, m_lo;",
        "and.b32 $3, $1, m_hi;",
        "}",
    )))
    E2M1_POS_LO = tl.constexpr(0x03020100)  # twice the e2m1 magnitudes 0, 1, 2, 3
    E2M1_POS_HI = tl.constexpr(0x0C080604)  # 4, 6, 8, 12
    E2M1_NEG_LO = tl.constexpr(-33620224)  # 0xFDFEFF00: their negatives
    E2M1_NEG_HI = tl.constexpr(-185009412)  # 0xF4F8FAFC

    @triton.jit
    def _e2m1_times_2_pow_minus_14(nibble):
        """uint8 codes in the low 4 bits -> fp32 value * 2^-14, exactly (fp16 bit placement)."""
        n16 = nibble.to(tl.uint16)
        bits = ((n16 & 7) << 9) | ((n16 & 8) << 12)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _block_scales(scale_bytes, IS_NVFP4: tl.constexpr):
        """Scale bytes -> fp32: e4m3 value * 2^-8 (NVFP4) or 2^(byte - 127) (MXFP4)."""
        if IS_NVFP4:
            b16 = scale_bytes.to(tl.uint16)
            bits = ((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)
            return bits.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            return (scale_bytes.to(tl.uint32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _decode_power(IS_NVFP4: tl.constexpr):
        """The power of two that undoes the 2^-14 of the e2m1 decode and (NVFP4) the 2^-8 of the
        e4m3 decode."""
        if IS_NVFP4:
            return 4194304.0  # 2^22
        else:
            return 16384.0  # 2^14

    @triton.jit
    def _decode_multiplier(global_scale_ptr, IS_NVFP4: tl.constexpr):
        """Global scale times _decode_power: applied once to fp32 sums."""
        return tl.load(global_scale_ptr) * _decode_power(IS_NVFP4)

    @triton.jit
    def _scale_bytes(scales_ptr):
        """The block scales as the bytes the kernels decode (the weight holds e4m3 for NVFP4). The
        pointer is reinterpreted here rather than the tensor viewed by the launcher: a view is an
        aten call per layer in Inductor's generated code."""
        return scales_ptr.to(tl.pointer_type(tl.uint8))

    @triton.jit
    def _code_words(codes_ptr):
        """The packed uint8 codes read as int32 words of eight codes (reinterpreted as _scale_bytes)."""
        return codes_ptr.to(tl.pointer_type(tl.int32))

    @triton.jit
    def _mma(w, x, acc, UPCAST_DOT: tl.constexpr):
        """acc (BN, BM) += w (BN, BK) @ x (BM, BK)^T. UPCAST_DOT: compute from fp32 copies of the
        bf16/fp16 operands (same products, exact in fp32) - only for TRITON_INTERPRET=1, whose
        bf16 tl.dot returns garbage in Triton 3.9."""
        if UPCAST_DOT:
            return tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(x), acc)
