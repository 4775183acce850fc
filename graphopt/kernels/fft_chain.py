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
- "dft":    the real DFT as square B x B matrix products on tensor cores, on the packed
            ("halfcomplex") spectrum of B reals per block (Re X_0..Re X_{B/2-1}, then Re X_{B/2}
            in the slot of the always-zero Im X_0, then Im X_1..Im X_{B/2-1}); even B only.
            Three launches: `_dft_forward_kernel` gathers P_k, zero-pads and runs the GEMM
            (T*C, B) x (B, B); `_packed_contract_kernel` does the per-frequency complex
            contraction (FMA, K fused in c, channel loop unrolled); `_dft_inverse_kernel` runs the
            GEMM (T*N, B) x (B, B) with bias, crop and cast in its epilogue. Measured on an H200
            (fft_chain_h200.json, CUDA graph): faster than cuBLAS only at ~16 tokens on 5120->13824 B=512 K=2
            (1.22x); 0.59x on 13824->5120 (its contraction loops over 4x more channels); at 256
            and 4096 tokens 0.31-0.64x. The DFT costs 2*B*B flops per block (vs ~2.5 B log2 B for
            an FFT) and its kernels are latency-bound (see the cost-model constants).
            Caveat: not FlashFFTConv's b1*b2 factorization, which would cut the DFT flops further.
- "dft2":   the dft pipeline rebuilt for latency at few tokens (3 launches). Spectra are stored
            frequency-major, XS^T (B, T*C) and YS^T (B, T*N), so one frequency over all tokens and
            channels is a contiguous (T, C) matrix. `_dft2_forward_kernel` gathers P_k through a
            cached int32 source table (its next tile loaded one K step ahead, the zero padding a
            positional mask) with skinny-M configs; `_spectral_mma_contract_kernel` does the
            contraction as tensor-core matmuls per frequency, [Yr|Yi] = Xr @ G[q,0] + Xi @ G[q,1],
            with G (Q, 2, CP, 2NP) built once per coefficient tensor (cached); every load of a
            program is independent, so they are in flight together; `_dft2_inverse_kernel` reads
            YS^T as its transposed A operand and adds bias, crops and casts.
- "dft2_pregather": as dft2, but one Triton gather launch materializes P x (T, C*B) first (one
            more launch when K > 1; each token's row is staged on chip and gathered there by
            tl.gather) and the forward kernel is a plain GEMM. Measured on an H100
            (CUDA graph, B=512 K=2, bench/results/fft_chain_h100.json): 3.3-3.5x cuBLAS at 16
            tokens on both target shapes, 3.8x at 1 token, 1.63x / 1.15x at 256 tokens.
            The cost-model constants DFT2_* are fitted to an H100 sweep (see below).
Precision: the cuFFT paths are full fp32. The dft path keeps 16-bit inputs in their dtype for
the DFT operands and the stored spectra (fp32 accumulation, fp32 coefficients): for bf16 (and fp16, run
in bf16 for range) about twice the relative error of rounding the output to bf16 (3.4e-3 vs 1.7e-3 on 5120->13824, B=512,
K=2); fp32 inputs run the GEMMs as TF32 (~1e-3). dft2 adds its TF32 contraction (fp32 coefficients,
bf16/fp32 spectra; see DFT2_COEFF_DTYPE): in the CPU interpreter fp32 inputs match float64 to ~2e-7,
16-bit inputs stay within the same few-roundings bound as dft (tests). On CPU the op always runs
the torch reference (any float dtype, float64 included).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn as nn

from graphopt.hardware import device_spec
from graphopt.kernels.launch import INTERPRET as _INTERPRET  # fixed at import, as Triton reads it

try:  # Triton is optional on CPU-only installs; the torch paths do not need it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

IMPLEMENTATIONS: tuple[str, ...] = ("torch", "triton", "dft", "dft2", "dft2_pregather")
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
    # contiguous before .real/.imag: with K=1 the reshape is a strided view, and Inductor (torch
    # 2.13) took the real/imag planes of that complex view wrongly in the backward graph (input
    # gradients off by more than their norm); eager and aot_eager were right
    spec = spec.permute(0, 2, 1, 3).reshape(k * n_in, n_out, spec.shape[-1]).contiguous()  # (C, N, F)
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
    if t == 0:  # no tokens (MKL's FFT refuses an empty batch): zero gradients
        d_bias = grad_out.new_zeros(grad_out.shape[-1]) if has_bias else None
        return x.new_zeros(x.shape), torch.zeros_like(coeff_real), torch.zeros_like(coeff_imag), d_bias
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
# A physical roofline per kernel launch, as replayed from a CUDA graph. Five constants, fitted
# (least squares on log time) to the H200 timings of the current kernels
# (bench/results/fft_chain_h200.json: torch/triton/dft at B=512 K=2, 16/256/4096 tokens;
# fft_chain_h200.log: 48 explore-fft dft rows, B=256-2048, K=2-16; the torch/triton rows
# of fft_chain_torch_triton_h200.json and explore_fft_h200/), with the measured ceilings
# 690 TFLOP/s, 4.22 TB/s, 6 us launch. Every prediction is within 0.7-1.6x of its timing and
# faster/slower than cuBLAS agrees on 97/99 rows (both misses are dft wins predicted as losses).
#  - LAUNCH_FRACTION_IN_GRAPH = 0.33: a kernel node replayed from a CUDA graph costs ~2 us (0.33
#    of the eager launch overhead); the 16-token torch path (12 nodes) measures 0.033-0.036 ms;
#  - cuFFT and the torch copies/casts stream at the "pointwise" family's memory efficiency;
#  - FMA_EFFICIENCY = 0.8: fraction of the fp32 CUDA-core peak reached by the complex
#    contractions (cuBLAS cgemm per frequency, our Triton FMA kernels) where they are
#    throughput-bound (4096 tokens);
#  - SERIAL_STEP_S = 0.56 us: one channel step of _fft_contract_kernel's loop (a dependent
#    global-load round trip); a program that loops C times cannot finish faster than C steps,
#    times the number of waves of programs;
#  - DFT_CONTRACT_STEP_S = 3.3 us: one step (4 channels, unrolled) of _packed_contract_kernel.
#    It is what makes the dft path slow at 16 tokens (13824->5120: 14 steps, 0.068 ms measured;
#    0.023 ms predicted without this term);
#  - DFT_GEMM_STEP_S = 1.7 us: one 64-wide K step of the DFT GEMMs (the forward's permutation
#    gather is a dependent load). The dft GEMMs are latency-bound at every measured shape (B*B
#    per block at 69 TFLOP/s or less), so the "fft_chain" family's tensor-core efficiency never
#    binds in these rows and stays unfitted.
# Where the FFT chain wins on an H200 (CUDA graph, bf16, vs cuBLAS): only at ~16 tokens, by
# 1.1-1.2x (dft on 5120->13824 B=512 K=2; torch on both shapes at B=512 K=2). At 256 and 4096
# tokens every implementation measured 0.31-0.64x cuBLAS. Without a CUDA graph (eager launches)
# the torch/triton paths are 2.4-3x slower than cuBLAS even at 16 tokens: not modelled here.
LAUNCH_FRACTION_IN_GRAPH = 0.33
FMA_EFFICIENCY = 0.8
SERIAL_STEP_S = 0.56e-6
DFT_CONTRACT_STEP_S = 3.3e-6
DFT_GEMM_STEP_S = 1.7e-6
PROGRAMS_PER_SM = 4  # resident 4-warp programs per SM assumed for the wave count
# dft2 / dft2_pregather, fitted on an H100 (bench/fit_fft_cost_model.py on
# bench/results/fft_fit_sweep_h100.json: every implementation at the explorer's --quick
# configurations, CUDA graph, torch 2.11, triton 3.6): per program, one load round trip plus
# epilogue (DFT2_LATENCY_S), plus one pipelined 64-wide K step per DFT2_GEMM_STEP_S, plus one
# (frequency, 64-channel chunk) pair of tensor-core dots per DFT2_CONTRACT_STEP_S; dft2's in-kernel
# gather adds DFT2_GATHER_STEP_S (a dependent index -> element load) to each K step and makes its
# forward GEMM run at DFT2_INKERNEL_GATHER_MATRIX_FRACTION of the matrix ceiling. On the sweep the
# implementation the model picks is on average 0.8% slower than the fastest measured one (2 of 46
# configurations more than 5% off; without the gather step term: 2.7%, 5 configurations).
# The staged gather of dft2_pregather streams its bytes (row, gathered columns, one index per
# column) at DFT2_GATHER_MEMORY_EFFICIENCY of the memory ceiling: 0.6 from the autotuned kernel's
# profile (bench/results/fft_chain_h100.json: 20.7 us on 13824->5120 and 6.9 us on
# 5120->13824 at 256 tokens, B=512 K=2). Predicted vs
# measured: dft2 0.79-1.42x (median 1.05), dft2_pregather 0.9-1.4x. With these constants and the
# dense model's partial-overlap term (cost_model.GEMM_PARTIAL_OVERLAP), the explorer's --quick run
# on an H100 agreed on faster/slower for 315/336 rows (bench/results/explore_fft_h100/).
DFT2_LATENCY_S = 1.0e-6
DFT2_GEMM_STEP_S = 0.3e-6
DFT2_CONTRACT_STEP_S = 0.2e-6
DFT2_GATHER_MEMORY_EFFICIENCY = 0.6
DFT2_GATHER_STEP_S = 1.0e-6
DFT2_INKERNEL_GATHER_MATRIX_FRACTION = 0.12


