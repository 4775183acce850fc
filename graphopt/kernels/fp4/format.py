"""FP4 (e2m1) weights: the MXFP4 and NVFP4 formats, their kernel layout, and the torch reference
of graphopt::fp4_linear. Plain torch (no Triton).

Formats (`quantize_fp4` / `dequantize_fp4`, one `Fp4Tensor` per weight of shape (N, K)):
  e2m1 codes: 4 bits, sign | exponent (2 bits) | mantissa (1 bit); magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Codes are packed two per byte along K, element 2i in the LOW
  nibble and element 2i+1 in the HIGH nibble (the OCP MX, ONNX FLOAT4E2M1 and
  torch.float4_e2m1fn_x2 order).
  MXFP4 (OCP MX v1.0): blocks of 32 along K share an e8m0 scale 2^(floor(log2(amax)) - 2),
  stored as its biased exponent byte (uint8, value 2^(byte - 127)). Exponents are clamped to
  [-126, 127] (bytes 1..254): blocks whose amax is below 2^-124 (denormal-range weights) lose
  their smallest values, and the NaN byte 255 is never written.
  NVFP4: blocks of 16 share an e4m3 scale (torch.float8_e4m3fn); one fp32 per-tensor
  `global_scale = amax(|W|) / (6 * 448)` makes the block scales span e4m3's range. A block's
  decode scale is e4m3 * global_scale.
  Quantization divides by the block scale, rounds to the nearest e2m1 value with ties to even
  (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturates at +-6.
  `scale_search=True` tries a few scales per block and keeps the one with the lowest squared
  error (any scale is a valid MXFP4/NVFP4 tensor; decoders are unchanged).
  In gptq.py, `quantize_fp4_gptq(w, hessian)` (GPTQ-style: rounding errors fed forward along K
  through the inverse-Hessian Cholesky factor, block scales re-chosen as the scan reaches each
  block) and `calibrate_fp4(model, inputs)` (Hessians of every nn.Linear from forward hooks; with
  `sequential=True` layer by layer on the partly quantized model, aiming at the full-precision
  output) return the same Fp4Tensor, so everything downstream is unchanged.
  K that is not a multiple of the block is zero-padded inside the format; `shape` keeps the
  real (N, K). NaN/Inf weights are rejected.

Kernel layout (`to_kernel_layout` / `from_kernel_layout`), arranged once at compile time:
  * K is zero-padded to a multiple of 64 (KERNEL_K_MULTIPLE), so every kernel K-tile is full
    (tile configs whose BLOCK_K does not divide the padded K are skipped) and rows start 32-byte
    aligned; only activations are masked at the K tail.
  * Within each scale block of BS elements (BS = 32 MXFP4, 16 NVFP4), byte j holds element j in
    its low nibble and element j + BS/2 in its high nibble. The low nibbles of a block's BS/2
    bytes are then the block's first half and the high nibbles its second half, so a kernel
    decodes `codes & 15` and `codes >> 4` into two contiguous half-blocks and pairs them with
    two contiguous slices of x: no nibble interleaving in registers. A block's bytes never mix
    with another block's, so read as FLOAT4E2M1 the bytes are a within-block permutation of W
    (the ONNX standard form undoes it with Reshape/Transpose).
  * Block scales stay (N, K_padded / BS), one byte each; the kernels decode e8m0 / e4m3 with bit
    arithmetic (no fp8 hardware needed), and e2m1 by placing its 3 magnitude bits into an fp16
    exponent/mantissa (exact: the result is value * 2^-14, folded into the block scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphopt.kernels.weight_chunks import CHUNK_ELEMENTS, chunk_rows, sqnr_db_of_parts

FORMATS: tuple[str, ...] = ("mxfp4", "nvfp4")
BLOCK_SIZES: dict[str, int] = {"mxfp4": 32, "nvfp4": 16}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_MIN_EXP, E8M0_MAX_EXP = -126, 127
KERNEL_K_MULTIPLE = 64
# The 16 code values, indexed by code (bit 3 = sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding boundaries between consecutive magnitudes, and whether a tie rounds up (to the even
# code above) or down. Code = number of boundaries below |x| (or at it, for ties that round up).
_E2M1_BOUNDS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)
# Candidate scale multipliers of the MSE search (NVFP4: times amax/6; MXFP4: powers of two).
_NVFP4_SEARCH_FACTORS: tuple[float, ...] = (1.0, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2, 1.3, 1.5)
_MXFP4_SEARCH_EXPONENTS: tuple[int, ...] = (0, -1, 1)


def _check_format(format: str) -> int:
    if format not in FORMATS:
        raise ValueError(f"unknown FP4 format {format!r}; valid choices: {', '.join(FORMATS)}")
    return BLOCK_SIZES[format]


@dataclass(frozen=True)
class Fp4Tensor:
    """A weight (N, K) in MXFP4 or NVFP4, in the standard (OCP / ONNX) packing.

    codes:        uint8 (N, K_blocks / 2); element 2i in the low nibble, 2i + 1 in the high one.
    scales:       (N, K_blocks / block_size); MXFP4: uint8 e8m0 exponent bytes,
                  NVFP4: torch.float8_e4m3fn.
    global_scale: fp32 scalar tensor; NVFP4 per-tensor decode scale, 1.0 for MXFP4.
    shape:        the real (N, K); K_blocks is K rounded up to the block size.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]
    format: str

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.format]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + (4 if self.format == "nvfp4" else 0)


