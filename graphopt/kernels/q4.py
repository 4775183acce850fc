"""Q4_0 weights x Q8_1 activations: ggml formats, torch references and Triton kernels.

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
  The launchers run the config they are given, or the untuned default for the token count
  (`default_config`); they never time anything. `tune_q4_linear` times the candidates at compile
  time -- decode sizes as CUDA-graph replays, L2-cold -- and keeps the fastest on disk
  (graphopt.kernels.tuning; GRAPHOPT_Q4_AUTOTUNE=0 disables it).

Caveats: inference only (no autograd). Activations must be contiguous in their last dim (the
launchers make them so). The fused kernels re-quantize the activation tile once per N tile (and
the gemv once per token row and N tile): redundant CUDA-core work that grows with M*K*N/BLOCK_N;
at large token counts the separate path (quantize once) or dense bf16 wins, and the q4_linear
pass's cost model says so. Split-K sums in a different fp32 order than the unsplit kernel, and
the atomic and "last" reductions are not bitwise deterministic run to run.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphopt.kernels import tuning
from graphopt.kernels.launch import INTERPRET, cdiv, launch, next_power_of_2
from graphopt.kernels.split_k import finish_split_tile, split_buffers

try:  # libdevice mul_rn: a multiply rounded on its own, never contracted into an FMA
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover (triton without the extra libdevice module)
    _libdevice = None

QK = 32  # values per Q4_0 / Q8_1 block
Q4_0_BLOCK_BYTES = 18
Q8_1_BLOCK_BYTES = 36
SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_k(k: int, what: str) -> None:
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
    """A dense [N, K] weight -> kernel layout (qweight, scales) through ggml Q4_0."""
    return pack_q4_0(quantize_q4_0(w))


def weight_sqnr_db(w: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> float:
    w = w.detach().to(torch.float64)
    err = w - dequantize_packed(qweight, scales, w.shape[1], torch.float64)
    signal, noise = float((w * w).sum()), float((err * err).sum())
    return math.inf if noise == 0 else 10.0 * math.log10(max(signal, 1e-300) / noise)


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
    q, _, d16, _ = _q8_1_fields(x.reshape(-1, k))
    d8 = d16.to(torch.float64)
    s8 = d8 * q.to(torch.float64).sum(-1)
    return _finish(_integer_q4_gemm(q, d8, s8, qweight, scales), bias, tuple(x.shape[:-1]), x.dtype)


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


# =============================================================================================
# Tile configs
# =============================================================================================
REDUCE_MODES = ("workspace", "atomic", "last")  # TileConfig.reduce choices (split-K partial sums)
TILE_KERNELS = ("gemm", "swap", "gemv", "dp4a", "tma")  # TileConfig.kernel choices


@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the Q4 kernels.

    kernel "gemm": tensor-core int8 tl.dot; a BLOCK_M x BLOCK_N output tile, PAIRS block pairs
      (64 K values, one 32-deep dot per block) per K step.
    kernel "swap": the same kernel with the operands swapped for few tokens (SWAP_AB): BLOCK_N
      weight rows on the MMA's M side (64 per warpgroup of num_warps), BLOCK_M tokens on its N
      side (8 or 16 for decode, 32 for 17-64 tokens), the unpacked weights in registers as
      wgmma's A operand.
    kernel "dp4a": the decode kernel with integer dot products: the Q8_1 activations packed four
      int8 per word in registers and dp4a (4 MACs per instruction) against the nibbles of each
      weight word; same tiling fields as "gemv".
    kernel "tma": q4_tma's Gluon decode (sm_90+, the separate path: a quantize launch, then weights
      and activations fed by TMA): block_n weight rows (64 per warpgroup), block_m tokens (8 or 16,
      the MMA's N), pairs 4 (K steps of 256), num_stages ring slots; split-K reduces "last".
    kernel "gemv": the decode kernel (fp32 FMAs, no tensor cores); block_m token rows per program
      (0: min(GEMV_MAX_ROWS, next power of two of the token count)), block_n weight rows per program,
      PAIRS block pairs per iteration (every weight row streams 32 * PAIRS contiguous bytes a step).
    split_k: programs along K (1: none; 0: enough for PROGRAMS_PER_SM programs per SM). Their fp32
      partial sums are combined by `reduce`: "workspace" (split s writes slice s of an fp32
      [SPLIT_K, M, N] buffer; a small kernel sums the slices, adds the bias and casts) or "atomic"
      (tl.atomic_add into a zeroed fp32 [M, N] buffer, then the same small kernel with one slice), or
      "last" (atomics into a zeroed fp32 [M, N] buffer; the split that finishes a tile last, by an
      arrival counter, writes the output with bias: no sum kernel).
    """

    kernel: str  # "gemm" | "swap" | "gemv" | "dp4a" | "tma"
    block_m: int
    block_n: int
    pairs: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    reduce: str = "workspace"

    def __post_init__(self):
        if self.kernel not in TILE_KERNELS:
            raise ValueError(f"TileConfig.kernel {self.kernel!r} is not valid; valid choices: {', '.join(TILE_KERNELS)}")
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"TileConfig.reduce {self.reduce!r} is not valid; valid choices: {', '.join(REDUCE_MODES)}")
        if self.kernel in ("gemm", "swap") and self.pairs not in (1, 2, 4):
            raise ValueError(f"gemm/swap configs take 1, 2 or 4 block pairs per K step, got {self.pairs}")
        if self.kernel in ("gemv", "dp4a") and (self.pairs & (self.pairs - 1) or self.block_m > GEMV_MAX_ROWS
                                      or self.block_m & (self.block_m - 1)):
            raise ValueError(f"gemv configs need power-of-two pairs and block_m (0..{GEMV_MAX_ROWS}), got {self}")
        if self.kernel == "tma" and not (self.pairs == 4 and self.block_m in (8, 16) and self.num_warps == 4
                                         and self.block_n in (64, 128) and self.reduce == "last"
                                         and self.num_stages >= 1 and self.split_k >= 1):
            raise ValueError(f"tma configs take pairs=4, block_m 8 or 16, block_n 64 or 128, 4 warps, reduce "
                             f"'last' and an explicit split_k, got {self}")

    @property
    def name(self) -> str:
        base = f"{self.kernel}_m{self.block_m}n{self.block_n}k{64 * self.pairs}_w{self.num_warps}s{self.num_stages}"
        if self.split_k == 1:
            return base
        reduce = {"workspace": "W", "atomic": "A", "last": "L"}[self.reduce]
        return f"{base}_sk{'auto' if self.split_k == 0 else self.split_k}{reduce}"

    def shared_memory_bytes(self, act_bytes: int) -> int:
        """Estimate of the shared memory one CTA needs: pipelined activation and weight tiles
        (act_bytes per activation value: 2 for the fused bf16 input, 1 for Q8_1) plus the int8
        operand tiles the dot reads from shared memory."""
        if self.kernel in ("gemv", "dp4a"):
            return 0
        k_step = 64 * self.pairs
        if self.kernel == "tma":  # per slot: weight bytes, int8 activations, d4, d and s
            return self.num_stages * (self.block_n * k_step // 2 + self.block_m * k_step + 16 * self.block_n
                                      + 64 * self.block_m)
        if self.kernel == "swap":  # the weights stay in registers
            return self.num_stages * self.block_m * k_step * act_bytes + self.block_m * k_step
        staged = self.num_stages * (self.block_m * k_step * act_bytes + self.block_n * k_step // 2)
        operands = self.block_m * k_step + k_step * self.block_n
        return staged + operands


GEMV_MAX_ROWS = 8  # token rows one gemv program handles (more rows: more programs along M)
GEMV_MAX_TOKENS = 8  # token counts for which the gemv kernel is a candidate
DECODE_MAX_TOKENS = 16
PROGRAMS_PER_SM = 4  # split_k=0 aims at this many programs per SM

_GEMV_CONFIGS = [TileConfig("gemv", 0, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
    (32, 8, 4, 1, 0, "workspace"), (64, 8, 4, 1, 0, "workspace"), (64, 8, 4, 1, 0, "atomic"),
    (64, 4, 4, 1, 0, "workspace"), (64, 8, 4, 3, 0, "workspace"), (32, 8, 4, 1, 1, "workspace"))] + [
    TileConfig("dp4a", 0, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
        (32, 8, 4, 1, 0, "workspace"), (64, 8, 4, 1, 0, "workspace"), (64, 4, 4, 1, 0, "atomic"),
        (128, 4, 8, 1, 0, "workspace"), (64, 8, 4, 3, 0, "workspace"), (32, 4, 4, 1, 1, "workspace"),
        # one-warp tiles of 16-32 rows: the fastest dp4a configs of the H100 sweep
        # (bench/results/q4_decode_h100_wide.*): 2.32-2.34x cuBLAS at 1 token, 1.04-1.12x at 4
        (32, 4, 1, 1, 4, "workspace"), (16, 8, 1, 1, 4, "workspace"), (32, 8, 1, 1, 0, "workspace"),
        (16, 8, 1, 1, 0, "workspace"),
        # the same with the single-launch split-K reduction (no separate sum kernel)
        (32, 4, 1, 1, 4, "last"), (16, 8, 1, 1, 4, "last"), (32, 8, 1, 1, 0, "last"), (16, 8, 1, 1, 0, "last"),
        # a split of 8 (q4_decode_h100_splits.*): the best one-token tile on 13824->5120,
        # 21.4 us against 23.2 us for the best of the tiles above in the same run
        (16, 4, 1, 1, 8, "last"))]
_DECODE_GEMM_CONFIGS = [TileConfig("gemm", 16, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
    (64, 2, 4, 3, 0, "workspace"), (128, 2, 4, 3, 0, "workspace"), (64, 4, 4, 3, 0, "atomic"),
    (32, 2, 4, 4, 0, "workspace"), (64, 2, 4, 3, 1, "workspace"))]
# The operand-swapped decode tiles ("swap"), for token blocks of 8 or 16 (wgmma's N side); (block_n,
# pairs, warps, stages, reduce[, split_k]). The H100 sweep (bench/results/q4_decode_h100_swap.*):
# one warpgroup on 128 rows with 3 stages was best on all six rows (64-row tiles 1.3x slower, two
# warpgroups 1.4x, 1 stage 1.3-1.9x); 256-row tiles need fewer instructions per weight offline
# (0.20 against 0.29 warp-instructions at 16 tokens) at 189 registers. Deeper pipelines did not
# help (q4_decode_h100_swap_stages.*, 128-row tiles): 4 stages were 2-3% slower than 3
# on three of four rows and 1% faster on the fourth; 6 stages were 3-9% slower on all four.
_SWAP_SHAPES = ((128, 1, 4, 3, "last", 16), (128, 1, 4, 3, "last"), (128, 2, 4, 3, "last", 16),
                (128, 1, 4, 4, "last", 16), (256, 1, 4, 3, "last", 16), (256, 1, 4, 3, "last"))


def swap_configs(m: int, shapes=_SWAP_SHAPES) -> list[TileConfig]:
    """The "swap" decode configs for m tokens (one token block of 8 or 16 columns); shapes are
    (block_n, pairs, warps, stages, reduce[, split_k]), split_k 0 (automatic) when left out."""
    block_m = 8 if m <= 8 else 16
    return [TileConfig("swap", block_m, *shape[:4], shape[5] if len(shape) > 5 else 0, shape[4]) for shape in shapes]


# 64 x 256 tiles (8 warps): the fused kernel re-quantizes its activation tile once per N tile, so
# wider N tiles halve that work. Offline sm_90 compile (triton 3.9), warp-instructions per output
# element and K value: 0.0096 fused / 0.0070 separate, against 0.0135 / 0.0075 at 64 x 128.
_WIDE_N_CONFIGS = [TileConfig("gemm", 64, 256, p, 8, 3, 0) for p in (1, 2)]
_MID_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s, sk) for bm, bn, p, w, s, sk in (
    (32, 64, 2, 4, 3, 0), (64, 64, 2, 4, 3, 0), (32, 128, 2, 4, 3, 0), (64, 128, 2, 8, 3, 1),
    (32, 64, 1, 4, 4, 1))] + _WIDE_N_CONFIGS
