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
from graphopt.cost import coefficients
from graphopt.cost_model import Estimate, chain, family_efficiency, linear, roofline
from graphopt.kernels import fp4_tma
from graphopt.kernels.fp4 import (FMA_BLOCK_M, MMA_BLOCK_M, PATHS, PREFILL_CONFIGS, _padded_k, default_path,
                                  fp4_weight_bytes)

# A roofline per kernel path: max(CUDA-core decode work, tensor-core FLOPs, memory traffic) plus
# one launch overhead per kernel. The rates are the device ceilings (graphopt.hardware) times the
# fp4_gemv / fp4_gemm family efficiencies and the "fp4.*" coefficients of the GPU's data file
# (graphopt.cost.coefficients), each fitted to the run its entry names:
#  - fma_gemv_decode_ops_per_weight: the CUDA-core word-tile kernel (BLOCK_M in FMA_BLOCK_M): code
#    and scale decode ops per weight beside one fp32 FMA (2 ops) per token row;
#  - int_gemv_decode_ops_per_weight, int_gemv_ops_per_extra_row: the integer-dot kernel at 1 token,
#    and per extra token row of a program (INT_GEMV_MAX_ROWS);
#  - gemv_mma_decode_ops_per_weight, gemv_mma_ops_per_extra_row: the Triton tensor-core decode per
#    program of 16 tokens, and per token row past 16 (programs of 32 or 64);
#  - tma_decode_ops_per_weight, tma_decode_latency_s, tma_decode_latency_s_per_extra_row: the Gluon
#    decode fed by TMA (kernels/fp4_tma.py): per-weight ops, and a fixed latency beyond the launch
#    (the ring's first loads, the split-K epilogue) that grows per token row past 16;
#  - mma_decode_ops_per_weight: the fused prefill GEMM decodes each weight to bf16 once per
#    BLOCK_M token rows, and leaves SMs idle when its grid has fewer tiles than SMs;
#  - dequant_copy_fraction: the `dequant` path's kernel writes W in bf16 at this fraction of the
#    copy bandwidth.
# tests/cost/test_fit_regression.py checks the faster/slower call against the measured files, and
# bench/validate_cost_model.py the agreement on held-out shapes.
INT_GEMV_MAX_ROWS = 2  # the integer-dot tiles in DECODE_CONFIGS take 1 or 2 tokens per program


def _fitted(hw, name: str) -> float:
    return coefficients.value(hw, f"fp4.{name}")


def _fp4_kernel_estimate(hw, name: str, family: str, *, decode_ops: float = 0.0, mma_flops: float = 0.0,
                         bytes_moved: float = 0.0, sm_fill: float = 1.0, launches: int = 1,
                         memory_fraction: float | None = None, latency_s: float = 0.0):
    """One kernel: CUDA-core decode ops and bytes at `family`'s efficiencies (or `memory_fraction`
    of the copy bandwidth), tensor-core FLOPs at cuBLAS's; the slowest of the three, divided by the
    fraction of SMs its grid fills, plus a fixed `latency_s` and its launches."""
    compute_eff, memory_eff = family_efficiency(hw, family)
    memory_eff = memory_fraction if memory_fraction is not None else memory_eff
    decode_s = decode_ops / (hw.fp32_flops * compute_eff)
    mma_s = mma_flops / (hw.matrix_ceiling * family_efficiency(hw, "cublas_gemm")[0])
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
            decode_ops=weights * (_fitted(hw, "fma_gemv_decode_ops_per_weight") + 2.0 * fma_rows),
            bytes_moved=w_bytes + act_bytes))
    if tokens <= INT_GEMV_MAX_ROWS:  # CUDA cores with integer dot products
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 GEMV (Triton, CUDA cores, integer dots, {tokens} row(s))", "fp4_gemv",
            decode_ops=weights * (_fitted(hw, "int_gemv_decode_ops_per_weight")
                                  + _fitted(hw, "int_gemv_ops_per_extra_row") * (tokens - 1)),
            bytes_moved=w_bytes + act_bytes))
    for block_m in MMA_BLOCK_M:  # tensor cores: W is read and decoded once per block_m tokens
        passes = -(-tokens // block_m)
        ops_per_weight = (_fitted(hw, "gemv_mma_decode_ops_per_weight")
                          + _fitted(hw, "gemv_mma_ops_per_extra_row") * (block_m - MMA_BLOCK_M[0]))
        candidates.append(_fp4_kernel_estimate(
            hw, f"FP4 GEMV (Triton, tensor cores, {passes} pass(es) of {block_m} tokens)", "fp4_gemv",
            decode_ops=weights * passes * ops_per_weight, mma_flops=2.0 * block_m * passes * weights,
            bytes_moved=w_bytes * passes + act_bytes))
        if tma and passes == 1:  # the same tiles through TMA: fewer ops per weight, a longer fixed
            # latency; fitted and measured up to 64 tokens (one pass), so not predicted past that
            candidates.append(_fp4_kernel_estimate(
                hw, f"FP4 GEMV (Gluon, TMA + tensor cores, {block_m} tokens)", "fp4_gemv",
                decode_ops=weights * _fitted(hw, "tma_decode_ops_per_weight"), mma_flops=2.0 * block_m * weights,
                bytes_moved=w_bytes + act_bytes,
                latency_s=_fitted(hw, "tma_decode_latency_s")
                + _fitted(hw, "tma_decode_latency_s_per_extra_row") * (block_m - MMA_BLOCK_M[0])))
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
            decode_ops=weights * m_tiles * _fitted(hw, "mma_decode_ops_per_weight"),
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
    `dequant` writes W in bf16 once (fp4.dequant_copy_fraction of the copy bandwidth) and runs the
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
                                 memory_fraction=_fitted(hw, "dequant_copy_fraction")),
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
    (graphopt.hardware.device_spec, with its measured ceilings), cached (an estimate is too much
    Python to repeat per call); without a GPU spec (None: the interpreter) the kernels' static
    default_path."""
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
