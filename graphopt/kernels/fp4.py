"""FP4 (e2m1) weights: the MXFP4 and NVFP4 formats, and Triton weight-only GEMMs that read them.

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
  `quantize_fp4_gptq(w, hessian)` (GPTQ-style: rounding errors fed forward along K through the
  inverse-Hessian Cholesky factor, block scales re-chosen as the scan reaches each block) and
  `calibrate_fp4(model, inputs)` (Hessians of every nn.Linear from forward hooks; with
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

Kernels (CUDA; on CPU they run under TRITON_INTERPRET=1 for tests):
  * `_fp4_gemv_words_kernel`, decode, 1-4 tokens per program on CUDA cores: each program streams
    a (BLOCK_N rows x K-range) strip of the codes as tiles of int32 words, prefetching the next
    tile in registers. A word right-shifted by 0/4/8/12 holds two codes at bits 0 and 16, so four
    integer ops place both into fp16 bit patterns (sign << 15 | magnitude << 9 = value * 2^-14,
    exact; the 2^14 and the scale decode's 2^8 are folded into one per-call multiplier; on the
    GPU one PTX cvt per half turns them into fp32, with no 16-bit extraction first). A word's
    eight activations are two 4-element vector loads shared by every row of the tile; w * x is
    summed per word in-thread (one FMA chain), times the word's block scale, and rows are reduced
    across threads once at the end. Split-K adds into a persistent zeroed fp32 workspace; the split that
    finishes a tile last (atomic counter) writes the output with bias and re-zeroes the
    workspace: one launch per call, no memset or cast kernels.
  * `_fp4_gemv_words_mma_kernel`, decode on tensor cores, 16, 32 or 64 tokens per program: the same
    word tiles, one MMA per code position of a word (tokens are the narrow MMA dimension: out^T
    = W x^T), so no shuffles build a contiguous K tile; split-K as above.
  * `_fp4_gemm_kernel`, prefill (fused): tiles of the weight are dequantized to bf16/fp16 in
    registers and fed to tl.dot (weight tile as the left operand), grouped tile order for L2.
  * `_fp4_dequantize_kernel` + cuBLAS (path `dequant`), prefill for many tokens: W is decoded
    once to the activation dtype (2 bytes/weight written, transient) and multiplied by cuBLAS,
    as vLLM does for AWQ at >= 256 tokens; at 4096 tokens the decode costs a few % of the GEMM.
  `choose_fp4_path` picks the kernel per token count from the roofline cost model
  (`estimate_fp4_linear`, families fp4_gemv / fp4_gemm). Activations: bf16 or fp16 (fp32 is
  cast to bf16 for the kernel and the output cast back). Accumulation is fp32. Bias optional.
  Inference only: there is no autograd formula (weights are frozen constants).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphopt.kernels import fp4_tma, tuning

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
def quantize_fp4(w: torch.Tensor, format: str = "nvfp4", *, scale_search: bool = False) -> Fp4Tensor:
    """Quantize a 2-D weight (N, K) along K into MXFP4 or NVFP4 (see the module docstring).

    `scale_search=True`: per block, try a few decode scales around the amax rule (MXFP4: the
    power of two below and above; NVFP4: multipliers 0.8-1.5 of amax/6, each rounded to e4m3)
    and keep the one with the lowest squared error. Never worse than the amax rule, per block.
    """
    block_size = _check_format(format)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp4 expects a 2-D floating-point weight (N, K), got "
                         f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))} {getattr(w, 'dtype', '')}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp4: the weight contains NaN or Inf")
    n, k = w.shape
    blocks = _blocks(w, block_size)  # (N, B, bs)
    global_scale = _global_scale(blocks, format)
    codes, scales, _ = _choose_block_scales(blocks, format, global_scale, scale_search, finite_max=_finite_max(w))
    packed = pack_nibbles(codes.flatten(1))
    return Fp4Tensor(packed.contiguous(), scales.contiguous(), global_scale.reshape(()), (n, k), format)


def _global_scale(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """fp32 per-tensor decode scale: NVFP4 amax(|W|) / (6 * 448) (1.0 for an all-zero W), MXFP4 1.0."""
    if format == "mxfp4":
        return torch.ones((), dtype=torch.float32, device=blocks.device)
    tensor_amax = blocks.abs().amax() if blocks.numel() else torch.zeros((), device=blocks.device)
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
    """Signal-to-quantization-noise ratio 10 log10(sum ref^2 / sum (ref - approx)^2), in dB."""
    ref = reference.detach().to(torch.float64)
    noise = (ref - approximation.detach().to(torch.float64)).square().sum()
    signal = ref.square().sum()
    if noise == 0:
        return math.inf
    return float(10.0 * torch.log10(signal / noise))


# ---------------------------------------------------------------------------------------------
# Error-compensating quantization (GPTQ-style) and calibration
# ---------------------------------------------------------------------------------------------
# Minimizes the layer output error ||X W^T - X Wq^T||^2 = tr((W - Wq) H (W - Wq)^T) / 2 with
# H = 2 X^T X instead of the weight error: columns of W (along K) are quantized one at a time in
# natural order, and each column's rounding error, scaled by the row of the upper Cholesky factor
# U of H^-1 (H^-1 = U^T U), is subtracted from the columns not yet quantized, so correlated inputs
# absorb it. Block scales are chosen when the scan reaches a block's first column, from the
# block's *current* (error-updated) values, with the same rule as quantize_fp4 (amax rule, or the
# per-block scale search), except that the search weighs column j's squared error by 1 / U[j, j]^2,
# the output error that quantizing column j leaves after compensation (GPTQ's own loss); the NVFP4
# global scale comes from the original weight. Updates are applied lazily per chunk of GPTQ_CHUNK
# columns (a multiple of both block sizes; speed only, the result does not depend on it).
# The weighting is a small gain on MiniLM (bench/fp4_minilm_quality.py's measure, NVFP4, 352
# calibration texts, 2 CPU threads; embedding cosine min / mean over the 10 evaluation and the 40
# validation sentences; the thread count alone moves these by up to 0.001):
# weighted 0.9876 / 0.9923 and 0.9898 / 0.9923, unweighted 0.9892 / 0.9919 and 0.9894 / 0.9916;
# with calibrate_fp4(sequential=True) 0.9923 / 0.9948 and 0.9910 / 0.9945 against 0.9917 / 0.9946
# and 0.9909 / 0.9944. Tried there and not kept (changes within +-0.001 of the mean, or worse):
# activation order (columns by descending diag H, each block's scale chosen at its first column
# in that order, or up front from W), a finer scale search (35 factors, 16x slower), only the
# amax->6 / amax->4 scale pair (0.9862 / 0.9903: the search's 10 factors include both), a
# least-squares re-fit of the block scales under H with the codes fixed, a larger NVFP4 global
# scale (x1.1, x1.5: same; x0.9 and below saturate blocks and hurt), and bias correction
# b += (W - Wq) E[x] after GPTQ.
GPTQ_CHUNK = 128
# Damping: H += GPTQ_DAMP * mean(diag H) * I (also the ridge of calibrate_fp4's sequential target
# re-fit). Larger than GPTQ's usual 0.01 because FP4 over-fits an estimated Hessian: on MiniLM with
# 24 calibration sentences (~400 tokens) 0.01 / 0.1 / 1.0 gave NVFP4 embedding cosine min/mean
# 0.975/0.985, 0.983/0.989, 0.985/0.989; with 196 texts (~4,100 tokens) 0.01 to 0.1 were alike
# (0.987-0.989 / 0.992) and 1.0 worse (0.985 / 0.989); sequential calibration on those 196 texts
# gave 0.9879/0.9925, 0.9900/0.9936, 0.9908/0.9940 with 0.03 / 0.1 / 0.3 (the measure of
# bench/fp4_minilm_quality.py, unweighted scale search).
GPTQ_DAMP = 0.1


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, float64; damping grows x10 (up
    to 4 times) if H is not positive definite in float64."""
    k = hessian.shape[0]
    eye = torch.eye(k, dtype=torch.float64, device=hessian.device)
    mean_diag = hessian.diagonal().mean().clamp_min(1e-12)
    for attempt in range(5):
        chol, info = torch.linalg.cholesky_ex(hessian + (damp * 10 ** attempt) * mean_diag * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError("quantize_fp4_gptq: the Hessian is not positive definite even with damping "
                     f"{damp * 1e4:g} x mean(diag); check the calibration activations for NaN/Inf")


def quantize_fp4_gptq(w: torch.Tensor, hessian: torch.Tensor, format: str = "nvfp4", *, scale_search: bool = True,
                      damp: float = GPTQ_DAMP) -> Fp4Tensor:
    """Quantize a weight (N, K) to MXFP4 / NVFP4, compensating rounding errors through the input
    Hessian `hessian` (K, K) = 2 X^T X / tokens of calibration activations X (tokens, K).

    Same Fp4Tensor as quantize_fp4 (same packing, scales, global scale rule), so kernels, the op
    and ONNX are unchanged; only which codes / block scales are picked differs. With a diagonal
    Hessian no error is fed forward; the scale search then minimizes each block's H-weighted
    squared error, so for a multiple of the identity the result equals
    quantize_fp4(w, format, scale_search=scale_search). Input channels that calibration never
    excited (zero Hessian diagonal) are quantized as zero weights. Cost: one Python step per
    column of K (a few ms per column for N of a few thousand on CPU).
    """
    block_size = _check_format(format)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp4_gptq expects a 2-D floating-point weight (N, K), got "
                         f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))} {getattr(w, 'dtype', '')}")
    n, k = w.shape
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (k, k):
        raise ValueError(f"quantize_fp4_gptq: hessian must be a ({k}, {k}) tensor for a weight of shape {(n, k)}, "
                         f"got {tuple(getattr(hessian, 'shape', ()))}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp4_gptq: the weight contains NaN or Inf")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("quantize_fp4_gptq: the Hessian contains NaN or Inf")
    if not damp > 0:
        raise ValueError(f"quantize_fp4_gptq: damp must be > 0, got {damp}")
    blocks = _blocks(w, block_size)  # (N, B, bs), zero-padded along K
    global_scale = _global_scale(blocks, format)
    finite_max = _finite_max(w)
    k_blocks = blocks.shape[1] * block_size
    weight = blocks.reshape(n, k_blocks).clone()  # (N, Kb) fp32, updated in place by the error feedback
    h = torch.eye(k_blocks, dtype=torch.float64, device=w.device)  # padded columns: identity, decoupled
    h[:k, :k] = hessian.detach().to(device=w.device, dtype=torch.float64)
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    upper = _inverse_hessian_factor(h, damp).to(torch.float32)  # (Kb, Kb)
    column_loss = upper.diagonal().square().reciprocal()  # (Kb,) output error per unit squared column error

    codes = torch.zeros(n, k_blocks, dtype=torch.uint8, device=w.device)
    stored_scales = []  # per block: (N,) uint8 e8m0 bytes / float8_e4m3fn
    decode_scale = None
    for start in range(0, k_blocks, GPTQ_CHUNK):
        end = min(start + GPTQ_CHUNK, k_blocks)
        chunk = weight[:, start:end]  # view: (N, C)
        u = upper[start:end, start:end]  # (C, C)
        errors = torch.empty_like(chunk)
        for j in range(end - start):
            if j % block_size == 0:  # the block's scale, from its error-updated values
                block = chunk[:, j:j + block_size].unsqueeze(1)  # (N, 1, bs)
                loss = column_loss[start + j:start + j + block_size]
                _, stored, decode = _choose_block_scales(block, format, global_scale, scale_search, loss / loss.mean(),
                                                         finite_max=finite_max)
                stored_scales.append(stored[:, 0])
                decode_scale = decode[:, 0]  # (N,)
            column = chunk[:, j]
            safe = torch.where(decode_scale > 0, decode_scale, torch.ones_like(decode_scale))
            code = round_to_e2m1_codes(column / safe)
            code = torch.where(decode_scale > 0, code, torch.zeros_like(code))
            codes[:, start + j] = code
            error = (column - e2m1_values(code) * decode_scale) / u[j, j]
            chunk[:, j + 1:] -= error[:, None] * u[j, j + 1:][None, :]
            errors[:, j] = error
        weight[:, end:] -= errors @ upper[start:end, end:]
    scales = torch.stack(stored_scales, dim=1)  # (N, B)
    return Fp4Tensor(pack_nibbles(codes).contiguous(), scales.contiguous(), global_scale.reshape(()), (n, k), format)


