"""Tile configurations of the FP4 kernels: the KernelConfig of one launch, the candidates the
compile-time tuner times (DECODE_CONFIGS, PREFILL_CONFIGS), the untuned defaults, and the rules of
which tile can run which shape (`_valid_config`) on which device (`_runs_here`).

Paths: "gemv" (decode kernels, decode.py), "gemm" (the fused dequant-GEMM, prefill.py) and "dequant"
(the dequantize kernel, then cuBLAS). Which path a call takes is chosen at compile time by the cost
model (graphopt.cost.fp4) and handed to the op in its kernel string; `default_path` is the static
rule for a call that names none."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphopt.kernels import fp4_tma
from graphopt.kernels.fp4 import decode_persistent
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
    # > 0: one-token decode on decode_persistent's Gluon kernel (sm_80+), this many programs per SM; block_n
    # = rows per group (block_n / num_warps per warp), num_stages = chunks loaded ahead (its depth)
    programs_per_sm: int = 0
    # > 0: the persistent kernel's register cap (ptxas maxnreg): 65536 / (32 x num_warps x programs_per_sm)
    # lets every program of the tile sit on its SM where the fused prologues would take a few more
    max_registers: int = 0

    @property
    def gluon(self) -> bool:
        """Whether a Gluon kernel runs this tile: Inductor cannot launch one from its generated code, so
        the op calls graphopt::fp4_gluon_linear (opaque), and the tuner offers it only under CUDA graphs."""
        return self.tma or self.programs_per_sm > 0


FMA_BLOCK_M: tuple[int, ...] = (1, 2, 4)  # decode BLOCK_M values of the CUDA-core kernel
INT_BLOCK_M: tuple[int, ...] = (1, 2, 4)  # and of the integer-dot one
MIN_DECODE_BLOCK_N = 8  # narrowest decode tile; sizes the split-K counters (one per tile)
MMA_BLOCK_M: tuple[int, ...] = (16, 32, 64)  # tokens per program of the tensor-core decode kernel (its MMA's N)
# Candidates the compile-time tuner (tune.py) times once per (path, token bucket, N, K, format,
# dtype, bias, device) on a GPU. Kept short: every distinct tile costs a compile. Each tile
# below is one the tuner chose in a committed run (bench/results/fp4_linear_*.json, "tuned"), or a
# fallback that keeps a tile for every shape; tiles that were timed in those runs and never chosen
# (by a kernel that runs wherever they do: a loss to the TMA kernel does not count) are not listed.
#  - The CUDA-core kernel (_fp4_gemv_words_kernel, BLOCK_M 1, 2 or 4 tokens per program): narrow
#    tiles of 8-16 rows (fp4_linear_mma_decode_h100.json at 1 token, fp4_linear_h200.json at 4);
#    BLOCK_K 64 keeps a tile for every K (a multiple of 64).
#  - The tensor-core kernel (_fp4_gemv_words_mma_kernel, 16, 32 or 64 tokens per program): 64 x 128
#    or 128 x 256 elements split 4-16 at 16 tokens, 128 x 128 split 8 and 64 x 256 split 4 at 32
#    (fp4_linear_64tok_h100.json, fp4_linear_1_256tok_h100.json), and the same kernel on
#    pre-permuted activations (permute_x: one more launch per call, no shuffle of the activation
#    tile in the kernel), which won every 64-token call of fp4_linear_1_256tok_h100.json. Unsplit
#    128-element tiles keep a 32- and a 64-token candidate for K = 128.
#  - Integer dot products (_fp4_gemv_int_kernel) at 1 and 2 tokens per program: 16-32 rows of
#    256-2048 elements (fp4_linear_1_2tok_h100.json, fp4_linear_13b_mlp_h100.json,
#    fp4_linear_1_64tok_h100.json).
#  - fp4_tma's Gluon kernel (TMA-fed words, activations and scales; sm_90+, NVFP4, bf16
#    activations): 64 rows x 256 elements, 4 warps, 2 ring slots, at 16, 32 and 64 tokens per
#    program with the splits it won (fp4_linear_1_64tok_h100.json, fp4_linear_13b_mlp_h100.json).
#  - One token: integer dots at 16 x 1024, the fastest integer-dot tile on three of LLaMA-3-8B's four
#    decode shapes, and decode_persistent's kernel at the tiles among the four fastest on some shape
#    and format (2-4 rows per warp, 4 or 8 warps, 2-8 programs per SM; one chunk ahead, three at
#    K = 14336), in bench_decode_persistent.py's run (results/decode_persistent_1tok_h200.json), and
#    one row per warp, 8 warps, 4 programs per SM, three chunks ahead: the fastest NVFP4 tile on
#    4096 -> 28672 and tied fastest on 4096 -> 4096 in results/decode_persistent_fp4_1tok_h200.json;
#    and 2 rows per warp, 4 warps, 5 programs per SM (registers capped to fit them), three chunks
#    ahead: eight-row groups in one even wave over the SMs where the rows divide into no whole waves
#    of the larger groups, the fastest NVFP4 tile on LLaMA-2-13B's down projection
#    (results/decode_persistent_13b_balanced_tiles_h200.json).
DECODE_CONFIGS: tuple[KernelConfig, ...] = (
    tuple(KernelConfig(bn, bm, bk, sk, num_warps=w, num_stages=1)
          for bn, bm, bk, sk, w in ((16, 4, 256, 1, 4), (16, 4, 256, 4, 4), (8, 1, 1024, 1, 4), (8, 1, 1024, 4, 4),
                                    (8, 1, 256, 1, 1), (8, 1, 256, 4, 1), (8, 2, 1024, 4, 4), (8, 4, 1024, 4, 4)))
    + tuple(KernelConfig(16, bm, 64, 1, num_warps=4, num_stages=1) for bm in FMA_BLOCK_M)
    + tuple(KernelConfig(bn, bm, bk, sk, num_warps=4, num_stages=1, permute_x=permuted)
            for bn, bm, bk, sk, permuted in (
                (64, 16, 128, 4, False), (64, 16, 128, 8, False), (128, 16, 256, 4, False), (128, 16, 256, 8, False),
                (128, 16, 256, 16, False), (128, 32, 128, 8, False), (64, 32, 256, 4, False), (128, 32, 128, 1, False),
                (64, 16, 128, 4, True), (64, 16, 128, 8, True), (128, 16, 256, 8, True), (128, 16, 256, 16, True),
                (64, 32, 256, 8, True), (64, 32, 256, 4, True), (128, 64, 256, 8, True), (128, 64, 128, 8, True),
                (128, 64, 128, 4, True), (128, 64, 128, 2, True), (128, 64, 128, 1, True)))
    + tuple(KernelConfig(bn, bm, bk, sk, num_warps=w, num_stages=1, int_dots=True)
            for bn, bm, bk, sk, w in ((16, 1, 512, 1, 4), (16, 1, 256, 8, 1), (32, 1, 256, 8, 1), (32, 1, 512, 1, 4),
                                      (16, 1, 2048, 1, 4), (32, 1, 256, 2, 1), (16, 1, 256, 1, 1), (16, 2, 256, 4, 1),
                                      (16, 2, 256, 8, 1)))
    + tuple(KernelConfig(64, bm, 256, sk, num_warps=4, num_stages=2, tma=True)
            for bm, sk in ((16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4), (64, 1), (64, 4), (64, 8)))
    + (KernelConfig(16, 1, 1024, 1, num_warps=4, num_stages=1, int_dots=True),)
    + tuple(KernelConfig(rows * warps, 1, 8 * decode_persistent.CHUNK_WORDS, num_warps=warps, num_stages=depth,
                         programs_per_sm=per_sm, max_registers=cap)
            for rows, warps, per_sm, depth, cap in ((4, 4, 4, 1, 0), (4, 4, 8, 1, 0), (2, 8, 2, 1, 0), (2, 4, 4, 1, 0),
                                                    (2, 8, 2, 3, 0), (1, 8, 4, 3, 0), (1, 8, 4, 3, 64), (2, 4, 5, 3, 96)))
)
# Prefill: the fused dequant-GEMM tiles chosen in those runs.
PREFILL_CONFIGS: tuple[KernelConfig, ...] = (
    KernelConfig(128, 128, 64, num_warps=8, num_stages=3),
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
# 5120x13824 (bench/results/fp4_dequant_tiles_h100.json): (8, 1024, 4, 0) beat (64, 64, 4, 0),
# and the interleaved (4, 1024, 4, 1) was fastest, the closest to the copy rate.
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
    32: KernelConfig(64, 32, 256, 8, num_warps=4, num_stages=1, permute_x=True),
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
    if cfg.programs_per_sm:  # the persistent one-token kernel: its own tile rules
        return (path == "gemv" and m <= 1 and cfg.block_m == 1 and cfg.split_k == 1
                and not (cfg.int_dots or cfg.permute_x or cfg.tma) and cfg.block_n % cfg.num_warps == 0
                and decode_persistent.tile_problem(cfg.block_n // cfg.num_warps, cfg.num_warps, cfg.num_stages,
                                                   cfg.programs_per_sm) is None)

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
    needs an sm_90+ GPU (never the interpreter) and bf16 in and out; the persistent one an sm_80+ GPU
    and its output in x's dtype (bf16 or fp16); the Triton kernels run anywhere."""
    if cfg.programs_per_sm:
        return not INTERPRET and out_dtype == x2.dtype and decode_persistent.supports(x2)
    return not cfg.tma or (not INTERPRET and out_dtype == torch.bfloat16 and fp4_tma.supports(x2))


