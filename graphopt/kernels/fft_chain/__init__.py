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

Implementations (the fft_linear pass picks one per call site with the cost model,
graphopt.cost.fft_chain, and writes it into the op; `impl="auto"` at call time runs the fixed
rule of `default_implementation`):
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
            (fft_chain_h200.json, CUDA graph): faster than cuBLAS only at ~16 tokens on 5120->13824 B=512 K=2;
            slower on 13824->5120 (its contraction loops over 4x more channels) and at 256 and
            4096 tokens. The DFT costs 2*B*B flops per block (vs ~2.5 B log2 B for
            an FFT) and its kernels are latency-bound (see graphopt/cost/fft_chain.py).
            Caveat: not FlashFFTConv's b1*b2 factorization, which would cut the DFT flops further.
- "dft2":   the dft pipeline rebuilt for latency at few tokens (3 launches). Spectra are stored
            frequency-major, XS^T (B, T*C) and YS^T (B, T*N), so one frequency over all tokens and
            channels is a contiguous (T, C) matrix. `_dft2_forward_kernel` gathers P_k through an
            int32 source table (its next tile loaded one K step ahead, the zero padding a
            positional mask) with skinny-M configs; `_spectral_mma_contract_kernel` does the
            contraction as tensor-core matmuls per frequency, [Yr|Yi] = Xr @ G[q,0] + Xi @ G[q,1],
            with G (Q, 2, CP, 2NP) the coefficient planes laid out for it; every load of a
            program is independent, so they are in flight together; `_dft2_inverse_kernel` reads
            YS^T as its transposed A operand and adds bias, crops and casts.
- "dft2_pregather": as dft2, but one Triton gather launch materializes P x (T, C*B) first (one
            more launch when K > 1; each token's row is staged on chip and gathered there by
            tl.gather) and the forward kernel is a plain GEMM (timings: bench/RESULTS.md, FFT chain).
            The cost-model constants DFT2_* are fitted to an H100 sweep (graphopt/cost/fft_chain.py).
Operand tables: the DFT paths read constant tables besides x (the packed DFT matrices; for dft2
and dft2_pregather the gather's source index and G). `operand_tables` builds those of one
implementation; the fft_linear pass builds them at compile time from the constant coefficients
and permutations and passes them to graphopt::fft_chain_linear as graph constants. A table not
given is built by the launcher for that call and freed with it: no tensor a call allocates
outlives it but its output, so the op is safe under CUDA graphs.
Precision: the cuFFT paths are full fp32. The dft path keeps 16-bit inputs in their dtype for
the DFT operands and the stored spectra (fp32 accumulation, fp32 coefficients): for bf16 (and fp16, run
in bf16 for range) about twice the relative error of rounding the output to bf16 (3.4e-3 vs 1.7e-3 on 5120->13824, B=512,
K=2); fp32 inputs run the GEMMs as TF32 (~1e-3). dft2 adds its TF32 contraction (fp32 coefficients,
bf16/fp32 spectra; see DFT2_COEFF_DTYPE): in the CPU interpreter fp32 inputs match float64 to ~2e-7,
16-bit inputs stay within the same few-roundings bound as dft (tests). On CPU the op always runs
the torch reference (any float dtype, float64 included).

Modules: `layer` (plain torch: shapes, references, the backward, FFTChainLinear, projection of a
dense matrix), `triton_kernels` (the Triton kernels), `launchers` (input checks, operand tables,
one launcher per implementation, `fft_chain_linear`). Every public name is importable from here.
"""

from graphopt.kernels.fft_chain import launchers as _launchers
from graphopt.kernels.fft_chain.launchers import (
    DFT2_COEFF_DTYPE,
    GATHER_ROW_CHUNK,
    IMPL_CHOICES,
    IMPLEMENTATIONS,
    TABLE_NAMES,
    available_implementations,
    default_implementation,
    fft_chain_dft,
    fft_chain_dft2,
    fft_chain_dft2_pregather,
    fft_chain_linear,
    fft_chain_torch,
    fft_chain_triton,
    operand_tables,
    tables_read,
)
from graphopt.kernels.fft_chain.layer import (
    FFTChainLinear,
    block_circulant_dense,
    chain_dims,
    fft_chain_backward,
    fft_chain_spectral_reference,
    make_permutations,
    project_dense,
    reference_fft_chain,
    relative_error,
    spectral_coefficients,
)
from graphopt.kernels.fft_chain.triton_kernels import HAS_TRITON

# internals the tests and benchmarks reach through the family's path
_INTERPRET = _launchers._INTERPRET
_LAUNCHERS = _launchers._LAUNCHERS
_dft_tables = _launchers._dft_tables
_dft2_coefficient_operands = _launchers._dft2_coefficient_operands
_launch_gather_columns = _launchers._launch_gather_columns

__all__ = [
    "DFT2_COEFF_DTYPE", "GATHER_ROW_CHUNK", "HAS_TRITON", "IMPLEMENTATIONS", "IMPL_CHOICES", "TABLE_NAMES", "FFTChainLinear",
    "available_implementations", "block_circulant_dense", "chain_dims", "default_implementation",
    "fft_chain_backward", "fft_chain_dft", "fft_chain_dft2", "fft_chain_dft2_pregather", "fft_chain_linear",
    "fft_chain_spectral_reference", "fft_chain_torch", "fft_chain_triton", "make_permutations", "operand_tables",
    "project_dense", "reference_fft_chain", "relative_error", "spectral_coefficients", "tables_read",
]