# 17-64 tokens: the operand-swapped kernel on blocks of 32 tokens (two at 64 tokens; the token
# block is the grid's fastest axis, so the second block's read of W can hit L2). H100, 64 tokens,
# fused (bench/results/q4_decode_swap_64tok_h100.*): 90.6 / 95.1 us on 5120->13824 /
# 13824->5120 against 118.9 / 116.1 us for the best "gemm" tile; 64-token blocks took 113-119 us.
_MID_SWAP_CONFIGS = [TileConfig("swap", 32, bn, 1, 4, 3, 0, "last") for bn in (128, 256)]
_LARGE_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s) for bm, bn, p, w, s in (
    (128, 128, 1, 8, 3), (128, 128, 2, 8, 3), (128, 128, 2, 8, 4), (128, 64, 2, 4, 4), (64, 128, 2, 4, 4))
    ] + _WIDE_N_CONFIGS


def tma_configs(m: int) -> list[TileConfig]:
    """q4_tma's decode tiles for m <= 16 tokens (8- or 16-token blocks, 64-row tiles, 2-3 slots)."""
    block_m = 8 if m <= 8 else 16
    return [TileConfig("tma", block_m, 64, 4, 4, stages, split, "last") for split in (1, 2, 4, 8) for stages in (2, 3)]


