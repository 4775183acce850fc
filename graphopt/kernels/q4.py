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
  _quantize_q8_1_kernel  bf16/fp16/fp32 [M, K] -> ggml block_q8_1 bytes [M, K/32, 36].
  _q4_gemm_kernel        tensor-core int8 tl.dot, int32 per block, fp32 accumulation, with the
                         activation source a constexpr: ACT_PREQUANTIZED (reads block_q8_1 bytes;
                         the "separate" path), ACT_FUSED (bf16/fp16 in, Q8_1 quantization of each
                         K tile in registers: the fused kernel), ACT_STATIC (the fake-quant idiom
                         round(x / s).clamp(qmin, qmax) with a per-tensor or per-row scale s).
  _q4_gemv_kernel        decode path (1-4 tokens): fused quantization, fp32 FMAs on the integer
                         values (exact), no tensor cores, small N tiles for many CTAs.
  The launchers pick a tile config by token count; on a GPU they time the candidate configs once
  per (path, token bucket, N, K, dtype) and cache the fastest (GRAPHOPT_Q4_AUTOTUNE=0 disables it).

Caveats: inference only (no autograd). Activations must be contiguous in their last dim (the
launchers make them so). The fused kernel re-quantizes the activation tile once per N tile, which
is redundant CUDA-core work that grows with M*K*N/BLOCK_N; at large token counts the separate path
(quantize once) or dense bf16 wins, and the q4_linear pass's cost model says so.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

