"""Q8_1 activation quantization in Triton, byte-exact with ggml's quantize_row_q8_1_ref (the torch
reference: graphopt.kernels.q4.quantize_q8_1): the in-register rounding the Q4 kernels share
(`_q8_1_quantize`), the kernel that writes block_q8_1 bytes (`_quantize_q8_1_kernel`, launched by
q4.quantize_q8_1_triton), and `quantize_for_tma`, which writes the int8 values and fp32 scales in
the layout q4_tma's Gluon decode reads through TMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphopt.kernels.launch import INTERPRET, launch

try:  # libdevice mul_rn: a multiply rounded on its own, never contracted into an FMA
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover (triton without the extra libdevice module)
    _libdevice = None

QK = 32  # values per Q8_1 block


def _exact_mul() -> bool:
    """Use libdevice mul_rn in the Q8_1 rounding (compiled kernels; the interpreter has no libdevice)."""
    return _libdevice is not None and not INTERPRET


# Float tricks used below (all exact, valid for |integer| < 2^22):
#   int -> float:  bitcast(i + 0x4B400000) - 1.5*2^23   (IADD + FADD instead of a slow I2F)
#   rint(v):       (v + 1.5*2^23) - 1.5*2^23             (round half to even; the integer is also in
#                                                          the low bits of v + 1.5*2^23)
#   nibble -> float: bitcast(nibble | 0x4B000000) - 2^23  (LOP3 + FADD)


@triton.jit
def _round_half_even_tl(v):
    t = v.to(tl.int32)
    frac = v - t.to(tl.float32)
    odd = (t % 2) != 0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    down = (frac < -0.5) | ((frac == -0.5) & odd)
    return t + up.to(tl.int32) - down.to(tl.int32)


@triton.jit
def _q8_1_quantize(x, EXACT: tl.constexpr):
    """Q8_1 of an fp32 (R, 32) tile, one block per row, with the float32 steps of
    quantize_row_q8_1_ref: d = amax / 127, id = 1 / d, q = roundf(x * id) (half away from zero).
    Returns (q fp32 (R, 32) integer-valued, q int32 (R, 32), d fp32 (R,), d rounded to fp16 (R,)).

    x * id must be rounded to fp32 before rounding to an integer: on the GPU, LLVM contracts a
    multiply feeding an add into one FMA (exact product), which moves values lying within half an
    ulp of .5 to the other integer than ggml's C code (byte mismatches). EXACT uses libdevice
    mul_rn (an explicitly rounded multiply that is never contracted); the interpreter (numpy,
    no contraction) uses a plain multiply."""
    amax = tl.max(tl.abs(x), axis=1)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    nonzero = d != 0.0
    inv_d = tl.where(nonzero, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(nonzero, d, 1.0)), 0.0)
    inv_b = tl.broadcast_to(inv_d[:, None], x.shape)
    if EXACT:
        # through tl: Inductor compiles this kernel's source again, without this module's aliases
        v = tl.extra.libdevice.mul_rn(x, inv_b)
    else:
        v = x * inv_b
    f = v + 12582912.0  # 1.5 * 2^23 + rint(v): the fp32 ulp is 1 there
    r = f - 12582912.0  # rint(v), exact
    diff = r - v  # exact
    up = (diff == -0.5) & (v > 0.0)  # ties: half away from zero, not to even
    down = (diff == 0.5) & (v < 0.0)
    q = r + up.to(tl.float32) - down.to(tl.float32)
    qi = f.to(tl.int32, bitcast=True) - 0x4B400000 + up.to(tl.int32) - down.to(tl.int32)
    return q, qi, d, d.to(tl.float16).to(tl.float32)



@triton.jit
def _store_q8_1_header(block_ptrs, d, s, mask):
    """The 4-byte header of each block (fp16 d, then fp16 s, little-endian) as one 32-bit word,
    through a word pointer into the uint8 output (blocks start at multiples of 36 bytes: aligned).
    Storing the fp16 bytes one by one is miscompiled for sm_90 by Triton 3.6's toolchain: the low
    byte of d became F2I.U8 of d's value (0 for small d)."""
    d_bits = d.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    s_bits = s.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(block_ptrs.to(tl.pointer_type(tl.uint32)), d_bits | (s_bits << 16), mask=mask)


@triton.jit
def _quantize_q8_1_kernel(
    x_ptr, out_ptr,  # x (M, K); out uint8 (M, nb, 36)
    M, NB, stride_xm, stride_om,
    BLOCKS: tl.constexpr, EXACT: tl.constexpr,
):
    """Writes every byte through the one uint8 output (no dtype views of it passed in: a traced
    graph copies each tensor argument a kernel writes, and two overlapping views would overwrite
    each other); the headers go through a word pointer cast inside the kernel."""
    pid_m = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,)
    j = tl.arange(0, 32)
    mask = (blocks < NB)[:, None]
    x = tl.load(x_ptr + pid_m * stride_xm + blocks[:, None] * 32 + j[None, :], mask=mask, other=0.0).to(tl.float32)
    _, qi, d, _ = _q8_1_quantize(x, EXACT)
    s = tl.sum(qi, axis=1).to(tl.float32) * d  # ggml: (float) sum * d with the float32 d
    block_ptrs = out_ptr + pid_m * stride_om + blocks * 36  # (BLOCKS,): fp16 d, fp16 s, 32 int8 q
    tl.store(block_ptrs[:, None] + 4 + j[None, :], qi.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
    _store_q8_1_header(block_ptrs, d, s, blocks < NB)


@triton.jit
def _quantize_for_tma_kernel(x_ptr, q_ptr, ds_ptr, K, KP, M4, stride_xm, BLOCKS_PER_PROGRAM: tl.constexpr,
                             EXACT: tl.constexpr):
    """Q8_1 of row program_id(0) of x, blocks program_id(1) * BLOCKS_PER_PROGRAM...: q int8 (M, KP),
    ds fp32 (2 * KP / 32, M4) with d at row 2b and d * sum(q) at row 2b + 1 (q4's _load_act_block's
    fused path: the fp16-rounded d, exact products)."""
    pid_m = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    k = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + pid_m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    q, qi, _, d16 = _q8_1_quantize(x, EXACT)
    live = blocks < KP // 32
    tl.store(q_ptr + pid_m * KP + k, qi.to(tl.int8), mask=live[:, None])
    tl.store(ds_ptr + 2 * blocks * M4 + pid_m, d16, mask=live)
    tl.store(ds_ptr + (2 * blocks + 1) * M4 + pid_m, d16 * tl.sum(q, axis=1), mask=live)


def quantize_for_tma(x2: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (M, K) bf16/fp16/fp32 -> (q int8 (M, k_padded), ds fp32 (2 * k_padded / 32, M rounded up to 4))."""
    m, k = x2.shape
    m4 = -(-m // 4) * 4  # ds rows 16-byte aligned for TMA
    q = torch.empty(m, k_padded, dtype=torch.int8, device=x2.device)
    ds = torch.empty(2 * k_padded // QK, m4, dtype=torch.float32, device=x2.device)
    per_program = 8
    grid = (m, triton.cdiv(k_padded // QK, per_program))
    launch(_quantize_for_tma_kernel, grid, x2, q, ds, k, k_padded, m4, x2.stride(0), BLOCKS_PER_PROGRAM=per_program,
           EXACT=_exact_mul())
    return q, ds