def candidate_configs(m: int, fused: bool) -> list[TileConfig]:
    """Tile configs worth timing for `m` token rows (the fp32 gemv kernel quantizes in-kernel, so it
    is a candidate of the fused path only; the dp4a one runs either way)."""
    if m <= DECODE_MAX_TOKENS:  # the dp4a decode kernel's per-row cost is small enough for 16 rows
        if fused:
            decode = [c for c in _GEMV_CONFIGS if m <= GEMV_MAX_TOKENS or c.kernel == "dp4a"]
        else:  # Q8_1 blocks in: the dp4a kernel reads them as they are (the fp32 gemv kernel cannot)
            decode = [c for c in _GEMV_CONFIGS if c.kernel == "dp4a"]
        return decode + _DECODE_GEMM_CONFIGS + swap_configs(m)
    if m <= 64:
        return _MID_CONFIGS + _MID_SWAP_CONFIGS
    return _LARGE_CONFIGS


def default_config(m: int, fused: bool) -> TileConfig:
    """The untuned choice for m token rows (an op's kernel string "")."""
    if m <= GEMV_MAX_TOKENS and fused:
        return _GEMV_CONFIGS[1]
    if m <= DECODE_MAX_TOKENS:
        return _DECODE_GEMM_CONFIGS[0]
    if m <= 64:
        return _MID_CONFIGS[0]
    return _LARGE_CONFIGS[0]


