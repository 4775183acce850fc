"""FFT-chain (block-circulant) structured linear layers: the layer, its projection, and kernels.

    y = sum_k BC(C_k) . P_k x + bias

- `BC(C)` is block-circulant: (out/B) x (in/B) circulant blocks of size B x B; the first column of
  block (i, j) is `C[i, j]` (B numbers), so block (i, j) multiplies an input block by circular
  convolution with `C[i, j]`.
- `P_1` is the identity; `P_k` (k > 1) are fixed, seeded permutations of the input features.
- Sizes that B does not divide are zero-padded: the input to ceil(in/B)*B (the padded features
  are zeros), the output from ceil(out/B)*B rows cropped back to `out`. The padding is real work:
  the FFT and the contraction run on the padded sizes.

Parameters: K * ceil(out/B) * ceil(in/B) * B  (compression ~ B / K against a dense matrix).

Because the inverse FFT is linear, the K channels share one inverse transform:

    y_i = irfft( sum_k sum_j  C^_kij (.) rfft((P_k x)_j) )

so the K channels concatenate along the contraction dimension ("C = K * n_in") of one small
complex matrix product per frequency (F = B/2 + 1 frequencies).

Spectral layout used by the op and every kernel (written once here, shared by all):
    X^     (T, C, F)  complex spectrum of the permuted, padded input blocks;  c = k * n_in + j
    C^     (C, N, F)  spectral coefficients, given as two real planes coeff_real / coeff_imag
    Y^     (T, N, F)  output spectrum;  N = n_out
`spectral_coefficients(coeffs)` turns the trainable time-domain coefficients (K, N, n_in, B) into
those planes (differentiably).

Implementations (the op `graphopt::fft_chain_linear` chooses with the cost model, `impl="auto"`):
- "torch":  cuFFT rfft -> one batched complex matmul per frequency (torch.bmm, K folded into the
            contraction) -> cuFFT irfft. Needs permutes of the spectra around the bmm.
- "triton": cuFFT rfft -> `_fft_contract_kernel` (Triton) reading rfft's interleaved output and
            writing irfft's input layout directly (no permutes), fusing the K-channel sum ->
            cuFFT irfft.
- "dft":    the DFT as matrix products on tensor cores, fused: `_dft_forward_kernel` gathers the
            permutation, zero-pads and multiplies input blocks by the real DFT matrix (tl.dot);
            `_dft_contract_inverse_kernel` does the per-frequency contraction (FMA, K fused) and
            the inverse DFT as a second tl.dot, adding the bias and cropping in its epilogue.
            Two launches in all, the regime for few tokens.
            Caveat: the DFT is one dense B x F product per block (2*B*B flops per real block),
            not FlashFFTConv's b1*b2 Monarch factorization (which would cut it to ~4*B*(b1+b2));
            it therefore loses to cuFFT at many tokens, and the cost model says so.
Precision: the spectra are fp32 whatever the input dtype; tl.dot on fp32 runs as TF32 on GPUs
(~1e-3 relative error), the cuFFT paths are full fp32. On CPU the op always runs the torch
reference (any float dtype, float64 included).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn as nn

try:  # Triton is optional on CPU-only installs; the torch paths do not need it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

IMPLEMENTATIONS: tuple[str, ...] = ("torch", "triton", "dft")
IMPL_CHOICES: tuple[str, ...] = ("auto", *IMPLEMENTATIONS)


# =============================================================================================
# Shapes and helpers
# =============================================================================================
def chain_dims(in_features: int, out_features: int, block_size: int, k: int) -> dict[str, int]:
    """Derived sizes: n_in, n_out (blocks), F (frequencies), C = K * n_in (contraction length)."""
    n_in = -(-in_features // block_size)
    n_out = -(-out_features // block_size)
    return {"n_in": n_in, "n_out": n_out, "F": block_size // 2 + 1, "C": k * n_in, "N": n_out}


def make_permutations(in_features: int, k: int, seed: int = 0) -> torch.Tensor:
    """(K, in_features) int64: row 0 the identity (P_1 = I), rows 1.. seeded random permutations."""
    gen = torch.Generator().manual_seed(int(seed))
    rows = [torch.arange(in_features)]
    rows += [torch.randperm(in_features, generator=gen) for _ in range(k - 1)]
    return torch.stack(rows)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _complex_dtype(real: torch.dtype) -> torch.dtype:
    return torch.complex128 if real == torch.float64 else torch.complex64


def spectral_coefficients(coeffs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Time-domain coefficients (K, N, n_in, B) -> real and imaginary planes (K*n_in, N, F).

    Differentiable; the fft_linear pass folds it into constants for inference graphs.
    """
    k, n_out, n_in, _ = coeffs.shape
    work = coeffs if coeffs.dtype == torch.float64 else coeffs.float()
    spec = torch.fft.rfft(work, dim=-1)  # (K, N, n_in, F)
    spec = spec.permute(0, 2, 1, 3).reshape(k * n_in, n_out, spec.shape[-1])  # (C, N, F)
    return spec.real.contiguous(), spec.imag.contiguous()


