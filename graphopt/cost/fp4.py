"""Cost model of graphopt::fp4_linear (graphopt.kernels.fp4): the predicted time of each kernel path
on a HardwareSpec, and the path the op runs for a token count.

`estimate_fp4_linear` prices the paths (gemv: the decode kernels; gemm: the fused dequant-GEMM;
dequant: the dequantize kernel then cuBLAS) with the roofline core of graphopt.cost_model
(families fp4_gemv / fp4_gemm); `choose_fp4_path` picks the fastest. The fp4_linear pass asks
these at compile time and hands the op its path (and tile) in the kernel string: `device_path` is
the choice for a CUDA device, `path_ranges` that choice for every token count.
"""

from __future__ import annotations

import functools

import torch

from graphopt import hardware
from graphopt.cost_model import KERNEL_EFFICIENCY, Estimate, chain, linear, roofline
from graphopt.kernels import fp4_tma
from graphopt.kernels.fp4 import (FMA_BLOCK_M, MMA_BLOCK_M, PATHS, PREFILL_CONFIGS, _padded_k, default_path,
                                  fp4_weight_bytes)

# A roofline per kernel path: max(CUDA-core decode work, tensor-core FLOPs, memory traffic) plus
# one launch overhead per kernel. The rates are the device ceilings (graphopt.hardware) times the
# fp4_gemv / fp4_gemm efficiencies in graphopt.cost_model.KERNEL_EFFICIENCY and the constants
# below. The prefill paths (gemm, dequant) are fitted to bench/results/fp4_linear_h200.json (H200,
# torch 2.11, triton 3.6, NVFP4, bf16 activations, cuBLAS bf16 baseline; ceilings 690 TFLOP/s
# bf16, 4.22 TB/s copy, 6 us launch): 64 tokens 0.17-0.31x of cuBLAS on the best path, 256 tokens
# 0.2-0.3x, 4096 tokens (dequant + cuBLAS) 0.67-0.71x there. The decode kernels are fitted
# separately, below.
# tests/test_cost_model_measured.py checks the faster/slower call against both files.

# The decode (gemv) kernels work on word tiles; their constants are fitted to
# bench/results/fp4_linear_mma_decode_h100.json (H100, NVFP4, L2-cold, the six LLaMA shapes,
# the DECODE_CONFIGS (kernels/fp4/configs.py), PTX conversions, the tensor-core kernel; predicted / measured
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



def _fp4_kernel_estimate(hw, name: str, family: str, *, decode_ops: float = 0.0, mma_flops: float = 0.0,
                         bytes_moved: float = 0.0, sm_fill: float = 1.0, launches: int = 1,
                         memory_fraction: float | None = None, latency_s: float = 0.0):
    """One kernel: CUDA-core decode ops and bytes at `family`'s efficiencies (or `memory_fraction`
    of the copy bandwidth), tensor-core FLOPs at cuBLAS's; the slowest of the three, divided by the
    fraction of SMs its grid fills, plus a fixed `latency_s` and its launches."""
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
    the kernels' _runs_here and _valid_config tma rules): Gluon in this Triton, an sm_90+ GPU, NVFP4, bf16
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


@functools.lru_cache(maxsize=4096)
def device_path(device_index: int | None, tokens: int, in_features: int, out_features: int, fmt: str,
                act_dtype: torch.dtype) -> str:
    """The path for calls of `tokens` rows on CUDA device `device_index`: choose_fp4_path on its spec
    (graphopt.hardware.device_spec, with its measured ceilings), cached (an estimate costs ~40 us of
    Python); without a GPU spec (None: the interpreter) the kernels' static default_path."""
    hw = None if device_index is None else hardware.device_spec(device_index)
    if hw is None or not hw.is_gpu:
        return default_path(tokens)
    return choose_fp4_path(hw, tokens, in_features, out_features, fmt, act_dtype)


# path_ranges prices the power-of-two token buckets up to this count; the last path holds beyond it
# (every term of every path grows linearly in the tokens there, so their order no longer changes).
PATH_RANGES_MAX_BUCKET = 1 << 24


def path_ranges(device_index: int | None, in_features: int, out_features: int, fmt: str,
                act_dtype: torch.dtype) -> list[tuple[int, int | None, str]]:
    """device_path for every token count, as (lo, hi, path) ranges: the counts of one power-of-two
    bucket, (bucket / 2, bucket], share the bucket's path; neighbours with the same path are merged,
    and the last range is open-ended (hi None). For an op whose token count is not known at
    compile time (graphopt.kernels.fp4.kernel_string of these, with default tiles)."""
    ranges: list[tuple[int, int | None, str]] = []
    bucket = 1
    while bucket <= PATH_RANGES_MAX_BUCKET:
        path = device_path(device_index, bucket, in_features, out_features, fmt, act_dtype)
        if ranges and ranges[-1][2] == path:
            ranges[-1] = (ranges[-1][0], bucket, path)
        else:
            ranges.append((1 if bucket == 1 else bucket // 2 + 1, bucket, path))
        bucket *= 2
    ranges[-1] = (ranges[-1][0], None, ranges[-1][2])
    return ranges