# =============================================================================================
# Triton kernels
# =============================================================================================
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
def _store_fp16_bytes(ptrs, v, mask):
    """v as fp16, little-endian, into the byte pairs at ptrs (uint8 pointers)."""
    bits = v.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(ptrs, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptrs + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _quantize_q8_1_kernel(
    x_ptr, out_ptr,  # x (M, K); out uint8 (M, nb, 36)
    M, NB, stride_xm, stride_om,
    BLOCKS: tl.constexpr, EXACT: tl.constexpr,
):
    """Writes every byte through the one uint8 output (no dtype views of it: a traced graph copies
    each tensor argument a kernel writes, and two overlapping views would overwrite each other)."""
    pid_m = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,)
    j = tl.arange(0, 32)
    mask = (blocks < NB)[:, None]
    x = tl.load(x_ptr + pid_m * stride_xm + blocks[:, None] * 32 + j[None, :], mask=mask, other=0.0).to(tl.float32)
    _, qi, d, _ = _q8_1_quantize(x, EXACT)
    s = tl.sum(qi, axis=1).to(tl.float32) * d  # ggml: (float) sum * d with the float32 d
    block_ptrs = out_ptr + pid_m * stride_om + blocks * 36  # (BLOCKS,): fp16 d, fp16 s, 32 int8 q
    tl.store(block_ptrs[:, None] + 4 + j[None, :], qi.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
    _store_fp16_bytes(block_ptrs, d, blocks < NB)
    _store_fp16_bytes(block_ptrs + 2, s, blocks < NB)


@triton.jit
def _quantize_for_tma_kernel(x_ptr, q_ptr, ds_ptr, K, KP, M4, stride_xm, BLOCKS_PER_PROGRAM: tl.constexpr,
                             EXACT: tl.constexpr):
    """Q8_1 of row program_id(0) of x, blocks program_id(1) * BLOCKS_PER_PROGRAM...: q int8 (M, KP),
    ds fp32 (2 * KP / 32, M4) with d at row 2b and d * sum(q) at row 2b + 1 (q4._load_act_block's
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
    x_ptr, w_ptr, ws_ptr,  # x (M, K) bf16/fp16/fp32; qweight (N, Kp/2) uint8, or its int32 words (N, Kp/8)
    #                        when USE_DP4A; scales (Kp/32, N) fp16
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
    w_tile = w_ptr + offs_n[:, None, None] * stride_wn + offs_c[None, :, None] * WORDS + offs_w[None, None, :]
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


# =============================================================================================
# Launchers
# =============================================================================================
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _exact_mul() -> bool:
    """Use libdevice mul_rn in the Q8_1 rounding (compiled kernels; the interpreter has no libdevice)."""
    return _libdevice is not None and not INTERPRET


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in SUPPORTED_ACT_DTYPES:
        raise ValueError(f"{what}: activations must be float16, bfloat16 or float32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # interpreter: a few programs are enough to exercise split-K
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_k(requested: int, tiles: int, num_pairs: int, step: int, device: torch.device) -> tuple[int, int]:
    """(programs along K, block pairs per program: a multiple of the K step)."""
    steps = cdiv(num_pairs, step)
    if requested == 0:
        split = cdiv(PROGRAMS_PER_SM * _sm_count(device.index if device.type == "cuda" else None), tiles)
    else:
        split = requested
    split = max(1, min(split, steps))
    pairs_per_split = step * cdiv(steps, split)
    return cdiv(num_pairs, pairs_per_split), pairs_per_split


def quantize_q8_1_triton(x: torch.Tensor, blocks_per_program: int = 8) -> torch.Tensor:
    """Triton Q8_1 quantization: x [..., K] -> block_q8_1 bytes uint8 [..., K/32, 36]."""
    k = x.shape[-1]
    _check_k(k, "quantize_q8_1")
    x2 = _rows(x, "quantize_q8_1")
    m, nb = x2.shape[0], k // QK
    out = torch.empty(m, nb, Q8_1_BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    if m:
        grid = (m, cdiv(nb, blocks_per_program))
        launch(_quantize_q8_1_kernel, grid, x2, out, m, nb, x2.stride(0), out.stride(0),
               BLOCKS=blocks_per_program, EXACT=_exact_mul())
    return out.reshape(*x.shape[:-1], nb, Q8_1_BLOCK_BYTES)


def _gemv_rows(m) -> int:
    """Token rows per gemv program when the config leaves it open: the next power of two of m, at
    most GEMV_MAX_ROWS (comparisons only: m is symbolic in a graph traced with dynamic shapes)."""
    return next(rows for rows in (1, 2, 4, GEMV_MAX_ROWS) if m <= rows or rows == GEMV_MAX_ROWS)


def _launch(act_mode: int, a: torch.Tensor, ad: torch.Tensor, stride_am: int, stride_adm: int, m: int, k: int,
            qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: TileConfig, quot_dtype=tl.float32, qmin: int = -128, qmax: int = 127) -> None:
    """Run `config` on (M=m, K=k) activations into `out` (M, N): the main kernel, plus, with
    split-K, the fp32 buffers it reduces into (allocated here, zeroed) and the small kernel that
    sums them into `out` (none with reduce="last": the kernel's last split per tile writes `out`)."""
    n = qweight.shape[0]
    num_pairs = cdiv(k, 64)
    if config.kernel in ("gemv", "dp4a"):
        if act_mode != ACT_FUSED and not (act_mode == ACT_PREQUANTIZED and config.kernel == "dp4a"):
            raise ValueError("the decode kernels take unquantized activations (the fused path); of them, only "
                             "'dp4a' also reads Q8_1 blocks (the separate path)")
        rows = config.block_m or _gemv_rows(m)
        tiles_m = cdiv(m, rows)
    else:
        tiles_m = cdiv(m, config.block_m)
    tiles_n = cdiv(n, config.block_n)
    split, pairs_per_split = _split_k(config.split_k, tiles_m * tiles_n, num_pairs, config.pairs, out.device)
    reduce = REDUCE_NONE if split == 1 else {"atomic": REDUCE_ATOMIC, "workspace": REDUCE_WORKSPACE,
                                              "last": REDUCE_LAST}[config.reduce]
    has_bias = bias is not None
    acc_buf = counters = out  # placeholders, read only under REDUCE_LAST
    if reduce == REDUCE_LAST:
        acc_buf, counters = split_buffers(out.device, m, n, tiles_m * tiles_n)
    if reduce in (REDUCE_NONE, REDUCE_LAST):
        dest = out
    elif reduce == REDUCE_ATOMIC:
        direct = out.dtype == torch.float32 and not has_bias and out.is_contiguous()
        dest = out.zero_() if direct else torch.zeros(m, n, dtype=torch.float32, device=out.device)
    else:
        dest = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    stride_os = m * n if reduce == REDUCE_WORKSPACE else 0
    stride_om = dest.stride(-2)
    bias_arg = bias if has_bias else dest
    if config.kernel in ("gemv", "dp4a"):
        dp4a = config.kernel == "dp4a"
        w = qweight.view(torch.int32) if dp4a else qweight
        launch(
            _q4_gemv_kernel, (tiles_n, split, tiles_m),
            a, w, scales, bias_arg, dest, acc_buf, counters, m, n, k, pairs_per_split,
            stride_am, w.stride(0), scales.stride(0), stride_os, stride_om,
            HAS_BIAS=has_bias, REDUCE=reduce, EXACT=_exact_mul(), USE_DP4A=dp4a, USE_ASM=dp4a and not INTERPRET,
            PREQUANTIZED=act_mode == ACT_PREQUANTIZED, ROWS=rows, BLOCK_N=config.block_n, CHUNK=config.pairs, num_warps=config.num_warps,
            num_stages=config.num_stages)
    else:
        launch(
            _q4_gemm_kernel, (tiles_m, tiles_n, split),
            a, ad, qweight, scales, bias_arg, dest, acc_buf, counters, m, n, k, pairs_per_split,
            stride_am, stride_adm, qweight.stride(0), scales.stride(0), stride_os, stride_om,
            ACT_MODE=act_mode, QUOT_DTYPE=quot_dtype, QMIN=qmin, QMAX=qmax, HAS_BIAS=has_bias, REDUCE=reduce,
            EXACT=_exact_mul(), BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAIRS=config.pairs,
            SWAP_AB=config.kernel == "swap", USE_ASM=not INTERPRET,
            num_warps=config.num_warps, num_stages=config.num_stages)
    if dest is not out:
        splits = split if reduce == REDUCE_WORKSPACE else 1
        block = 1024
        launch(
            _splitk_sum_kernel, (m, cdiv(n, block)),
            dest, bias_arg, out, n, splits, stride_os, dest.stride(-2), out.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4)


def kernel_config(kernel: str) -> TileConfig | None:
    """The tile an op's kernel string selects (tuning.encode of a TileConfig), None for ""."""
    return tuning.decode(TileConfig, kernel) if kernel else None


def _check_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return bias.contiguous()


def q4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                     mode: str = "fused", config: TileConfig | None = None) -> torch.Tensor:
    """y = Q8_1(x) @ Q4_0(W).T (+ bias) for x [..., K] -> [..., N] in x's dtype, with `config` or
    the untuned default. mode "fused": one kernel (the decode GEMV or the tiled GEMM, both
    quantizing in registers; plus the split-K sum where the config splits K); "separate":
    quantize_q8_1_triton, then the GEMM on the Q8_1 bytes, or with a "tma" config q4_tma's decode."""
    if mode not in ("fused", "separate"):
        raise ValueError(f"q4_linear mode {mode!r} is not valid; valid choices: fused, separate")
    k = x.shape[-1]
    _check_k(k, "q4_linear")
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    if config is not None and config.kernel == "tma":
        if mode != "separate":
            raise ValueError("tma configs run the separate path (mode='separate'): a quantize launch, then the "
                             "Gluon decode")
        return tma_linear(_rows(x, "q4_linear"), qweight, scales, bias, config).reshape(*x.shape[:-1], n)
    if mode == "separate":
        return q4_q8_gemm_triton(quantize_q8_1_triton(x), qweight, scales, bias, x.dtype, config=config)
    x2 = _rows(x, "q4_linear")
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _launch(ACT_FUSED, x2, x2, x2.stride(0), 0, m, k, qweight, scales, bias, out, config or default_config(m, True))
    return out.reshape(*x.shape[:-1], n)


def _tma_runs(x2: torch.Tensor, n: int, qweight: torch.Tensor) -> bool:
    """Whether q4_tma's decode can run this call: Gluon, an sm_90+ GPU (never the interpreter), K
    steps of 256 over the padded K, and fp16 scale rows 16-byte aligned (N a multiple of 8)."""
    from graphopt.kernels import q4_tma

    return not INTERPRET and n % 8 == 0 and q4_tma.tiles_k(qweight.shape[1] * 2) and q4_tma.supports(x2)


def tma_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               config: TileConfig) -> torch.Tensor:
    """q4_tma's separate decode of x2 (M, K): (M, N) in x2's dtype. Gluon kernels are not Triton JIT
    functions that Inductor can launch, so graphopt::q4_tma_decode, an opaque op, calls this."""
    from graphopt.kernels import q4_tma

    m, n = x2.shape[0], qweight.shape[0]
    bias = _check_bias(bias, n)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if not m:
        return out
    if not _tma_runs(x2, n, qweight):
        raise ValueError("a tma config needs an sm_90+ GPU (not the interpreter), Triton's Gluon, "
                         "K padded to a multiple of 256 and out_features a multiple of 8")
    steps = qweight.shape[1] * 2 // q4_tma.STEP
    split = max(1, min(config.split_k, steps))
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    buffers = split_buffers(out.device, m, n, tiles) if split > 1 else (out, out)
    q4_tma.launch_decode(x2, qweight, scales, bias, out, *buffers, split, config)
    return out