def _permuted_blocks(x2d: torch.Tensor, perms: torch.Tensor, block_size: int, n_in: int) -> torch.Tensor:
    """x (T, in) -> (T, K, n_in * B): channel 0 = x, channel k = x[:, perms[k-1]], zero-padded."""
    channels = [x2d.unsqueeze(1)]
    if perms.shape[0]:
        channels.append(x2d[:, perms])  # (T, K-1, in)
    xk = torch.cat(channels, dim=1) if len(channels) > 1 else channels[0]
    pad = n_in * block_size - x2d.shape[-1]
    if pad:
        xk = torch.nn.functional.pad(xk, (0, pad))
    return xk


def _inverse_weights(block_size: int, freqs: int, dtype: torch.dtype, device) -> torch.Tensor:
    """w_f of irfft: 1 for DC (and Nyquist when B is even), 2 for the bins counted twice."""
    w = torch.full((freqs,), 2.0, dtype=dtype, device=device)
    w[0] = 1.0
    if block_size % 2 == 0:
        w[-1] = 1.0
    return w


# =============================================================================================
# References (plain torch)
# =============================================================================================
def reference_fft_chain(x: torch.Tensor, coeffs: torch.Tensor, perms: torch.Tensor, bias: torch.Tensor | None, block_size: int, out_features: int | None = None) -> torch.Tensor:
    """The layer from its time-domain coefficients (K, N, n_in, B) and ALL K permutations
    (K, in_features; row 0 the identity, applied like any other row). Plain torch rfft path."""
    k, n_out, n_in, b = coeffs.shape
    if b != block_size:
        raise ValueError(f"coeffs last dim {b} != block_size {block_size}")
    out_features = n_out * block_size if out_features is None else out_features
    dt = _compute_dtype(x)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(dt)
    xk = x2d[:, perms]  # (T, K, in)
    pad = n_in * block_size - x2d.shape[-1]
    if pad:
        xk = torch.nn.functional.pad(xk, (0, pad))
    xs = torch.fft.rfft(xk.reshape(x2d.shape[0], k, n_in, block_size), dim=-1)  # (T, K, n_in, F)
    cs = torch.fft.rfft(coeffs.to(dt), dim=-1)  # (K, N, n_in, F)
    ys = torch.einsum("tkjf,kijf->tif", xs, cs)  # (T, N, F)
    y = torch.fft.irfft(ys, n=block_size, dim=-1).reshape(x2d.shape[0], n_out * block_size)[:, :out_features]
    if bias is not None:
        y = y + bias.to(dt)
    return y.reshape(*lead, out_features).to(x.dtype)


def fft_chain_spectral_reference(x: torch.Tensor, coeff_real: torch.Tensor, coeff_imag: torch.Tensor, perms: torch.Tensor, bias: torch.Tensor | None, block_size: int, out_features: int) -> torch.Tensor:
    """The op's semantics from spectral planes (C, N, F) and the K-1 non-identity permutations
    (K-1, in_features). Plain torch: rfft -> einsum over c -> irfft. The op's CPU implementation."""
    dt = _compute_dtype(x)
    c_len, n_out, _ = coeff_real.shape
    k = perms.shape[0] + 1
    n_in = c_len // k
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(dt)
    xk = _permuted_blocks(x2d, perms, block_size, n_in)  # (T, K, n_in*B)
    xs = torch.fft.rfft(xk.reshape(x2d.shape[0], c_len, block_size), dim=-1)  # (T, C, F)
    cs = torch.complex(coeff_real.to(dt), coeff_imag.to(dt))  # (C, N, F)
    ys = torch.einsum("tcf,cnf->tnf", xs, cs)
    y = torch.fft.irfft(ys, n=block_size, dim=-1).reshape(x2d.shape[0], n_out * block_size)[:, :out_features]
    if bias is not None:
        y = y + bias.to(dt)
    return y.reshape(*lead, out_features).to(x.dtype)


