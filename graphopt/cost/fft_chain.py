"""Cost model of the FFT chain (family "fft_chain"): the predicted time of each implementation of
graphopt.kernels.fft_chain on a HardwareSpec, as replayed from a CUDA graph, and the choice of the
fastest one, which the fft_linear pass makes per call site at compile time."""

from __future__ import annotations

import math

from graphopt.cost_model import Estimate, chain, roofline
from graphopt.kernels.fft_chain.launchers import IMPLEMENTATIONS, _pow2_at_least, available_implementations
from graphopt.kernels.fft_chain.layer import chain_dims

# A physical roofline per kernel launch, as replayed from a CUDA graph. Five constants, fitted
# (least squares on log time) to the H200 timings of the current kernels
# (bench/results/fft_chain_h200.json: torch/triton/dft at B=512 K=2, 16/256/4096 tokens;
# fft_chain_h200.log: 48 explore-fft dft rows, B=256-2048, K=2-16; the torch/triton rows
# of fft_chain_h200_round1.json and explore_fft_h200/), with the measured ceilings
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
