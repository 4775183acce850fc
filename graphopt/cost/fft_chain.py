"""Cost model of the FFT chain (family "fft_chain"): the predicted time of each implementation of
graphopt.kernels.fft_chain on a HardwareSpec, as replayed from a CUDA graph, and the choice of the
fastest one, which the fft_linear pass makes per call site at compile time."""

from __future__ import annotations

import math

from graphopt.cost import coefficients
from graphopt.cost_model import Estimate, chain, roofline
from graphopt.kernels.fft_chain.launchers import IMPLEMENTATIONS, _pow2_at_least, available_implementations
from graphopt.kernels.fft_chain.layer import chain_dims

# A physical roofline per kernel launch, as replayed from a CUDA graph, with the "fft_chain.*"
# coefficients of the GPU's data file (graphopt.cost.coefficients):
#  - launch_fraction_in_graph: the cost of a kernel node replayed from a CUDA graph, as a fraction
#    of the eager launch overhead;
#  - cuFFT and the torch copies/casts stream at the "pointwise" family's memory efficiency;
#  - fma_efficiency: fraction of the fp32 CUDA-core peak reached by the complex contractions
#    (cuBLAS cgemm per frequency, our Triton FMA kernels) where they are throughput-bound;
#  - serial_step_s: one channel step of _fft_contract_kernel's loop (a dependent global-load round
#    trip); a program that loops C times cannot finish faster than C steps, times the number of
#    waves of programs;
#  - dft_contract_step_s: one step (4 channels, unrolled) of _packed_contract_kernel;
#  - dft_gemm_step_s: one 64-wide K step of the dft path's GEMMs (the forward's permutation gather
#    is a dependent load). Those GEMMs are latency-bound at every measured shape, so the
#    "fft_chain" family's tensor-core efficiency does not bind there;
#  - dft2 / dft2_pregather, per program: one load round trip plus epilogue (dft2_latency_s), one
#    pipelined 64-wide K step per dft2_gemm_step_s, one (frequency, 64-channel chunk) pair of
#    tensor-core dots per dft2_contract_step_s; dft2's in-kernel gather adds dft2_gather_step_s (a
#    dependent index -> element load) to each K step and runs its forward GEMM at
#    dft2_inkernel_gather_matrix_fraction of the matrix ceiling; dft2_pregather's staged gather is
#    a pointwise pass over its bytes.
# Without a CUDA graph (eager launches) the torch/triton paths pay full launches: not modelled here.
PROGRAMS_PER_SM = 4  # resident 4-warp programs per SM assumed for the wave count


def _fitted(hw, name: str) -> float:
    return coefficients.value(hw, f"fft_chain.{name}")


def _fft_flops(length: int, transforms: float) -> float:
    """Real FFT of `length`: ~2.5 N log2 N flops (half a complex FFT's 5 N log2 N)."""
    return 2.5 * length * math.log2(max(length, 2)) * transforms


