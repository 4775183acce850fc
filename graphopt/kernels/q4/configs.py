"""Tile configurations of the Q4 kernels: `TileConfig` (one launch shape), the candidates the
compile-time tuner times per token count (`candidate_configs`, `tma_configs`), and the untuned
default (`default_config`, a fixed table)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from graphopt.kernels.q4 import decode_persistent

REDUCE_MODES = ("workspace", "atomic", "last")  # TileConfig.reduce choices (split-K partial sums)
TILE_KERNELS = ("gemm", "swap", "gemv", "dp4a", "tma", "persistent")  # TileConfig.kernel choices


@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the Q4 kernels.

    kernel "gemm": tensor-core int8 tl.dot; a BLOCK_M x BLOCK_N output tile, PAIRS block pairs
      (64 K values, one 32-deep dot per block) per K step.
    kernel "swap": the same kernel with the operands swapped for few tokens (SWAP_AB): BLOCK_N
      weight rows on the MMA's M side (64 per warpgroup of num_warps), BLOCK_M tokens on its N
      side (8 or 16 for decode, 32 for 17-64 tokens), the unpacked weights in registers as
      wgmma's A operand.
    kernel "dp4a": the decode kernel with integer dot products: the Q8_1 activations packed four
      int8 per word in registers and dp4a (4 MACs per instruction) against the nibbles of each
      weight word; same tiling fields as "gemv".
    kernel "tma": q4_tma's Gluon decode (sm_90+, the separate path: a quantize launch, then weights
      and activations fed by TMA): block_n weight rows (64 per warpgroup), block_m tokens (8 or 16,
      the MMA's N), pairs 4 (K steps of 256), num_stages ring slots; split-K reduces "last".
    kernel "persistent": decode_persistent's Gluon decode of 1-8 tokens (sm_80+, either mode: it
      quantizes the activations itself): block_n rows per group (block_n / num_warps per warp),
      num_stages chunks loaded ahead, programs_per_sm programs per SM; block_m the token bucket it was
      tuned for (1, 2 or 4; any count up to decode_persistent.MAX_TOKENS runs), split_k 1.
    kernel "gemv": the decode kernel (fp32 FMAs, no tensor cores); block_m token rows per program
      (0: min(GEMV_MAX_ROWS, next power of two of the token count)), block_n weight rows per program,
      PAIRS block pairs per iteration (every weight row streams 32 * PAIRS contiguous bytes a step).
    split_k: programs along K (1: none; 0: enough for PROGRAMS_PER_SM programs per SM). Their fp32
      partial sums are combined by `reduce`: "workspace" (split s writes slice s of an fp32
      [SPLIT_K, M, N] buffer; a small kernel sums the slices, adds the bias and casts) or "atomic"
      (tl.atomic_add into a zeroed fp32 [M, N] buffer, then the same small kernel with one slice), or
      "last" (atomics into a zeroed fp32 [M, N] buffer; the split that finishes a tile last, by an
      arrival counter, writes the output with bias: no sum kernel).
    """

    kernel: str  # "gemm" | "swap" | "gemv" | "dp4a" | "tma" | "persistent"
    block_m: int
    block_n: int
    pairs: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    reduce: str = "workspace"
    programs_per_sm: int = 0  # "persistent" only

    def __post_init__(self):
        if self.kernel not in TILE_KERNELS:
            raise ValueError(f"TileConfig.kernel {self.kernel!r} is not valid; valid choices: {', '.join(TILE_KERNELS)}")
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"TileConfig.reduce {self.reduce!r} is not valid; valid choices: {', '.join(REDUCE_MODES)}")
        if self.kernel in ("gemm", "swap") and self.pairs not in (1, 2, 4):
            raise ValueError(f"gemm/swap configs take 1, 2 or 4 block pairs per K step, got {self.pairs}")
        if self.kernel in ("gemv", "dp4a") and (self.pairs & (self.pairs - 1) or self.block_m > GEMV_MAX_ROWS
                                      or self.block_m & (self.block_m - 1)):
            raise ValueError(f"gemv configs need power-of-two pairs and block_m (0..{GEMV_MAX_ROWS}), got {self}")
        if self.kernel == "tma" and not (self.pairs == 4 and self.block_m in (8, 16) and self.num_warps == 4
                                         and self.block_n in (64, 128) and self.reduce == "last"
                                         and self.num_stages >= 1 and self.split_k >= 1):
            raise ValueError(f"tma configs take pairs=4, block_m 8 or 16, block_n 64 or 128, 4 warps, reduce "
                             f"'last' and an explicit split_k, got {self}")
        if (self.kernel == "persistent") != (self.programs_per_sm > 0):
            raise ValueError(f"programs_per_sm > 0 goes with the persistent kernel and only with it, got {self}")
        if self.kernel == "persistent" and not _persistent_tile_fits(self):
            raise ValueError(f"persistent configs take block_m 1-{decode_persistent.MAX_TOKENS}, split_k 1, block_n = rows x num_warps with rows in "
                             f"{decode_persistent.ROWS_CHOICES}, num_warps in {decode_persistent.WARPS_CHOICES}, "
                             f"num_stages in {decode_persistent.DEPTH_CHOICES} and rows x (num_stages + 1) <= "
                             f"{decode_persistent.MAX_ROWS_IN_FLIGHT}, got {self}")

    @property
    def name(self) -> str:
        if self.kernel == "persistent":
            return (f"persistent_r{self.block_n // self.num_warps}w{self.num_warps}p{self.programs_per_sm}"
                    f"d{self.num_stages}")
        base = f"{self.kernel}_m{self.block_m}n{self.block_n}k{64 * self.pairs}_w{self.num_warps}s{self.num_stages}"
        if self.split_k == 1:
            return base
        reduce = {"workspace": "W", "atomic": "A", "last": "L"}[self.reduce]
        return f"{base}_sk{'auto' if self.split_k == 0 else self.split_k}{reduce}"

    def shared_memory_bytes(self, act_bytes: int) -> int:
        """Estimate of the shared memory one CTA needs: pipelined activation and weight tiles
        (act_bytes per activation value: 2 for the fused bf16 input, 1 for Q8_1) plus the int8
        operand tiles the dot reads from shared memory."""
        if self.kernel in ("gemv", "dp4a", "persistent"):
            return 0
        k_step = 64 * self.pairs
        if self.kernel == "tma":  # per slot: weight bytes, int8 activations, d4, d and s
            return self.num_stages * (self.block_n * k_step // 2 + self.block_m * k_step + 16 * self.block_n
                                      + 64 * self.block_m)
        if self.kernel == "swap":  # the weights stay in registers
            return self.num_stages * self.block_m * k_step * act_bytes + self.block_m * k_step
        staged = self.num_stages * (self.block_m * k_step * act_bytes + self.block_n * k_step // 2)
        operands = self.block_m * k_step + k_step * self.block_n
        return staged + operands


GEMV_MAX_ROWS = 8  # token rows one gemv program handles (more rows: more programs along M)
GEMV_MAX_TOKENS = 8  # token counts for which the gemv kernel is a candidate
DECODE_MAX_TOKENS = 16
PROGRAMS_PER_SM = 4  # split_k=0 aims at this many programs per SM

# Each tile list below holds the tiles the tuner chose in a committed run (bench/results/q4_*.json,
# "tuned") or that were the fastest of a tile sweep there; tiles those runs timed and never chose
# are not listed.
_GEMV_DEFAULT = TileConfig("gemv", 0, 64, 8, 4, 1, 0, "workspace")
_GEMV_CONFIGS = [_GEMV_DEFAULT] + [TileConfig("gemv", 0, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
    (64, 8, 4, 1, 0, "atomic"), (64, 8, 4, 3, 0, "workspace"))] + [
    TileConfig("dp4a", 0, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
        (32, 8, 4, 1, 0, "workspace"),
        # one-warp tiles of 16-32 rows: the fastest dp4a configs of the H100 sweep at 1 and 4
        # tokens (bench/results/q4_decode_h100_wide.*)
        (32, 4, 1, 1, 4, "workspace"), (16, 8, 1, 1, 4, "workspace"), (32, 8, 1, 1, 0, "workspace"),
        (16, 8, 1, 1, 0, "workspace"),
        # the same with the single-launch split-K reduction (no separate sum kernel)
        (32, 4, 1, 1, 4, "last"), (16, 8, 1, 1, 4, "last"), (32, 8, 1, 1, 0, "last"), (16, 8, 1, 1, 0, "last"),
        # a split of 8 (q4_decode_h100_splits.*): the best one-token tile on 13824->5120, faster
        # than the best of the tiles above in the same run
        (16, 4, 1, 1, 8, "last"))]
_DECODE_GEMM_CONFIGS = [TileConfig("gemm", 16, bn, p, w, s, sk, r) for bn, p, w, s, sk, r in (
    (64, 2, 4, 3, 0, "workspace"), (128, 2, 4, 3, 0, "workspace"), (64, 4, 4, 3, 0, "atomic"))]
# The operand-swapped decode tiles ("swap"), for token blocks of 8 or 16 (wgmma's N side); (block_n,
# pairs, warps, stages, reduce[, split_k]). The H100 sweep (bench/results/q4_decode_h100_swap.*):
# one warpgroup on 128 rows with 3 stages was best on all six rows (ahead of 64-row tiles, two
# warpgroups and 1 stage); 256-row tiles need fewer instructions per weight offline
# (0.20 against 0.29 warp-instructions at 16 tokens) at 189 registers. Deeper pipelines did not
# help (q4_decode_h100_swap_stages.*, 128-row tiles): 4 stages were slower than 3 on three of
# four rows and faster on the fourth; 6 stages were slower on all four.
_SWAP_SHAPES = ((128, 1, 4, 3, "last", 16), (128, 1, 4, 3, "last"), (128, 1, 4, 4, "last", 16),
                (256, 1, 4, 3, "last", 16))


def swap_configs(m: int, shapes=_SWAP_SHAPES) -> list[TileConfig]:
    """The "swap" decode configs for m tokens (one token block of 8 or 16 columns); shapes are
    (block_n, pairs, warps, stages, reduce[, split_k]), split_k 0 (automatic) when left out."""
    block_m = 8 if m <= 8 else 16
    return [TileConfig("swap", block_m, *shape[:4], shape[5] if len(shape) > 5 else 0, shape[4]) for shape in shapes]


# 64 x 256 tiles (8 warps): the fused kernel re-quantizes its activation tile once per N tile, so
# wider N tiles halve that work. Offline sm_90 compile (triton 3.9), warp-instructions per output
# element and K value: 0.0096 fused / 0.0070 separate, against 0.0135 / 0.0075 at 64 x 128.
_WIDE_N_CONFIGS = [TileConfig("gemm", 64, 256, 1, 8, 3, 0)]
_MID_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s, sk) for bm, bn, p, w, s, sk in (
    (32, 64, 2, 4, 3, 0), (32, 128, 2, 4, 3, 0), (64, 128, 2, 8, 3, 1))] + _WIDE_N_CONFIGS