def calibrate_fp4(model: torch.nn.Module, calibration_inputs, format: str = "nvfp4", *, scale_search: bool = True,
                  damp: float = GPTQ_DAMP, sequential: bool = False) -> dict[str, Fp4Tensor]:
    """GPTQ-style FP4 weights for every nn.Linear of `model` that the calibration run reaches.

    `calibration_inputs`: an iterable of model inputs, each a Mapping (called as model(**x)), a
    tuple/list (model(*x)) or a single tensor (model(x)). Forward pre-hooks accumulate X^T X of
    each Linear's input (float64, all leading dims flattened to tokens; padding tokens count too,
    so feed unpadded sequences where it matters) while the full-precision model runs under
    no_grad; then each weight is quantized with quantize_fp4_gptq(w, 2 X^T X / tokens).

    `sequential=True` quantizes the linears in the order the model first calls them, in groups
    that read the same input tensor (attention's q, k, v), so that each group sees the inputs Xq
    the model produces with the earlier linears already quantized, and aims at the full-precision
    model's output rather than at its own: it quantizes the ridge solution of
    min ||X W^T - Xq W'^T||^2 + ||(W - W') R^1/2||^2, W' = W (X^T Xq + R) (Xq^T Xq + R)^-1 with
    R = damp * mean(diag Xq^T Xq) * I, under the Hessian 2 Xq^T Xq / tokens (GPTQ's sequential
    mode, with an asymmetric target as in GPTAQ; for R -> 0 this minimizes ||X W^T - Xq Wq^T||^2
    exactly), so later layers undo part of the earlier layers' error. The Fp4Tensor then
    approximates W' (its SQNR against W is a little lower). Cost: per group, two forwards of
    every calibration input up to that group (stopped there), one of the full-precision model and
    one with the quantized weights (torch.func.functional_call; `model` is never modified). Needs each reached nn.Linear called once per forward (else ValueError).
    On MiniLM (bench/fp4_minilm_quality.py, NVFP4, 352 texts) it lifts the embedding cosine
    min / mean from 0.988 / 0.992 to 0.993 / 0.995 on the 10 evaluation sentences (0.990 / 0.992
    to 0.990 / 0.994 on 40 validation ones), for 5.5x the calibration time (27 s -> 149 s).

    Returns {module path (as in model.named_modules()): Fp4Tensor}; write a plan for the
    fp4_linear pass with graphopt.passes.fp4_linear.save_fp4_plan.
    """
    _check_format(format)
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    if sequential:
        return _calibrate_sequential(model, list(calibration_inputs), linears, format, scale_search, damp)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook_for(name: str):
        def hook(mod, args):
            x = args[0].detach().reshape(-1, mod.in_features).to(torch.float64)  # (tokens, K)
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    handles = [mod.register_forward_pre_hook(hook_for(name)) for name, mod in linears.items()]
    try:
        with torch.no_grad():
            for item in calibration_inputs:
                _call(model, item)
    finally:
        for handle in handles:
            handle.remove()
    if not counts:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    return {name: quantize_fp4_gptq(linears[name].weight.detach(), 2.0 * sums[name] / counts[name], format,
                                    scale_search=scale_search, damp=damp)
            for name in linears if name in counts}


def _call(model: torch.nn.Module, item, parameters: dict | None = None):
    """model(**item) / model(*item) / model(item), with `parameters` ({name: tensor}) substituted
    for the model's own through torch.func.functional_call when given."""
    from collections.abc import Mapping

    args, kwargs = ((), dict(item)) if isinstance(item, Mapping) else (
        (tuple(item), {}) if isinstance(item, (tuple, list)) else ((item,), {}))
    if parameters:
        return torch.func.functional_call(model, parameters, args, kwargs)
    return model(*args, **kwargs)


class _InputCaptured(Exception):
    """Raised by a forward pre-hook to end a calibration forward once it holds the input it wanted."""


def _linear_groups(model: torch.nn.Module, item, linears: dict) -> list[list[str]]:
    """Names of the linears one forward of `item` reaches, in first-call order, grouped where
    consecutive linears read the same input tensor."""
    calls: list[tuple[str, torch.Tensor]] = []
    handles = [mod.register_forward_pre_hook(lambda mod, args, name=name: calls.append((name, args[0])))
               for name, mod in linears.items()]
    try:
        with torch.no_grad():
            _call(model, item)
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, _ in calls]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"calibrate_fp4(sequential=True) needs each nn.Linear called once per forward; "
                         f"{', '.join(repeated)} called more often; use sequential=False")
    groups: list[list[str]] = []
    for i, (name, x) in enumerate(calls):
        if i and x is calls[i - 1][1]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _captured_input(model: torch.nn.Module, item, module: torch.nn.Module, parameters: dict | None) -> torch.Tensor:
    """The input (tokens, K) float64 that `module` receives when the model runs `item`; the
    forward stops there."""
    captured = []

    def hook(mod, args):
        captured.append(args[0].detach().reshape(-1, mod.in_features).to(torch.float64))
        raise _InputCaptured

    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            _call(model, item, parameters)
    except _InputCaptured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError("calibrate_fp4(sequential=True): a calibration input did not reach a linear that the first "
                         "one reached; the linears' order must not depend on the input")
    return captured[0]


def _calibrate_sequential(model, inputs: list, linears: dict, format: str, scale_search: bool, damp: float
                          ) -> dict[str, Fp4Tensor]:
    """calibrate_fp4(sequential=True): see its docstring."""
    if not inputs:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    groups = _linear_groups(model, inputs[0], linears)
    if not groups:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    params = dict(model.named_parameters(remove_duplicate=False))
    quantized: dict[str, Fp4Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}  # parameter name -> dequantized weight of the linears done
    for group in groups:
        first = linears[group[0]]
        xq_xq = x_xq = 0  # (K, K) float64: Xq^T Xq and X^T Xq, tokens paired between the two runs
        tokens = 0
        for item in inputs:
            x = _captured_input(model, item, first, None)
            xq = _captured_input(model, item, first, dequantized)
            xq_xq = xq_xq + xq.t() @ xq
            x_xq = x_xq + x.t() @ xq
            tokens += xq.shape[0]
        ridge = damp * xq_xq.diagonal().mean().clamp_min(1e-12) * torch.eye(xq_xq.shape[0], dtype=torch.float64,
                                                                             device=xq_xq.device)
        # W' = W M, M = (X^T Xq + R)(Xq^T Xq + R)^-1 (the second factor symmetric): the full-precision
        # output from the quantized inputs, shrunk toward W where the calibration data say little.
        target_map = torch.linalg.solve(xq_xq + ridge, (x_xq + ridge).t()).t()
        for name in group:
            weight = linears[name].weight.detach()
            target = (weight.to(torch.float64) @ target_map.to(weight.device)).to(torch.float32)
            quantized[name] = quantize_fp4_gptq(target, 2.0 * xq_xq / tokens, format, scale_search=scale_search, damp=damp)
            deq = dequantize_fp4(quantized[name], weight.dtype)
            dequantized.update({pname: deq for pname, p in params.items() if p is linears[name].weight})
    return quantized


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
    """Plain torch: dequantize the kernel-layout weight to fp32, F.linear in fp32, cast to x.dtype."""
    w = dequantize_kernel_layout(codes, scales, global_scale, out_features, in_features, format)
    b = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), w.to(x.device), b).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Cost model: bytes and work of each path, and the path choice per token count
# ---------------------------------------------------------------------------------------------
# A roofline per kernel path: max(CUDA-core decode work, tensor-core FLOPs, memory traffic) plus
# one launch overhead per kernel. The rates are the device ceilings (graphopt.hardware) times the
# fp4_gemv / fp4_gemm efficiencies in graphopt.cost_model.KERNEL_EFFICIENCY and the constants
# below. The prefill paths (gemm, dequant) are fitted to bench/results/fp4_linear_h200.json (H200,
# torch 2.11, triton 3.6, NVFP4, bf16 activations, cuBLAS bf16 baseline; ceilings 690 TFLOP/s
# bf16, 4.22 TB/s copy, 6 us launch): 64 tokens 0.17-0.31x of cuBLAS on the best path, 256 tokens
# 0.2-0.3x, 4096 tokens (dequant + cuBLAS) 0.67-0.71x there. The decode kernels are fitted
# separately, below.
# tests/test_cost_model_measured.py checks the faster/slower call against both files.
MMA_BLOCK_M: tuple[int, ...] = (16, 32, 64)  # tokens per program of the tensor-core decode kernel (its MMA's N)

# The decode (gemv) kernels work on word tiles; their constants are fitted to
# bench/results/fp4_linear_mma_decode_h100.json (H100, NVFP4, L2-cold, the six LLaMA shapes,
# the DECODE_CONFIGS below, PTX conversions, the tensor-core kernel; predicted / measured
# 0.88-1.13 on all 18 rows). CUDA-core
# _fp4_gemv_words_kernel (BLOCK_M in FMA_BLOCK_M): per weight, one fp32 FMA (2 ops) per token
# row plus this many ops of code/scale decode, at the fp4_gemv compute efficiency (0.13 of the
# fp32 ceiling): 1 token 0.30-0.34 ps per weight after the 4 us launch on all six shapes (0.32
# predicted), where the memory term (0.65 of the copy bandwidth) is just below.
FMA_GEMV_DECODE_OPS_PER_WEIGHT = 0.8
# One token on _fp4_gemv_int_kernel: the same ops scale, from the offline sm_90 counts (29-34
# instructions per word row against 45 for the FMA kernel at one token: 0.65 x (0.8 + 2)). On the
# H100 it measured 20.6-20.7 us on the two 70.8 M weight layers (bench/results/
# fp4_decode_int_1tok_h100.*), where the memory term (0.65 of the copy bandwidth) is the bound.
INT_GEMV_DECODE_OPS_PER_WEIGHT = 1.8
# Two tokens per program (the codes decoded once, four more dp2a per word): 39-47 instructions per
# word offline against 29-34 at one token. Fitted to the six two-token rows of
# bench/results/fp4_linear_1_2tok_h100.* (18.1-25.9 us on the 45-71 M weight layers):
# predicted / measured 0.98-1.05 (the one-token rows of that run: 1.10-1.20).
INT_GEMV_OPS_PER_EXTRA_ROW = 0.9
INT_GEMV_MAX_ROWS = 2  # the integer-dot tiles in DECODE_CONFIGS take 1 or 2 tokens per program
# Tensor-core _fp4_gemv_words_mma_kernel: decode ops per weight per program of 16 tokens; measured
# 0.58-0.67 ps per weight at 4-16 tokens on the four 45-71 M weight layers (0.75-0.84 on the
# smaller two) in the same run; predicted 0.57 + launch.
GEMV_MMA_DECODE_OPS_PER_WEIGHT = 5.0
# Programs of 32 or 64 tokens: each token row past 16 adds this many ops per weight
# (the activation tile's trip through shared memory, the wider MMA). Fitted to the L2-cold rows of
# bench/results/fp4_linear_1_256tok_h100.json, pre-permuted activations: 44-47 us at 32
# tokens and 57-59 us at 64 on the two 70.8 M weight layers (5.0 + 0.05 * 48 predicts 64 us there;
# predicted / measured 0.82-1.16 on the twelve 32- and 64-token rows).
# Without the permutation the activation tile's shuffle made it 0.085 (71-80 us at 64 tokens).
GEMV_MMA_OPS_PER_EXTRA_ROW = 0.05
# The Gluon decode kernel fed by TMA (kernels/fp4_tma.py; sm_90+, NVFP4, bf16
# activations, K padded to a multiple of 256), with the same 16/32/64 tokens per program. Fitted to
# the 24 rows of 4-64 tokens in bench/results/fp4_linear_1_64tok_h100.json (L2-cold, the tuned tile on
# each; the scales by TMA, converted in hardware): 0.264 ps per weight (these ops at the fp4_gemv
# efficiency) after a fixed latency that the launch alone does not explain (the ring's first loads
# and the split-K epilogue: 3.2 us over the launch at 16 tokens, 0.1 us more per token row past 16).
# Predicted / measured 0.91-1.09 on 23 rows; 13824->5120 at 64 tokens measured 1.36x the prediction
# (80 row tiles for 132 SMs). (With the scales gathered by plain loads the fit is 2.5, 4.7 us, 0.11.)
TMA_DECODE_OPS_PER_WEIGHT = 2.3
TMA_DECODE_LATENCY_S = 3.2e-6
TMA_DECODE_LATENCY_S_PER_EXTRA_ROW = 0.1e-6
# The fused prefill GEMM (_fp4_gemm_kernel) decodes every weight to bf16 in registers once per
# BLOCK_M token rows: CUDA-core ops per decoded weight, fitted on the H200
# (bench/results/fp4_linear_h200.json): 0.55-0.6e12 decoded weights/s at 4096 tokens with every
# SM busy (= 67e12 * 0.066 / 7.5), and proportionally less when its grid has fewer tiles than SMs
# (64 tokens, K=4096: 0.137 ms for every N of 4096..14336).
MMA_DECODE_OPS_PER_WEIGHT = 7.5
# _fp4_dequantize_kernel (the `dequant` path) reads the packed weight and writes W in bf16 at
# this fraction of the copy bandwidth. Fitted to the interleaved tiles (DEQUANT_TILES) on the
# H100 (bench/results/fp4_linear_64tok_h100.json, dequant_ms - cublas_ms at 64 tokens:
# 44-72 us for the 45-71 M weight layers, 0.87 of the copy bandwidth; predicted within
# 0.94-1.14x).
DEQUANT_COPY_FRACTION = 0.85


def fp4_weight_bytes(in_features: int, out_features: int, format: str) -> int:
    """Bytes the kernels read for one weight: packed codes, block scales, global scale."""
    bs = _check_format(format)
    k_padded = _padded_k(in_features)
    return out_features * k_padded // 2 + out_features * k_padded // bs + 4


