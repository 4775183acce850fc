"""The FFT-chain layer in plain torch: derived sizes, the references the kernels are tested against,
the op's backward, `FFTChainLinear`, and the projection of a dense matrix onto the layer
(`project_dense`). The layer and its spectral layout are described in graphopt.kernels.fft_chain."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


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
    """y = sum_k BC(C_k) P_k x + bias, trained by autograd (see graphopt.kernels.fft_chain).

    Parameters: `coeffs` (K, ceil(out/B), ceil(in/B), B), `bias` (out,). Buffer `perms` (K, in)
    int64 with row 0 the identity. The forward calls `torch.ops.graphopt.fft_chain_linear` with
    `impl="auto"`, so a Dynamo graph of this layer already holds the op; the fft_linear pass picks
    the implementation per call site and folds the coefficient spectrum and the implementation's
    operand tables into constants. Called directly, each call builds the tables it reads.
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