def q4_q8_gemm_triton(xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, config: TileConfig | None = None) -> torch.Tensor:
    """Pre-quantized activations (block_q8_1 bytes [..., K/32, 36]) x Q4_0 -> [..., N] in out_dtype,
    with `config` ("gemm", "swap" or "dp4a") or the untuned default."""
    if xq.dtype != torch.uint8 or xq.shape[-1] != Q8_1_BLOCK_BYTES:
        raise ValueError(f"q4_q8_gemm expects block_q8_1 bytes uint8 [..., K/32, 36], got {xq.dtype} {tuple(xq.shape)}")
    if config is not None and config.kernel in ("gemv", "tma"):
        raise ValueError("q4_q8_gemm takes Q8_1 bytes: only 'gemm', 'swap' and 'dp4a' configs apply (the fp32 gemv "
                         "kernel quantizes itself; tma tiles run q4_linear's separate mode)")
    k = xq.shape[-2] * QK
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    x3 = xq.reshape(-1, xq.shape[-2], Q8_1_BLOCK_BYTES).contiguous()
    m = x3.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m:
        config = config or default_config(m, False)
        if config.kernel == "dp4a":  # the decode kernel reads whole blocks as int32 words
            aligned = x3 if x3.storage_offset() % 4 == 0 else x3.clone()
            words = aligned.view(torch.int32).reshape(m, -1)
            _launch(ACT_PREQUANTIZED, words, words, words.stride(0), 0, m, k, qweight, scales, bias, out, config)
        else:
            q_view = x3.view(torch.int8)[:, :, 4:]
            d_view = x3.view(torch.float16)
            _launch(ACT_PREQUANTIZED, q_view, d_view, x3.stride(0), d_view.stride(0), m, k, qweight, scales, bias, out,
                    config)
    return out.reshape(*xq.shape[:-2], n)