def _fp4_kernel_estimate(hw, name: str, family: str, *, decode_ops: float = 0.0, mma_flops: float = 0.0,
                         bytes_moved: float = 0.0, sm_fill: float = 1.0, launches: int = 1,
                         memory_fraction: float | None = None, latency_s: float = 0.0):
    """One kernel: CUDA-core decode ops and bytes at `family`'s efficiencies (or `memory_fraction`
    of the copy bandwidth), tensor-core FLOPs at cuBLAS's; the slowest of the three, divided by the
    fraction of SMs its grid fills, plus a fixed `latency_s` and its launches."""
    from graphopt.cost_model import KERNEL_EFFICIENCY, Estimate

    compute_eff, memory_eff = KERNEL_EFFICIENCY[family]
    memory_eff = memory_fraction if memory_fraction is not None else memory_eff
    decode_s = decode_ops / (hw.fp32_flops * compute_eff)
    mma_s = mma_flops / (hw.matrix_ceiling * KERNEL_EFFICIENCY["cublas_gemm"][0])
    memory_s = bytes_moved / (hw.memory_ceiling * memory_eff)
    body = max(decode_s, mma_s, memory_s) / max(sm_fill, 1e-9) + latency_s
    launch_s = launches * hw.launch_overhead
    bound = "launch" if launch_s > body else ("memory" if memory_s >= max(decode_s, mma_s) else "compute")
    return Estimate(name, (body + launch_s) * 1e3, decode_ops + mma_flops, bytes_moved, launches, bound)


def tma_decode_applies(hw, in_features: int, fmt: str, act_dtype: torch.dtype) -> bool:
    """Whether the decode tuner has fp4_tma's Gluon kernel to pick on `hw` (the cost-model side of
    _runs_here and _valid_config's tma rules): Gluon in this Triton, an sm_90+ GPU, NVFP4, bf16
    activations, and K steps of 256 that tile the padded K."""
    return (fp4_tma.runs_on_spec(hw) and fmt == "nvfp4" and act_dtype == torch.bfloat16
            and fp4_tma.tiles_k(_padded_k(in_features), 256))


def _gemv_estimate(hw, tokens: int, in_features: int, out_features: int, w_bytes: int, act_bytes: float,
                   tma: bool = False):
    """Best of the decode kernels the autotuner chooses between (`tma`: fp4_tma's kernel too)."""
    weights = _padded_k(in_features) * out_features
    candidates = []
    fma_rows = next((bm for bm in FMA_BLOCK_M if bm >= tokens), None)
    if fma_rows is not None:  # CUDA-core kernel: every program reads W once for all its token rows
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 GEMV (Triton, CUDA cores, {fma_rows} row(s))", "fp4_gemv",
            decode_ops=weights * (FMA_GEMV_DECODE_OPS_PER_WEIGHT + 2.0 * fma_rows),
            bytes_moved=w_bytes + act_bytes))
    if tokens <= INT_GEMV_MAX_ROWS:  # CUDA cores with integer dot products
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 GEMV (Triton, CUDA cores, integer dots, {tokens} row(s))", "fp4_gemv",
            decode_ops=weights * (INT_GEMV_DECODE_OPS_PER_WEIGHT + INT_GEMV_OPS_PER_EXTRA_ROW * (tokens - 1)),
            bytes_moved=w_bytes + act_bytes))
    for block_m in MMA_BLOCK_M:  # tensor cores: W is read and decoded once per block_m tokens
        passes = -(-tokens // block_m)
        ops_per_weight = GEMV_MMA_DECODE_OPS_PER_WEIGHT + GEMV_MMA_OPS_PER_EXTRA_ROW * (block_m - MMA_BLOCK_M[0])
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 GEMV (Triton, tensor cores, {passes} pass(es) of {block_m} tokens)", "fp4_gemv",
            decode_ops=weights * passes * ops_per_weight, mma_flops=2.0 * block_m * passes * weights,
            bytes_moved=w_bytes * passes + act_bytes))
        if tma and passes == 1:  # the same tiles through TMA: fewer ops per weight, a longer fixed
            # latency; fitted and measured up to 64 tokens (one pass), so not predicted past that
            candidates.append(_fp4_kernel_estimate(
                hw, f"FP4 GEMV (Gluon, TMA + tensor cores, {block_m} tokens)", "fp4_gemv",
                decode_ops=weights * TMA_DECODE_OPS_PER_WEIGHT, mma_flops=2.0 * block_m * weights,
                bytes_moved=w_bytes + act_bytes,
                latency_s=TMA_DECODE_LATENCY_S + TMA_DECODE_LATENCY_S_PER_EXTRA_ROW * (block_m - MMA_BLOCK_M[0])))
    return min(candidates, key=lambda e: e.ms)


def _gemm_estimate(hw, tokens: int, in_features: int, out_features: int, w_bytes: int, act_bytes: float):
    """Fused dequant-GEMM: W is decoded once per BLOCK_M rows of tokens, in the tile that uses it."""
    weights = _padded_k(in_features) * out_features
    candidates = []
    for block_m, block_n in sorted({(c.block_m, c.block_n) for c in PREFILL_CONFIGS}):
        m_tiles = -(-tokens // block_m)
        tiles = m_tiles * -(-out_features // block_n)
        fill = min(1.0, tiles / hw.sm_count) if hw.sm_count else 1.0
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 dequant-GEMM (Triton, {block_m}x{block_n} tiles)", "fp4_gemm",
            decode_ops=weights * m_tiles * MMA_DECODE_OPS_PER_WEIGHT,
            mma_flops=2.0 * m_tiles * block_m * weights,
            bytes_moved=w_bytes * m_tiles + act_bytes, sm_fill=fill))
    return min(candidates, key=lambda e: e.ms)


def estimate_fp4_linear(hw, tokens: int, in_features: int, out_features: int, fmt: str = "nvfp4", *,
                        dtype_bytes: int = 2, bias: bool = False, path: str | None = None,
                        act_dtype: torch.dtype = torch.bfloat16):
    """Predicted time of graphopt::fp4_linear (the cheapest path unless `path` names one).

    GPU: `gemv` is the best of the CUDA-core kernel (<= 4 tokens: W read once, bound by its
    per-weight decode + FMA work) and the tensor-core ones (W decoded once per 16, 32 or 64 tokens;
    the TMA-fed one where tma_decode_applies for `act_dtype`); `gemm`
    decodes W once per BLOCK_M token rows and leaves SMs idle when it has fewer tiles than SMs;
    `dequant` writes W in bf16 once (DEQUANT_COPY_FRACTION of the copy bandwidth) and runs the
    cuBLAS linear on it. CPU: the op dequantizes to fp32 and runs a dense fp32 linear, which is
    always slower than the original.
    """
    from graphopt.cost_model import chain, linear, roofline

    tokens = max(int(tokens), 1)
    w_bytes = fp4_weight_bytes(in_features, out_features, fmt)
    act_bytes = dtype_bytes * tokens * (in_features + out_features) + (dtype_bytes * out_features if bias else 0)
    if not hw.is_gpu:
        dequant = roofline(hw, "FP4 dequantize (torch)", bytes_moved=w_bytes + 4 * in_features * out_features,
                           family="pointwise")
        dense = linear(hw, tokens, in_features, out_features, dtype_bytes=4, bias=bias)
        return chain("FP4 reference (dequantize + fp32 linear)", dequant, dense)
    builders = {
        "gemv": lambda: _gemv_estimate(hw, tokens, in_features, out_features, w_bytes, act_bytes,
                                       tma=tma_decode_applies(hw, in_features, fmt, act_dtype)),
        "gemm": lambda: _gemm_estimate(hw, tokens, in_features, out_features, w_bytes, act_bytes),
        "dequant": lambda: chain(
            "FP4 dequantize (Triton) + cuBLAS bf16",
            _fp4_kernel_estimate(hw, "FP4 dequantize to bf16 (Triton)", "fp4_gemm",
                                 bytes_moved=w_bytes + 2 * in_features * out_features,
                                 memory_fraction=DEQUANT_COPY_FRACTION),
            linear(hw, tokens, in_features, out_features, dtype_bytes=dtype_bytes, bias=bias),
        ),
    }
    if path is not None:
        if path not in builders:
            raise ValueError(f"unknown FP4 kernel path {path!r}; valid choices: {', '.join(builders)}")
        return builders[path]()
    return min((build() for build in builders.values()), key=lambda e: e.ms)


def choose_fp4_path(hw, tokens: int, in_features: int, out_features: int, fmt: str = "nvfp4",
                    act_dtype: torch.dtype = torch.bfloat16) -> str:
    """'gemv', 'gemm' or 'dequant', whichever the cost model predicts fastest for this token count."""
    times = {p: estimate_fp4_linear(hw, tokens, in_features, out_features, fmt, path=p, act_dtype=act_dtype).ms
             for p in PATHS}
    return min(times, key=times.get)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None

from graphopt.kernels.launch import INTERPRET, cdiv, launch  # noqa: E402
from graphopt.kernels.split_k import split_buffers  # noqa: E402

if triton is not None:
    from graphopt.kernels.split_k import finish_split_tile


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of one launch. BLOCK_K is in elements (a multiple of the scale block)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    int_dots: bool = False  # decode, BLOCK_M 1-4: _fp4_gemv_int_kernel (int16 activations, dp2a)
    permute_x: bool = False  # tensor-core decode: activations pre-permuted (permuted_activations, X_PERMUTED)
    tma: bool = False  # decode on fp4_tma's Gluon kernel (NVFP4, bf16, sm_90+); num_stages = its TMA ring slots


FMA_BLOCK_M: tuple[int, ...] = (1, 2, 4)  # decode BLOCK_M values of the CUDA-core kernel
INT_BLOCK_M: tuple[int, ...] = (1, 2, 4)  # and of the integer-dot one
MIN_DECODE_BLOCK_N = 8  # narrowest decode tile; sizes the split-K counters (one per tile)
# Candidates the launcher times once per (path, token bucket, N, K, format, dtype, bias, device) on a GPU. Kept
# short: every distinct tile compiles once (~1 s). Decode: BLOCK_M 1, 2 or 4 is the CUDA-core
# kernel (_fp4_gemv_words_kernel, that many tokens per program), 16, 32 or 64 the tensor-core one
# (_fp4_gemv_words_mma_kernel, up to that many tokens per program). From the H100 sweeps of
# bench/bench_fp4_decode.py (bench/results/fp4_decode_h100_wide_word.log): the CUDA-core kernel is fastest
# with narrow tiles, 8-16 rows of 256-1024 elements (1 token: 8x1024 with 4 warps, 0.030 ms on
# 5120->13824; 8x256 with 1 warp and a split of 4, 0.028 ms on 13824->5120), the tensor-core one
# with 64 rows x 128 elements or 128 x 256 and a split of 8-16 (bench/results/
# fp4_decode_h100_split_ab.* and _paired_ab.*: 0.041-0.045 ms at 4-16 tokens on both shapes);
# BLOCK_K 64 keeps a CUDA-core config for every K (a multiple of 64).
DECODE_CONFIGS: tuple[KernelConfig, ...] = (
    tuple(KernelConfig(16, bm, bk, sk, num_warps=4, num_stages=1)
          for bm in FMA_BLOCK_M for bk in (256, 512) for sk in (1, 2, 4, 8))
    + tuple(KernelConfig(8, bm, bk, sk, num_warps=w, num_stages=1)
            for bm in FMA_BLOCK_M for bk, w in ((1024, 4), (512, 2), (256, 1)) for sk in (1, 2, 4))
    + tuple(KernelConfig(16, bm, 64, 1, num_warps=4, num_stages=1) for bm in FMA_BLOCK_M)
    + tuple(KernelConfig(bn, 16, bk, sk, num_warps=4, num_stages=1)
            for bn, bk, sk in ((64, 128, 4), (64, 128, 8), (64, 128, 16), (128, 256, 4), (128, 256, 8),
                               (128, 256, 16)))
    # the tensor-core kernel at 32 and 64 tokens per program: the best tiles of the H100 sweeps
    # (bench/results/fp4_decode_mma_32_64tok_h100*): 32 tokens 128 x 128 elements, split 8 (49.9 /
    # 55.2 us on 13824->5120 / 5120->13824; 16-token programs 76-82 us); 64 tokens 128 x 256, split 8
    # (70.9 / 79.5 us; 32-token programs 86-94 us, 16-token 135-153 us); unsplit 128-element tiles
    # keep a candidate for layers with K <= 128
    + tuple(KernelConfig(bn, bm, bk, sk, num_warps=w, num_stages=1)
            for bn, bm, bk, sk, w in ((128, 32, 128, 8, 4), (128, 32, 128, 4, 4), (256, 32, 128, 4, 8),
                                      (64, 32, 256, 8, 4), (64, 32, 256, 4, 4), (128, 32, 128, 1, 4),
                                      (128, 64, 256, 8, 4), (128, 64, 128, 8, 4), (128, 64, 128, 4, 4),
                                      (128, 64, 128, 2, 4), (128, 64, 128, 1, 4)))
    # one token, integer dot products (_fp4_gemv_int_kernel): the best tiles of the H100 sweeps
    # (bench/results/fp4_decode_int_1tok_h100.*): 16 x 512 elements with 4 warps (20.7 us on
    # 5120->13824) and 16 x 256 with 1 warp and a split of 8 (20.6 us on 13824->5120), against
    # 25.4-27.2 us for the FMA kernel's tuned tiles; on LLaMA-7B's step shapes
    # (fp4_decode_int_llama7b_h100.*): 32 x 512, 4 warps (4096->12288, 14.9 us), 16 x 2048,
    # 4 warps (4096->4096, 7.6 us), 32 x 256, 1 warp, split 2 (4096->22016, 26.1 us); and 16 x 256,
    # 1 warp (4096->32000, 34.4 us; fp4_decode_int_lmhead_h100.*)
    + tuple(KernelConfig(bn, 1, bk, sk, num_warps=w, num_stages=1, int_dots=True)
            for bn, bk, w, sk in ((16, 512, 4, 1), (16, 1024, 4, 1), (16, 512, 4, 2), (16, 256, 1, 2),
                                  (16, 256, 1, 8), (32, 256, 1, 8), (32, 128, 1, 4), (32, 512, 4, 1),
                                  (16, 2048, 4, 1), (32, 256, 1, 2), (16, 256, 1, 1)))
    # two tokens per program, integer dot products: the best tiles of the H100 sweep
    # (bench/results/fp4_decode_int_2_4tok_h100.*): 16 x 256, 1 warp, split 4 (28.6 us on
    # 5120->13824, 29.8 us on 13824->5120; 25.8 / 29.0 us in
    # fp4_decode_int_1_2tok_h100.*), against 40-43 us for the tensor-core kernel. Four tokens
    # per program measured 50-52 us there, slower than the tensor-core kernel's 41-43 us: not listed.
    + tuple(KernelConfig(bn, 2, bk, sk, num_warps=1, num_stages=1, int_dots=True)
            for bn, bk, sk in ((16, 256, 4), (16, 256, 8), (16, 256, 2), (32, 128, 4), (8, 512, 1), (8, 512, 2)))
)
# Every tensor-core tile also on pre-permuted activations (permute_x: one more launch per call,
# and no shuffle of the activation tile in the kernel; offline sm_90 at 64 x 128 x 256: 1125
# instead of 1682 instructions per K step, no spills instead of 328 bytes). H100, L2-cold, with the
# permutation's launch (bench/results/fp4_decode_mma_permuted_*tok_h100.*): best permuted / plain tile
# 41.2 / 45.6 and 40.8 / 44.7 us at 16 tokens on 5120->13824 / 13824->5120, 45.5 / 53.6 and
# 47.6 / 50.6 at 32, 57.8 / 70.9 and 61.0 / 80.9 at 64. The tuner still times both.
DECODE_CONFIGS += tuple(dataclasses.replace(c, permute_x=True) for c in DECODE_CONFIGS
                        if c.block_m in MMA_BLOCK_M and not c.int_dots)