QK = 32  # values per Q4_0 / Q8_1 block
Q4_0_BLOCK_BYTES = 18
Q8_1_BLOCK_BYTES = 36
SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    d16 = scales.t()[:, : in_features // QK].contiguous().view(torch.uint8).reshape(qweight.shape[0], -1, 2)
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
    q4u = _kernel_nibbles(qweight)[:, : nb * QK].reshape(n, nb, QK).to(torch.int64)  # (N, nb, 32)
    d4 = scales.t()[:, :nb].to(torch.float64)  # (N, nb)
    q8 = q8.to(torch.int64)
    out = torch.empty(m, n, dtype=torch.float64, device=q8.device)
    rows = max(1, (1 << 22) // max(1, n * nb))  # bound the (rows, N, nb) int64 temporary
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        dots = torch.einsum("mbk,nbk->mnb", q8[start:stop], q4u).to(torch.float64)  # exact ints
        inner = d8[start:stop, None, :].double() * dots - 8.0 * s8[start:stop, None, :].double()
        out[start:stop] = (inner * d4[None]).sum(dim=-1)
    return out


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


def static_quantize(x: torch.Tensor, act_scale: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """round(x / s).clamp(qmin, qmax) exactly as eager torch computes it (the quotient rounded to
    the promoted dtype, round half to even): (q fp32 [M, K], s fp32 [M]) with rows = x's leading dims."""
    k = x.shape[-1]
    quot_dtype = torch.promote_types(x.dtype, act_scale.dtype)
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
    out_dtype = torch.promote_types(x.dtype, act_scale.dtype)
    return _finish(_integer_q4_gemm(q, s_blocks, s8, qweight, scales), bias, tuple(x.shape[:-1]), out_dtype)


# =============================================================================================
# Tile configs
# =============================================================================================
@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the Q4 kernels. PAIRS block pairs (64 K values each) per K step."""

    kernel: str  # "gemm" (tensor cores) | "gemv" (fp32 FMAs, decode)
    block_m: int
    block_n: int
    pairs: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"{self.kernel}_m{self.block_m}n{self.block_n}k{64 * self.pairs}_w{self.num_warps}s{self.num_stages}"

    def shared_memory_bytes(self, act_bytes: int) -> int:
        """Estimate of the shared memory one CTA needs: pipelined activation and weight tiles
        (act_bytes per activation value: 2 for the fused bf16 input, 1 for Q8_1) plus the int8
        operand tiles the dot reads from shared memory."""
        if self.kernel == "gemv":
            return 0
        k_step = 64 * self.pairs
        staged = self.num_stages * (self.block_m * k_step * act_bytes + self.block_n * k_step // 2)
        operands = self.block_m * k_step + k_step * self.block_n
        return staged + operands


GEMV_MAX_TOKENS = 4  # the fp32 decode kernel handles up to this many rows
DECODE_MAX_TOKENS = 16

_GEMV_CONFIGS = [TileConfig("gemv", 0, bn, 1, w, 1) for bn, w in ((16, 2), (32, 4), (64, 4), (32, 2))]
_DECODE_GEMM_CONFIGS = [TileConfig("gemm", 16, bn, p, 4, s) for bn, p, s in
                        ((32, 1, 4), (32, 2, 3), (64, 1, 4), (64, 2, 3), (128, 1, 3), (16, 2, 4))]
_MID_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s) for bm, bn, p, w, s in
                ((32, 64, 1, 4, 4), (32, 128, 1, 4, 3), (64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 128, 2, 8, 3),
                 (32, 64, 2, 4, 3))]
_LARGE_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s) for bm, bn, p, w, s in
                  ((128, 128, 1, 8, 3), (128, 128, 2, 8, 3), (128, 256, 1, 8, 3), (64, 256, 1, 8, 3),
                   (128, 64, 1, 4, 4), (64, 128, 2, 4, 4))]


def candidate_configs(m: int, fused: bool) -> list[TileConfig]:
    """Tile configs worth timing for `m` token rows (the decode GEMV only where it applies: it
    quantizes in-kernel, so it is a fused-path kernel)."""
    if m <= GEMV_MAX_TOKENS:
        return (_GEMV_CONFIGS if fused else []) + _DECODE_GEMM_CONFIGS
    if m <= DECODE_MAX_TOKENS:
        return _DECODE_GEMM_CONFIGS
    if m <= 64:
        return _MID_CONFIGS
    return _LARGE_CONFIGS


def default_config(m: int, fused: bool) -> TileConfig:
    """The untimed choice (CPU interpreter, or autotuning off)."""
    if m <= GEMV_MAX_TOKENS and fused:
        return TileConfig("gemv", 0, 32, 1, 4, 1)
    if m <= DECODE_MAX_TOKENS:
        return TileConfig("gemm", 16, 32, 2, 4, 3)
    if m <= 64:
        return TileConfig("gemm", 32, 64, 1, 4, 4)
    return TileConfig("gemm", 128, 128, 1, 8, 3)


# =============================================================================================
# Triton kernels
# =============================================================================================
ACT_PREQUANTIZED = 0  # block_q8_1 bytes from _quantize_q8_1_kernel (the separate path)
ACT_FUSED = 1  # bf16/fp16/fp32 activations, Q8_1 quantization in registers (the fused kernel)
ACT_STATIC = 2  # round(x / s).clamp(qmin, qmax) with a per-row scale s (the fake-quant idiom)


@triton.jit
def _round_half_away_tl(v):
    t = v.to(tl.int32)  # truncation toward zero
    frac = v - t.to(tl.float32)  # exact
    return t + (frac >= 0.5).to(tl.int32) - (frac <= -0.5).to(tl.int32)


@triton.jit
def _round_half_even_tl(v):
    t = v.to(tl.int32)
    frac = v - t.to(tl.float32)
    odd = (t % 2) != 0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    down = (frac < -0.5) | ((frac == -0.5) & odd)
    return t + up.to(tl.int32) - down.to(tl.int32)


@triton.jit
def _q8_1_block(x):
    """Q8_1 of a [R, 32] fp32 tile, one block per row: (q int32 [R, 32], d fp32 [R] (the fp16-rounded
    d that dequantizes), s fp32 [R] = d * sum q). Same float32 steps as quantize_row_q8_1_ref."""
    amax = tl.max(tl.abs(x), axis=1)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv_d = tl.where(d != 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0.0, d, 1.0)), 0.0)
    q = _round_half_away_tl(x * inv_d[:, None])
    d16 = d.to(tl.float16).to(tl.float32)
    return q, d16, d16 * tl.sum(q, axis=1).to(tl.float32)


@triton.jit
def _quantize_q8_1_kernel(
    x_ptr, q_ptr, ds_ptr,  # x (M, K); q int8 view (M, nb, 36) + 4; ds fp16 view (M, nb, 18)
    M, NB, stride_xm, stride_qm, stride_dsm,
    BLOCKS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,)
    j = tl.arange(0, 32)
    mask = (blocks < NB)[:, None]
    x = tl.load(x_ptr + pid_m * stride_xm + blocks[:, None] * 32 + j[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv_d = tl.where(d != 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0.0, d, 1.0)), 0.0)
    q = _round_half_away_tl(x * inv_d[:, None])
    s = tl.sum(q, axis=1).to(tl.float32) * d  # ggml: sum * d with the float32 d
    tl.store(q_ptr + pid_m * stride_qm + blocks[:, None] * 36 + j[None, :], q.to(tl.int8), mask=mask)
    ds_base = ds_ptr + pid_m * stride_dsm + blocks * 18
    tl.store(ds_base, d.to(tl.float16), mask=blocks < NB)
    tl.store(ds_base + 1, s.to(tl.float16), mask=blocks < NB)


@triton.jit
def _load_act_block(
    a_ptr, ad_ptr, offs_m, m_mask, kb, K, stride_am, stride_adm,
    ACT_MODE: tl.constexpr, QUOT_DTYPE: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
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
            return _q8_1_block(x)
        else:  # static scale per row (ad_ptr: fp32 [M])
            s = tl.load(ad_ptr + offs_m, mask=m_mask, other=1.0)
            v = tl.math.div_rn(x, s[:, None]).to(QUOT_DTYPE).to(tl.float32)
            q = tl.minimum(tl.maximum(_round_half_even_tl(v), QMIN), QMAX)
            return q, s, s * tl.sum(q, axis=1).to(tl.float32)


@triton.jit
def _q4_gemm_kernel(
    a_ptr, ad_ptr,  # activations (see _load_act_block)
    w_ptr, ws_ptr,  # qweight (N, Kp/2) uint8, scales (Kp/32, N) fp16
    bias_ptr, out_ptr,  # bias (N,), out (M, N)
    M, N, K,
    stride_am, stride_adm, stride_wn, stride_wsb, stride_om,
    ACT_MODE: tl.constexpr, QUOT_DTYPE: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
):
    """out[m, n] = sum_b d4[b, n] * (a_scale[m, b] * dot(q8, q4u)[m, n] - 8 * a_sum[m, b]), one int8
    tl.dot of depth 32 per block, int32 per block, fp32 across blocks."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_j = tl.arange(0, 32)
    w_rows = w_ptr + offs_n[None, :] * stride_wn + offs_j[:, None]  # (32, BN): byte j of row n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_pairs = tl.cdiv(K, 64)
    for step in range(0, tl.cdiv(num_pairs, PAIRS)):
        for i in tl.static_range(PAIRS):
            p = step * PAIRS + i
            live = n_mask & (offs_n * 0 + p < num_pairs)  # (BN,): past the last pair, load nothing
            wb = tl.load(w_rows + p * 32, mask=live[None, :], other=0)  # (32, BN) uint8
            w_lo = (wb & 0xF).to(tl.int8)  # block 2p
            w_hi = (wb >> 4).to(tl.int8)  # block 2p + 1
            d4_lo = tl.load(ws_ptr + (2 * p) * stride_wsb + offs_n, mask=live, other=0.0).to(tl.float32)
            d4_hi = tl.load(ws_ptr + (2 * p + 1) * stride_wsb + offs_n, mask=live, other=0.0).to(tl.float32)
            q_lo, sc_lo, sum_lo = _load_act_block(a_ptr, ad_ptr, offs_m, m_mask, 2 * p, K, stride_am, stride_adm,
                                                  ACT_MODE, QUOT_DTYPE, QMIN, QMAX)
            q_hi, sc_hi, sum_hi = _load_act_block(a_ptr, ad_ptr, offs_m, m_mask, 2 * p + 1, K, stride_am, stride_adm,
                                                  ACT_MODE, QUOT_DTYPE, QMIN, QMAX)
            dot_lo = tl.dot(q_lo.to(tl.int8), w_lo, out_dtype=tl.int32).to(tl.float32)  # (BM, BN)
            dot_hi = tl.dot(q_hi.to(tl.int8), w_hi, out_dtype=tl.int32).to(tl.float32)
            acc += d4_lo[None, :] * (sc_lo[:, None] * dot_lo - 8.0 * sum_lo[:, None])
            acc += d4_hi[None, :] * (sc_hi[:, None] * dot_hi - 8.0 * sum_hi[:, None])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _q4_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,  # x (M, K), qweight (N, Kp/2), scales (Kp/32, N)
    M, N, K, stride_xm, stride_wn, stride_wsb, stride_om,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Decode: ROWS (<= 4) token rows, Q8_1-quantized in registers, dot products as fp32 FMAs on
    the integer values (exact: |sum| < 2^24), BLOCK_N output rows per program."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, ROWS)
    r_mask = offs_r < M
    offs_j = tl.arange(0, 32)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for p in range(0, tl.cdiv(K, 64)):
        wb = tl.load(w_ptr + offs_n[:, None] * stride_wn + p * 32 + offs_j[None, :], mask=n_mask[:, None], other=0)
        w_lo = (wb & 0xF).to(tl.float32)  # (BN, 32)
        w_hi = (wb >> 4).to(tl.float32)
        d4_lo = tl.load(ws_ptr + (2 * p) * stride_wsb + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        d4_hi = tl.load(ws_ptr + (2 * p + 1) * stride_wsb + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        k_lo = 64 * p + offs_j
        x_lo = tl.load(x_ptr + offs_r[:, None] * stride_xm + k_lo[None, :],
                       mask=r_mask[:, None] & (k_lo < K)[None, :], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + offs_r[:, None] * stride_xm + (k_lo + 32)[None, :],
                       mask=r_mask[:, None] & (k_lo + 32 < K)[None, :], other=0.0).to(tl.float32)
        q_lo, d8_lo, s8_lo = _q8_1_block(x_lo)  # (ROWS, 32), (ROWS,), (ROWS,)
        q_hi, d8_hi, s8_hi = _q8_1_block(x_hi)
        dot_lo = tl.sum(q_lo.to(tl.float32)[:, None, :] * w_lo[None, :, :], axis=2)  # (ROWS, BN)
        dot_hi = tl.sum(q_hi.to(tl.float32)[:, None, :] * w_hi[None, :, :], axis=2)
        acc += d4_lo[None, :] * (d8_lo[:, None] * dot_lo - 8.0 * s8_lo[:, None])
        acc += d4_hi[None, :] * (d8_hi[:, None] * dot_hi - 8.0 * s8_hi[:, None])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_r[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


# =============================================================================================
# Launchers
# =============================================================================================
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in SUPPORTED_ACT_DTYPES:
        raise ValueError(f"{what}: activations must be float16, bfloat16 or float32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_q8_1_triton(x: torch.Tensor, blocks_per_program: int = 8) -> torch.Tensor:
    """Triton Q8_1 quantization: x [..., K] -> block_q8_1 bytes uint8 [..., K/32, 36]."""
    k = x.shape[-1]
    _check_k(k, "quantize_q8_1")
    x2 = _rows(x, "quantize_q8_1")
    m, nb = x2.shape[0], k // QK
    out = torch.empty(m, nb, Q8_1_BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    if m:
        grid = (m, triton.cdiv(nb, blocks_per_program))
        q_view = out.view(torch.int8)[:, :, 4:]
        ds_view = out.view(torch.float16)
        _quantize_q8_1_kernel[grid](x2, q_view, ds_view, m, nb, x2.stride(0), out.stride(0), ds_view.stride(0),
                                    BLOCKS=blocks_per_program)
    return out.reshape(*x.shape[:-1], nb, Q8_1_BLOCK_BYTES)


def _launch(act_mode: int, a: torch.Tensor, ad: torch.Tensor, stride_am: int, stride_adm: int, m: int, k: int,
            qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: TileConfig, quot_dtype=tl.float32, qmin: int = -128, qmax: int = 127) -> None:
    n = qweight.shape[0]
    bias_arg = bias if bias is not None else out
    if config.kernel == "gemv":
        if act_mode != ACT_FUSED or m > GEMV_MAX_TOKENS:
            raise ValueError(f"the gemv decode kernel takes <= {GEMV_MAX_TOKENS} rows of unquantized activations")
        rows = triton.next_power_of_2(max(m, 1))
        _q4_gemv_kernel[(triton.cdiv(n, config.block_n),)](
            a, qweight, scales, bias_arg, out, m, n, k, stride_am, qweight.stride(0), scales.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, ROWS=rows, BLOCK_N=config.block_n, num_warps=config.num_warps)
        return
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _q4_gemm_kernel[grid](
        a, ad, qweight, scales, bias_arg, out, m, n, k,
        stride_am, stride_adm, qweight.stride(0), scales.stride(0), out.stride(0),
        ACT_MODE=act_mode, QUOT_DTYPE=quot_dtype, QMIN=qmin, QMAX=qmax, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAIRS=config.pairs,
        num_warps=config.num_warps, num_stages=config.num_stages)


def _autotune_enabled() -> bool:
    return torch.cuda.is_available() and not _interpreting() and os.environ.get("GRAPHOPT_Q4_AUTOTUNE", "1") != "0"


def _token_bucket(m: int) -> int:
    return triton.next_power_of_2(max(m, 1)) if m <= 4096 else 4096 * math.ceil(m / 4096)


_TUNED: dict[tuple, TileConfig] = {}


def _choose(path: str, m: int, n: int, k: int, dtype: torch.dtype, fused: bool, run) -> TileConfig:
    """Fastest candidate config for this problem (timed once on the GPU, cached), or the default."""
    if not _autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return _TUNED.get((path, _token_bucket(m), n, k, dtype), default_config(m, fused))
    key = (path, _token_bucket(m), n, k, dtype)
    if key in _TUNED:
        return _TUNED[key]
    from triton.testing import do_bench

    best, best_ms = default_config(m, fused), math.inf
    for config in candidate_configs(m, fused):
        try:
            ms = do_bench(lambda: run(config), warmup=5, rep=20, return_mode="median")
        except Exception:  # out of shared memory / registers for this tile: skip it
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    _TUNED[key] = best
    return best


def _check_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return bias.contiguous()


def q4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                     mode: str = "fused", config: TileConfig | None = None) -> torch.Tensor:
    """y = Q8_1(x) @ Q4_0(W).T (+ bias) for x [..., K] -> [..., N] in x's dtype.
    mode "fused": one kernel (the decode GEMV or the tiled GEMM, both quantizing in registers);
    "separate": quantize_q8_1_triton, then the GEMM on the Q8_1 bytes."""
    if mode not in ("fused", "separate"):
        raise ValueError(f"q4_linear mode {mode!r} is not valid; valid choices: fused, separate")
    k = x.shape[-1]
    _check_k(k, "q4_linear")
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    if mode == "separate":
        return q4_q8_gemm_triton(quantize_q8_1_triton(x), qweight, scales, bias, x.dtype, config=config)
    x2 = _rows(x, "q4_linear")
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        def run(cfg: TileConfig) -> None:
            _launch(ACT_FUSED, x2, x2, x2.stride(0), 0, m, k, qweight, scales, bias, out, cfg)

        run(config or _choose("fused", m, n, k, x.dtype, True, run))
    return out.reshape(*x.shape[:-1], n)


def q4_q8_gemm_triton(xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, config: TileConfig | None = None) -> torch.Tensor:
    """Pre-quantized activations (block_q8_1 bytes [..., K/32, 36]) x Q4_0 -> [..., N] in out_dtype."""
    if xq.dtype != torch.uint8 or xq.shape[-1] != Q8_1_BLOCK_BYTES:
        raise ValueError(f"q4_q8_gemm expects block_q8_1 bytes uint8 [..., K/32, 36], got {xq.dtype} {tuple(xq.shape)}")
    k = xq.shape[-2] * QK
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    x3 = xq.reshape(-1, xq.shape[-2], Q8_1_BLOCK_BYTES).contiguous()
    m = x3.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m:
        q_view = x3.view(torch.int8)[:, :, 4:]
        d_view = x3.view(torch.float16)

        def run(cfg: TileConfig) -> None:
            _launch(ACT_PREQUANTIZED, q_view, d_view, x3.stride(0), d_view.stride(0), m, k, qweight, scales, bias, out, cfg)

        run(config or _choose("gemm", m, n, k, out_dtype, False, run))
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
    out_dtype = torch.promote_types(x.dtype, act_scale.dtype)
    x2 = _rows(x, "q4_linear_static")
    m = x2.shape[0]
    s = _rows_scale(act_scale, x)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        quot = _TL_DTYPES[out_dtype]
        cfg = config or (default_config(m, False) if m > DECODE_MAX_TOKENS else TileConfig("gemm", 16, 32, 2, 4, 3))
        _launch(ACT_STATIC, x2, s, x2.stride(0), 1, m, k, qweight, scales, bias, out, cfg, quot, qmin, qmax)
    return out.reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def describe_configs() -> str:
    rows = [f"{c.name}: ~{c.shared_memory_bytes(2) // 1024} KiB smem fused / {c.shared_memory_bytes(1) // 1024} KiB separate"
            for c in _DECODE_GEMM_CONFIGS + _MID_CONFIGS + _LARGE_CONFIGS]
    return "\n".join(rows)


__all__ = [
    "quantize_q4_0", "dequantize_q4_0", "quantize_q8_1", "dequantize_q8_1", "pack_q4_0", "unpack_q4_0",
    "dequantize_packed", "quantize_weight", "weight_sqnr_db", "reference_q4_linear", "reference_q4_q8_gemm",
    "reference_q4_linear_static", "quantize_q8_1_triton", "q4_linear_triton", "q4_q8_gemm_triton",
    "q4_linear_static_triton", "TileConfig", "candidate_configs", "default_config",
]
