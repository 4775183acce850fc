"""Q4_0 weights and Q8_1 activations: the ggml formats, the kernel layout of the weights, and the
torch references of the q4 ops. Plain torch (no Triton).

Formats (byte-exact with ggml's reference quantizers, quantize_row_q4_0_ref / _q8_1_ref):
  block_q4_0, 18 bytes per 32 values: fp16 d, then 16 bytes; byte j holds element j in its low
    nibble and element j+16 in its high nibble; value = (nibble - 8) * d. d = max / -8 where max
    is the signed value of largest magnitude (first one on ties), and nibble = min(15,
    int8(x * (1/d) + 8.5)), all in float32 like the C code (id = 1/d, not a division per value).
  block_q8_1, 36 bytes per 32 values: fp16 d = amax / 127, fp16 s = d * sum(q) (the integer sum
    times the float32 d, rounded once to fp16), then 32 int8 q = roundf(x * (1/d)) (half away
    from zero).
  `quantize_q4_0(w) -> uint8 [rows, K/32, 18]`, `quantize_q8_1(x) -> uint8 [rows, K/32, 36]`
  (leading dims are kept), and the matching `dequantize_*`. K must be a multiple of 32: anything
  else is a ValueError (we do not pad silently; the pass declines such layers).

Kernel layout of the weights (`pack_q4_0` / `unpack_q4_0`, lossless both ways):
  qweight uint8 [N, Kp/2], Kp = K rounded up to 64: for the block pair p = (2p, 2p+1), byte
    32p + j holds element j of block 2p (low nibble) and element j of block 2p+1 (high nibble).
    One 32-byte load then yields two whole 32-value blocks, each one int8 dot of depth 32, so a
    per-block integer sum needs no nibble interleaving in registers.
  scales fp16 [Kp/32, N]: d of block b of output row n at [b, n] (coalesced along N). A padding
    block (K/32 odd) has d = 0 and nibbles 0.

The GEMM, per output (m, n) and 32-block b (q4u = unsigned nibble 0..15, q8 int8):
    y[m, n] = sum_b d4[n, b] * (d8[m, b] * sum_k q4u * q8  -  8 * s8[m, b]),  s8 = d8 * sum_k q8
  The s term absorbs the -8 offset of Q4_0, so the tensor cores see unsigned nibbles. The kernels
  recompute s8 from the integers (exact) instead of reading the fp16 s of the Q8_1 block, so every
  path (separate, fused, decode) gives dequantize-then-matmul numbers up to fp32 summation order.
  (The stored s is still written, for byte-exactness with ggml.)
"""

from __future__ import annotations

import math

import torch

from graphopt.kernels.weight_chunks import chunk_rows, sqnr_db_of_parts

QK = 32  # values per Q4_0 / Q8_1 block
Q4_0_BLOCK_BYTES = 18
Q8_1_BLOCK_BYTES = 36
SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_k(k: int, what: str) -> None:
    if k <= 0:
        raise ValueError(f"{what}: the last dimension is {k}; Q4_0/Q8_1 blocks need a positive multiple of {QK}")
    if k % QK:
        raise ValueError(f"{what}: the last dimension ({k}) must be a multiple of {QK} for Q4_0/Q8_1 blocks; "
                         f"pad it to {math.ceil(k / QK) * QK} or leave this layer unquantized")


# =============================================================================================
# ggml formats (torch references)
# =============================================================================================
def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C roundf: half away from zero (torch.round is half to even). v - trunc(v) is exact."""
    t = torch.trunc(v)
    frac = v - t
    return t + (frac >= 0.5).to(v.dtype) - (frac <= -0.5).to(v.dtype)


def _fp16_rounded(d: torch.Tensor) -> torch.Tensor:
    """d (float32, >= 0) rounded to the nearest float16 value, as d.to(float16) does, in float32.
    With integer arithmetic on the bits: Inductor on torch 2.11 compiles d.to(fp16).to(fp64) as
    d.to(fp64), skipping the rounding (and lowers a uint8 -> fp16 view of fused bytes wrongly)."""
    bits = d.contiguous().view(torch.int32)
    # normal halves: keep 10 of float32's 23 mantissa bits, round to nearest even
    normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    subnormal = torch.round(d * 2.0**24) * 2.0**-24  # below 2^-14 a half's step is 2^-24
    rounded = torch.where(d < 2.0**-14, subnormal, normal)
    return torch.where(rounded > 65504.0, torch.full_like(rounded, float("inf")), rounded)


def _round_half_even(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """ggml block_q4_0 bytes of `w` [..., K] (K % 32 == 0) -> uint8 [..., K/32, 18]."""
    _check_k(w.shape[-1], "quantize_q4_0")
    x = w.detach().to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // QK, QK)  # (..., nb, 32)
    index = x.abs().argmax(dim=-1, keepdim=True)  # first maximum, like `if (amax < fabsf(v))`
    signed_max = torch.gather(x, -1, index)  # (..., nb, 1)
    d = signed_max / -8.0
    inv_d = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))  # float32 1/d, as the C code
    q = (x * inv_d + 8.5).to(torch.int8).clamp_max(15).to(torch.uint8)  # int8() truncates
    packed = q[..., :16] | (q[..., 16:] << 4)  # (..., nb, 16)
    d16 = d.to(torch.float16).view(torch.uint8)  # (..., nb, 2) little-endian
    return torch.cat([d16, packed], dim=-1).contiguous()


def _q4_0_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d fp32 [..., nb], unsigned nibbles uint8 [..., nb, 32]) of block_q4_0 bytes."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != Q4_0_BLOCK_BYTES:
        raise ValueError(f"expected block_q4_0 bytes uint8 [..., K/32, 18], got {blocks.dtype} {tuple(blocks.shape)}")
    blocks = blocks.contiguous()
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].to(torch.float32)
    qs = blocks[..., 2:]
    nibbles = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # element j | element j + 16
    return d, nibbles


def dequantize_q4_0(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., K/32, 18] -> [..., K] values (nibble - 8) * d (exact in float32)."""
    d, nibbles = _q4_0_fields(blocks)
    values = (nibbles.to(torch.float32) - 8.0) * d[..., None]
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