# 17-64 tokens: the operand-swapped kernel on blocks of 32 tokens (two at 64 tokens; the token
# block is the grid's fastest axis, so the second block's read of W can hit L2). H100, 64 tokens,
# fused (bench/results/q4_decode_swap_64tok_h100.*): faster on 5120->13824 and 13824->5120 than
# the best "gemm" tile and than 64-token blocks.
_MID_SWAP_CONFIGS = [TileConfig("swap", 32, bn, 1, 4, 3, 0, "last") for bn in (128, 256)]
_LARGE_CONFIGS = [TileConfig("gemm", bm, bn, p, w, s) for bm, bn, p, w, s in (
    (128, 128, 1, 8, 3), (128, 64, 2, 4, 4))] + _WIDE_N_CONFIGS


def tma_configs(m: int) -> list[TileConfig]:
    """q4_tma's decode tiles for m <= 16 tokens (8- or 16-token blocks, 64-row tiles, 2-3 slots)."""
    block_m = 8 if m <= 8 else 16
    return [TileConfig("tma", block_m, 64, 4, 4, stages, split, "last") for split in (1, 2, 4, 8) for stages in (2, 3)]


def _persistent_tile_fits(cfg: TileConfig) -> bool:
    rows = cfg.block_n // max(cfg.num_warps, 1)
    return (1 <= cfg.block_m <= decode_persistent.MAX_TOKENS and cfg.split_k == 1 and rows * cfg.num_warps == cfg.block_n
            and decode_persistent.tile_problem(rows, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm) is None)