def fft_chain_backward(grad_out: torch.Tensor, x: torch.Tensor, coeff_real: torch.Tensor, coeff_imag: torch.Tensor, perms: torch.Tensor, has_bias: bool, block_size: int):
    """Gradients of the op w.r.t. x, coeff_real, coeff_imag, bias, in plain torch (traceable).

    With G^ = (w_f / B) rfft(pad(g)) (the adjoint of irfft, w_f its bin weights):
        dC^ = sum_t conj(X^) G^,   dX^ = sum_n G^ conj(C^),   dx_blocks = B * irfft(dX^ / w_f)
    then crop the padding and scatter each channel back through its permutation.
    """
    dt = _compute_dtype(x)
    c_len, n_out, freqs = coeff_real.shape
    k = perms.shape[0] + 1
    n_in = c_len // k
    in_features = x.shape[-1]
    g2d = grad_out.reshape(-1, grad_out.shape[-1]).to(dt)
    x2d = x.reshape(-1, in_features).to(dt)
    t = x2d.shape[0]
    w = _inverse_weights(block_size, freqs, dt, x.device)
    g_pad = torch.nn.functional.pad(g2d, (0, n_out * block_size - g2d.shape[-1]))
    gs = torch.fft.rfft(g_pad.reshape(t, n_out, block_size), dim=-1) * (w / block_size)  # (T, N, F)
    xs = torch.fft.rfft(_permuted_blocks(x2d, perms, block_size, n_in).reshape(t, c_len, block_size), dim=-1)
    cs = torch.complex(coeff_real.to(dt), coeff_imag.to(dt))
    d_coeff = torch.einsum("tcf,tnf->cnf", xs.conj(), gs)
    d_xs = torch.einsum("tnf,cnf->tcf", gs, cs.conj())
    d_xk = (block_size * torch.fft.irfft(d_xs / w, n=block_size, dim=-1)).reshape(t, k, n_in * block_size)[..., :in_features]
    d_x = d_xk[:, 0].clone()
    if k > 1:
        d_x.index_add_(1, perms.reshape(-1), d_xk[:, 1:].reshape(t, -1))
    d_bias = g2d.sum(0).to(grad_out.dtype) if has_bias else None
    return (d_x.reshape(x.shape).to(x.dtype), d_coeff.real.to(coeff_real.dtype).contiguous(),
            d_coeff.imag.to(coeff_imag.dtype).contiguous(), d_bias)