def _serial_bound_s(hw, programs: int, steps: int, step_s: float | None = None) -> float:
    """Latency floor of a Triton kernel: waves of programs, each `steps` dependent steps of `step_s`
    (default: the fft_chain.serial_step_s coefficient)."""
    waves = -(-programs // max(1, hw.sm_count * PROGRAMS_PER_SM))
    return waves * steps * (_fitted(hw, "serial_step_s") if step_s is None else step_s)


def estimate_fft_chain(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, impl: str, *, dtype_bytes: int = 2, bias: bool = True):
    """Predicted time of one implementation (see IMPLEMENTATIONS) on hardware `hw`, as run in a
    CUDA graph. Each kernel launch is listed with its FLOPs and its DRAM bytes: activations in/out
    (dtype_bytes), fp32 intermediates (4 bytes, 8 per complex), copies that torch inserts
    (C2R inputs are cloned, bmm operands made contiguous), the coefficient spectra; Triton loops
    also get their serial-latency floor (see the coefficients above)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown fft_chain implementation {impl!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
    d = chain_dims(in_features, out_features, block_size, k)
    t, c, n, f, b = tokens, d["C"], d["N"], d["F"], block_size
    in_p, out_p = d["n_in"] * b, n * b
    db = dtype_bytes
    launch_s = hw.launch_overhead * (_fitted(hw, "launch_fraction_in_graph") if hw.is_gpu else 1.0)
    parts = []

    def add(name, flops=0.0, moved=0.0, family="pointwise", unit="fp32", serial_s=0.0):
        est = roofline(hw, name, flops=flops, bytes_moved=moved, launches=0, family=family, unit=unit)
        body_ms = max(est.ms, serial_s * 1e3)
        bound = "latency" if serial_s * 1e3 > est.ms else est.bound
        parts.append(Estimate(name, body_ms + launch_s * 1e3, flops, moved, 1, bound))

    def add_fma(name, flops, moved, serial_s=0.0):
        """Complex contraction on fp32 CUDA cores at fma_efficiency of the peak."""
        compute_s = flops / (hw.fp32_flops * _fitted(hw, "fma_efficiency")) if hw.is_gpu else 0.0
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
        # Latency floors (dft_gemm_step_s, dft_contract_step_s): one step per 64-wide K tile of a
        # GEMM, one per 4 channels of the contraction (UNROLL=4), per wave of programs of each
        # kernel's first autotune config.
        k_steps = -(-b // 64)
        add("gather + forward DFT GEMM", flops=unit_scale * 2.0 * rows_f * b * b, family="fft_chain", unit="matrix",
            moved=db * t * in_features * k + sb * (b * b + t * c * b),
            serial_s=_serial_bound_s(hw, k_steps * -(-(t * c) // 32), k_steps, _fitted(hw, "dft_gemm_step_s")))
        q = b // 2
        # _packed_contract_kernel, first config (BT=16, BN=4, BQ=32, 4 channels per step)
        programs = -(-q // 32) * -(-n // 4) * -(-t // 16)
        add_fma("packed contraction", 4.0 * t * c * n * b, sb * t * c * b * -(-n // 4) + 4.0 * c * n * 2 * f * -(-t // 16) + sb * t * n * b,
                serial_s=_serial_bound_s(hw, programs, -(-c // 4), _fitted(hw, "dft_contract_step_s")))
        add("inverse DFT GEMM + bias", flops=unit_scale * 2.0 * rows_i * b * b, family="fft_chain", unit="matrix",
            moved=sb * (t * n * b + b * b) + db * (t * out_features + (out_features if bias else 0)),
            serial_s=_serial_bound_s(hw, k_steps * -(-(t * n) // 32), k_steps, _fitted(hw, "dft_gemm_step_s")))
    else:  # dft2 / dft2_pregather: frequency-major spectra, tensor-core contraction
        latency_s, gemm_step_s = _fitted(hw, "dft2_latency_s"), _fitted(hw, "dft2_gemm_step_s")
        sb = db if db in (2,) else 4
        unit_scale = 1.0 if sb == 2 else 2.0
        q = b // 2
        k_steps = -(-b // 64)
        if impl == "dft2_pregather" and k > 1:
            # each token's row, its C*B gathered columns, and one index per column (L2-resident)
            idx_bytes = 2 if in_features <= 2**15 else 4
            add("gather P_k x (staged row gather)", moved=db * t * in_features + (db + idx_bytes) * t * c * b)

        def gemm_floor(rows: int, step_s: float = gemm_step_s) -> float:
            """Best of a skinny (32 x 64) and a wide (128 x 128, 8 warps: 2 per SM) tile grid."""
            skinny = _serial_bound_s(hw, -(-rows // 32) * -(-b // 64), 1, latency_s + k_steps * step_s)
            wide = _serial_bound_s(hw, 2 * -(-rows // 128) * -(-b // 128), 1, latency_s + 2 * k_steps * step_s)
            return min(skinny, wide)

        fwd_flops = unit_scale * 2.0 * max(t * c, 16) * b * b
        in_kernel_gather = impl == "dft2" and k > 1
        # the in-kernel gather adds a dependent (index -> element) load round trip to every K step
        fwd_floor = gemm_floor(t * c, gemm_step_s + (_fitted(hw, "dft2_gather_step_s") if in_kernel_gather else 0.0))
        if in_kernel_gather and hw.is_gpu:
            # every gathered element costs its own 32-byte sector, once per program column of the
            # GEMM that reads it: the gathered GEMM runs at a small fraction of the matrix rate
            fwd_floor = max(fwd_floor, fwd_flops / (hw.matrix_ceiling * _fitted(hw, "dft2_inkernel_gather_matrix_fraction")))
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
            serial_s=_serial_bound_s(hw, programs, 1, latency_s + 2 * c_chunks * _fitted(hw, "dft2_contract_step_s")))
        add("inverse DFT GEMM + bias", flops=unit_scale * 2.0 * max(t * n, 16) * b * b, family="fft_chain", unit="matrix",
            moved=sb * (t * n * b + b * b) + db * (t * out_features + (out_features if bias else 0)), serial_s=gemm_floor(t * n))
    return chain(f"fft_chain[{impl}] B={b} K={k}", *parts)


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


__all__ = ["IMPLEMENTATIONS", "available_implementations", "choose_implementation", "estimate_fft_chain"]