def _fft_flops(length: int, transforms: float) -> float:
    """Real FFT of `length`: ~2.5 N log2 N flops (half a complex FFT's 5 N log2 N)."""
    return 2.5 * length * math.log2(max(length, 2)) * transforms


def _serial_bound_s(hw, programs: int, steps: int, step_s: float | None = None) -> float:
    """Latency floor of a Triton kernel: waves of programs, each `steps` dependent steps of `step_s`."""
    waves = -(-programs // max(1, hw.sm_count * PROGRAMS_PER_SM))
    return waves * steps * (SERIAL_STEP_S if step_s is None else step_s)


def estimate_fft_chain(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, impl: str, *, dtype_bytes: int = 2, bias: bool = True):
    """Predicted time of one implementation (see IMPLEMENTATIONS) on hardware `hw`, as run in a
    CUDA graph. Each kernel launch is listed with its FLOPs and its DRAM bytes: activations in/out
    (dtype_bytes), fp32 intermediates (4 bytes, 8 per complex), copies that torch inserts
    (C2R inputs are cloned, bmm operands made contiguous), the coefficient spectra; Triton loops
    also get their serial-latency floor (see the constants above)."""
    from graphopt.cost_model import Estimate, chain, roofline

    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown fft_chain implementation {impl!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
    d = chain_dims(in_features, out_features, block_size, k)
    t, c, n, f, b = tokens, d["C"], d["N"], d["F"], block_size
    in_p, out_p = d["n_in"] * b, n * b
    db = dtype_bytes
    launch_s = hw.launch_overhead * (LAUNCH_FRACTION_IN_GRAPH if hw.is_gpu else 1.0)
    parts = []

    def add(name, flops=0.0, moved=0.0, family="pointwise", unit="fp32", serial_s=0.0):
        est = roofline(hw, name, flops=flops, bytes_moved=moved, launches=0, family=family, unit=unit)
        body_ms = max(est.ms, serial_s * 1e3)
        bound = "latency" if serial_s * 1e3 > est.ms else est.bound
        parts.append(Estimate(name, body_ms + launch_s * 1e3, flops, moved, 1, bound))

    def add_fma(name, flops, moved, serial_s=0.0):
        """Complex contraction on fp32 CUDA cores at FMA_EFFICIENCY of the peak."""
        compute_s = flops / (hw.fp32_flops * FMA_EFFICIENCY) if hw.is_gpu else 0.0
        add(name, flops=0.0 if hw.is_gpu else flops, moved=moved, serial_s=max(serial_s, compute_s))

    xspec, yspec, cspec = 8.0 * t * c * f, 8.0 * t * n * f, 8.0 * c * n * f
    contract_flops = 8.0 * t * c * n * f
    if impl in ("torch", "triton"):
        if db != 4:
            add("cast x to fp32", moved=(db + 4.0) * t * in_features)
        if k > 1:
            add("gather P_k x", moved=8.0 * t * in_features * (k - 1))
            add("concatenate channels", moved=8.0 * t * in_features * k)
        if in_p != in_features:
            add("zero-pad", moved=4.0 * t * k * (in_features + in_p))
        add("rfft (cuFFT)", flops=_fft_flops(b, t * c), moved=4.0 * t * c * b + xspec)
        if impl == "torch":
            add("complex(coeffs)", moved=2 * cspec)
            add("coeffs contiguous for bmm", moved=2 * cspec)
            add("X contiguous for bmm", moved=2 * xspec)
            add_fma("complex bmm (cuBLAS cgemm)", contract_flops, xspec + cspec + yspec)
        else:
            # _fft_contract_kernel, first config (BT=16, BN=4, BF=32): loops over all C channels
            programs = -(-f // 32) * -(-n // 4) * -(-t // 16)
            add_fma("triton contraction", contract_flops, xspec * -(-n // 4) + cspec * -(-t // 16) + yspec,
                    serial_s=_serial_bound_s(hw, programs, c))
        add("clone irfft input (C2R)", moved=2 * yspec)
        add("irfft (cuFFT)", flops=_fft_flops(b, t * n), moved=yspec + 4.0 * t * out_p)
        if bias:
            add("crop + bias", moved=8.0 * t * out_features + db * out_features)
        if db != 4:
            add("cast y", moved=(4.0 + db) * t * out_features)
    elif impl == "dft":  # three kernels on the packed real spectrum
        sb = db if db in (2,) else 4  # spectra stored in the 16-bit input dtype, else fp32
        unit_scale = 1.0 if sb == 2 else 2.0  # fp32 operands run as TF32: half the bf16 rate
        rows_f, rows_i = max(t * c, 16), max(t * n, 16)  # tensor-core tiles are >= 16 rows
        # Latency floors fitted to the H200 dft timings (see DFT_GEMM_STEP_S,
        # DFT_CONTRACT_STEP_S): one step per 64-wide K tile of a GEMM, one per 4 channels of the
        # contraction (UNROLL=4), per wave of programs of each kernel's first autotune config.
        k_steps = -(-b // 64)
        add("gather + forward DFT GEMM", flops=unit_scale * 2.0 * rows_f * b * b, family="fft_chain", unit="matrix",
            moved=db * t * in_features * k + sb * (b * b + t * c * b),
            serial_s=_serial_bound_s(hw, k_steps * -(-(t * c) // 32), k_steps, DFT_GEMM_STEP_S))
        q = b // 2
        # _packed_contract_kernel, first config (BT=16, BN=4, BQ=32, 4 channels per step)
        programs = -(-q // 32) * -(-n // 4) * -(-t // 16)
        add_fma("packed contraction", 4.0 * t * c * n * b, sb * t * c * b * -(-n // 4) + 4.0 * c * n * 2 * f * -(-t // 16) + sb * t * n * b,
                serial_s=_serial_bound_s(hw, programs, -(-c // 4), DFT_CONTRACT_STEP_S))
        add("inverse DFT GEMM + bias", flops=unit_scale * 2.0 * rows_i * b * b, family="fft_chain", unit="matrix",
            moved=sb * (t * n * b + b * b) + db * (t * out_features + (out_features if bias else 0)),
            serial_s=_serial_bound_s(hw, k_steps * -(-(t * n) // 32), k_steps, DFT_GEMM_STEP_S))
    else:  # dft2 / dft2_pregather: frequency-major spectra, tensor-core contraction (constants fitted on an H100)
        sb = db if db in (2,) else 4
        unit_scale = 1.0 if sb == 2 else 2.0
        q = b // 2
        k_steps = -(-b // 64)
        if impl == "dft2_pregather" and k > 1:
            # each token's row, its C*B gathered columns, and one index per column (L2-resident)
            idx_bytes = 2 if in_features <= 2**15 else 4
            moved = db * t * in_features + (db + idx_bytes) * t * c * b
            gather_s = moved / (hw.memory_ceiling * DFT2_GATHER_MEMORY_EFFICIENCY) if hw.is_gpu else 0.0
            add("gather P_k x (staged row gather)", moved=moved, serial_s=gather_s)

        def gemm_floor(rows: int, step_s: float = DFT2_GEMM_STEP_S) -> float:
            """Best of a skinny (32 x 64) and a wide (128 x 128, 8 warps: 2 per SM) tile grid."""
            skinny = _serial_bound_s(hw, -(-rows // 32) * -(-b // 64), 1, DFT2_LATENCY_S + k_steps * step_s)
            wide = _serial_bound_s(hw, 2 * -(-rows // 128) * -(-b // 128), 1, DFT2_LATENCY_S + 2 * k_steps * step_s)
            return min(skinny, wide)

        fwd_flops = unit_scale * 2.0 * max(t * c, 16) * b * b
        in_kernel_gather = impl == "dft2" and k > 1
        # the in-kernel gather adds a dependent (index -> element) load round trip to every K step
        fwd_floor = gemm_floor(t * c, DFT2_GEMM_STEP_S + (DFT2_GATHER_STEP_S if in_kernel_gather else 0.0))
        if in_kernel_gather and hw.is_gpu:
            # every gathered element costs its own 32-byte sector, once per program column of the
            # GEMM that reads it: the gathered GEMM runs at a small fraction of the matrix rate
            fwd_floor = max(fwd_floor, fwd_flops / (hw.matrix_ceiling * DFT2_INKERNEL_GATHER_MATRIX_FRACTION))
        add("forward DFT GEMM" + (" (in-kernel gather)" if impl == "dft2" else ""), flops=fwd_flops,
            family="fft_chain", unit="matrix", moved=db * t * in_features * k + sb * (b * b + t * c * b), serial_s=fwd_floor)
        cp, np2 = _pow2_at_least(c, 16), 2 * _pow2_at_least(n, 8)
        t_tiles = -(-t // 16) if t <= 64 else -(-t // 64)
        c_chunks = -(-cp // 64)
        programs = -(-q // 2) * -(-np2 // 128) * t_tiles
        coeff_bytes = 4.0 * q * 2 * cp * np2  # fp32 G, read once per token tile
        # per frequency: 2 dots of (T, CP) x (CP, 2NP), 2 flops per MAC; x2: fp32 G runs as TF32 (half the bf16 rate)
        add("tensor-core contraction", flops=2.0 * 2.0 * max(t, 16) * cp * np2 * q * 2.0, family="fft_chain", unit="matrix",
            moved=sb * t * c * b + coeff_bytes * t_tiles + sb * t * n * b,
            serial_s=_serial_bound_s(hw, programs, 1, DFT2_LATENCY_S + 2 * c_chunks * DFT2_CONTRACT_STEP_S))
        add("inverse DFT GEMM + bias", flops=unit_scale * 2.0 * max(t * n, 16) * b * b, family="fft_chain", unit="matrix",
            moved=sb * (t * n * b + b * b) + db * (t * out_features + (out_features if bias else 0)), serial_s=gemm_floor(t * n))
    return chain(f"fft_chain[{impl}] B={b} K={k}", *parts)


def available_implementations(device_type: str, block_size: int | None = None) -> tuple[str, ...]:
    """Implementations that run on a device type ("cuda" needs Triton for the Triton ones; the
    dft path needs an even block size)."""
    if device_type == "cuda":
        if not HAS_TRITON:
            return ("torch",)
        if block_size is not None and block_size % 2:
            return ("torch", "triton")
        return IMPLEMENTATIONS
    return ("torch",)


def choose_implementation(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, *, device_type: str = "cuda", dtype_bytes: int = 2, bias: bool = True,
                          implementations: tuple[str, ...] | None = None):
    """(name, Estimate) of the implementation the cost model predicts fastest, among
    `implementations` (default: all that run on `device_type` with this block size)."""
    best = None
    for impl in available_implementations(device_type, block_size):
        if implementations is not None and impl not in implementations:
            continue
        est = estimate_fft_chain(hw, tokens, in_features, out_features, block_size, k, impl, dtype_bytes=dtype_bytes, bias=bias)
        if best is None or est.ms < best[1].ms:
            best = (impl, est)
    return best

# =============================================================================================
# Triton kernels
# =============================================================================================
if HAS_TRITON:

    def _configs(options: list[dict], warps: list[int], stages: list[int] | None = None) -> list:
        """Autotune configs: every option x warps x stages; an option may pin "num_warps"/"num_stages"."""
        stages = stages or [3]
        if _INTERPRET:  # the interpreter runs every config: keep one
            options, warps, stages = options[:1], warps[:1], stages[:1]
        out = []
        for o in options:
            meta = {key: v for key, v in o.items() if key not in ("num_warps", "num_stages")}
            for w in ([o["num_warps"]] if "num_warps" in o else warps):
                for st in ([o["num_stages"]] if "num_stages" in o else stages):
                    out.append(triton.Config(meta, num_warps=w, num_stages=st))
        return out

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
    # Candidate 3 ("dft"): three tensor-core-friendly kernels on the packed real spectrum.
    # Packed ("halfcomplex") layout of one block's spectrum, B = 2Q reals, even B only:
    #   slot q      (0 <= q < Q): Re X_q
    #   slot Q + q  (1 <= q < Q): Im X_q
    #   slot Q               : Re X_{B/2} (the Nyquist bin, real; Im X_0 = Im X_{B/2} = 0)
    # so the forward and inverse real DFTs are square B x B matrix products with no padding.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_P": 64, "BLOCK_N": 64}, {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_N": 64},
                          {"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_P": 128, "BLOCK_N": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_P": 256, "BLOCK_N": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "C", "B"],
    )
    @triton.jit
    def _dft_forward_kernel(
        x_ptr,  # (T, IN) input dtype
        perm_ptr,  # (K-1, IN) int64 (a dummy when K = 1)
        w_ptr,  # (B, B) operand dtype: packed forward real-DFT matrix, W[n, p]
        xs_ptr,  # (T * C, B) spectrum dtype out: row t * C + c holds channel-block c of token t
        M, IN, C, NIN, B, M_BUCKET, stride_xt,
        FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """XS = gather(x) @ W: rows (t, c = k * NIN + j), the permutation P_k and the zero padding
        applied while loading; one tensor-core GEMM (T*C, B) x (B, B), fp32 accumulation."""
        pid_p, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) flattened (t, c)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,)
        tok = offs_m // C
        ch = offs_m % C
        k = ch // NIN
        j = ch % NIN
        row_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for n0 in range(0, B, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,) time sample within the block
            pos = j[:, None] * B + offs_n[None, :]  # (BM, BN) position in the permuted, padded row
            valid = row_ok[:, None] & (pos < IN) & (offs_n[None, :] < B)
            use_perm = k[:, None] > 0  # channel 0 is the identity: no permutation row
            permuted = tl.load(perm_ptr + (k[:, None] - 1) * IN + pos, mask=valid & use_perm, other=0)
            src = tl.where(use_perm, permuted, pos)
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + src, mask=valid, other=0.0)  # (BM, BN)
            wt = tl.load(w_ptr + offs_n[:, None] * B + offs_p[None, :],
                         mask=(offs_n[:, None] < B) & (offs_p[None, :] < B), other=0.0)  # (BN, BP)
            if FP32_DOT:  # the CPU interpreter multiplies bf16 tl.dot operands wrongly (their uint16 storage)
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(xt.to(w_ptr.dtype.element_ty), wt)
        out_mask = row_ok[:, None] & (offs_p[None, :] < B)
        tl.store(xs_ptr + offs_m[:, None] * B + offs_p[None, :], acc.to(xs_ptr.dtype.element_ty), mask=out_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 4}, {"BLOCK_T": 16, "BLOCK_N": 2, "BLOCK_Q": 32, "UNROLL": 4},
                          {"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 2}, {"BLOCK_T": 8, "BLOCK_N": 8, "BLOCK_Q": 32, "UNROLL": 4},
                          {"BLOCK_T": 16, "BLOCK_N": 2, "BLOCK_Q": 16, "UNROLL": 8}, {"BLOCK_T": 32, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 2},
                          {"BLOCK_T": 64, "BLOCK_N": 4, "BLOCK_Q": 16, "UNROLL": 2}, {"BLOCK_T": 32, "BLOCK_N": 8, "BLOCK_Q": 32, "UNROLL": 1}], [4], [3]),
        key=["T_BUCKET", "C", "N", "Q"],
    )
    @triton.jit
    def _packed_contract_kernel(
        xs_ptr,  # (T, C, 2Q) packed spectra, spectrum dtype
        cr_ptr, ci_ptr,  # (C, N, Q + 1) fp32 coefficient planes (F = Q + 1 frequencies)
        ys_ptr,  # (T, N, 2Q) packed output spectra, spectrum dtype
        T, C, N, Q, T_BUCKET,
        UNROLL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    ):
        """YS[t, n, q] = sum_c XS[t, c, q] * C^[c, n, q] (complex, on the packed layout; K fused in c).
        Slot 0 is special: its 'real' slot is DC and its 'imaginary' slot is the real Nyquist bin,
        so both multiply by real coefficients (Re C_0 and Re C_Q)."""
        pid_q, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        F = Q + 1
        mask_tq = (offs_t[:, None] < T) & (offs_q[None, :] < Q)  # (BT, BQ)
        mask_nq = (offs_n[:, None] < N) & (offs_q[None, :] < Q)  # (BN, BQ)
        mask_ni = mask_nq & (offs_q[None, :] >= 1)  # Im C_0 is dropped (irfft ignores Im Y_0)
        q_b = tl.where(offs_q == 0, Q, offs_q)  # coefficient partnering the 'imaginary' slot: Re C_Q at q = 0
        x_re = xs_ptr + offs_t[:, None] * (C * 2 * Q) + offs_q[None, :]
        c_off = offs_n[:, None] * F  # (BN, 1)
        acc_r = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_Q), dtype=tl.float32)
        acc_i = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_Q), dtype=tl.float32)
        for c0 in range(0, C, UNROLL):
            for u in tl.static_range(UNROLL):  # independent loads in flight: the loop is latency-bound at few tokens
                c = c0 + u
                ok = ((offs_q * 0 + c) < C)[None, :]  # (1, BQ): the unrolled tail past C
                xr = tl.load(x_re + c * 2 * Q, mask=mask_tq & ok, other=0.0).to(tl.float32)  # (BT, BQ)
                xi = tl.load(x_re + c * 2 * Q + Q, mask=mask_tq & ok, other=0.0).to(tl.float32)
                base = c * N * F + c_off
                wr = tl.load(cr_ptr + base + offs_q[None, :], mask=mask_nq & ok, other=0.0)  # (BN, BQ)
                wi = tl.load(ci_ptr + base + offs_q[None, :], mask=mask_ni & ok, other=0.0)
                wb = tl.load(cr_ptr + base + q_b[None, :], mask=mask_nq & ok, other=0.0)
                xr3, xi3 = xr[:, None, :], xi[:, None, :]
                acc_r += xr3 * wr[None, :, :] - xi3 * wi[None, :, :]
                acc_i += xr3 * wi[None, :, :] + xi3 * wb[None, :, :]
        y_off = offs_t[:, None, None] * (N * 2 * Q) + offs_n[None, :, None] * (2 * Q) + offs_q[None, None, :]
        y_mask = (offs_t[:, None, None] < T) & (offs_n[None, :, None] < N) & (offs_q[None, None, :] < Q)
        tl.store(ys_ptr + y_off, acc_r.to(ys_ptr.dtype.element_ty), mask=y_mask)
        tl.store(ys_ptr + y_off + Q, acc_i.to(ys_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _inverse_dft_tile(ys_ptr, stride_ys_m, stride_ys_p, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_P: tl.constexpr):
        """The inverse-DFT GEMM tile shared by the dft and dft2 pipelines: rows (t, n) of the packed
        output spectra (element (m, p) at ys + m * stride_ys_m + p * stride_ys_p) times Winv, then
        bias, crop to OUT and cast in the epilogue. Grid (B / BLOCK_R, T*N / BLOCK_M)."""
        pid_r, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (t, n)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p0 in range(0, B, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            a = tl.load(ys_ptr + offs_m[:, None] * stride_ys_m + offs_p[None, :] * stride_ys_p,
                        mask=row_ok[:, None] & (offs_p[None, :] < B), other=0.0)
            g = tl.load(winv_ptr + offs_p[:, None] * B + offs_r[None, :], mask=(offs_p[:, None] < B) & (offs_r[None, :] < B), other=0.0)
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), g.to(tl.float32))
            else:
                acc += tl.dot(a.to(winv_ptr.dtype.element_ty), g)
        tok = offs_m // N
        cols = (offs_m % N)[:, None] * B + offs_r[None, :]  # (BM, BR) output feature
        mask = row_ok[:, None] & (offs_r[None, :] < B) & (cols < OUT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + tok[:, None] * stride_yt + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_P": 64}, {"BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_P": 64},
                          {"BLOCK_M": 64, "BLOCK_R": 128, "BLOCK_P": 64}, {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_P": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_R": 256, "BLOCK_P": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "N", "B"],
    )
    @triton.jit
    def _dft_inverse_kernel(
        ys_ptr,  # (T * N, B) packed output spectra, spectrum dtype
        winv_ptr,  # (B, B) operand dtype: packed inverse real-DFT matrix (irfft bin weights and 1/B folded in)
        bias_ptr,  # (OUT,) or a dummy
        y_ptr,  # (T, OUT) output dtype
        M, N, B, OUT, M_BUCKET, stride_yt,
        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        """y[t, n*B + r] = sum_p YS[t*N + n, p] Winv[p, r] + bias: one GEMM (T*N, B) x (B, B) whose
        epilogue adds the bias, crops the padded output columns and casts."""
        _inverse_dft_tile(ys_ptr, B, 1, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS, FP32_DOT, BLOCK_M, BLOCK_R, BLOCK_P)

    # -----------------------------------------------------------------------------------------
    # A program stores STEPS x BLOCK_W columns of one token (unrolled: every index load of the
    # program is in flight at once); the widest configs cover a whole LLaMA-sized row, so the row
    # is read once per token.
    _GATHER_OPTIONS = [{"BLOCK_W": 32, "STEPS": 2}] if _INTERPRET else [
        {"BLOCK_W": 1024, "STEPS": 4, "num_warps": 8}, {"BLOCK_W": 2048, "STEPS": 4, "num_warps": 8},
        {"BLOCK_W": 2048, "STEPS": 8, "num_warps": 16}, {"BLOCK_W": 2048, "STEPS": 16, "num_warps": 16},
        {"BLOCK_W": 4096, "STEPS": 4, "num_warps": 16}, {"BLOCK_W": 1024, "STEPS": 16, "num_warps": 8}]

    @triton.autotune(configs=_configs(_GATHER_OPTIONS, [8], [1]), key=["T_BUCKET", "IN", "W"])
    @triton.jit
    def _gather_columns_kernel(
        x_ptr,  # (T, IN)
        src_ptr,  # (W,) int16 or int32: source column of each output column, in [0, IN)
        out_ptr,  # (T, W) contiguous
        IN, W, stride_xt, T_BUCKET,
        ROW_CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_W: tl.constexpr, STEPS: tl.constexpr,
    ):
        """out[t, w] = x[t, src[w]]: the permuted input of dft2_pregather. A random permutation read
        straight from global memory costs one 32-byte sector per 2-byte element; here the token's
        row is read once per program, coalesced, in chunks of ROW_CHUNK features, and tl.gather
        picks the elements from that on-chip copy (shared memory). Each output column is stored by
        the one chunk that holds its source."""
        t = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * (STEPS * BLOCK_W)
        offs_row = tl.arange(0, ROW_CHUNK)
        for c in tl.static_range(N_CHUNKS):
            base = c * ROW_CHUNK
            row = tl.load(x_ptr + t * stride_xt + base + offs_row, mask=base + offs_row < IN, other=0.0)
            for step in tl.static_range(STEPS):
                offs_w = first + step * BLOCK_W + tl.arange(0, BLOCK_W)
                w_ok = offs_w < W
                local = tl.load(src_ptr + offs_w, mask=w_ok, other=0).to(tl.int32) - base
                here = (local >= 0) & (local < ROW_CHUNK)
                vals = tl.gather(row, tl.where(here, local, 0), 0)
                tl.store(out_ptr + t * W + offs_w, vals, mask=w_ok & here)

    # Candidate 4 ("dft2", "dft2_pregather"): the dft pipeline rebuilt for latency at few tokens.
    # Same packed real spectrum, but stored FREQUENCY-MAJOR: XS^T (B, T*C) and YS^T (B, T*N), so
    # that one frequency's spectrum over all tokens and channels is one contiguous (T, C) matrix
    # and the contraction becomes small tensor-core matmuls, per frequency:
    #   [Yr | Yi] (T, 2NP) = Xr (T, CP) @ G[q, 0] (CP, 2NP) + Xi (T, CP) @ G[q, 1] (CP, 2NP)
    # with G built once per coefficient tensor (`_dft2_coefficient_operands`). The forward GEMM
    # either gathers P_k through an int32 source table whose next tile is loaded one K step ahead
    # ("dft2", 3 launches), or reads an input pre-gathered by `_gather_columns_kernel`
    # ("dft2_pregather"; the zero padding is then a mask computed from the row, not a load).
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_P": 64, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_K": 128},
                          {"BLOCK_M": 16, "BLOCK_P": 128, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 32, "BLOCK_P": 128, "BLOCK_K": 64},
                          {"BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_K": 64},
                          {"BLOCK_M": 128, "BLOCK_P": 128, "BLOCK_K": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_P": 256, "BLOCK_K": 64, "num_warps": 8},
                          # wide P tiles: each gathered x element is loaded by B / BLOCK_P programs
                          {"BLOCK_M": 16, "BLOCK_P": 256, "BLOCK_K": 64}, {"BLOCK_M": 32, "BLOCK_P": 256, "BLOCK_K": 64, "num_warps": 8},
                          {"BLOCK_M": 16, "BLOCK_P": 512, "BLOCK_K": 32, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "C", "B", "GATHER"],
    )
    @triton.jit
    def _dft2_forward_kernel(
        x_ptr,  # GATHER: (T, IN) input; else rows of B samples already in channel order: token t, channel c at t * stride_xt + c * B
        src_ptr,  # (C, B) int32: source feature of sample n of channel-block c (any valid index in the padding); GATHER only
        w_ptr,  # (B, B) operand dtype: packed forward real-DFT matrix W[n, p]
        xs_ptr,  # (B, M) spectrum dtype out, frequency-major: XS^T[p, t * C + c]
        M, IN, C, NIN, B, M_BUCKET, stride_xt,
        GATHER: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """XS^T = (P x, zero-padded, as (T*C, B) rows) @ W, stored transposed. The zero padding is
        the mask j * B + n < IN (j = c mod NIN): no load decides it."""
        pid_p, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) flattened (t, c)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,) packed spectral slot
        offs_kk = tl.arange(0, BLOCK_K)
        tok = offs_m // C
        ch = offs_m % C
        j = ch % NIN
        row_ok = offs_m < M
        x_row = x_ptr + tok[:, None] * stride_xt  # (BM, 1)
        if GATHER:  # source indices of the first K step; each step prefetches the next one's
            idx = tl.load(src_ptr + ch[:, None] * B + offs_kk[None, :], mask=row_ok[:, None] & (offs_kk[None, :] < B), other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            offs_k = k0 + offs_kk  # (BK,) time sample within the block
            valid = row_ok[:, None] & (offs_k[None, :] < B) & (j[:, None] * B + offs_k[None, :] < IN)
            if GATHER:
                xt = tl.load(x_row + idx, mask=valid, other=0.0)  # (BM, BK)
                nxt = offs_k + BLOCK_K
                idx = tl.load(src_ptr + ch[:, None] * B + nxt[None, :], mask=row_ok[:, None] & (nxt[None, :] < B), other=0)
            else:
                xt = tl.load(x_row + ch[:, None] * B + offs_k[None, :], mask=valid, other=0.0)
            wt = tl.load(w_ptr + offs_k[:, None] * B + offs_p[None, :], mask=(offs_k[:, None] < B) & (offs_p[None, :] < B), other=0.0)
            if FP32_DOT:  # the CPU interpreter multiplies bf16 tl.dot operands wrongly
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(xt.to(w_ptr.dtype.element_ty), wt)
        out_mask = row_ok[:, None] & (offs_p[None, :] < B)
        tl.store(xs_ptr + offs_p[None, :] * M + offs_m[:, None], acc.to(xs_ptr.dtype.element_ty), mask=out_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "FQ": 2}, {"BLOCK_T": 16, "FQ": 1}, {"BLOCK_T": 16, "FQ": 4}, {"BLOCK_T": 32, "FQ": 2},
                          {"BLOCK_T": 64, "FQ": 1}, {"BLOCK_T": 64, "FQ": 2}, {"BLOCK_T": 128, "FQ": 1, "num_warps": 8}], [4], [1]),
        key=["T_BUCKET", "C", "N", "Q"],
    )
    @triton.jit
    def _spectral_mma_contract_kernel(
        xs_ptr,  # (B, T*C) frequency-major packed input spectra, spectrum dtype
        g_ptr,  # (Q, 2, CP, 2NP) coefficient operands (see _dft2_coefficient_operands)
        ys_ptr,  # (B, T*N) frequency-major packed output spectra, spectrum dtype
        T, C, N, Q, T_BUCKET,
        CP: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N2: tl.constexpr,
        FP32_DOT: tl.constexpr, BLOCK_T: tl.constexpr, FQ: tl.constexpr,
    ):
        """Per frequency q of this program's FQ: [Yr | Yi] = Xr @ G[q,0] + Xi @ G[q,1] on tensor
        cores (fp32 accumulation). Slot 0 (DC real, Nyquist real) needs no special case: G[0]
        holds Re C_0 and Re C_Q where those slots meet. All loads of a program are independent
        (the frequency and channel loops are unrolled), so they are in flight together."""
        pid_q, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n2 = pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2)  # column of [Yr | Yi]
        is_imag = offs_n2 >= NP
        n = tl.where(is_imag, offs_n2 - NP, offs_n2)
        m_in = T * C
        m_out = T * N
        t_ok = offs_t < T
        for i in tl.static_range(FQ):
            q = pid_q * FQ + i
            q_ok_t = (offs_t * 0 + q) < Q  # (BT,): this frequency exists (a vector: the interpreter wants full-shape masks)
            q_ok_n = (offs_n2 * 0 + q) < Q  # (BN2,)
            acc = tl.zeros((BLOCK_T, BLOCK_N2), dtype=tl.float32)
            for c0 in tl.static_range(0, CP, BLOCK_C):
                offs_c = c0 + tl.arange(0, BLOCK_C)
                x_mask = (t_ok & q_ok_t)[:, None] & (offs_c[None, :] < C)
                x_off = offs_t[:, None] * C + offs_c[None, :]  # (BT, BC)
                xr = tl.load(xs_ptr + q * m_in + x_off, mask=x_mask, other=0.0)
                xi = tl.load(xs_ptr + (Q + q) * m_in + x_off, mask=x_mask, other=0.0)
                g_off = q * (4 * CP * NP) + offs_c[:, None] * (2 * NP) + offs_n2[None, :]  # (BC, BN2)
                g_mask = (offs_c[:, None] < CP) & (q_ok_n & (offs_n2 < 2 * NP))[None, :]
                gr = tl.load(g_ptr + g_off, mask=g_mask, other=0.0)
                gi = tl.load(g_ptr + g_off + 2 * CP * NP, mask=g_mask, other=0.0)
                if FP32_DOT:
                    acc = tl.dot(xr.to(tl.float32), gr.to(tl.float32), acc)
                    acc = tl.dot(xi.to(tl.float32), gi.to(tl.float32), acc)
                else:  # fp32 coefficients: TF32 tensor cores; bf16 coefficients: bf16 ones
                    acc = tl.dot(xr.to(g_ptr.dtype.element_ty), gr, acc)
                    acc = tl.dot(xi.to(g_ptr.dtype.element_ty), gi, acc)
            slot = tl.where(is_imag, Q + q, q)  # (BN2,)
            y_off = slot[None, :] * m_out + offs_t[:, None] * N + n[None, :]
            y_mask = t_ok[:, None] & (q_ok_n & (n < N) & (offs_n2 < 2 * NP))[None, :]
            tl.store(ys_ptr + y_off, acc.to(ys_ptr.dtype.element_ty), mask=y_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_P": 128},
                          {"BLOCK_M": 16, "BLOCK_R": 128, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 32, "BLOCK_R": 128, "BLOCK_P": 64},
                          {"BLOCK_M": 64, "BLOCK_R": 64, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 64, "BLOCK_R": 128, "BLOCK_P": 64},
                          {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_P": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_R": 256, "BLOCK_P": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "N", "B"],
    )
    @triton.jit
    def _dft2_inverse_kernel(
        ys_ptr,  # (B, T*N) frequency-major packed output spectra, spectrum dtype
        winv_ptr,  # (B, B) operand dtype: packed inverse real-DFT matrix
        bias_ptr,  # (OUT,) or a dummy
        y_ptr,  # (T, OUT) output dtype
        M, N, B, OUT, M_BUCKET, stride_yt,
        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        """y[t, n*B + r] = sum_p YS^T[p, t*N + n] Winv[p, r] + bias (GEMM (T*N, B) x (B, B) reading
        its A operand transposed), with bias, crop and cast in the epilogue."""
        _inverse_dft_tile(ys_ptr, 1, M, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS, FP32_DOT, BLOCK_M, BLOCK_R, BLOCK_P)

# =============================================================================================
# Launchers
# =============================================================================================
def _t_bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


@functools.lru_cache(maxsize=32)
def _dft_tables(block_size: int, device: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed real-DFT matrices (see the packed layout above), built in float64, stored in `dtype`:
    forward W (B, B) with XS = x @ W, inverse Winv (B, B) with x = XS @ Winv (irfft of the packed
    spectrum: bin weights 1 (DC, Nyquist) or 2, and 1/B, folded in). Even B only."""
    if block_size % 2:
        raise ValueError(f"the packed real DFT needs an even block_size, got {block_size}")
    q_len = block_size // 2
    n = torch.arange(block_size, dtype=torch.float64)
    q = torch.arange(q_len, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(n, q) / block_size  # (B, Q)
    alternating = torch.cos(math.pi * n)  # (-1)^n: the Nyquist bin
    fwd = torch.zeros(block_size, block_size, dtype=torch.float64)
    fwd[:, :q_len] = torch.cos(angle)
    fwd[:, q_len + 1:] = -torch.sin(angle[:, 1:])
    fwd[:, q_len] = alternating
    weight = torch.full((q_len,), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    inv = torch.zeros(block_size, block_size, dtype=torch.float64)
    inv[:q_len] = weight[:, None] * torch.cos(angle.T) / block_size
    inv[q_len + 1:] = -2.0 * torch.sin(angle.T[1:]) / block_size
    inv[q_len] = alternating / block_size
    return fwd.to(device=device, dtype=dtype).contiguous(), inv.to(device=device, dtype=dtype).contiguous()


def _dft_dtypes(x_dtype: torch.dtype) -> torch.dtype:
    """Operand and spectrum storage dtype of the dft path: bf16 for 16-bit inputs (tensor cores at
    full rate; ~2x the output-rounding error, see the module docstring; fp16 inputs too, because a
    spectrum bin can reach B * max|x| and overflow fp16), fp32 (TF32 GEMMs) otherwise."""
    return torch.bfloat16 if x_dtype in (torch.float16, torch.bfloat16) else torch.float32


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
    """Candidate 3: gather + forward DFT GEMM -> packed contraction -> inverse DFT GEMM + bias (3 launches)."""
    if not HAS_TRITON:
        raise RuntimeError("impl='dft' needs Triton; valid choices without it: torch")
    if block_size % 2:
        raise ValueError(f"impl='dft' needs an even block_size (packed real spectrum), got {block_size}; valid choices for odd block sizes: torch, triton")
    out_dtype = x2d.dtype
    op_dtype = _dft_dtypes(x2d.dtype)
    x2d = (x2d if x2d.dtype in (torch.float16, torch.bfloat16, torch.float32) else x2d.float()).contiguous()
    t, in_features = x2d.shape
    c_len, n_out, _ = coeff_real.shape
    n_in = c_len // (perms.shape[0] + 1)
    q_len = block_size // 2
    fwd, inv = _dft_tables(block_size, str(x2d.device), op_dtype)
    perm_arg = perms.contiguous() if perms.shape[0] else torch.zeros(1, dtype=torch.int64, device=x2d.device)
    xs = torch.empty(t * c_len, block_size, device=x2d.device, dtype=op_dtype)  # (T*C, B) packed spectra
    m_fwd = t * c_len
    _dft_forward_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_P"]), triton.cdiv(m_fwd, meta["BLOCK_M"]))](
        x2d, perm_arg, fwd, xs, m_fwd, in_features, c_len, n_in, block_size, _t_bucket(m_fwd), x2d.stride(0), FP32_DOT=_INTERPRET)
    ys = torch.empty(t * n_out, block_size, device=x2d.device, dtype=op_dtype)  # (T*N, B) packed output spectra
    cr, ci = coeff_real.float().contiguous(), coeff_imag.float().contiguous()
    _packed_contract_kernel[lambda meta: (triton.cdiv(q_len, meta["BLOCK_Q"]), triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(t, meta["BLOCK_T"]))](
        xs, cr, ci, ys, t, c_len, n_out, q_len, _t_bucket(t))
    y = torch.empty(t, out_features, device=x2d.device, dtype=x2d.dtype)
    bias_arg = bias.contiguous() if bias is not None else cr
    m_inv = t * n_out
    _dft_inverse_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_R"]), triton.cdiv(m_inv, meta["BLOCK_M"]))](
        ys, inv, bias_arg, y, m_inv, n_out, block_size, out_features, _t_bucket(m_inv), y.stride(0), HAS_BIAS=bias is not None, FP32_DOT=_INTERPRET)
    return y.to(out_dtype)


# Operand tables of the dft2 launchers, built once per (tensor, version) and reused: the fft_linear
# pass folds the coefficient spectrum into constants, so every call sees the same tensor objects
# (and a CUDA-graph capture after a first eager call launches no table-building ops). Keyed on the
# tensors' ids, validated by weak references and their version counters (an in-place update
# rebuilds); an entry is dropped when its tensor dies, and the oldest goes first past 64 entries.
# Caveat: a trainable FFTChainLinear recomputes its spectrum every forward, so on CUDA with dft2
# each call rebuilds G (a few small torch ops). Inference tensors (made under
# torch.inference_mode) have no version counter: an in-place write to one, which only inference
# mode allows, is not seen, and the old operands stay in use until clear_operand_cache().
_OPERAND_CACHE: dict = {}
_OPERAND_CACHE_SIZE = 64


def clear_operand_cache() -> None:
    """Forget every cached dft2 operand table (needed only after an in-place write to an inference tensor)."""
    _OPERAND_CACHE.clear()


def _tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (see the caveat above)
        return -1


def _cached_operand(tensors: tuple, tag: tuple, build):
    # A view (e.g. `layer.perms[1:]`, a new object per call) is identified by its base tensor and
    # its position in it; views share the base's version counter.
    anchors = tuple(t if t._base is None else t._base for t in tensors)
    key = (*((id(a), t.data_ptr(), tuple(t.shape), t.stride()) for a, t in zip(anchors, tensors)), *tag)
    hit = _OPERAND_CACHE.get(key)
    versions = tuple(_tensor_version(t) for t in tensors)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], anchors)) and hit[1] == versions:
        return hit[2]
    value = build()
    while len(_OPERAND_CACHE) >= _OPERAND_CACHE_SIZE:
        _OPERAND_CACHE.pop(next(iter(_OPERAND_CACHE)), None)

    def drop(_ref, key=key):  # a source tensor died (e.g. per-step coefficients in training): free its operands
        entry = _OPERAND_CACHE.get(key)
        if entry is not None and any(r is _ref for r in entry[0]):
            _OPERAND_CACHE.pop(key, None)

    _OPERAND_CACHE[key] = (tuple(weakref.ref(a, drop) for a in anchors), versions, value)
    return value


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _dft2_source_table(perms: torch.Tensor, in_features: int, block_size: int, n_in: int) -> torch.Tensor:
    """(C, B) int32: src[k * n_in + j, n] = the input feature that sample n of block j of channel k
    reads (perm_k[j * B + n]; channel 0 the identity); 0 in the zero padding, which the kernels
    mask by position (j * B + n >= in_features), never by this table."""
    ident = torch.arange(in_features, device=perms.device, dtype=torch.int64)[None]
    rows = torch.cat([ident, perms.to(torch.int64)]) if perms.shape[0] else ident  # (K, in)
    rows = torch.nn.functional.pad(rows, (0, n_in * block_size - in_features))
    return rows.reshape(-1, block_size).to(torch.int32).contiguous()


def _dft2_coefficient_operands(coeff_real: torch.Tensor, coeff_imag: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(C, N, F) spectral planes -> G (Q, 2, CP, 2NP), frequency-major, zero-padded to CP = pow2 >= 16
    channels and NP = pow2 >= 8 outputs, such that for every packed slot pair q:
        [Yr_q | Yi_q] (T, 2NP) = Xr_q (T, CP) @ G[q, 0] + Xi_q (T, CP) @ G[q, 1]
    i.e. G[q, 0] = [Re C_q | Im C_q], G[q, 1] = [-Im C_q | Re C_q]. At q = 0 the 'real' slot is
    DC and the 'imaginary' slot the Nyquist bin, both real: G[0, 0] = [Re C_0 | 0],
    G[0, 1] = [0 | Re C_Q] (irfft ignores Im Y_0 and Im Y_Q)."""
    c_len, n_out, freqs = coeff_real.shape
    q_len = freqs - 1
    cp, np_ = _pow2_at_least(c_len, 16), _pow2_at_least(n_out, 8)
    cr, ci = coeff_real.detach().float(), coeff_imag.detach().float()
    crq, ciq = cr[:, :, :q_len].permute(2, 0, 1), ci[:, :, :q_len].permute(2, 0, 1)  # (Q, C, N)
    g = torch.zeros(q_len, 2, cp, 2 * np_, device=coeff_real.device, dtype=torch.float32)
    g[:, 0, :c_len, :n_out] = crq
    g[:, 0, :c_len, np_:np_ + n_out] = ciq
    g[:, 1, :c_len, :n_out] = -ciq
    g[:, 1, :c_len, np_:np_ + n_out] = crq
    g[0, 0, :c_len, np_:np_ + n_out] = 0.0
    g[0, 1, :c_len, :n_out] = 0.0
    g[0, 1, :c_len, np_:np_ + n_out] = cr[:, :, q_len]
    return g.to(dtype).contiguous()


# Coefficient operand dtype of the dft2 contraction: fp32 planes run the tensor-core dots as TF32
# (10-bit mantissa, below the bf16 rounding of the stored spectra); torch.bfloat16 would halve the
# coefficient bytes at ~4x the coefficient rounding error.
DFT2_COEFF_DTYPE = torch.float32


# Staged gather: one program keeps a row chunk of at most GATHER_ROW_CHUNK features on chip
# (32 KiB of bf16 in shared memory); the column tiling is autotuned (`_GATHER_OPTIONS`).
GATHER_ROW_CHUNK = 16384


def _launch_gather_columns(x2d: torch.Tensor, src: torch.Tensor, out: torch.Tensor) -> None:
    """out (T, W) = x2d[:, src] (src int16/int32, flattened) with `_gather_columns_kernel`."""
    t, in_features = x2d.shape
    width = out.shape[1]
    row_chunk = min(_pow2_at_least(in_features, 16), 64 if _INTERPRET else GATHER_ROW_CHUNK)
    _gather_columns_kernel[lambda meta: (t, triton.cdiv(width, meta["BLOCK_W"] * meta["STEPS"]))](
        x2d, src, out, in_features, width, x2d.stride(0), _t_bucket(t),
        ROW_CHUNK=row_chunk, N_CHUNKS=triton.cdiv(in_features, row_chunk))


def _narrow_source_table(src: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (C, B) int32 source table flattened, as int16 where the features fit (half the index
    bytes that every token's gather reads)."""
    flat = src.reshape(-1)
    return flat.to(torch.int16) if in_features <= 2**15 else flat


def _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, *, pregather: bool):
    name = "dft2_pregather" if pregather else "dft2"
    if not HAS_TRITON:
        raise RuntimeError(f"impl={name!r} needs Triton; valid choices without it: torch")
    if block_size % 2:
        raise ValueError(f"impl={name!r} needs an even block_size (packed real spectrum), got {block_size}; valid choices for odd block sizes: torch, triton")
    out_dtype = x2d.dtype
    op_dtype = _dft_dtypes(x2d.dtype)
    x2d = (x2d if x2d.dtype in (torch.float16, torch.bfloat16, torch.float32) else x2d.float()).contiguous()
    t, in_features = x2d.shape
    c_len, n_out, _ = coeff_real.shape
    k = perms.shape[0] + 1
    n_in = c_len // k
    q_len = block_size // 2
    dev = x2d.device
    fwd, inv = _dft_tables(block_size, str(dev), op_dtype)
    # 1. forward DFT GEMM -> XS^T (B, T*C), frequency-major
    m_fwd = t * c_len
    src = _cached_operand((perms,), ("dft2_src", in_features, block_size, n_in), lambda: _dft2_source_table(perms, in_features, block_size, n_in))
    if k == 1:  # the identity: channel-block j of token t starts at t * stride + j * B
        source, stride, gather = x2d, x2d.stride(0), False
    elif pregather:  # one gather launch materializes (T, C*B) in channel order
        width = c_len * block_size
        source = torch.empty(t, width, device=dev, dtype=x2d.dtype)
        gather_src = _cached_operand((perms,), ("gather_src", in_features, block_size, n_in),
                                     lambda: _narrow_source_table(src, in_features))
        _launch_gather_columns(x2d, gather_src, source)
        stride, gather = source.stride(0), False
    else:
        source, stride, gather = x2d, x2d.stride(0), True
    xs = torch.empty(block_size, m_fwd, device=dev, dtype=op_dtype)
    _dft2_forward_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_P"]), triton.cdiv(m_fwd, meta["BLOCK_M"]))](
        source, src, fwd, xs, m_fwd, in_features, c_len, n_in, block_size, _t_bucket(m_fwd), stride,
        GATHER=gather, FP32_DOT=_INTERPRET)
    # 2. per-frequency contraction on tensor cores -> YS^T (B, T*N)
    g = _cached_operand((coeff_real, coeff_imag), ("dft2_g", DFT2_COEFF_DTYPE), lambda: _dft2_coefficient_operands(coeff_real, coeff_imag, DFT2_COEFF_DTYPE))
    cp, np2 = g.shape[2], g.shape[3]
    block_c, block_n2 = min(cp, 64), min(np2, 128)
    ys = torch.empty(block_size, t * n_out, device=dev, dtype=op_dtype)
    _spectral_mma_contract_kernel[lambda meta: (triton.cdiv(q_len, meta["FQ"]), triton.cdiv(np2, block_n2), triton.cdiv(t, meta["BLOCK_T"]))](
        xs, g, ys, t, c_len, n_out, q_len, _t_bucket(t),
        CP=cp, NP=np2 // 2, BLOCK_C=block_c, BLOCK_N2=block_n2, FP32_DOT=_INTERPRET)
    # 3. inverse DFT GEMM + bias + crop + cast
    y = torch.empty(t, out_features, device=dev, dtype=x2d.dtype)
    bias_arg = bias.contiguous() if bias is not None else fwd
    m_inv = t * n_out
    _dft2_inverse_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_R"]), triton.cdiv(m_inv, meta["BLOCK_M"]))](
        ys, inv, bias_arg, y, m_inv, n_out, block_size, out_features, _t_bucket(m_inv), y.stride(0),
        HAS_BIAS=bias is not None, FP32_DOT=_INTERPRET)
    return y.to(out_dtype)


def fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 4: forward DFT GEMM with the permutation gathered in-kernel (source-index tile
    prefetched one K step ahead) -> tensor-core per-frequency contraction -> inverse DFT GEMM +
    bias. 3 launches, spectra frequency-major."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=False)


def fft_chain_dft2_pregather(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 5: as dft2, but P_k x is gathered once first (`_gather_columns_kernel`, one extra
    launch when K > 1) and the forward kernel is a plain GEMM with no dependent loads."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=True)


_LAUNCHERS = {"torch": fft_chain_torch, "triton": fft_chain_triton, "dft": fft_chain_dft,
              "dft2": fft_chain_dft2, "dft2_pregather": fft_chain_dft2_pregather}


def fft_chain_linear(x, coeff_real, coeff_imag, perms, bias, block_size: int, out_features: int, impl: str = "auto"):
    """Run the layer with one implementation ("auto": the cost model's choice for this shape).
    x (..., in) -> (..., out_features). On CPU every implementation name runs the torch path."""
    _check_inputs(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl)
    if x.numel() == 0 and x.shape[-1] > 0:  # no tokens (MKL's FFT refuses an empty batch)
        return x.new_empty(*x.shape[:-1], out_features)
    # .contiguous(): the paths crop (..., n_out * B) to out_features, a strided view the op's fake
    # (and Inductor's stride assertions) take for contiguous
    if not x.is_cuda:  # CPU: the torch reference (the Triton launchers are tested directly)
        return fft_chain_spectral_reference(x, coeff_real, coeff_imag, perms, bias, block_size, out_features).contiguous()
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, in_features)
    if impl == "auto":
        impl = "torch"
        if x.is_cuda:
            k = perms.shape[0] + 1
            impl, _ = choose_implementation(device_spec(x.device.index), x2d.shape[0], in_features, out_features,
                                            block_size, k, device_type="cuda", dtype_bytes=x.element_size(), bias=bias is not None)
    y = _LAUNCHERS[impl](x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features)
    return y.reshape(*lead, out_features).contiguous()
