"""Tile configurations of the FP4 kernels: the KernelConfig of one launch, the candidates the
compile-time tuner times (DECODE_CONFIGS, PREFILL_CONFIGS), the untuned defaults, and the rules of
which tile can run which shape (`_valid_config`) on which device (`_runs_here`).

Paths: "gemv" (decode kernels, decode.py), "gemm" (the fused dequant-GEMM, prefill.py) and "dequant"
(the dequantize kernel, then cuBLAS). Which path a call takes is chosen at compile time by the cost
model (graphopt.cost.fp4) and handed to the op in its kernel string; `default_path` is the static
rule for a call that names none."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from graphopt.kernels import fp4_tma
from graphopt.kernels.fp4.format import BLOCK_SIZES, KERNEL_K_MULTIPLE
from graphopt.kernels.launch import INTERPRET

PATHS: tuple[str, ...] = ("gemv", "gemm", "dequant")


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
MMA_BLOCK_M: tuple[int, ...] = (16, 32, 64)  # tokens per program of the tensor-core decode kernel (its MMA's N)
# Candidates the compile-time tuner (tune.py) times once per (path, token bucket, N, K, format,
# dtype, bias, device) on a GPU. Kept short: every distinct tile compiles once (~1 s). Decode:
# BLOCK_M 1, 2 or 4 is the CUDA-core kernel (_fp4_gemv_words_kernel, that many tokens per
# program), 16, 32 or 64 the tensor-core one
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
DEQUANT_CONFIG = KernelConfig(64, 1, KERNEL_K_MULTIPLE)  # placeholder: the dequant path has no tile choice


# Dequantize tile: (rows, elements per row, warps, interleave) per program. interleave 1: one
# contiguous store per row (INTERLEAVE in _fp4_dequantize_kernel), 0: two half-block stores. The
# first entry is the default; bench_fp4.py --dequant-sweep times them all. H100, NVFP4, W bf16
# 5120x13824 (bench/results/fp4_dequant_tiles_h100.json): (64, 64, 4, 0) 0.31 ms;
# (8, 1024, 4, 0) 0.147 ms; interleaved (4, 1024, 4, 1) 0.071 ms = 2.55 TB/s, 0.86 of the copy.
DEQUANT_TILES: tuple[tuple[int, int, int, int], ...] = (
    (4, 1024, 4, 1), (8, 1024, 4, 1), (4, 2048, 4, 1), (16, 512, 4, 1), (2, 4096, 8, 1),
    (8, 1024, 4, 0), (4, 2048, 4, 0), (2, 4096, 8, 0),
)

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


def default_path(tokens) -> str:
    """The path of a call whose kernel string names none: decode up to the interpreter's decode tile
    (16 tokens), else the tiled GEMM. A static rule; the cost model's choice comes from the pass."""
    return "gemv" if tokens <= INTERPRET_DECODE_CONFIG.block_m else "gemm"


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


def _candidates(path: str, args: tuple, allow_tma: bool) -> list[KernelConfig]:
    x2, codes, _, _, _, out_features, _, format, out_dtype = args
    m, k_padded, bs = x2.shape[0], codes.shape[1] * 2, BLOCK_SIZES[format]
    valid = [cfg for cfg in (DECODE_CONFIGS if path == "gemv" else PREFILL_CONFIGS)
             if _valid_config(cfg, path, m, out_features, k_padded, bs) and _runs_here(cfg, x2, out_dtype)
             and (allow_tma or not cfg.tma)]
    # the tuning filter's picks, or every valid tile where it leaves none (a short K, say)
    return [cfg for cfg in valid if _worth_timing(cfg, path, m, k_padded)] or valid