# =============================================================================================
# The layer
# =============================================================================================
class FFTChainLinear(nn.Module):
    """y = sum_k BC(C_k) P_k x + bias, trained by autograd (see the module docstring).

    Parameters: `coeffs` (K, ceil(out/B), ceil(in/B), B), `bias` (out,). Buffer `perms` (K, in)
    int64 with row 0 the identity. The forward calls `torch.ops.graphopt.fft_chain_linear` with
    `impl="auto"`, so a Dynamo graph of this layer already holds the op; the fft_linear pass picks
    the implementation per call site and folds the coefficient spectrum into constants.
    """

    def __init__(self, in_features: int, out_features: int, block_size: int = 512, k: int = 1, bias: bool = True, seed: int = 0, *, device=None, dtype=None):
        super().__init__()
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        if k < 1:
            raise ValueError(f"k (number of FFT channels) must be >= 1, got {k}")
        self.in_features, self.out_features, self.block_size, self.k, self.seed = in_features, out_features, block_size, k, seed
        dims = chain_dims(in_features, out_features, block_size, k)
        self.n_in, self.n_out = dims["n_in"], dims["n_out"]
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.coeffs = nn.Parameter(torch.empty(k, self.n_out, self.n_in, block_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.register_buffer("perms", make_permutations(in_features, k, seed).to(device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Each output sums K * in_features products, like a dense layer of fan-in K*in.
        bound = 1.0 / math.sqrt(self.k * self.in_features)
        nn.init.uniform_(self.coeffs, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1.0 / math.sqrt(self.in_features), 1.0 / math.sqrt(self.in_features))

    @property
    def compression(self) -> float:
        """Dense parameters / FFT-chain parameters (weights only)."""
        return self.in_features * self.out_features / self.coeffs.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coeff_real, coeff_imag = spectral_coefficients(self.coeffs)
        return torch.ops.graphopt.fft_chain_linear(x, coeff_real, coeff_imag, self.perms[1:], self.bias,
                                                   self.block_size, self.out_features, "auto")

    @torch.no_grad()
    def to_dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The equivalent dense weight (out, in), materialized by applying the layer to the identity."""
        eye = torch.eye(self.in_features, dtype=dtype, device=self.coeffs.device)
        return reference_fft_chain(eye, self.coeffs.to(dtype), self.perms, None, self.block_size, self.out_features).t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
                f"k={self.k}, bias={self.bias is not None}, compression={self.compression:.1f}x")


def block_circulant_dense(coeffs: torch.Tensor, in_features: int | None = None, out_features: int | None = None) -> torch.Tensor:
    """BC(C) as a dense (out, in) matrix from coeffs (N, n_in, B), built explicitly (no FFT)."""
    n_out, n_in, b = coeffs.shape
    r = torch.arange(b, device=coeffs.device)
    idx = (r[:, None] - r[None, :]) % b  # circulant: M[r, s] = c[(r - s) mod B]
    blocks = coeffs[:, :, idx]  # (N, n_in, B, B)
    dense = blocks.permute(0, 2, 1, 3).reshape(n_out * b, n_in * b)
    return dense[: out_features or n_out * b, : in_features or n_in * b]


# =============================================================================================
# Projection of a dense matrix
# =============================================================================================
def _fit_block_circulant(target: torch.Tensor, mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Least-squares block-circulant fit of `target` (out_p, in_p) on the entries where mask = 1:
    each coefficient is the mean of its wrapped diagonal (r - s = d mod B) within each block."""
    out_p, in_p = target.shape
    n_out, n_in, b = out_p // block_size, in_p // block_size, block_size
    blocks = (target * mask).reshape(n_out, b, n_in, b).permute(0, 2, 1, 3)  # (N, n_in, B_r, B_s)
    weights = mask.reshape(n_out, b, n_in, b).permute(0, 2, 1, 3)
    r = torch.arange(b, device=target.device)
    # diagonal d holds (r, s = r - d mod B): gather column s for each row r
    cols = (r[None, :] - r[:, None]) % b  # (d, r) -> s
    sums = torch.gather(blocks, 3, cols.T.expand(n_out, n_in, b, b)).sum(2)  # (N, n_in, d) after sum over r
    counts = torch.gather(weights, 3, cols.T.expand(n_out, n_in, b, b)).sum(2)
    return sums / counts.clamp_min(1)


@torch.no_grad()
def project_dense(weight: torch.Tensor, block_size: int, k: int = 1, bias: torch.Tensor | None = None, seed: int = 0) -> FFTChainLinear:
    """A fitted FFTChainLinear for a dense weight (out, in).

    K = 1: the least-squares block-circulant (the mean of each wrapped diagonal of each B x B
    block, over the entries inside the unpadded matrix). K > 1: greedy residual fitting; channel k
    is the least-squares fit of BC(C_k) P_k to the residual R, i.e. the block-circulant fit of
    R P_k^T (R with its columns permuted by P_k), in closed form, after which R -= BC(C_k) P_k.
    Each step can only lower the residual, so the error does not increase with K.
    """
    out_features, in_features = weight.shape
    layer = FFTChainLinear(in_features, out_features, block_size, k, bias=bias is not None, seed=seed, device=weight.device)
    w = weight.double()
    dims = chain_dims(in_features, out_features, block_size, k)
    out_p, in_p = dims["n_out"] * block_size, dims["n_in"] * block_size
    residual = torch.zeros(out_p, in_p, dtype=torch.float64, device=weight.device)
    residual[:out_features, :in_features] = w
    mask = torch.zeros_like(residual)
    mask[:out_features, :in_features] = 1.0
    perms = layer.perms.to(weight.device)
    coeffs = []
    for channel in range(k):
        perm = torch.cat([perms[channel], torch.arange(in_features, in_p, device=weight.device)])
        permuted = residual[:, perm]  # R P^T: column a of the fit multiplies (P x)_a = x[perm[a]]
        c = _fit_block_circulant(permuted, mask, block_size)  # (N, n_in, B)
        fitted = block_circulant_dense(c) * mask  # BC(C) restricted to the real entries
        back = torch.empty_like(fitted)
        back[:, perm] = fitted  # BC(C) P
        residual = residual - back
        coeffs.append(c)
    layer.coeffs.copy_(torch.stack(coeffs).to(layer.coeffs.dtype))
    if bias is not None:
        layer.bias.copy_(bias)
    return layer


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F in float64."""
    exact = exact.double()
    return float(torch.linalg.norm(approx.double() - exact) / torch.linalg.norm(exact).clamp_min(1e-300))


# =============================================================================================
# Cost model (family "fft_chain")
# =============================================================================================
def _fft_flops(length: int, transforms: float) -> float:
    """Real FFT of `length`: ~2.5 N log2 N flops (half a complex FFT's 5 N log2 N)."""
    return 2.5 * length * math.log2(max(length, 2)) * transforms


def estimate_fft_chain(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, impl: str, *, dtype_bytes: int = 2, bias: bool = True):
    """Predicted time of one implementation (see IMPLEMENTATIONS) on hardware `hw`.

    Counts, per kernel: FLOPs of the transforms and the contraction (complex multiply-add = 8
    real flops), and the bytes of activations in/out (dtype_bytes), fp32 spectra (8 bytes per
    complex) written and read once, coefficients (8 bytes per complex), gathers and pads.
    """
    from graphopt.cost_model import chain, roofline

    d = chain_dims(in_features, out_features, block_size, k)
    t, c, n, f, b = tokens, d["C"], d["N"], d["F"], block_size
    in_p, out_p = d["n_in"] * b, n * b
    x_bytes, y_bytes = dtype_bytes * t * in_features, dtype_bytes * t * out_features
    xspec, yspec, cspec = 8.0 * t * c * f, 8.0 * t * n * f, 8.0 * c * n * f
    contract_flops = 8.0 * t * c * n * f
    parts = []

    def add(name, flops=0.0, moved=0.0, launches=1, family="fft_chain", unit="fp32"):
        parts.append(roofline(hw, name, flops=flops, bytes_moved=moved, launches=launches, family=family, unit=unit))

    if impl in ("torch", "triton"):
        # cast + gather + pad into one fp32 (T, K, in_p) buffer (1 launch per step present)
        prep_launches = 1 + (k > 1) + (in_p != in_features)
        add("gather/pad", moved=x_bytes + 4.0 * t * k * in_p * prep_launches, launches=prep_launches, family="pointwise")
        add("rfft", flops=_fft_flops(b, t * c), moved=4.0 * t * c * b + xspec)
        if impl == "torch":
            add("permute X", moved=2 * xspec, family="pointwise")
            add("coeff complex+permute", moved=2 * 2 * cspec, launches=2, family="pointwise")
            add("complex bmm", flops=contract_flops, moved=xspec + cspec + yspec)
            add("permute Y", moved=2 * yspec, family="pointwise")
        else:
            add("triton contraction", flops=contract_flops, moved=xspec + cspec + yspec)
        add("irfft", flops=_fft_flops(b, t * n), moved=yspec + 4.0 * t * out_p)
        add("crop+bias+cast", moved=4.0 * t * out_features + y_bytes + (dtype_bytes * out_features if bias else 0), family="pointwise")
    elif impl == "dft":
        # tl.dot on fp32 runs as TF32: half the bf16 tensor-core rate, so count its flops twice.
        tp = max(t, 16)  # tl.dot tiles are at least 16 tokens tall
        fwd_flops = 2.0 * tp * c * b * 2 * f
        add("dft forward (tl.dot)", flops=2 * fwd_flops, moved=x_bytes + 8.0 * b * f + xspec, unit="matrix")
        r_tiles = max(1, b // _DFT_BLOCK_R)
        inv_flops = 2.0 * tp * n * 2 * f * b
        add("contract+inverse (tl.dot)", flops=2 * inv_flops, moved=xspec * 1.0 + cspec + 8.0 * f * b + y_bytes, unit="matrix")
        add("contract (FMA)", flops=contract_flops * r_tiles, launches=0)
    else:
        raise ValueError(f"unknown fft_chain implementation {impl!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
    return chain(f"fft_chain[{impl}] B={b} K={k}", *parts)


def available_implementations(device_type: str) -> tuple[str, ...]:
    """Implementations that run on a device type ("cuda" needs Triton for the Triton ones)."""
    if device_type == "cuda":
        return IMPLEMENTATIONS if HAS_TRITON else ("torch",)
    return ("torch",)


def choose_implementation(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, *, device_type: str = "cuda", dtype_bytes: int = 2, bias: bool = True):
    """(name, Estimate) of the implementation the cost model predicts fastest."""
    best = None
    for impl in available_implementations(device_type):
        est = estimate_fft_chain(hw, tokens, in_features, out_features, block_size, k, impl, dtype_bytes=dtype_bytes, bias=bias)
        if best is None or est.ms < best[1].ms:
            best = (impl, est)
    return best


# =============================================================================================
# Triton kernels
# =============================================================================================
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DFT_BLOCK_R = 256  # output columns per program of the fused kernel (contraction redone per tile)

if HAS_TRITON:

    def _configs(options: list[dict], warps: list[int]) -> list:
        if _INTERPRET:  # the interpreter runs every config: keep one
            options, warps = options[:1], warps[:1]
        return [triton.Config(o, num_warps=w) for o in options for w in warps]

    # -----------------------------------------------------------------------------------------
    # Candidate 2: per-frequency contraction on rfft's own layout, K channels fused.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_F": 32}, {"BLOCK_T": 8, "BLOCK_N": 8, "BLOCK_F": 32},
                          {"BLOCK_T": 32, "BLOCK_N": 4, "BLOCK_F": 16}, {"BLOCK_T": 4, "BLOCK_N": 8, "BLOCK_F": 64}], [4]),
        key=["T_BUCKET", "C", "N", "F"],
    )
    @triton.jit
    def _fft_contract_kernel(
        x_ptr,  # (T, C, F, 2) fp32: view_as_real of rfft's output
        cr_ptr, ci_ptr,  # (C, N, F) fp32 planes
        y_ptr,  # (T, N, F, 2) fp32: view_as_real of irfft's input
        T, C, N, F, T_BUCKET,
        stride_xt, stride_xc, stride_yt, stride_yn,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
    ):
        pid_f, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_tf = (offs_t[:, None] < T) & (offs_f[None, :] < F)  # (BT, BF)
        mask_nf = (offs_n[:, None] < N) & (offs_f[None, :] < F)  # (BN, BF)
        acc_r = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_F), dtype=tl.float32)
        acc_i = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_F), dtype=tl.float32)
        x_base = x_ptr + offs_t[:, None] * stride_xt + offs_f[None, :] * 2
        c_base = offs_n[:, None] * F + offs_f[None, :]
        for c in range(0, C):
            xr = tl.load(x_base + c * stride_xc, mask=mask_tf, other=0.0)  # (BT, BF)
            xi = tl.load(x_base + c * stride_xc + 1, mask=mask_tf, other=0.0)
            wr = tl.load(cr_ptr + c * N * F + c_base, mask=mask_nf, other=0.0)  # (BN, BF)
            wi = tl.load(ci_ptr + c * N * F + c_base, mask=mask_nf, other=0.0)
            xr3, xi3 = xr[:, None, :], xi[:, None, :]
            wr3, wi3 = wr[None, :, :], wi[None, :, :]
            acc_r += xr3 * wr3 - xi3 * wi3
            acc_i += xr3 * wi3 + xi3 * wr3
        y_off = offs_t[:, None, None] * stride_yt + offs_n[None, :, None] * stride_yn + offs_f[None, None, :] * 2
        y_mask = (offs_t[:, None, None] < T) & (offs_n[None, :, None] < N) & (offs_f[None, None, :] < F)
        tl.store(y_ptr + y_off, acc_r, mask=y_mask)
        tl.store(y_ptr + y_off + 1, acc_i, mask=y_mask)

    # -----------------------------------------------------------------------------------------
    # Candidate 3a: gather + zero-pad + forward real DFT as a tensor-core product.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_F": 64, "BLOCK_B": 64}, {"BLOCK_T": 64, "BLOCK_F": 64, "BLOCK_B": 32},
                          {"BLOCK_T": 128, "BLOCK_F": 64, "BLOCK_B": 32}, {"BLOCK_T": 64, "BLOCK_F": 128, "BLOCK_B": 32}], [4]),
        key=["T_BUCKET", "C", "F", "B"],
    )
    @triton.jit
    def _dft_forward_kernel(
        x_ptr,  # (T, IN) any float dtype
        perm_ptr,  # (K-1, IN) int64
        cos_ptr, nsin_ptr,  # (B, F) fp32: cos(2 pi f n / B), -sin(2 pi f n / B)
        xr_ptr, xi_ptr,  # (T, C, F) fp32 planes out
        T, IN, C, NIN, F, B, T_BUCKET, stride_xt,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr,
    ):
        pid_f, ch, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        k = ch // NIN
        j = ch % NIN
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        acc_r = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
        acc_i = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
        for b0 in range(0, B, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            pos = j * B + offs_b  # position in the permuted, padded input
            valid = (pos < IN) & (offs_b < B)
            use_perm = (pos * 0 + k) > 0  # channel 0 is the identity: no permutation row
            permuted = tl.load(perm_ptr + (k - 1) * IN + pos, mask=valid & use_perm, other=0)
            src = tl.where(use_perm, permuted, pos)
            xt = tl.load(x_ptr + offs_t[:, None] * stride_xt + src[None, :],
                         mask=(offs_t[:, None] < T) & valid[None, :], other=0.0).to(tl.float32)  # (BT, BB)
            t_mask = (offs_b[:, None] < B) & (offs_f[None, :] < F)
            cos_t = tl.load(cos_ptr + offs_b[:, None] * F + offs_f[None, :], mask=t_mask, other=0.0)  # (BB, BF)
            sin_t = tl.load(nsin_ptr + offs_b[:, None] * F + offs_f[None, :], mask=t_mask, other=0.0)
            acc_r += tl.dot(xt, cos_t)
            acc_i += tl.dot(xt, sin_t)
        out = offs_t[:, None] * (C * F) + ch * F + offs_f[None, :]
        out_mask = (offs_t[:, None] < T) & (offs_f[None, :] < F)
        tl.store(xr_ptr + out, acc_r, mask=out_mask)
        tl.store(xi_ptr + out, acc_i, mask=out_mask)

    # -----------------------------------------------------------------------------------------
    # Candidate 3b: contraction (K fused, FMA) + inverse real DFT (tl.dot) + bias + crop.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_F": 32, "BLOCK_R": _DFT_BLOCK_R}, {"BLOCK_T": 32, "BLOCK_F": 32, "BLOCK_R": _DFT_BLOCK_R},
                          {"BLOCK_T": 64, "BLOCK_F": 16, "BLOCK_R": _DFT_BLOCK_R}], [4, 8]),
        key=["T_BUCKET", "C", "N", "F", "B"],
    )
    @triton.jit
    def _dft_contract_inverse_kernel(
        xr_ptr, xi_ptr,  # (T, C, F) fp32
        cr_ptr, ci_ptr,  # (C, N, F) fp32
        icos_ptr, isin_ptr,  # (F, B) fp32: w_f cos(2 pi f r / B) / B, -w_f sin(2 pi f r / B) / B
        bias_ptr,  # (OUT,) or dummy
        y_ptr,  # (T, OUT) output dtype
        T, C, N, F, B, OUT, T_BUCKET, stride_yt,
        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        pid_r, i, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask_tf = (offs_t[:, None] < T) & (offs_f[None, :] < F)
            x_off = offs_t[:, None] * (C * F) + offs_f[None, :]
            yr = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
            yi = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
            for c in range(0, C):
                xr = tl.load(xr_ptr + x_off + c * F, mask=mask_tf, other=0.0)  # (BT, BF)
                xi = tl.load(xi_ptr + x_off + c * F, mask=mask_tf, other=0.0)
                wr = tl.load(cr_ptr + (c * N + i) * F + offs_f, mask=offs_f < F, other=0.0)[None, :]  # (1, BF)
                wi = tl.load(ci_ptr + (c * N + i) * F + offs_f, mask=offs_f < F, other=0.0)[None, :]
                yr += xr * wr - xi * wi
                yi += xr * wi + xi * wr
            g_mask = (offs_f[:, None] < F) & (offs_r[None, :] < B)
            g_off = offs_f[:, None] * B + offs_r[None, :]
            gr = tl.load(icos_ptr + g_off, mask=g_mask, other=0.0)  # (BF, BR)
            gi = tl.load(isin_ptr + g_off, mask=g_mask, other=0.0)
            acc += tl.dot(yr, gr)
            acc += tl.dot(yi, gi)
        cols = i * B + offs_r
        col_mask = (offs_r < B) & (cols < OUT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        y_mask = (offs_t[:, None] < T) & col_mask[None, :]
        tl.store(y_ptr + offs_t[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# =============================================================================================
# Launchers
# =============================================================================================
def _t_bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


@functools.lru_cache(maxsize=32)
def _dft_tables(block_size: int, device: str) -> tuple[torch.Tensor, ...]:
    """Forward (B, F) cos / -sin and inverse (F, B) irfft matrices, fp32, built in float64."""
    freqs = block_size // 2 + 1
    n = torch.arange(block_size, dtype=torch.float64)
    f = torch.arange(freqs, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(n, f) / block_size  # (B, F)
    w = _inverse_weights(block_size, freqs, torch.float64, "cpu")
    fwd_cos, fwd_nsin = torch.cos(angle), -torch.sin(angle)
    inv_cos = (w[:, None] * torch.cos(angle.T)) / block_size  # (F, B)
    inv_nsin = -(w[:, None] * torch.sin(angle.T)) / block_size
    return tuple(t.float().contiguous().to(device) for t in (fwd_cos, fwd_nsin, inv_cos, inv_nsin))


def _check_inputs(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl):
    if impl not in IMPL_CHOICES:
        raise ValueError(f"unknown fft_chain impl {impl!r}; valid choices: {', '.join(IMPL_CHOICES)}")
    if coeff_real.shape != coeff_imag.shape or coeff_real.dim() != 3:
        raise ValueError(f"coeff_real/coeff_imag must both be (C, N, F); got {tuple(coeff_real.shape)} and {tuple(coeff_imag.shape)}")
    c_len, n_out, freqs = coeff_real.shape
    if freqs != block_size // 2 + 1:
        raise ValueError(f"coefficients have {freqs} frequencies; block_size {block_size} needs {block_size // 2 + 1}")
    in_features = x.shape[-1]
    k = perms.shape[0] + 1
    if perms.dim() != 2 or (perms.shape[0] and perms.shape[1] != in_features):
        raise ValueError(f"perms must be (K-1, in_features={in_features}) int64, got {tuple(perms.shape)}")
    if c_len != k * (-(-in_features // block_size)):
        raise ValueError(f"coefficients have C={c_len} but K={k} channels x ceil({in_features}/{block_size}) blocks = {k * -(-in_features // block_size)}")
    if n_out * block_size < out_features or (n_out - 1) * block_size >= out_features:
        raise ValueError(f"coefficients have {n_out} output blocks of {block_size}; out_features {out_features} needs {-(-out_features // block_size)}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be ({out_features},), got {tuple(bias.shape)}")


def fft_chain_torch(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 1: rfft -> per-frequency complex bmm (K in the contraction) -> irfft."""
    t, c_len, n_out = x2d.shape[0], coeff_real.shape[0], coeff_real.shape[1]
    dt = _compute_dtype(x2d)
    xk = _permuted_blocks(x2d.to(dt), perms, block_size, c_len // (perms.shape[0] + 1))
    xs = torch.fft.rfft(xk.reshape(t, c_len, block_size), dim=-1)  # (T, C, F)
    cs = torch.complex(coeff_real.to(dt), coeff_imag.to(dt)).permute(2, 0, 1)  # (F, C, N)
    ys = torch.bmm(xs.permute(2, 0, 1), cs)  # (F, T, N)
    y = torch.fft.irfft(ys.permute(1, 2, 0), n=block_size, dim=-1).reshape(t, n_out * block_size)[:, :out_features]
    y = y + bias.to(dt) if bias is not None else y
    return y.to(x2d.dtype)


def fft_chain_triton(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 2: rfft -> Triton contraction on rfft's layout (no permutes) -> irfft."""
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' needs Triton; valid choices without it: torch")
    t, (c_len, n_out, freqs) = x2d.shape[0], coeff_real.shape
    xk = _permuted_blocks(x2d.float(), perms, block_size, c_len // (perms.shape[0] + 1))
    xs = torch.view_as_real(torch.fft.rfft(xk.reshape(t, c_len, block_size), dim=-1))  # (T, C, F, 2)
    ys = torch.empty(t, n_out, freqs, 2, device=x2d.device, dtype=torch.float32)  # (T, N, F, 2)
    cr, ci = coeff_real.float().contiguous(), coeff_imag.float().contiguous()

    def grid(meta):
        return (triton.cdiv(freqs, meta["BLOCK_F"]), triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(t, meta["BLOCK_T"]))

    _fft_contract_kernel[grid](xs, cr, ci, ys, t, c_len, n_out, freqs, _t_bucket(t),
                               xs.stride(0), xs.stride(1), ys.stride(0), ys.stride(1))
    y = torch.fft.irfft(torch.view_as_complex(ys), n=block_size, dim=-1).reshape(t, n_out * block_size)[:, :out_features]
    y = y + bias.float() if bias is not None else y
    return y.to(x2d.dtype)


def fft_chain_dft(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 3: fused gather + DFT (tl.dot) kernel, then fused contraction + inverse DFT kernel."""
    if not HAS_TRITON:
        raise RuntimeError("impl='dft' needs Triton; valid choices without it: torch")
    x2d = x2d.contiguous()
    t, in_features = x2d.shape
    c_len, n_out, freqs = coeff_real.shape
    n_in = c_len // (perms.shape[0] + 1)
    fwd_cos, fwd_nsin, inv_cos, inv_nsin = _dft_tables(block_size, str(x2d.device))
    perm_arg = perms.contiguous() if perms.shape[0] else torch.zeros(1, dtype=torch.int64, device=x2d.device)
    xr = torch.empty(t, c_len, freqs, device=x2d.device, dtype=torch.float32)  # (T, C, F)
    xi = torch.empty_like(xr)
    bucket = _t_bucket(t)

    def grid_fwd(meta):
        return (triton.cdiv(freqs, meta["BLOCK_F"]), c_len, triton.cdiv(t, meta["BLOCK_T"]))

    _dft_forward_kernel[grid_fwd](x2d, perm_arg, fwd_cos, fwd_nsin, xr, xi, t, in_features, c_len, n_in, freqs,
                                  block_size, bucket, x2d.stride(0))
    y = torch.empty(t, out_features, device=x2d.device, dtype=x2d.dtype)
    cr, ci = coeff_real.float().contiguous(), coeff_imag.float().contiguous()
    bias_arg = bias.contiguous() if bias is not None else cr

    def grid_inv(meta):
        return (triton.cdiv(block_size, meta["BLOCK_R"]), n_out, triton.cdiv(t, meta["BLOCK_T"]))

    _dft_contract_inverse_kernel[grid_inv](xr, xi, cr, ci, inv_cos, inv_nsin, bias_arg, y, t, c_len, n_out, freqs,
                                           block_size, out_features, bucket, y.stride(0), HAS_BIAS=bias is not None)
    return y


_LAUNCHERS = {"torch": fft_chain_torch, "triton": fft_chain_triton, "dft": fft_chain_dft}


@functools.lru_cache(maxsize=1)
def _device_spec():
    from graphopt.hardware import get_spec

    return get_spec("auto")


def fft_chain_linear(x, coeff_real, coeff_imag, perms, bias, block_size: int, out_features: int, impl: str = "auto"):
    """Run the layer with one implementation ("auto": the cost model's choice for this shape).
    x (..., in) -> (..., out_features). On CPU every implementation name runs the torch path."""
    _check_inputs(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl)
    if not x.is_cuda:  # CPU: the torch reference (the Triton launchers are tested directly)
        return fft_chain_spectral_reference(x, coeff_real, coeff_imag, perms, bias, block_size, out_features)
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, in_features)
    if impl == "auto":
        impl = "torch"
        if x.is_cuda:
            k = perms.shape[0] + 1
            impl, _ = choose_implementation(_device_spec(), x2d.shape[0], in_features, out_features, block_size, k,
                                            device_type="cuda", dtype_bytes=x.element_size(), bias=bias is not None)
    y = _LAUNCHERS[impl](x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features)
    return y.reshape(*lead, out_features)