def q4_linear_static_triton(x: torch.Tensor, act_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None, qmin: int = -128, qmax: int = 127,
                            config: TileConfig | None = None) -> torch.Tensor:
    """The fake-quant idiom fused: (round(x / s).clamp(qmin, qmax) * s) @ W_q4.T, integer dots."""
    k = x.shape[-1]
    _check_k(k, "q4_linear_static")
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    if not (-128 <= qmin <= qmax <= 127):
        raise ValueError(f"clamp bounds must lie in the int8 range [-128, 127], got ({qmin}, {qmax})")
    if config is not None and config.kernel not in ("gemm", "swap"):
        raise ValueError("q4_linear_static runs the tensor-core kernel: only 'gemm' and 'swap' configs apply")
    out_dtype = static_result_dtype(x, act_scale)
    if out_dtype not in _TL_DTYPES:
        raise ValueError(f"q4_linear_static: x / act_scale is {out_dtype}; the kernel takes "
                         f"{', '.join(str(d) for d in _TL_DTYPES)}")
    x2 = _rows(x, "q4_linear_static")
    m = x2.shape[0]
    s = _rows_scale(act_scale, x)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        quot = _TL_DTYPES[out_dtype]
        cfg = config or (default_config(m, False) if m > DECODE_MAX_TOKENS else _DECODE_GEMM_CONFIGS[0])
        _launch(ACT_STATIC, x2, s, x2.stride(0), 1, m, k, qweight, scales, bias, out, cfg, quot, qmin, qmax)
    return out.reshape(*x.shape[:-1], n)