# fp4_tma's Gluon kernel (TMA-fed words, activations and scales, sm_90+, NVFP4 with bf16
# activations): the best tiles of the H100 sweep (bench/results/fp4_decode_mma_vs_tma_h100.*):
# 64 rows x 256 elements, 4 warps, 2 ring slots, unsplit on 5120->13824 and split 4-8 on
# 13824->5120: 28-30 us at 1-16 tokens (tensor-core kernel above: 38-41 us), 30-33 us at 32 tokens
# (54-66), 34-46 us at 64 (58-66); 27-29 us at 4-16 tokens with the scales also loaded by TMA.
# No 128-element steps: none won the sweep, and their 8 scale bytes per row are below a TMA box's
# 16. The tuner keeps the integer-dot kernel where it is faster (one token, 20-21 us).
DECODE_CONFIGS += tuple(KernelConfig(64, bm, 256, sk, num_warps=4, num_stages=2, tma=True)
                        for bm in MMA_BLOCK_M for sk in (1, 2, 4, 8))
PREFILL_CONFIGS: tuple[KernelConfig, ...] = (
    KernelConfig(128, 128, 64, num_warps=8, num_stages=3),
    KernelConfig(128, 128, 128, num_warps=8, num_stages=3),
    KernelConfig(128, 64, 128, num_warps=4, num_stages=4),
    KernelConfig(256, 128, 64, num_warps=8, num_stages=3),
)
# Small tiles for TRITON_INTERPRET=1 (tests on CPU).
INTERPRET_DECODE_CONFIG = KernelConfig(16, 16, 128, split_k=2, num_warps=4, num_stages=1)
INTERPRET_PREFILL_CONFIG = KernelConfig(16, 16, 64, num_warps=4, num_stages=1)

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
    def _mma(w, x, acc, UPCAST_DOT: tl.constexpr):
        """acc (BN, BM) += w (BN, BK) @ x (BM, BK)^T. UPCAST_DOT: compute from fp32 copies of the
        bf16/fp16 operands (same products, exact in fp32) - only for TRITON_INTERPRET=1, whose
        bf16 tl.dot returns garbage in Triton 3.9."""
        if UPCAST_DOT:
            return tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(x), acc)

    # --- e2m1 decode on 32-bit words -------------------------------------------------------
    # A kernel-layout word (4 bytes of one scale block, little endian) holds 8 codes. Shifting it
    # right by SHIFT in {0, 4, 8, 12} puts one code at bits 0-3 and another at bits 16-19, so
    # 4 integer ops give TWO fp16 bit patterns at once (value * 2^-14, exact). Which elements:
    # byte j of a block = element j (low nibble) | element j + BS/2 (high nibble), so for word q
    # of a block (bytes 4q..4q+3) the (low, high) halves are elements
    #   SHIFT 0: (4q, 4q+2)  4: (4q+H, 4q+2+H)  8: (4q+1, 4q+3)  12: (4q+1+H, 4q+3+H),  H = BS/2.
    @triton.jit
    def _e2m1_pair_bits(words, SHIFT: tl.constexpr, MANTISSA_LSB: tl.constexpr):
        """int32 words -> int32 with two 16-bit float bit patterns: the code at bit SHIFT (low half)
        and at bit SHIFT + 16 (high half), each as sign << 15 | magnitude << MANTISSA_LSB. fp16
        (MANTISSA_LSB 9) gives value * 2^-14, bf16 (6) value * 2^-126, exactly."""
        # magnitude bits (code bits 0-2) to bits MANTISSA_LSB.., sign (code bit 3) to bit 15, each
        # with one shift of the word (an arithmetic right shift's extended bits are masked off)
        if SHIFT <= MANTISSA_LSB:
            magnitude = words << (MANTISSA_LSB - SHIFT)
        else:
            magnitude = words >> (SHIFT - MANTISSA_LSB)
        if SHIFT == 12:
            sign = words
        else:
            sign = words << (12 - SHIFT)
        magnitude_mask: tl.constexpr = (7 << MANTISSA_LSB) | (7 << (MANTISSA_LSB + 16))
        return (magnitude & magnitude_mask) | (sign & -2147450880)  # -2147450880 == 0x80008000

    @triton.jit
    def _fp16_halves(bits, USE_ASM: tl.constexpr):
        """int32 holding two fp16 bit patterns -> (low, high) as fp32. USE_ASM: one PTX cvt per
        half straight from the 32-bit register (sm_90: one HADD2.F32 each; the int16 casts cost
        an extra PRMT/shift per half). The interpreter cannot run PTX."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                "=f,=f,r", [bits], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return lo, hi

    @triton.jit
    def _decode_shift(words, SHIFT: tl.constexpr, USE_ASM: tl.constexpr):
        return _fp16_halves(_e2m1_pair_bits(words, SHIFT, 9), USE_ASM)

    @triton.jit
    def _finish_row(acc, token, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """SPLIT_K == 1: out = acc + bias, stored in out's dtype. Otherwise add into the fp32
        workspace row (the last split copies it out, see _fp4_gemv_words_kernel). Tokens >= M are skipped."""
        n_mask = n_mask & ((offs_n * 0 + token) < M)
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += bias
            tl.store(out_ptr + token * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
        else:
            tl.atomic_add(ws_ptr + token * N + offs_n, acc, mask=n_mask, sem="relaxed")

    @triton.jit
    def _drain_row(token, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS: tl.constexpr):
        n_mask = n_mask & ((offs_n * 0 + token) < M)
        ws_row = ws_ptr + token * N + offs_n
        zero = tl.zeros((offs_n.shape[0],), dtype=tl.float32)
        total = tl.atomic_add(ws_row, zero, mask=n_mask, sem="relaxed")  # read at L2, where the adds landed
        if HAS_BIAS:
            total += bias
        tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _store_token_tile(acc, offs_n, n_mask, rows, offs_m, m_mask, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr,
                          bias_ptr, counter_ptr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The output of a decode program that owns several token rows (the tensor-core and
        integer-dot kernels): acc (BLOCK_N, BLOCK_M) fp32 for columns offs_n and tokens offs_m.
        One K split: + bias, stored in out's dtype. Otherwise split_k.finish_split_tile, on the
        (M, N) sums buffer and the counter of tile (pid_m, pid_n)."""
        out_mask = n_mask[:, None] & m_mask[None, :]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # (BN, BM)
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            finish_split_tile(acc, ws_ptr + offs_m[None, :] * N + offs_n[:, None], out_ptrs, out_mask,
                              bias_ptr + rows[:, None], n_mask[:, None],
                              counter_ptr + pid_m * tl.num_programs(0) + pid_n, SPLIT_K, HAS_BIAS)

    @triton.jit
    def _split4(x):
        """(R, 4) -> its four columns, each (R,)."""
        even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # (x0, x2), (x1, x3)
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3

    @triton.jit
    def _word_column_sums(x_row, k_lo, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF: tl.constexpr):
        """sum of w * x over the 8 codes of every word for one token: (BN, W) decoded words ->
        (BN, W). k_lo (W,): element index of each word's first low-nibble element; the word's
        codes are elements k_lo + 0..3 (low nibbles) and k_lo + HALF + 0..3 (high nibbles), so x
        is read as two 4-element vectors per word and shared by all BN rows of the tile."""
        offs4 = tl.arange(0, 4)
        k_a = k_lo[:, None] + offs4[None, :]
        k_b = k_a + HALF
        x0, x1, x2, x3 = _split4(tl.load(x_row + k_a, mask=k_a < K, other=0.0).to(tl.float32))
        x8, x9, x10, x11 = _split4(tl.load(x_row + k_b, mask=k_b < K, other=0.0).to(tl.float32))
        # one dependent FMA chain: 1 FMUL + 7 FFMA (pairwise sums cost 4 FMUL + 4 FFMA + 3 FADD)
        part = w0a * x0[None, :]
        part += w0b * x2[None, :]
        part += w8a * x1[None, :]
        part += w8b * x3[None, :]
        part += w4a * x8[None, :]
        part += w4b * x10[None, :]
        part += w12a * x9[None, :]
        part += w12b * x11[None, :]
        return part

    @triton.jit
    def _word_tile(N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr):
        """The (BLOCK_N rows x WORDS_PER_ITER words) tiling both decode kernels share, for program
        (pid_n = axis 0, pid_k = axis 1): output columns offs_n and their mask; word and scale
        offsets (from the weight's and the scales' base pointers, which stay out of this call:
        Inductor's mutation analysis takes every argument of a call as a source of its results, so
        a base pointer passed here would count as written wherever the output columns are) of the
        tile's first iteration (rows clamped: the hot loop needs no masks; the
        WORDS_PER_ITER // (BLOCK_SIZE // 8) scales of a tile, one per scale block); k_lo, the element
        index of each word's first low-nibble code; and this split's iterations [it_start, it_end),
        each split owning >= 1 (the launcher guarantees it)."""
        WPB: tl.constexpr = BLOCK_SIZE // 8  # int32 words per scale block
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)
        offs_w = tl.arange(0, WORDS_PER_ITER)
        word_offs = rows[:, None] * stride_wn + offs_w[None, :]  # (BN, W)
        scale_offs = rows[:, None] * stride_sn + (offs_w // WPB)[None, :]  # (BN, W): WPB words share one
        k_lo = (offs_w // WPB) * BLOCK_SIZE + (offs_w % WPB) * 4  # (W,)
        n_iters = K_PADDED // (WORDS_PER_ITER * 8)
        per_split = tl.cdiv(n_iters, SPLIT_K)
        it_start = tl.program_id(1) * per_split
        it_end = tl.minimum(it_start + per_split, n_iters)
        return offs_n, offs_n < N, rows, word_offs, scale_offs, k_lo, it_start, it_end

    @triton.jit
    def _fp4_gemv_words_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """Decode on CUDA cores, 1-4 tokens per program: out[M, N] = x[M, K] @ W[N, K]^T.
        Grid: (N / BLOCK_N, SPLIT_K, M / BLOCK_M); every split owns >= 1 K iteration.

        Per iteration a program reads a (BLOCK_N rows x WORDS_PER_ITER words) tile of int32 code
        words and their block scales, prefetched one iteration ahead in registers. The 8
        activations a word needs are two 4-element vector loads, made once per word column and
        shared by every row of the tile (a scale-block tile that reloads them element by element
        per word runs at 1.12-1.16x cuBLAS at 1 token on an H100, this one at 1.46-1.72x).
        The block scale multiplies each word's partial sum, the global scale the final sum.
        SPLIT_K > 1: partial rows are added into a zeroed fp32 workspace (ws_ptr, M x N) with
        atomics; the split that arrives last (per-tile counter) copies the rows out with bias in
        the output dtype and re-zeroes the workspace and the counter, so a call is one launch."""
        WPB: tl.constexpr = BLOCK_SIZE // 8  # int32 words per scale block
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, scale_offs, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = words_ptr + word_offs
        scale_ptrs = scales_ptr + scale_offs

        token0 = pid_m * BLOCK_M
        x_row0 = x_ptr + tl.minimum(token0, M - 1) * stride_xm
        x_row1 = x_ptr + tl.minimum(token0 + 1, M - 1) * stride_xm
        x_row2 = x_ptr + tl.minimum(token0 + 2, M - 1) * stride_xm
        x_row3 = x_ptr + tl.minimum(token0 + 3, M - 1) * stride_xm
        acc0 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, WORDS_PER_ITER), dtype=tl.float32)

        words = tl.load(word_ptrs + it_start * WORDS_PER_ITER)
        scale_bytes = tl.load(scale_ptrs + it_start * (WORDS_PER_ITER // WPB))
        for it in range(it_start, it_end):
            nxt = tl.minimum(it + 1, it_end - 1)  # prefetch; the last iteration re-reads its own tile
            next_words = tl.load(word_ptrs + nxt * WORDS_PER_ITER)
            next_scale_bytes = tl.load(scale_ptrs + nxt * (WORDS_PER_ITER // WPB))

            scale = _block_scales(scale_bytes, IS_NVFP4)  # (BN, W)
            w0a, w0b = _decode_shift(words, 0, USE_ASM)
            w4a, w4b = _decode_shift(words, 4, USE_ASM)
            w8a, w8b = _decode_shift(words, 8, USE_ASM)
            w12a, w12b = _decode_shift(words, 12, USE_ASM)
            k_it = k_lo + it * (WORDS_PER_ITER * 8)
            acc0 += scale * _word_column_sums(x_row0, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            if BLOCK_M > 1:
                acc1 += scale * _word_column_sums(x_row1, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            if BLOCK_M > 2:
                acc2 += scale * _word_column_sums(x_row2, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
                acc3 += scale * _word_column_sums(x_row3, k_it, K, w0a, w0b, w4a, w4b, w8a, w8b, w12a, w12b, HALF)
            words = next_words
            scale_bytes = next_scale_bytes

        multiplier = _decode_multiplier(global_scale_ptr, IS_NVFP4)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        _finish_row(tl.sum(acc0, axis=1) * multiplier, token0, offs_n, n_mask, M, N, bias, out_ptr, stride_om,
                    ws_ptr, HAS_BIAS, SPLIT_K)
        if BLOCK_M > 1:
            _finish_row(tl.sum(acc1, axis=1) * multiplier, token0 + 1, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
        if BLOCK_M > 2:
            _finish_row(tl.sum(acc2, axis=1) * multiplier, token0 + 2, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
            _finish_row(tl.sum(acc3, axis=1) * multiplier, token0 + 3, offs_n, n_mask, M, N, bias, out_ptr,
                        stride_om, ws_ptr, HAS_BIAS, SPLIT_K)
        if SPLIT_K > 1:
            tl.debug_barrier()  # every thread's workspace atomics precede the counter's release
            counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last split of this tile: copy out
                _drain_row(token0, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                if BLOCK_M > 1:
                    _drain_row(token0 + 1, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                if BLOCK_M > 2:
                    _drain_row(token0 + 2, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)
                    _drain_row(token0 + 3, offs_n, n_mask, M, N, bias, out_ptr, stride_om, ws_ptr, HAS_BIAS)

    # --- integer dot products for one token (the "int_dots" configs) -----------------------
    # Twice an e2m1 value is an integer, {0, 1, 2, 3, 4, 6, 8, 12} and negatives, so a code word
    # becomes signed int8 lanes and one token's activations, rounded to int16 per K tile, meet
    # them in dp2a (two 16 x 8-bit products per instruction, int32 sums): no fp16/fp32
    # conversion and no FMA per code.

    @triton.jit
    def _doubled_e2m1(nibble):
        """Codes (int32, 0-15) -> twice their e2m1 value as int32 (the interpreter's decode)."""
        mag = nibble & 7
        e = mag >> 1
        v = tl.where(e == 0, mag, (2 + (mag & 1)) << tl.maximum(e - 1, 0))
        return tl.where(nibble >= 8, -v, v)

    @triton.jit
    def _e2m1_int8_lanes(words, USE_ASM: tl.constexpr):
        """int32 code words -> (lo, hi): lane i (byte i) of lo holds twice the e2m1 value of nibble
        i, of hi that of nibble 4 + i, as signed int8. USE_ASM: 12 instructions per word. PRMT
        looks up each magnitude in a positive and a negative byte table (twice the e2m1 values
        0, 1, 2, 3, 4, 6, 8, 12 and their negatives, indexed by the magnitude bits; ptxas moves
        one table word in from a uniform register at each use); a third PRMT per half
        replicates each code's sign bit over its lane (bit 7 of a byte of the word is an odd
        nibble's sign, bit 7 of a byte of word << 4 an even one's); LOP3 picks per lane."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
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
                "=r,=r,r,r,r,r,r", [words, tl.full(words.shape, 0x03020100, tl.int32),
                                    tl.full(words.shape, 0x0C080604, tl.int32),
                                    tl.full(words.shape, -33620224, tl.int32),  # 0xFDFEFF00
                                    tl.full(words.shape, -185009412, tl.int32)],  # 0xF4F8FAFC
                dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo = tl.zeros_like(words)
            hi = tl.zeros_like(words)
            for t in tl.static_range(4):
                lo |= (_doubled_e2m1((words >> (4 * t)) & 15) & 255) << (8 * t)
                hi |= (_doubled_e2m1((words >> (16 + 4 * t)) & 15) & 255) << (8 * t)
            return lo, hi

    @triton.jit
    def _dp2a(a, b, c, HI: tl.constexpr, USE_ASM: tl.constexpr):
        """c + a.h0 * b.byte(i) + a.h1 * b.byte(i + 1), signed, i = 2 if HI else 0 (PTX dp2a)."""
        if USE_ASM:
            if HI:
                return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
        else:
            SHIFT: tl.constexpr = 16 if HI else 0
            b0 = (b << (24 - SHIFT)) >> 24
            b1 = (b << (16 - SHIFT)) >> 24
            return c + ((a << 16) >> 16) * b0 + (a >> 16) * b1

    @triton.jit
    def _rint(v):
        """Round to nearest even, for |v| < 2^22 (adding and removing 1.5 * 2^23)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _int16_activation_pairs(x_row, k_a, K, HALF: tl.constexpr):
        """One token's 8 W activations of a word tile (elements k_a + 0..3 and k_a + HALF + 0..3 of
        word column w) rounded to int16 with one step, (tile max) / 32766: an error of at most half a
        step, 2^-16 of the tile's largest activation. Returns the four (W,) int16 pairs in the lane
        order of _e2m1_int8_lanes (nibble 2i of a word is element 4q + i, nibble 2i + 1 is
        4q + i + HALF) and the step."""
        x_a = tl.load(x_row + k_a, mask=k_a < K, other=0.0).to(tl.float32)
        x_b = tl.load(x_row + k_a + HALF, mask=k_a + HALF < K, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x_a), axis=1), axis=0), tl.max(tl.max(tl.abs(x_b), axis=1), axis=0))
        step = tl.where(amax > 0, amax * (1.0 / 32766.0), 1.0)
        inv = tl.where(amax > 0, 32766.0 / amax, 0.0)
        q_a = _rint(x_a * inv).to(tl.int32)
        q_b = _rint(x_b * inv).to(tl.int32)
        a0, a1, a2, a3 = _split4((q_a & 0xFFFF) | (q_b << 16))  # (W,) each
        return a0, a1, a2, a3, step

    @triton.jit
    def _int_block_sums(a0, a1, a2, a3, step, lo, hi, scale_bytes, IS_NVFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                        NB: tl.constexpr, WPB: tl.constexpr, USE_ASM: tl.constexpr):
        """One token's part of a word tile, (BLOCK_N, NB) fp32 per scale block: its int16 pairs meet
        the words' int8 lanes (lo, hi) in four chained dp2a; each block's int32 sum is exact
        (|sum| <= 32 * 12 * 32767 < 2^24) and scaled once."""
        dots = _dp2a(tl.broadcast_to(a0[None, :], lo.shape), lo, tl.zeros_like(lo), False, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a1[None, :], lo.shape), lo, dots, True, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a2[None, :], lo.shape), hi, dots, False, USE_ASM)
        dots = _dp2a(tl.broadcast_to(a3[None, :], lo.shape), hi, dots, True, USE_ASM)
        block_dots = tl.sum(tl.reshape(dots, (BLOCK_N, NB, WPB)), axis=2)  # exact int32
        return _block_scales(scale_bytes, IS_NVFP4) * (block_dots.to(tl.float32) * step)

    @triton.jit
    def _fp4_gemv_int_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr,
    ):
        """Decode on CUDA cores with integer dot products, BLOCK_M (1, 2 or 4) tokens per program
        (grid as _fp4_gemv_words_kernel's). Each word's eight codes become int8 lanes once
        (_e2m1_int8_lanes) and meet every token's int16 activations in four dp2a per token
        (_int16_activation_pairs, _int_block_sums). Split-K and the output as in _fp4_gemv_words_mma_kernel."""
        WPB: tl.constexpr = BLOCK_SIZE // 8
        HALF: tl.constexpr = BLOCK_SIZE // 2
        NB: tl.constexpr = WORDS_PER_ITER // WPB  # scale blocks per tile row
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, _, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = words_ptr + word_offs
        scale_ptrs = scales_ptr + rows[:, None] * stride_sn + tl.arange(0, NB)[None, :]  # (BN, NB)
        token0 = pid_m * BLOCK_M
        # rows >= M (not stored) read row token0 again; token0 < M. A clamp with tl.minimum costs the
        # one-token kernel 24 registers at 16 x 256 (offline sm_90: 96 -> 120)
        x_row0 = x_ptr + token0 * stride_xm
        x_row1 = x_ptr + (token0 + (token0 + 1 < M).to(tl.int32)) * stride_xm
        x_row2 = x_ptr + (token0 + 2 * (token0 + 2 < M).to(tl.int32)) * stride_xm
        x_row3 = x_ptr + (token0 + 3 * (token0 + 3 < M).to(tl.int32)) * stride_xm
        offs4 = tl.arange(0, 4)
        acc0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)

        words = tl.load(word_ptrs + it_start * WORDS_PER_ITER)
        scale_bytes = tl.load(scale_ptrs + it_start * NB)
        for it in range(it_start, it_end):
            nxt = tl.minimum(it + 1, it_end - 1)  # prefetch; the last iteration re-reads its own tile
            next_words = tl.load(word_ptrs + nxt * WORDS_PER_ITER)
            next_scale_bytes = tl.load(scale_ptrs + nxt * NB)

            # the word's codes are elements k_lo + 0..3 (low nibbles) and k_lo + HALF + 0..3 (high)
            k_a = (k_lo + it * (WORDS_PER_ITER * 8))[:, None] + offs4[None, :]  # (W, 4)
            # activations first, then the lanes: they are consumed right after they are decoded
            # (the other order keeps them live through the rounding: 96 -> 122 registers at 16 x 256)
            p0, p1, p2, p3, step0 = _int16_activation_pairs(x_row0, k_a, K, HALF)
            if BLOCK_M > 1:
                r0, r1, r2, r3, step1 = _int16_activation_pairs(x_row1, k_a, K, HALF)
            if BLOCK_M > 2:
                s0, s1, s2, s3, step2 = _int16_activation_pairs(x_row2, k_a, K, HALF)
                t0, t1, t2, t3, step3 = _int16_activation_pairs(x_row3, k_a, K, HALF)
            lo, hi = _e2m1_int8_lanes(words, USE_ASM)  # (BN, W), shared by the tokens
            acc0 += _int_block_sums(p0, p1, p2, p3, step0, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            if BLOCK_M > 1:
                acc1 += _int_block_sums(r0, r1, r2, r3, step1, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            if BLOCK_M > 2:
                acc2 += _int_block_sums(s0, s1, s2, s3, step2, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
                acc3 += _int_block_sums(t0, t1, t2, t3, step3, lo, hi, scale_bytes, IS_NVFP4, BLOCK_N, NB, WPB, USE_ASM)
            words = next_words
            scale_bytes = next_scale_bytes

        # the 2 of the doubled codes, and (NVFP4) the 2^-8 of the e4m3 decode
        if BLOCK_M == 1:  # (BN, BLOCK_M) row sums, tokens in order
            sums = tl.sum(acc0, axis=1)[:, None]
        elif BLOCK_M == 2:
            sums = tl.join(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1))
        else:
            sums = tl.reshape(tl.join(tl.join(tl.sum(acc0, axis=1), tl.sum(acc2, axis=1)),
                                      tl.join(tl.sum(acc1, axis=1), tl.sum(acc3, axis=1))), (BLOCK_N, 4))
        offs_m = token0 + tl.arange(0, BLOCK_M)
        _store_token_tile(sums * (tl.load(global_scale_ptr) * (128.0 if IS_NVFP4 else 0.5)), offs_n, n_mask, rows,
                          offs_m, offs_m < M, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr, bias_ptr, counter_ptr,
                          SPLIT_K, HAS_BIAS)

    @triton.jit
    def _bf16_scale_pair(block_scale):
        """NVFP4 block scales from _block_scales (e4m3 value * 2^-8, fp32) -> int32 holding the
        bf16 of e4m3 value * 2^119 in both halves: exact, so the fp32 bits' low half is zero."""
        high = (block_scale * 1.7014118346046923e38).to(tl.int32, bitcast=True)  # * 2^127
        return high | (high.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)

    @triton.jit
    def _bf16_scaled_pair(words, SHIFT: tl.constexpr, scale_pair, USE_ASM: tl.constexpr):
        """Two codes (bits SHIFT and SHIFT + 16) times their NVFP4 block scale, as bf16 (low, high):
        the codes' bf16 bit placement (value * 2^-126) times scale_pair (bf16 e4m3 value * 2^119 in
        both halves) in one bf16x2 multiply. Exact: value * scale * 2^-7 has at most 6
        significant bits and lies in bf16's normal range (e4m3 <= 448 keeps the factor < 2^128)."""
        bits = _e2m1_pair_bits(words, SHIFT, 6)
        if USE_ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [bits, scale_pair], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:  # a bf16 half is the top of an fp32; the product is exact in fp32 too
            scale = (scale_pair & -65536).to(tl.float32, bitcast=True)
            lo = (bits << 16).to(tl.float32, bitcast=True) * scale
            hi = (bits & -65536).to(tl.float32, bitcast=True) * scale
            return lo.to(tl.bfloat16), hi.to(tl.bfloat16)

    @triton.jit
    def _split_positions(x, BLOCK_SIZE: tl.constexpr):
        """(BM, 8 W) activations of a word tile, in element order -> for each shift s in
        (0, 4, 8, 12), the (BM, W) pieces that the low and high codes of _decode_shift(words, s)
        multiply. Element e of a scale block is 4 q + 2 r1 + r0 + BS/2 h for word q: the pieces
        are (r0, h) = (0, 0), (0, 1), (1, 0), (1, 1), and r1 = 0 / 1 within a piece pair."""
        BM: tl.constexpr = x.shape[0]
        WPB: tl.constexpr = BLOCK_SIZE // 8
        NB: tl.constexpr = x.shape[1] // BLOCK_SIZE
        x = tl.reshape(x, (BM, NB, 2, WPB, 2, 2))  # (m, block, h, q, r1, r0)
        x = tl.reshape(tl.permute(x, (0, 1, 3, 2, 4, 5)), (BM, NB * WPB, 2, 2, 2))  # (m, word, h, r1, r0)
        even, odd = tl.split(x)
        s0_or_s4, s8_or_s12 = tl.split(even), tl.split(odd)  # each (r1 = 0, r1 = 1), (m, word, h)
        s0_lo, s4_lo = tl.split(s0_or_s4[0])
        s0_hi, s4_hi = tl.split(s0_or_s4[1])
        s8_lo, s12_lo = tl.split(s8_or_s12[0])
        s8_hi, s12_hi = tl.split(s8_or_s12[1])
        return s0_lo, s0_hi, s4_lo, s4_hi, s8_lo, s8_hi, s12_lo, s12_hi

    @triton.jit
    def _interleaved(x_lo, x_hi):
        """(BM, W) pieces of the activations -> (BM, 2W), column 2w + j from x_lo (j = 0) or x_hi."""
        return tl.reshape(tl.join(x_lo, x_hi), (x_lo.shape[0], 2 * x_lo.shape[1]))

    @triton.jit
    def _scaled_code_pairs(words, SHIFT: tl.constexpr, block_scale, IS_NVFP4: tl.constexpr,
                           DIRECT_BF16: tl.constexpr, dtype: tl.constexpr, USE_ASM: tl.constexpr):
        """The (low, high) codes of _decode_shift(words, SHIFT) times their block scale in the
        activation dtype, as the tensor-core kernel's two decodes compute them (DIRECT_BF16: times
        2^-7, which the kernel undoes on the sums). DIRECT_BF16: one bf16x2 multiply per code pair
        (_bf16_scaled_pair); otherwise fp32 products rounded to the activation dtype, with the power
        of two in the scale before the rounding, so code * e4m3 (NVFP4) is exact in fp16 and MXFP4
        weights keep their size."""
        if DIRECT_BF16:
            return _bf16_scaled_pair(words, SHIFT, _bf16_scale_pair(block_scale), USE_ASM)
        else:
            scale = block_scale * _decode_power(IS_NVFP4)
            lo, hi = _decode_shift(words, SHIFT, USE_ASM)
            return (lo * scale).to(dtype), (hi * scale).to(dtype)

    @triton.jit
    def _joined_pair_dot(lo, hi, x, acc, UPCAST_DOT: tl.constexpr):
        """acc += [lo | hi] @ x^T with lo and hi interleaved along K, x (BM, 2W) column 2w + j meeting
        word w's low (j = 0) or high (j = 1) code: the two halves of one bf16x2 register stay one
        register of the MMA operand (the K order of a dot is free)."""
        BN: tl.constexpr = lo.shape[0]
        W: tl.constexpr = lo.shape[1]
        return _mma(tl.reshape(tl.join(lo, hi), (BN, 2 * W)), x, acc, UPCAST_DOT)

    @triton.jit
    def _fp4_gemv_words_mma_kernel(
        x_ptr, words_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_wn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
        UPCAST_DOT: tl.constexpr, USE_ASM: tl.constexpr, DIRECT_BF16: tl.constexpr, X_PERMUTED: tl.constexpr = False,
    ):
        """Decode on tensor cores, up to BLOCK_M (16, 32 or 64) tokens per program, on the word tile of
        _fp4_gemv_words_kernel. Per shift of the words, the two decoded codes of each word are one
        MMA operand register (_joined_pair_dot): four MMAs per tile, each with K = 2 WORDS_PER_ITER. The
        activations are loaded once per tile, contiguous, and split into the matching pieces in
        registers. DIRECT_BF16 (NVFP4, bf16 activations): codes times block scale in one bf16x2
        multiply (_bf16_scaled_pair), otherwise fp32 products rounded to the activation dtype.
        The weights are decoded in the MMA's register layout; num_stages must stay 1, since
        Triton's pipeliner would stage the decoded tile through shared memory (H100: 0.92-0.96x
        cuBLAS at 1-16 tokens against 1.18-1.40x). Split-K as in _fp4_gemv_words_kernel.
        X_PERMUTED: x_ptr holds permuted_activations(x) (zero-padded to K_PADDED, each tile's four
        MMA operands contiguous), loaded as they are: no split in registers, whose 2-byte shared
        stores and shuffles grow with BLOCK_M."""
        WPB: tl.constexpr = BLOCK_SIZE // 8
        W: tl.constexpr = WORDS_PER_ITER
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        offs_n, n_mask, rows, word_offs, scale_offs, k_lo, it_start, it_end = _word_tile(
            N, K_PADDED, stride_wn, stride_sn, BLOCK_SIZE, BLOCK_N, WORDS_PER_ITER, SPLIT_K)
        word_ptrs = words_ptr + word_offs
        scale_ptrs = scales_ptr + scale_offs
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        if X_PERMUTED:  # rows >= M read row M - 1 (never stored), so the loads need no mask
            x_ptrs = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + tl.arange(0, 2 * W)[None, :]  # (BM, 2W)
        else:
            offs_k = tl.arange(0, 8 * W)
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # (BM, 8W)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(it_start, it_end):
            k0 = it * (8 * W)
            # the tile's four MMA operands of activations, one per shift of the words
            if X_PERMUTED:
                xs0 = tl.load(x_ptrs + k0)
                xs4 = tl.load(x_ptrs + k0 + 2 * W)
                xs8 = tl.load(x_ptrs + k0 + 4 * W)
                xs12 = tl.load(x_ptrs + k0 + 6 * W)
            else:
                x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (offs_k[None, :] + k0 < K), other=0.0)
                x0, x1, x2, x3, x4, x5, x6, x7 = _split_positions(x, BLOCK_SIZE)
            words = tl.load(word_ptrs + it * W)
            block_scale = _block_scales(tl.load(scale_ptrs + it * (W // WPB)), IS_NVFP4)
            # split pieces are interleaved at their dot: all four up front, the 16-token bf16 build
            # took 22 more instructions per step (offline sm_90)
            lo, hi = _scaled_code_pairs(words, 0, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs0 if X_PERMUTED else _interleaved(x0, x1), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 4, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs4 if X_PERMUTED else _interleaved(x2, x3), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 8, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs8 if X_PERMUTED else _interleaved(x4, x5), acc, UPCAST_DOT)
            lo, hi = _scaled_code_pairs(words, 12, block_scale, IS_NVFP4, DIRECT_BF16, dtype, USE_ASM)
            acc = _joined_pair_dot(lo, hi, xs12 if X_PERMUTED else _interleaved(x6, x7), acc, UPCAST_DOT)
        acc = acc * (tl.load(global_scale_ptr) * (128.0 if DIRECT_BF16 else 1.0))  # DIRECT_BF16: undo 2^-7

        _store_token_tile(acc, offs_n, n_mask, rows, offs_m, m_mask, pid_m, pid_n, N, stride_om, out_ptr, ws_ptr,
                          bias_ptr, counter_ptr, SPLIT_K, HAS_BIAS)

    @triton.jit
    def _fp4_dequantize_kernel(
        codes_ptr, scales_ptr, global_scale_ptr, out_ptr, N, K, N_BLOCKS,
        stride_cn, stride_sn, stride_on,
        IS_NVFP4: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr,
        INTERLEAVE: tl.constexpr,
    ):
        """W (N, K) in out's dtype from the kernel layout, for the prefill path (then cuBLAS).
        Grid: (N / BLOCK_N, N_BLOCKS / BLOCKS_PER_PROG); N_BLOCKS = scale blocks per row (padded).
        Each program decodes a (BLOCK_N, BLOCKS_PER_PROG blocks) tile: byte j of a block ->
        elements j and j + BS/2. INTERLEAVE: the two nibbles are interleaved in registers (join +
        permute), so every row of the tile is ONE contiguous run of BLOCKS_PER_PROG * BLOCK_SIZE
        elements (full-width vector stores); else two runs of BS/2 elements per block."""
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_g = pid_k * BLOCKS_PER_PROG + tl.arange(0, BLOCKS_PER_PROG)
        offs_j = tl.arange(0, HALF)
        tile_ok = (offs_n[:, None] < N) & (offs_g[None, :] < N_BLOCKS)  # (BN, G)
        codes = tl.load(codes_ptr + offs_n[:, None, None] * stride_cn + offs_g[None, :, None] * HALF + offs_j[None, None, :],
                        mask=tile_ok[:, :, None], other=0)  # (BN, G, HALF) uint8
        scale_bytes = tl.load(scales_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=tile_ok, other=0)
        scale = (_block_scales(scale_bytes, IS_NVFP4) * _decode_multiplier(global_scale_ptr, IS_NVFP4))[:, :, None]
        w_lo = (_e2m1_times_2_pow_minus_14(codes & 15) * scale).to(out_ptr.dtype.element_ty)
        w_hi = (_e2m1_times_2_pow_minus_14(codes >> 4) * scale).to(out_ptr.dtype.element_ty)
        if INTERLEAVE:
            w = tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2))  # (BN, G, 2, HALF): block order
            w = tl.reshape(w, (BLOCK_N, BLOCKS_PER_PROG * BLOCK_SIZE))
            offs_k = pid_k * (BLOCKS_PER_PROG * BLOCK_SIZE) + tl.arange(0, BLOCKS_PER_PROG * BLOCK_SIZE)
            tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w,
                     mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))
        else:
            k_lo = offs_g[None, :, None] * BLOCK_SIZE + offs_j[None, None, :]  # (1, G, HALF)
            out_rows = out_ptr + offs_n[:, None, None] * stride_on
            row_ok = (offs_n < N)[:, None, None]
            tl.store(out_rows + k_lo, w_lo, mask=row_ok & (k_lo < K))
            tl.store(out_rows + k_lo + HALF, w_hi, mask=row_ok & (k_lo + HALF < K))

    @triton.jit
    def _fp4_gemm_kernel(
        x_ptr, codes_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_cn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, GROUP_M: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """out[M, N] = x[M, K] @ W[N, K]^T for many tokens; 1-D grid over (M / BLOCK_M) * (N / BLOCK_N)
        tiles in groups of GROUP_M token tiles, so neighbouring programs share weight tiles in L2."""
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        tiles_per_group = GROUP_M * num_n
        group = pid // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % tiles_per_group) % group_size
        pid_n = (pid % tiles_per_group) // group_size

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        offs_g = tl.arange(0, BLOCKS_PER_ITER)
        offs_j = tl.arange(0, HALF)
        # In the loop, weights are code * block scale only: exact in bf16 / fp16 (<= 6 significant
        # bits, |w| in [2^-10, 2688] for NVFP4). NVFP4's fp32 global scale multiplies the sums once
        # after the loop; folded into each weight before its cast it would round the weight.
        power = _decode_power(IS_NVFP4)

        code_ptrs = codes_ptr + offs_n[:, None, None] * stride_cn + offs_g[None, :, None] * HALF + offs_j[None, None, :]  # (BN, G, HALF)
        scale_ptrs = scales_ptr + offs_n[:, None] * stride_sn + offs_g[None, :]  # (BN, G)
        k_in_iter = offs_g[:, None] * BLOCK_SIZE + offs_j[None, :]  # (G, HALF)
        x_base = x_ptr + offs_m[:, None, None] * stride_xm  # (BM, 1, 1)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(0, K_PADDED // (BLOCK_SIZE * BLOCKS_PER_ITER)):
            block0 = it * BLOCKS_PER_ITER
            codes = tl.load(code_ptrs + block0 * HALF, mask=n_mask[:, None, None], other=0)
            scale = _block_scales(tl.load(scale_ptrs + block0, mask=n_mask[:, None], other=0), IS_NVFP4) * power
            w_lo = _e2m1_times_2_pow_minus_14(codes & 15) * scale[:, :, None]
            w_hi = _e2m1_times_2_pow_minus_14(codes >> 4) * scale[:, :, None]
            w_lo = tl.reshape(w_lo.to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCKS_PER_ITER * HALF))
            w_hi = tl.reshape(w_hi.to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCKS_PER_ITER * HALF))
            k_lo = block0 * BLOCK_SIZE + k_in_iter
            x_lo = tl.load(x_base + k_lo[None, :, :], mask=m_mask[:, None, None] & (k_lo[None, :, :] < K), other=0.0)
            x_hi = tl.load(x_base + k_lo[None, :, :] + HALF, mask=m_mask[:, None, None] & (k_lo[None, :, :] + HALF < K), other=0.0)
            x_lo = tl.reshape(x_lo, (BLOCK_M, BLOCKS_PER_ITER * HALF))
            x_hi = tl.reshape(x_hi, (BLOCK_M, BLOCKS_PER_ITER * HALF))
            acc = _mma(w_lo, x_lo, acc, UPCAST_DOT)  # (BN, BM)
            acc = _mma(w_hi, x_hi, acc, UPCAST_DOT)

        if IS_NVFP4:
            acc = acc * tl.load(global_scale_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
PATHS: tuple[str, ...] = ("gemv", "gemm", "dequant")
_TUNED: dict[tuple, KernelConfig] = {}


@functools.lru_cache(maxsize=4096)
def _device_path(device_index: int | None, tokens: int, in_features: int, out_features: int, fmt: str,
                 act_dtype: torch.dtype) -> str:
    """The launcher's path: choose_fp4_path for CUDA device `device_index`, cached (the estimate
    costs ~40 us of Python, and the launcher asks on every call); without a GPU (None: the
    interpreter) decode up to 16 tokens (its one decode tile), else the tiled GEMM."""
    from graphopt.hardware import device_spec

    hw = None if device_index is None else device_spec(device_index)
    if hw is None or not hw.is_gpu:
        return "gemv" if tokens <= INTERPRET_DECODE_CONFIG.block_m else "gemm"
    return choose_fp4_path(hw, tokens, in_features, out_features, fmt, act_dtype)


def _token_bucket(m) -> int:
    """The power of two >= m; a symbolic m (a traced op body) guards on its bucket only."""
    bucket = 1
    while m > bucket:
        bucket *= 2
    return bucket


def _valid_config(cfg: KernelConfig, path: str, m: int, n: int, k_padded: int, block_size: int) -> bool:
    """Whether a tile config can run this shape (correctness, not speed)."""
    if path == "dequant":
        return True

    def power_of_two(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    if not (power_of_two(cfg.block_n) and power_of_two(cfg.block_k)) or cfg.split_k < 1:
        return False  # tl.arange extents; at least one K split
    if cfg.block_k % block_size or k_padded % cfg.block_k or (cfg.block_k // block_size) * (block_size // 2) < 16:
        return False
    if path == "gemv":
        if cfg.block_n < MIN_DECODE_BLOCK_N:
            return False  # the split-K arrival counters are sized for this many rows per tile
        if cfg.block_m in MMA_BLOCK_M and (cfg.block_k // 8 < 16 or cfg.block_n < 16):
            # 16 words per row (the MMAs' K is 32; with 8 words, K 16, the H100 results were wrong
            # although the interpreter's were right), and N >= 16
            return False
        if cfg.int_dots and cfg.block_m not in INT_BLOCK_M:
            return False
        if cfg.permute_x and (cfg.int_dots or cfg.block_m not in MMA_BLOCK_M):
            return False  # only the tensor-core kernel reads permuted activations
        if cfg.tma and not (block_size == 16 and cfg.block_m in MMA_BLOCK_M and not (cfg.int_dots or cfg.permute_x)
                            and fp4_tma.tiles_k(k_padded, cfg.block_k) and cfg.block_n % (16 * cfg.num_warps) == 0):
            return False  # NVFP4 only; the Gluon kernel's own tile and K rules (fp4_tma.tiles_k)
        return cfg.split_k <= k_padded // cfg.block_k and cfg.block_m in FMA_BLOCK_M + MMA_BLOCK_M
    return cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.split_k == 1 and not cfg.tma


def _runs_here(cfg: KernelConfig, x2: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this call's device and dtypes can run the config's kernel: fp4_tma's Gluon kernel
    needs an sm_90+ GPU (never the interpreter) and bf16 in and out; the Triton kernels run anywhere."""
    return not cfg.tma or (not INTERPRET and out_dtype == torch.bfloat16 and fp4_tma.supports(x2))


def _worth_timing(cfg: KernelConfig, path: str, m: int, k_padded: int) -> bool:
    """Tuning filter. 1-4 tokens: the CUDA-core kernels (FMA or integer dots) with BLOCK_M = the
    token bucket, or the tensor-core kernel; 5-16 tokens: CUDA-core with 4 tokens per program or
    the tensor-core kernel; 17-32: the tensor-core kernel with 32 tokens per program; more: 32 or
    64 (on the H100, 16-token programs took 1.5-2x as long at 32 and 64 tokens). A K split keeps at
    least two K tiles per program."""
    if path != "gemv":
        return True
    if m <= 4:
        block_ms = (_token_bucket(m), 16)
    elif m <= 16:
        block_ms = (4, 16)
    else:
        block_ms = (32,) if m <= 32 else (32, 64)
    if cfg.block_m not in block_ms:
        return False
    return cfg.split_k == 1 or (k_padded // cfg.block_k) // cfg.split_k >= 2


# Dequantize tile: (rows, elements per row, warps, interleave) per program. interleave 1: one
# contiguous store per row (INTERLEAVE in _fp4_dequantize_kernel), 0: two half-block stores. The
# first entry is the default; bench_fp4.py --dequant-sweep times them all. H100, NVFP4, W bf16
# 5120x13824 (bench/results/fp4_dequant_tiles_h100.json): (64, 64, 4, 0) 0.31 ms;
# (8, 1024, 4, 0) 0.147 ms; interleaved (4, 1024, 4, 1) 0.071 ms = 2.55 TB/s, 0.86 of the copy.
DEQUANT_TILES: tuple[tuple[int, int, int, int], ...] = (
    (4, 1024, 4, 1), (8, 1024, 4, 1), (4, 2048, 4, 1), (16, 512, 4, 1), (2, 4096, 8, 1),
    (8, 1024, 4, 0), (4, 2048, 4, 0), (2, 4096, 8, 0),
)


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, out_features: int,
                      in_features: int, format: str, dtype: torch.dtype = torch.bfloat16,
                      tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(N, K) weight in `dtype` from kernel-layout tensors, on the device (one Triton launch).
    tile: (rows, elements per row, warps, interleave) of one program; default DEQUANT_TILES[0]."""
    bs = _check_format(format)
    w = torch.empty((out_features, in_features), dtype=dtype, device=codes.device)
    block_n, elements, warps, interleave = tile or ((16, 64, 4, 0) if INTERPRET else DEQUANT_TILES[0])
    if elements % bs or block_n < 1:
        raise ValueError(f"dequantize tile {tile}: elements per row must be a multiple of the {format} block ({bs})")
    blocks_per_prog = elements // bs
    n_blocks = codes.shape[1] * 2 // bs
    grid = (cdiv(out_features, block_n), cdiv(n_blocks, blocks_per_prog))
    launch(
        _fp4_dequantize_kernel, grid, codes, scales.view(torch.uint8), global_scale, w, out_features, in_features, n_blocks,
        codes.stride(0), scales.stride(0), w.stride(0),
        IS_NVFP4=format == "nvfp4", BLOCK_SIZE=bs, BLOCK_N=block_n, BLOCKS_PER_PROG=blocks_per_prog,
        INTERLEAVE=bool(interleave), num_warps=warps,
    )
    return w


def _launch(path: str, cfg: KernelConfig, x2, codes, scales, global_scale, bias, out_features: int, in_features: int,
            format: str, out_dtype: torch.dtype) -> torch.Tensor:
    m = x2.shape[0]
    n, k_padded = out_features, codes.shape[1] * 2
    bs = BLOCK_SIZES[format]
    bias_arg = bias if bias is not None else global_scale  # never read when HAS_BIAS is False
    if path == "dequant":  # prefill for many tokens: decode W once (bf16/fp16), then cuBLAS
        # fp32 callers get an fp32 product of the bf16-rounded activations, as on the other paths.
        # bf16 / fp16 callers get W rounded once to their dtype (NVFP4's global scale is folded into
        # it; scaling cuBLAS's output instead would cost one more pass over it), as their own model's
        # weights are; the decode and tiled-GEMM paths keep W exact.
        compute_dtype = torch.float32 if out_dtype == torch.float32 else x2.dtype
        w = dequantize_triton(codes, scales, global_scale, n, in_features, format, compute_dtype)
        out = F.linear(x2.to(compute_dtype), w, None if bias is None else bias.to(compute_dtype))
        return out.to(out_dtype) if out.dtype != out_dtype else out
    if path == "gemv":  # decode: CUDA cores (BLOCK_M 1-4), tensor cores (BLOCK_M 16-64) or fp4_tma's kernel
        # permute_x (tensor-core tiles only, _valid_config) and tma: x's tiles rearranged once per
        # call, read by every program as they are
        x_arg = permuted_activations(x2, k_padded, cfg.block_k // 8, bs) if cfg.permute_x or cfg.tma else x2
        n_iters = k_padded // cfg.block_k
        split_k = cdiv(n_iters, cdiv(n_iters, cfg.split_k))  # every split owns >= 1 tile
        out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
        ws, counters = split_buffers(x2.device, m, n, m * cdiv(n, MIN_DECODE_BLOCK_N)) if split_k > 1 else (out, out)
        if cfg.tma:  # the Gluon kernel (NVFP4, bf16 in and out: _runs_here)
            fp4_tma.launch_decode(x_arg, codes, scales, global_scale, bias, out, ws, counters, split_k, cfg)
            return out
        grid = (cdiv(n, cfg.block_n), split_k, cdiv(m, cfg.block_m))
        args = (x_arg, codes.view(torch.int32), scales, global_scale, bias_arg, out, ws, counters, m, n, in_features,
                k_padded, x_arg.stride(0), k_padded // 8, scales.stride(0), out.stride(0))
        common = dict(IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, BLOCK_SIZE=bs, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, WORDS_PER_ITER=cfg.block_k // 8, SPLIT_K=split_k,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.int_dots:
            launch(_fp4_gemv_int_kernel, grid, *args, USE_ASM=not INTERPRET, **common)
        elif cfg.block_m in FMA_BLOCK_M:
            launch(_fp4_gemv_words_kernel, grid, *args, USE_ASM=not INTERPRET, **common)
        else:
            launch(_fp4_gemv_words_mma_kernel, grid, *args, UPCAST_DOT=INTERPRET, USE_ASM=not INTERPRET,
                   DIRECT_BF16=format == "nvfp4" and x2.dtype == torch.bfloat16, X_PERMUTED=cfg.permute_x, **common)
        return out
    common = dict(IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, BLOCK_SIZE=bs,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_ITER=cfg.block_k // bs,
                  UPCAST_DOT=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    launch(
        _fp4_gemm_kernel, grid, x2, codes, scales, global_scale, bias_arg, out, m, n, in_features, k_padded,
        x2.stride(0), codes.stride(0), scales.stride(0), out.stride(0), GROUP_M=cfg.group_m, **common,
    )
    return out


def permuted_activations(x2: torch.Tensor, k_padded: int, words_per_iter: int, block_size: int) -> torch.Tensor:
    """x (M, K) -> (M, k_padded), zero-padded, each K tile of 8 * words_per_iter elements
    rearranged for _fp4_gemv_words_mma_kernel's X_PERMUTED: the tile's four MMA operands (one per
    shift s = 0, 4, 8, 12 of the code words) one after another, each 2 * words_per_iter long, with
    column 2w + j the element that word w's code at bit s + 16 j multiplies. In a scale block,
    element h * BS/2 + 4q + 2 r1 + r0 sits at bit 8 r0 + 4 h + 16 r1 of word q (the kernel
    layout), so the operand of shift 8 r0 + 4 h holds (block, q, r1) in that order."""
    m, k = x2.shape
    if k_padded > k:
        x2 = F.pad(x2, (0, k_padded - k))
    wpb = block_size // 8
    tiles, blocks = k_padded // (8 * words_per_iter), 8 * words_per_iter // block_size
    # (m, tile, block, h, q, r1, r0) -> (m, tile, r0, h, block, q, r1)
    return x2.reshape(m, tiles, blocks, 2, wpb, 2, 2).permute(0, 1, 6, 3, 2, 4, 5).reshape(m, k_padded)


DEQUANT_CONFIG = KernelConfig(64, 1, KERNEL_K_MULTIPLE)  # placeholder: the dequant path has no tile choice


def _cold_decode_timer(args: tuple):
    """A decode tile's time as a model step sees it: calls over distinct copies of the weight,
    back to back in one CUDA graph, so each reads from HBM (graphopt.timing.cold_graph_ms, the
    benchmark's L2-cold timing). do_bench's L2 flush leaves the cache full of dirty lines, and its
    host-launched calls can be launch-bound at ~20 us; tiles picked that way ran up to 20% slower
    cold (5120->13824 at 1 token, 1.48x against 1.81x). None when the copies do not fit
    (the caller falls back to do_bench)."""
    from graphopt.timing import cold_copies, cold_graph_ms

    x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype = args
    weights = cold_copies((codes, scales))
    if weights is None:
        return None

    def time_config(cfg: KernelConfig) -> float:
        calls = [lambda c=c, s=s: _launch("gemv", cfg, x2, c, s, global_scale, bias, out_features, in_features, format,
                                          out_dtype) for c, s in weights]
        return cold_graph_ms(calls, reps=10)
    return time_config


def _tuned_key(path: str, args: tuple, allow_tma: bool = True) -> tuple:
    x2, codes, _, _, bias, out_features, _, format, _ = args
    return (path, _token_bucket(x2.shape[0]), out_features, codes.shape[1] * 2, format, x2.dtype, bias is not None,
            x2.device.index, allow_tma)


# Untuned decode tiles per token bucket (the tuner's usual winners on the H100), for calls that
# carry no tuned choice: a compile without the GPU present, or a direct call of the op.
_DEFAULT_DECODE: dict[int, KernelConfig] = {
    1: KernelConfig(16, 1, 512, 1, num_warps=4, num_stages=1, int_dots=True),
    2: KernelConfig(16, 2, 256, 4, num_warps=1, num_stages=1, int_dots=True),
    4: KernelConfig(16, 4, 256, 1, num_warps=4, num_stages=1),
    16: KernelConfig(128, 16, 256, 8, num_warps=4, num_stages=1, permute_x=True),
    32: KernelConfig(128, 32, 128, 8, num_warps=4, num_stages=1, permute_x=True),
    64: KernelConfig(128, 64, 256, 8, num_warps=4, num_stages=1, permute_x=True),
}


def _candidates(path: str, args: tuple, allow_tma: bool) -> list[KernelConfig]:
    x2, codes, _, _, _, out_features, _, format, out_dtype = args
    m, k_padded, bs = x2.shape[0], codes.shape[1] * 2, BLOCK_SIZES[format]
    valid = [cfg for cfg in (DECODE_CONFIGS if path == "gemv" else PREFILL_CONFIGS)
             if _valid_config(cfg, path, m, out_features, k_padded, bs) and _runs_here(cfg, x2, out_dtype)
             and (allow_tma or not cfg.tma)]
    # the tuning filter's picks, or every valid tile where it leaves none (a short K, say)
    return [cfg for cfg in valid if _worth_timing(cfg, path, m, k_padded)] or valid


def default_config(path: str, args: tuple) -> KernelConfig:
    """The tile a call runs without a tuned choice: the tuner's memory for this shape if it has
    one, else a fixed per-bucket tile (the interpreter's small tiles under TRITON_INTERPRET=1).
    Never times anything."""
    x2, codes, _, _, _, out_features, _, format, _ = args
    m, k_padded, bs = x2.shape[0], codes.shape[1] * 2, BLOCK_SIZES[format]
    if path == "dequant":
        return DEQUANT_CONFIG
    if INTERPRET or not x2.is_cuda:
        if path == "gemm":
            return INTERPRET_PREFILL_CONFIG
        cfg = INTERPRET_DECODE_CONFIG
        if m <= 4 or k_padded % cfg.block_k:  # the CUDA-core kernel (any K: BLOCK_K 64)
            cfg = dataclasses.replace(cfg, block_m=_token_bucket(m) if m <= 4 else 4, block_k=KERNEL_K_MULTIPLE)
        return dataclasses.replace(cfg, split_k=min(cfg.split_k, k_padded // cfg.block_k))
    tuned = _TUNED.get(_tuned_key(path, args, False))
    if tuned is not None:
        return tuned
    preferred = _DEFAULT_DECODE.get(_token_bucket(m)) if path == "gemv" else PREFILL_CONFIGS[0]
    if preferred is not None and _valid_config(preferred, path, m, out_features, k_padded, bs):
        return preferred
    candidates = _candidates(path, args, allow_tma=False)
    if not candidates:
        raise ValueError(f"no FP4 {path} tile fits M={m} N={out_features} K_padded={k_padded}")
    return candidates[0]


def tune_config(path: str, args: tuple, *, allow_tma: bool = True) -> KernelConfig:
    """The fastest valid candidate for this shape, timed on the GPU (kept in memory and in the tuning
    file, graphopt.kernels.tuning). For compile time and benchmarks, never for a call inside a
    user's forward: inside a CUDA-graph capture, or without a GPU, it times nothing and returns
    `default_config`. allow_tma: also time fp4_tma's Gluon decode. A candidate whose output disagrees
    with the first one that ran is dropped (a guard against a miscompiled tile being 'fastest')."""
    x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype = args
    if path == "dequant" or INTERPRET or not x2.is_cuda or torch.cuda.is_current_stream_capturing():
        return default_config(path, args)
    key = _tuned_key(path, args, allow_tma)
    if key in _TUNED:
        return _TUNED[key]
    disk_key = f"fp4|{tuning.device_key(x2.device.index or 0)}|{key[:-2]}|tma={allow_tma}"
    if (stored := tuning.lookup(disk_key)) is not None:
        _TUNED[key] = tuning.decode(KernelConfig, stored)
        return _TUNED[key]
    candidates = _candidates(path, args, allow_tma)
    time_config = _cold_decode_timer(args) if path == "gemv" else None
    if time_config is None:
        from triton.testing import do_bench

        def time_config(cfg):
            return do_bench(lambda: _launch(path, cfg, *args), warmup=5, rep=20, return_mode="median")
    best, best_ms, first_out = None, math.inf, None
    for cfg in candidates:
        try:
            out = _launch(path, cfg, *args).float()
            if first_out is None:
                first_out = out
            elif not torch.allclose(out, first_out, rtol=2e-2, atol=2e-2 * float(first_out.abs().max()) + 1e-6):
                continue
            ms = time_config(cfg)
        except Exception:  # e.g. out of shared memory for this tile on this GPU
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no FP4 {path} kernel configuration compiled for M={x2.shape[0]} N={out_features} "
                           f"K={in_features}")
    _TUNED[key] = best
    tuning.store(disk_key, tuning.encode(best))
    return best


def _bucket_range(m: int) -> tuple[int, int]:
    """The token counts that share m's tuned tile: (bucket / 2, bucket]."""
    bucket = _token_bucket(m)
    return (1 if bucket == 1 else bucket // 2 + 1), bucket


def tune_fp4_linear(tokens: int, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_features: int, in_features: int, format: str,
                    act_dtype: torch.dtype, *, allow_tma: bool) -> str:
    """The `kernel` argument of graphopt::fp4_linear for calls of `tokens` rows, chosen now (compile
    time): "lo-hi=path=<tile>" for the token counts lo..hi, or "" where nothing can be timed here
    (no GPU, the interpreter, a CUDA-graph capture running). Timed on random activations."""
    if INTERPRET or not codes.is_cuda or torch.cuda.is_current_stream_capturing() or tokens < 1:
        return ""
    path = _device_path(codes.device.index, tokens, in_features, out_features, format, act_dtype)
    x = torch.randn(tokens, in_features, device=codes.device, dtype=act_dtype)
    x2, out_dtype = _activation_rows(x, in_features)
    args = (x2, codes, scales.view(torch.uint8), global_scale, bias, out_features, in_features, format, out_dtype)
    cfg = tune_config(path, args, allow_tma=allow_tma)
    lo, hi = _bucket_range(tokens)
    return f"{lo}-{hi}={path}={tuning.encode(cfg)}"


@functools.lru_cache(maxsize=256)
def _parse_kernel(kernel: str) -> tuple[tuple[int, int, str, KernelConfig], ...]:
    entries = []
    for entry in filter(None, kernel.split(";")):
        try:
            span, path, cfg = entry.split("=", 2)
            lo, hi = (int(v) for v in span.split("-"))
        except ValueError:
            raise ValueError(f"graphopt::fp4_linear: kernel {entry!r} is not 'lo-hi=path=<tile json>'") from None
        if path not in PATHS:
            raise ValueError(f"graphopt::fp4_linear: unknown path {path!r} in kernel; valid choices: {', '.join(PATHS)}")
        entries.append((lo, hi, path, tuning.decode(KernelConfig, cfg)))
    return tuple(entries)


def kernel_choice(kernel: str, tokens) -> tuple[str | None, KernelConfig | None]:
    """(path, tile) for a call of `tokens` rows: the compile-time choice in `kernel` whose token
    range holds it, else (None, None) (the launcher's cost-model path and default tile). `tokens`
    may be symbolic: the comparisons then guard on its range."""
    for lo, hi, path, cfg in _parse_kernel(kernel):
        if lo <= tokens <= hi:
            return path, cfg
    return None, None


def fp4_linear_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_features: int, in_features: int, format: str, *,
                      path: str | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with W in the kernel layout (to_kernel_layout). x: (..., K) bf16/fp16
    (fp32 is computed from a bf16 copy, output fp32). `path`: gemv | gemm | dequant | None (cost model);
    `config`: the tile (None: default_config; nothing is timed here, see tune_config)."""
    if triton is None:
        raise RuntimeError("fp4_linear_triton needs Triton; use reference_fp4_linear on CPU")
    bs = _check_format(format)
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown FP4 kernel path {path!r}; valid choices: {', '.join(PATHS)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp4_linear: activations must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"fp4_linear: x has {x.shape[-1]} features, the weight expects {in_features}")
    k_padded = _padded_k(in_features)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (out_features, k_padded // 2):
        raise ValueError(f"fp4_linear: codes must be uint8 ({out_features}, {k_padded // 2}) in the kernel layout "
                         f"(to_kernel_layout), got {codes.dtype} {tuple(codes.shape)}")
    if tuple(scales.shape) != (out_features, k_padded // bs):
        raise ValueError(f"fp4_linear: {format} scales must be ({out_features}, {k_padded // bs}), got {tuple(scales.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"fp4_linear: bias must be ({out_features},), got {tuple(bias.shape)}")
    for name, t in (("codes", codes), ("scales", scales), ("global_scale", global_scale)) + ((("bias", bias),) if bias is not None else ()):
        if t.device != x.device:
            raise ValueError(f"fp4_linear: {name} is on {t.device} but x is on {x.device}")
        if name != "bias" and not t.is_contiguous():
            raise ValueError(f"fp4_linear: {name} must be contiguous")
    if bias is not None:
        bias = bias.contiguous()  # a strided view of a bias vector is fine: copied (N values) here
    x2, out_dtype = _activation_rows(x, in_features)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    if path is None:
        path = _device_path(x.device.index if x.is_cuda else None, _token_bucket(m), in_features, out_features, format,
                            x.dtype)
    args = (x2, codes, scales.view(torch.uint8), global_scale, bias, out_features, in_features, format, out_dtype)
    cfg = config or default_config(path, args)
    if cfg.tma and not _runs_here(cfg, x2, out_dtype):
        raise ValueError(f"fp4_linear: a tma config needs an sm_90+ GPU (not the interpreter) and bfloat16 activations "
                         f"and output; this call has {x2.device.type} {x.dtype}")
    if not _valid_config(cfg, path, m, out_features, k_padded, bs):
        raise ValueError(f"fp4_linear: config {cfg} is not valid for path {path} with M={m}, K_padded={k_padded}, "
                         f"block {bs} (BLOCK_N and BLOCK_K powers of two; BLOCK_K must divide K_padded, be a multiple "
                         f"of the block and give MMA K >= 16; 1 <= SPLIT_K <= K_padded / BLOCK_K; decode BLOCK_M is 1, 2, "
                         f"4, 16, 32 or 64 with BLOCK_N >= {MIN_DECODE_BLOCK_N} (>= 16, and BLOCK_K >= 128, for BLOCK_M >= 16), and 1, 2 or 4 for "
                         f"int_dots configs; permute_x only on the tensor-core tiles (BLOCK_M 16, 32 or 64); tma tiles: NVFP4, "
                         f"BLOCK_M 16, 32 or 64, BLOCK_K 256, K_padded a multiple of 256, "
                         f"BLOCK_N a multiple of 16 x num_warps; prefill tiles >= 16 without split)")
    out = _launch(path, cfg, *args)
    return out.reshape(*x.shape[:-1], out_features)


def _activation_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.dtype]:
    """x (..., K) as the kernels' (M, K) rows with unit last stride (fp32 through a bf16 copy), and
    the output dtype."""
    x2 = x.reshape(-1, in_features)
    if x2.dtype == torch.float32:
        x2 = x2.to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x.dtype


def fp4_linear(x: torch.Tensor, weight: Fp4KernelWeight, bias: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Convenience: the Triton kernel on CUDA (or under the interpreter), else the torch reference."""
    args = (x, weight.codes, weight.scales, weight.global_scale, bias, weight.out_features, weight.in_features, weight.format)
    if x.is_cuda or INTERPRET:
        return fp4_linear_triton(*args, **kwargs)
    return reference_fp4_linear(*args)