# ---------------------------------------------------------------------------------------------
# Element rounding and packing
# ---------------------------------------------------------------------------------------------
def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, 0..15) of already-scaled values: nearest, ties to even, saturating."""
    magnitude = x.abs().to(torch.float32)
    # code = number of boundaries strictly below |x|; a tie that rounds up uses the float just
    # below its boundary, so |x| == boundary counts it.
    bounds = torch.tensor([b for b, _ in _E2M1_BOUNDS], dtype=torch.float32, device=x.device)
    tie_up = torch.tensor([t for _, t in _E2M1_BOUNDS], device=x.device)
    bounds = torch.where(tie_up, torch.nextafter(bounds, torch.zeros_like(bounds)), bounds)
    code = torch.bucketize(magnitude, bounds).to(torch.uint8)
    negative = (x < 0) & (code > 0)  # canonical +0 for values that round to zero
    return code | (negative.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes (any integer dtype)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) codes -> (..., n) bytes, element 2i in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) codes, inverse of pack_nibbles."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _blocks(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N, K) -> fp32 (N, ceil(K / bs), bs), zero-padded along K."""
    n, k = w.shape
    pad = (-k) % block_size
    wf = w.detach().to(torch.float32)
    if pad:
        wf = F.pad(wf, (0, pad))
    return wf.reshape(n, (k + pad) // block_size, block_size)  # explicit: n may be 0


def _quantize_blocks(blocks: torch.Tensor, scale: torch.Tensor, error_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes for blocks (N, B, bs) under per-block decode scales (N, B); also the squared error per
    block, each element's weighted by `error_weights` (broadcast against (N, B, bs)) when given."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = round_to_e2m1_codes(blocks / safe[..., None])
    codes = torch.where(scale[..., None] > 0, codes, torch.zeros_like(codes))
    err = (e2m1_values(codes) * scale[..., None] - blocks).square()
    if error_weights is not None:
        err = err * error_weights
    return codes, err.sum(-1)


# ---------------------------------------------------------------------------------------------
# Public format API
# ---------------------------------------------------------------------------------------------
def quantize_fp4(w: torch.Tensor, format: str = "nvfp4", *, scale_search: bool = False,
                 tensor_amax: torch.Tensor | None = None) -> Fp4Tensor:
    """Quantize a 2-D weight (N, K) along K into MXFP4 or NVFP4 (see the module docstring).

    `scale_search=True`: per block, try a few decode scales around the amax rule (MXFP4: the
    power of two below and above; NVFP4: multipliers 0.8-1.5 of amax/6, each rounded to e4m3)
    and keep the one with the lowest squared error. Never worse than the amax rule, per block.
    `tensor_amax`: for `w` a part of a larger tensor (a tensor-parallel shard), that tensor's
    largest |value|, at least w's: NVFP4's global scale is then the whole tensor's, so each block
    is quantized as in the whole tensor. MXFP4 has no global scale and ignores it.
    """
    block_size = _check_format(format)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp4 expects a 2-D floating-point weight (N, K), got "
                         f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))} {getattr(w, 'dtype', '')}")
    n, k = w.shape
    rows = chunk_rows(k)  # the scale search's fp32 temporaries reach about 12x a bf16 weight's bytes
    chunks = [w[start:start + rows] for start in range(0, max(n, 1), rows)]
    if not all(bool(torch.isfinite(chunk).all()) for chunk in chunks):
        raise ValueError("quantize_fp4: the weight contains NaN or Inf")
    local_amax = max((chunk.detach().abs().amax().float() for chunk in chunks if chunk.numel()),
                     default=torch.zeros((), device=w.device))
    global_scale = _global_scale(local_amax, format, tensor_amax)
    packed = scales = None
    for start, chunk in zip(range(0, max(n, 1), rows), chunks):
        codes, chunk_scales, _ = _choose_block_scales(_blocks(chunk, block_size), format, global_scale, scale_search,
                                                      finite_max=_finite_max(w))
        if packed is None:  # filled in place, not concatenated: torch.cat would follow an ambient autocast
            packed = codes.new_empty((n, codes.shape[1] * codes.shape[2] // 2))
            scales = chunk_scales.new_empty((n, chunk_scales.shape[1]))
        packed[start:start + chunk.shape[0]] = pack_nibbles(codes.flatten(1))
        scales[start:start + chunk.shape[0]] = chunk_scales
    return Fp4Tensor(packed, scales, global_scale.reshape(()), (n, k), format)


def _global_scale(local_amax: torch.Tensor, format: str, tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 per-tensor decode scale from the weight's largest |value| `local_amax` (a 0-d fp32
    tensor): NVFP4 amax(|W|) / (6 * 448) (1.0 for an all-zero W), MXFP4 1.0."""
    if format == "mxfp4":
        return torch.ones((), dtype=torch.float32, device=local_amax.device)
    if tensor_amax is None:
        tensor_amax = local_amax
    else:
        tensor_amax = torch.as_tensor(tensor_amax, device=local_amax.device).to(local_amax.dtype).reshape(())
        if bool(tensor_amax < local_amax):
            raise ValueError(f"quantize_fp4: tensor_amax {float(tensor_amax):g} is below the weight's own largest "
                             f"|value| {float(local_amax):g}; it must be the amax of a tensor that contains the weight")
    return torch.where(tensor_amax > 0, tensor_amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(tensor_amax)).to(torch.float32)


def _finite_max(w: torch.Tensor) -> float:
    """The largest finite value of w's dtype: the scale search must not decode a weight past it,
    because the kernels that dequantize into the activations' dtype (fp16 models) would turn it into inf."""
    return float(torch.finfo(w.dtype).max)


def _choose_block_scales(blocks: torch.Tensor, format: str, global_scale: torch.Tensor, scale_search: bool,
                         error_weights: torch.Tensor | None = None, finite_max: float = math.inf
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block scale rule of quantize_fp4 for blocks (N, B, bs): (codes (N, B, bs), stored scales
    (N, B) — uint8 e8m0 bytes or float8_e4m3fn — and fp32 decode scales (N, B)). The scale search
    compares squared errors weighted by `error_weights` (broadcast against blocks; None: unweighted);
    a searched candidate that decodes some weight of the block beyond `finite_max` is not taken."""
    amax = blocks.abs().amax(-1)  # (N, B)
    if format == "mxfp4":
        _, exponent = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
        base = torch.where(amax > 0, exponent - 1 - 2, torch.full_like(exponent, E8M0_MIN_EXP))
        exponents = ((base + offset).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
                     for offset in (_MXFP4_SEARCH_EXPONENTS if scale_search else (0,)))
        candidates = (((exp + 127).to(torch.uint8), torch.exp2(exp.to(torch.float32))) for exp in exponents)
        return _best_scale_candidate(blocks, candidates, error_weights, finite_max)
    target = amax / E2M1_MAX / global_scale  # block scale in units of global_scale, <= 448
    e4m3 = ((target * factor).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
            for factor in (_NVFP4_SEARCH_FACTORS if scale_search else (1.0,)))
    candidates = ((s8.view(torch.uint8), s8.to(torch.float32) * global_scale) for s8 in e4m3)
    codes, stored, decode = _best_scale_candidate(blocks, candidates, error_weights, finite_max)
    return codes, stored.view(torch.float8_e4m3fn), decode


def _best_scale_candidate(blocks: torch.Tensor, candidates, error_weights: torch.Tensor | None, finite_max: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block, the best of the candidate scales: (codes (N, B, bs), stored bytes (N, B) uint8,
    decode scales (N, B)). candidates yields (stored bytes, decode scales); the first is the plain
    rule and always eligible; a later one replaces the current choice where its weighted error is
    lower and it decodes no weight of the block beyond finite_max."""
    best_codes = best_err = best_stored = best_scale = None
    for stored, scale in candidates:
        codes, err = _quantize_blocks(blocks, scale, error_weights)
        if best_err is None:
            best_codes, best_err, best_stored, best_scale = codes, err, stored, scale
            continue
        better = (err < best_err) & (_decoded_peak(codes, scale) <= finite_max)
        best_codes = torch.where(better[..., None], codes, best_codes)
        best_err = torch.where(better, err, best_err)  # the chosen candidate's error, not a rejected one's
        best_stored = torch.where(better, stored, best_stored)
        best_scale = torch.where(better, scale, best_scale)
    return best_codes, best_stored, best_scale


def _decoded_peak(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest decoded magnitude per block: codes (N, B, bs), decode scales (N, B)."""
    return e2m1_values(codes).abs().amax(-1) * scale


def block_decode_scales(q: Fp4Tensor) -> torch.Tensor:
    """fp32 decode scale of every block, (N, K_blocks / block_size)."""
    if q.format == "mxfp4":
        return torch.exp2(q.scales.view(torch.uint8).to(torch.float32) - 127.0)
    return q.scales.view(torch.float8_e4m3fn).to(torch.float32) * q.global_scale.to(torch.float32)


def dequantize_fp4(q: Fp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) weight an Fp4Tensor represents."""
    _check_format(q.format)
    n, k = q.shape
    values = e2m1_values(unpack_nibbles(q.codes)).unflatten(1, (-1, q.block_size))  # unflatten: n may be 0
    w = (values * block_decode_scales(q)[..., None]).flatten(1)[:, :k]
    return w.to(dtype)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(sum ref^2 / sum (ref - approx)^2), in dB, summed
    in float64 over weight_chunks.CHUNK_ELEMENTS at a time."""
    if reference.shape != approximation.shape:
        raise ValueError(f"sqnr_db: reference {tuple(reference.shape)} and approximation "
                         f"{tuple(approximation.shape)} differ in shape")
    ref, approx = reference.detach().reshape(-1), approximation.detach().reshape(-1)
    step = CHUNK_ELEMENTS
    return sqnr_db_of_parts((ref[i:i + step], approx[i:i + step]) for i in range(0, ref.numel(), step))


def weight_sqnr_db(w: torch.Tensor, q: Fp4Tensor) -> float:
    """sqnr_db(w, dequantize_fp4(q)), dequantizing a chunk of rows at a time (a whole dequantized
    lm_head in float64 would be several GB)."""
    n, k = q.shape
    rows = chunk_rows(k)
    return sqnr_db_of_parts((w[i:i + rows], dequantize_fp4(Fp4Tensor(q.codes[i:i + rows], q.scales[i:i + rows],
                                                                     q.global_scale, (min(rows, n - i), k), q.format)))
                          for i in range(0, n, rows))


# ---------------------------------------------------------------------------------------------
# Kernel layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp4KernelWeight:
    """An Fp4Tensor arranged for the Triton kernels (see the module docstring).

    codes:        uint8 (N, K_padded / 2), K_padded = K rounded up to KERNEL_K_MULTIPLE; in each
                  block of bs elements byte j = element j (low nibble) | element j + bs/2 (high).
    scales:       (N, K_padded / bs), dtype as in Fp4Tensor, zero bytes in the padding.
    global_scale: fp32 (1,).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    out_features: int
    in_features: int
    format: str

    @property
    def block_size(self) -> int:
        return BLOCK_SIZES[self.format]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + self.global_scale.numel() * 4



def _padded_k(k: int) -> int:
    return max(KERNEL_K_MULTIPLE, -(-k // KERNEL_K_MULTIPLE) * KERNEL_K_MULTIPLE)


def to_kernel_layout(q: Fp4Tensor) -> Fp4KernelWeight:
    """Rearrange a standard Fp4Tensor into the layout the kernels read (inverse: from_kernel_layout)."""
    bs = _check_format(q.format)
    n, k = q.shape
    k_padded = _padded_k(k)
    codes = unpack_nibbles(q.codes)  # (N, K_blocks) standard order
    codes = F.pad(codes, (0, k_padded - codes.shape[1])).reshape(n, k_padded // bs, bs)
    arranged = codes[..., : bs // 2] | (codes[..., bs // 2:] << 4)  # (N, blocks, bs/2)
    scales = q.scales.view(torch.uint8)
    scales = F.pad(scales, (0, k_padded // bs - scales.shape[1])).view(q.scales.dtype)
    return Fp4KernelWeight(
        arranged.reshape(n, k_padded // 2).contiguous(), scales.contiguous(),
        q.global_scale.reshape(1).to(torch.float32).contiguous(), n, k, q.format,
    )


def from_kernel_layout(kw: Fp4KernelWeight) -> Fp4Tensor:
    """Back to the standard packing; exact inverse of to_kernel_layout."""
    bs = _check_format(kw.format)
    n, k = kw.out_features, kw.in_features
    k_blocks = -(-k // bs) * bs
    arranged = kw.codes.view(torch.uint8).unflatten(1, (-1, bs // 2))
    codes = torch.cat((arranged & 15, arranged >> 4), dim=-1).flatten(1)[:, :k_blocks]
    scales = kw.scales.view(torch.uint8)[:, : k_blocks // bs].contiguous().view(kw.scales.dtype)
    return Fp4Tensor(pack_nibbles(codes).contiguous(), scales, kw.global_scale.reshape(()).clone(), (n, k), kw.format)


def dequantize_kernel_layout(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                             out_features: int, in_features: int, format: str) -> torch.Tensor:
    """fp32 (N, K) weight from kernel-layout tensors (the op's arguments)."""
    bs = _check_format(format)
    arranged = codes.view(torch.uint8).unflatten(1, (-1, bs // 2))
    values = e2m1_values(torch.cat((arranged & 15, arranged >> 4), dim=-1))  # (N, blocks, bs)
    if format == "mxfp4":
        block_scale = torch.exp2(scales.view(torch.uint8).to(torch.float32) - 127.0)
    else:
        block_scale = scales.view(torch.float8_e4m3fn).to(torch.float32) * global_scale.reshape(()).to(torch.float32)
    return (values * block_scale[..., None]).flatten(1)[:, :in_features]


def reference_fp4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_features: int, in_features: int, format: str) -> torch.Tensor:
    """Plain torch: dequantize the kernel-layout weight, F.linear in fp32 (float64 for float64 x: the
    tuner's exact product), cast to x.dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_kernel_layout(codes, scales, global_scale, out_features, in_features, format)
    b = None if bias is None else bias.to(compute)
    return F.linear(x.to(compute), w.to(x.device, compute), b).to(x.dtype)



def fp4_weight_bytes(in_features: int, out_features: int, format: str) -> int:
    """Bytes the kernels read for one weight: packed codes, block scales, global scale."""
    bs = _check_format(format)
    k_padded = _padded_k(in_features)
    return out_features * k_padded // 2 + out_features * k_padded // bs + 4