# =============================================================================================
# Compile-time tuning
# =============================================================================================
def _autotune_enabled() -> bool:
    """Whether tiles may be timed now: compiled kernels on a CUDA device, no CUDA-graph capture
    running (timing would launch into it), and GRAPHOPT_Q4_AUTOTUNE not 0."""
    return (torch.cuda.is_available() and not INTERPRET and os.environ.get("GRAPHOPT_Q4_AUTOTUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def _token_bucket(m: int) -> int:
    return next_power_of_2(max(m, 1)) if m <= 4096 else 4096 * math.ceil(m / 4096)


def _time_config(run, config: TileConfig, m: int, cold_weights: list | None = None) -> float:
    """GPU time of one config. Decode sizes: with `cold_weights` (graphopt.timing.cold_copies of
    the layer's (qweight, scales)), calls over the distinct copies back to back in one CUDA graph,
    so each reads its weight from HBM as a model step does (graphopt.timing.cold_graph_ms, as the
    FP4 decode tuner and the benchmarks time); else CUDA-graph replays of one call (a launch costs
    more than the kernel there, so plain do_bench would time the CPU). CUDA events otherwise."""
    from triton.testing import do_bench, do_bench_cudagraph

    from graphopt.timing import cold_graph_ms

    run(config)  # compile outside any capture
    if m <= DECODE_MAX_TOKENS and cold_weights:
        try:
            return cold_graph_ms([lambda w=w: run(config, *w) for w in cold_weights], reps=10)
        except Exception:  # capture not possible here: fall back to the hot timings below
            pass
    if m <= DECODE_MAX_TOKENS:
        try:
            return float(do_bench_cudagraph(lambda: run(config), rep=20, return_mode="median"))
        except Exception:  # capture not possible here: fall back to events
            pass
    return float(do_bench(lambda: run(config), warmup=5, rep=20, return_mode="median"))


def tune_q4_linear(x_shape: tuple[int, ...], qweight: torch.Tensor, scales: torch.Tensor, bias: bool,
                   dtype: torch.dtype, mode: str, allow_tma: bool) -> str:
    """The kernel string of graphopt::q4_linear in `mode` on activations of `x_shape` (..., K) in
    `dtype`: the fastest tile of `mode`, timed on the weights' GPU over random activations; "" (the
    untuned default) without a CUDA device, under the interpreter, during a
    CUDA-graph capture, or with tuning off. "fused" times candidate_configs(m, fused=True);
    "separate" the Q8_1-bytes configs (quantize launch included) and, with `allow_tma` where
    q4_tma's decode runs, its tiles. `bias`: whether the layer adds one. Each choice is kept per
    (GPU and versions, mode, token bucket, N, K, dtype), in memory and on disk (tuning.lookup)."""
    if mode not in ("fused", "separate"):
        raise ValueError(f"q4_linear mode {mode!r} is not valid; valid choices: fused, separate")
    if not qweight.is_cuda or not _autotune_enabled():
        return ""
    m, k, n = math.prod(x_shape[:-1]), x_shape[-1], qweight.shape[0]
    _check_k(k, "tune_q4_linear")
    _check_weight(qweight, scales, k)
    if not m:
        return ""
    device = qweight.device
    x = torch.randn(m, k, device=device).to(dtype)
    tma = allow_tma and mode == "separate" and m <= DECODE_MAX_TOKENS and _tma_runs(x, n, qweight)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = "|".join((tuning.device_key(index), "q4_linear", mode + ("+tma" if tma else ""), f"m{_token_bucket(m)}",
                    f"n{n}", f"k{k}", str(dtype).removeprefix("torch.")))
    cached = tuning.lookup(key)
    if cached is not None:
        return cached
    b = torch.randn(n, device=device).to(dtype) if bias else None

    def run(cfg: TileConfig, qw: torch.Tensor = qweight, sc: torch.Tensor = scales) -> torch.Tensor:
        return q4_linear_triton(x, qw, sc, b, mode, config=cfg)

    from graphopt.timing import cold_copies

    cold_weights = cold_copies((qweight, scales)) if m <= DECODE_MAX_TOKENS else None
    best, best_ms = default_config(m, mode == "fused"), math.inf
    for config in candidate_configs(m, mode == "fused") + (tma_configs(m) if tma else []):
        try:
            ms = _time_config(run, config, m, cold_weights)
        except Exception:  # out of shared memory / registers for this tile: skip it
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    kernel = tuning.encode(best)
    tuning.store(key, kernel)
    return kernel


@functools.lru_cache(maxsize=None)
def describe_configs() -> str:
    rows = [f"{c.name}: ~{c.shared_memory_bytes(2) // 1024} KiB smem fused / {c.shared_memory_bytes(1) // 1024} KiB separate"
            for c in _GEMV_CONFIGS + _DECODE_GEMM_CONFIGS + _MID_CONFIGS + _LARGE_CONFIGS]
    return "\n".join(rows)


__all__ = [
    "quantize_q4_0", "dequantize_q4_0", "quantize_q8_1", "dequantize_q8_1", "pack_q4_0", "unpack_q4_0",
    "dequantize_packed", "quantize_weight", "weight_sqnr_db", "reference_q4_linear", "reference_q4_q8_gemm",
    "reference_q4_linear_static", "quantize_q8_1_triton", "q4_linear_triton", "q4_q8_gemm_triton",
    "q4_linear_static_triton", "TileConfig", "candidate_configs", "default_config", "kernel_config", "tune_q4_linear",
]