def _worth_timing(cfg: KernelConfig, path: str, m: int, k_padded: int) -> bool:
    """Tuning filter. 1-4 tokens: the CUDA-core kernels (FMA or integer dots) with BLOCK_M = the
    token bucket, or the tensor-core kernel; 5-16 tokens: CUDA-core with 4 tokens per program or
    the tensor-core kernel; 17-32: the tensor-core kernel with 32 tokens per program; more: 32 or
    64 (on the H100, 16-token programs were slower at 32 and 64 tokens). A K split keeps at
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


def _candidates(path: str, args: tuple, allow_gluon: bool) -> list[KernelConfig]:
    x2, codes, _, _, _, out_features, _, format, out_dtype = args
    m, k_padded, bs = x2.shape[0], codes.shape[1] * 2, BLOCK_SIZES[format]
    valid = [cfg for cfg in (DECODE_CONFIGS if path == "gemv" else PREFILL_CONFIGS)
             if _valid_config(cfg, path, m, out_features, k_padded, bs) and _runs_here(cfg, x2, out_dtype)
             and (allow_gluon or not cfg.gluon)]
    # the tuning filter's picks, or every valid tile where it leaves none (a short K, say)
    return [cfg for cfg in valid if _worth_timing(cfg, path, m, k_padded)] or valid