def _q8_1_fields(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_1 quantization of x [..., K] in float32: (q int8-valued fp32 [..., nb, 32], d32 [..., nb],
    d16 [..., nb] fp16, s16 [..., nb] fp16), exactly as quantize_row_q8_1_ref."""
    _check_k(x.shape[-1], "quantize_q8_1")
    v = x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    amax = v.abs().amax(dim=-1)
    d = amax / 127.0
    inv_d = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = _round_half_away(v * inv_d[..., None])
    total = q.sum(dim=-1)  # exact small integers
    s = total * d  # C: int * float -> float
    return q, d, d.to(torch.float16), s.to(torch.float16)


def quantize_q8_1(x: torch.Tensor) -> torch.Tensor:
    """ggml block_q8_1 bytes of `x` [..., K] (K % 32 == 0) -> uint8 [..., K/32, 36]."""
    q, _, d16, s16 = _q8_1_fields(x)
    header = torch.stack([d16, s16], dim=-1).view(torch.uint8)  # (..., nb, 4): d then s
    return torch.cat([header, q.to(torch.int8).view(torch.uint8)], dim=-1).contiguous()


def _q8_1_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d fp32 [..., nb], s fp32 [..., nb], q int8 [..., nb, 32]) of block_q8_1 bytes."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != Q8_1_BLOCK_BYTES:
        raise ValueError(f"expected block_q8_1 bytes uint8 [..., K/32, 36], got {blocks.dtype} {tuple(blocks.shape)}")
    blocks = blocks.contiguous()
    header = blocks[..., :4].contiguous().view(torch.float16).to(torch.float32)  # (..., nb, 2)
    q = blocks[..., 4:].contiguous().view(torch.int8)
    return header[..., 0], header[..., 1], q


def dequantize_q8_1(blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., K/32, 36] -> [..., K] values q * d (the s field is redundant information)."""
    d, _, q = _q8_1_parts(blocks)
    return (q.to(torch.float32) * d[..., None]).reshape(*blocks.shape[:-2], -1).to(dtype)


# =============================================================================================
# Kernel layout of Q4_0 weights (lossless conversion to and from ggml blocks)
# =============================================================================================
def pack_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml block_q4_0 [N, K/32, 18] -> (qweight uint8 [N, Kp/2], scales fp16 [Kp/32, N])."""
    if blocks.dim() != 3:
        raise ValueError(f"pack_q4_0 expects block_q4_0 bytes [N, K/32, 18], got shape {tuple(blocks.shape)}")
    d, nibbles = _q4_0_fields(blocks)  # (N, nb), (N, nb, 32)
    n, nb = d.shape
    if nb % 2:  # pad one zero block so blocks come in pairs
        nibbles = torch.cat([nibbles, nibbles.new_zeros(n, 1, QK)], dim=1)
        d = torch.cat([d, d.new_zeros(n, 1)], dim=1)
    pairs = nibbles.reshape(n, -1, 2, QK)  # (N, pairs, 2, 32)
    qweight = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1).contiguous()
    scales = d.to(torch.float16).t().contiguous()
    return qweight, scales


def unpack_q4_0(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """(qweight [N, Kp/2], scales [Kp/32, N]) -> ggml block_q4_0 [N, K/32, 18] (exact inverse)."""
    _check_k(in_features, "unpack_q4_0")
    nibbles = _kernel_nibbles(qweight)[:, : in_features].reshape(qweight.shape[0], -1, QK)  # (N, nb, 32)
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    # reshape(-1) copies the (N, nb) transpose in row order; .contiguous() would not when nb == 1
    # (a size-1 dim makes the transposed view count as contiguous), and the byte view needs that order
    d16 = scales[: in_features // QK].t().reshape(-1).view(torch.uint8).reshape(qweight.shape[0], -1, 2)
    return torch.cat([d16, packed], dim=-1).contiguous()


def _kernel_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles [N, Kp] in natural K order from the kernel layout."""
    n = qweight.shape[0]
    pairs = qweight.reshape(n, -1, QK)  # (N, pairs, 32)
    return torch.stack([pairs & 0xF, pairs >> 4], dim=2).reshape(n, -1)


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, in_features: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [N, K] weight of the kernel layout."""
    nibbles = _kernel_nibbles(qweight)[:, :in_features].to(torch.float32)
    d = scales.t()[:, : in_features // QK].to(torch.float32).repeat_interleave(QK, dim=1)
    return ((nibbles - 8.0) * d).to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> kernel layout (qweight, scales) through ggml Q4_0, in row chunks of
    about weight_chunks.CHUNK_ELEMENTS (the fp32 temporaries reach about 5x a bf16 weight's bytes)."""
    n = w.shape[0]
    rows = chunk_rows(w.shape[-1])
    qweight = scales = None
    for start in range(0, max(n, 1), rows):
        chunk_q, chunk_d = pack_q4_0(quantize_q4_0(w[start:start + rows]))
        if qweight is None:  # filled in place, not concatenated: torch.cat would follow an ambient autocast
            qweight, scales = chunk_q.new_empty((n, chunk_q.shape[1])), chunk_d.new_empty((chunk_d.shape[0], n))
        qweight[start:start + chunk_q.shape[0]] = chunk_q
        scales[:, start:start + chunk_q.shape[0]] = chunk_d
    return qweight, scales


def weight_sqnr_db(w: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> float:
    """SQNR in dB of the packed Q4_0 weight against w [N, K], in float64, a chunk of rows at a time
    (a whole dequantized lm_head in float64 would be several GB)."""
    rows = chunk_rows(w.shape[1])
    return sqnr_db_of_parts((w[i:i + rows], dequantize_packed(qweight[i:i + rows], scales[:, i:i + rows], w.shape[1],
                                                              torch.float64))
                            for i in range(0, w.shape[0], rows))


# =============================================================================================
# References of the ops (CPU implementations; integer math of the formula in the docstring)
# =============================================================================================
def _check_weight(qweight: torch.Tensor, scales: torch.Tensor, k: int) -> int:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be uint8 [N, Kp/2] (see pack_q4_0), got {qweight.dtype} {tuple(qweight.shape)}")
    n, half = qweight.shape
    kp = 2 * half
    if kp % 64 or not (kp - 64 < k <= kp):
        raise ValueError(f"qweight [N={n}, {half}] holds K up to {kp} in 64-value pairs; activations have K={k}")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (kp // QK, n):
        raise ValueError(f"scales must be fp16 [{kp // QK}, {n}], got {scales.dtype} {tuple(scales.shape)}")
    return n


def _integer_q4_gemm(q8: torch.Tensor, d8: torch.Tensor, s8: torch.Tensor, qweight: torch.Tensor,
                     scales: torch.Tensor) -> torch.Tensor:
    """sum_b d4 * (d8 * sum q4u*q8 - 8 * s8) in float64.
    q8 (M, nb, 32) integer-valued, d8/s8 (M, nb) the per-row-and-block activation scale and
    d8 * sum(q8); returns (M, N) float64."""
    m, nb, _ = q8.shape
    n = qweight.shape[0]
    # Integer-valued float64: every partial sum (|q8| <= 128, q4u <= 15, 32 terms) is exact, and
    # CUDA has no int64 matmul.
    q4u = _kernel_nibbles(qweight)[:, : nb * QK].reshape(n, nb, QK).to(torch.float64)  # (N, nb, 32)
    d4 = scales.t()[:, :nb].to(torch.float64)  # (N, nb)
    q8 = q8.to(torch.float64)

    def rows(start, stop) -> torch.Tensor:  # (stop - start, N)
        dots = torch.einsum("mbk,nbk->mnb", q8[start:stop], q4u)  # exact integers
        inner = d8[start:stop, None, :].double() * dots - 8.0 * s8[start:stop, None, :].double()
        return (inner * d4[None]).sum(dim=-1)

    if not isinstance(m, int):  # a symbolic row count (a traced graph): one piece
        return rows(0, m)
    step = max(1, (1 << 22) // max(1, n * nb))  # bound the (rows, N, nb) float64 temporary
    return torch.cat([rows(start, min(m, start + step)) for start in range(0, m, step)]) if m else rows(0, 0)


def _finish(out64: torch.Tensor, bias: torch.Tensor | None, lead: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        out64 = out64 + bias.to(torch.float64)
    return out64.to(dtype).reshape(*lead, out64.shape[-1])


def reference_q4_q8_gemm(xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pre-quantized activations (block_q8_1 bytes [..., K/32, 36]) x kernel-layout Q4_0 -> [..., N]."""
    d8, _, q = _q8_1_parts(xq)
    k = q.shape[-2] * QK
    _check_weight(qweight, scales, k)
    lead = tuple(xq.shape[:-2])
    q = q.reshape(-1, k // QK, QK)
    d8 = d8.reshape(-1, k // QK)
    s8 = d8.double() * q.to(torch.float64).sum(-1)  # exact s (see module docstring)
    return _finish(_integer_q4_gemm(q, d8, s8, qweight, scales), bias, lead, out_dtype)


def reference_q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] quantized to Q8_1, times the Q4_0 weight: what every q4_linear mode computes."""
    k = x.shape[-1]
    _check_weight(qweight, scales, k)
    q, d, _, _ = _q8_1_fields(x.reshape(-1, k))
    d8 = _fp16_rounded(d).to(torch.float64)
    s8 = d8 * q.to(torch.float64).sum(-1)
    return _finish(_integer_q4_gemm(q, d8, s8, qweight, scales), bias, tuple(x.shape[:-1]), x.dtype)


def dequantized_q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference_q4_linear's product through one dense fp32 GEMM (a matmul library's): x's Q8_1
    values q * d times the dequantized weight, both exact in fp32, so equal to it up to fp32
    summation order. For a layer held only as Q4_0 where no Q4 tile computes the product."""
    k = x.shape[-1]
    _check_weight(qweight, scales, k)
    q, d, _, _ = _q8_1_fields(x.reshape(-1, k))
    values = (q * _fp16_rounded(d)[..., None]).reshape(x.shape).to(torch.float32)  # (..., K), exact
    y = torch.nn.functional.linear(values, dequantize_packed(qweight, scales, k),
                                   None if bias is None else bias.to(torch.float32))
    return y.to(x.dtype)


def static_result_dtype(x: torch.Tensor, act_scale: torch.Tensor) -> torch.dtype:
    """The dtype eager torch gives x / s, and so the fake-quant idiom's: a 0-dim scale does not
    promote a dimensioned x (float32 x over a float64 scalar tensor stays float32)."""
    return torch.result_type(x, act_scale)


def static_quantize(x: torch.Tensor, act_scale: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """round(x / s).clamp(qmin, qmax) exactly as eager torch computes it (the quotient rounded to
    the promoted dtype, round half to even): (q fp32 [M, K], s fp32 [M]) with rows = x's leading dims."""
    k = x.shape[-1]
    quot_dtype = static_result_dtype(x, act_scale)
    s = _rows_scale(act_scale, x)
    v = (x.reshape(-1, k).to(torch.float32) / s[:, None]).to(quot_dtype).to(torch.float32)
    return torch.round(v).clamp(qmin, qmax), s


def _rows_scale(act_scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-tensor or per-row activation scale as fp32 [M] (M = rows of x)."""
    lead = tuple(x.shape[:-1])
    shape = tuple(act_scale.shape)
    if act_scale.numel() != 1 and (not shape or shape[-1] != 1):
        raise ValueError(f"act_scale must be per-tensor or per-row (last dim 1), got shape {shape} for x {tuple(x.shape)}")
    try:
        return act_scale.to(torch.float32).expand(*lead, 1).reshape(-1).contiguous()
    except RuntimeError as exc:
        raise ValueError(f"act_scale of shape {shape} does not broadcast to the rows of x {tuple(x.shape)}") from exc


def reference_q4_linear_static(x: torch.Tensor, act_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               bias: torch.Tensor | None = None, qmin: int = -128, qmax: int = 127) -> torch.Tensor:
    """(round(x / s).clamp(qmin, qmax) * s) @ W_q4.T with W_q4 the dequantized Q4_0 weight,
    computed with integer dots: y = s * sum_b d4 * (sum q4u * q - 8 * sum q)."""
    k = x.shape[-1]
    _check_k(k, "q4_linear_static")
    _check_weight(qweight, scales, k)
    q, s = static_quantize(x, act_scale, qmin, qmax)
    q = q.reshape(-1, k // QK, QK)
    s_blocks = s.double()[:, None].expand(-1, k // QK)
    s8 = s_blocks * q.to(torch.float64).sum(-1)
    out_dtype = static_result_dtype(x, act_scale)
    return _finish(_integer_q4_gemm(q, s_blocks, s8, qweight, scales), bias, tuple(x.shape[:-1]), out_dtype)