# decode_persistent's tiles (rows per warp, warps, programs per SM, chunks ahead). One token: the
# four fastest on LLaMA-3-8B's decode shapes in bench_decode_persistent.py
# (results/decode_persistent_1tok_h200.json); 4 x 4, 4 per SM, one ahead was fastest on all four; and
# 2 x 8, 2 per SM, three ahead, the fastest on LLaMA-2-13B's up projection
# (results/decode_persistent_13b_balanced_tiles_h200.json).
# 2-4 tokens: the two that were fastest on some shape (results/decode_persistent_q4_2to8tok_h200.json:
# at 2 tokens the kernel beat the other tiles on three of the four shapes, at 4 on the widest only).
# Past 4 tokens none is offered: every token adds its dp4a per word, and at 8 tokens the kernel was
# slower than q4_tma's tile on all four shapes.
_PERSISTENT_TILES = ((4, 4, 4, 1), (2, 4, 4, 1), (2, 8, 2, 3), (2, 8, 2, 2), (2, 8, 2, 1))
_PERSISTENT_MULTI_TOKEN_TILES = ((2, 8, 2, 1), (2, 4, 4, 1))
PERSISTENT_MAX_OFFERED_TOKENS = 4


def persistent_configs(m: int) -> list[TileConfig]:
    """decode_persistent's tiles the tuner times for m tokens (none past PERSISTENT_MAX_OFFERED_TOKENS;
    the kernel itself takes up to decode_persistent.MAX_TOKENS)."""
    if not 1 <= m <= PERSISTENT_MAX_OFFERED_TOKENS:
        return []
    bucket = 1 << (m - 1).bit_length()
    return [TileConfig("persistent", bucket, rows * warps, 1, warps, depth, 1, "workspace", per_sm)
            for rows, warps, per_sm, depth in (_PERSISTENT_TILES if m == 1 else _PERSISTENT_MULTI_TOKEN_TILES)]


