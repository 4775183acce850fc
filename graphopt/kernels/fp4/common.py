"""Triton helpers the FP4 kernels share: e2m1 and block-scale decode by bit placement, and the
tensor-core dot (with the interpreter's fp32 form)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None

if triton is not None:

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