def candidate_configs(m: int, fused: bool) -> list[TileConfig]:
    """Tile configs worth timing for `m` token rows (the fp32 gemv kernel quantizes in-kernel, so it
    is a candidate of the fused path only; the dp4a one runs either way)."""
    if m <= DECODE_MAX_TOKENS:  # the dp4a decode kernel's per-row cost is small enough for 16 rows
        if fused:
            decode = [c for c in _GEMV_CONFIGS if m <= GEMV_MAX_TOKENS or c.kernel == "dp4a"]
        else:  # Q8_1 blocks in: the dp4a kernel reads them as they are (the fp32 gemv kernel cannot)
            decode = [c for c in _GEMV_CONFIGS if c.kernel == "dp4a"]
        return decode + _DECODE_GEMM_CONFIGS + swap_configs(m)
    if m <= 64:
        return _MID_CONFIGS + _MID_SWAP_CONFIGS
    return _LARGE_CONFIGS


def default_config(m: int, fused: bool) -> TileConfig:
    """The untuned choice for m token rows (an op's kernel string "")."""
    if m <= GEMV_MAX_TOKENS and fused:
        return _GEMV_DEFAULT
    if m <= DECODE_MAX_TOKENS:
        return _DECODE_GEMM_CONFIGS[0]
    if m <= 64:
        return _MID_CONFIGS[0]
    return _LARGE_CONFIGS[0]


@functools.lru_cache(maxsize=None)
def describe_configs() -> str:
    rows = [f"{c.name}: ~{c.shared_memory_bytes(2) // 1024} KiB smem fused / {c.shared_memory_bytes(1) // 1024} KiB separate"
            for c in _GEMV_CONFIGS + _DECODE_GEMM_CONFIGS + _MID_CONFIGS + _LARGE_CONFIGS]
    return "\n".join(rows)
