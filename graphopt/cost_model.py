"""Roofline cost model: predicted time of each candidate implementation on a target GPU.

Every estimate is built the same way. Count the FLOPs (or integer ops) a candidate does and the
fewest bytes it must move through device memory. Divide each by the rate of the unit that does it,
scaled by how well that kernel family uses the unit (`KERNEL_EFFICIENCY`). Take the larger of the
two (roofline: the other overlaps), then add one launch overhead per kernel launch.

Rates are the hardware *ceilings* (see graphopt.hardware: measured by `graphopt calibrate` where
available, else datasheet peak times a typical achievable fraction), so a family efficiency of 1.0
means "as good as cuBLAS / a plain copy on this device".

Passes ask for estimates of "before" (the subgraph as the downstream compiler would run it) and of
each candidate "after", and record both in their Decision. Per-shape measured tables (filled by
`graphopt calibrate` or a benchmark) override the model where they have an entry:
`lookup_measured` / `record_measured`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from graphopt.hardware import HardwareSpec, cache_dir

# (compute efficiency, memory efficiency) relative to the device ceilings, per kernel family.
# Starting values come from the H100 reference points in shared/DESIGN.md; bench/bench_cost_model.py
# prints predicted vs measured so these can be checked and refit.
KERNEL_EFFICIENCY: dict[str, tuple[float, float]] = {
    "cublas_gemm": (1.0, 0.92),
    # Elementwise / softmax passes over an L x L score matrix: measured on an H200 (bench_cost_model,
    # naive attention at L=4k-8k) they reach about half the copy bandwidth.
    "pointwise": (1.0, 0.5),
    # Attention families, relative to the measured matmul ceiling (690 TFLOP/s on our H200;
    # bench/results/attention_h200.json, bf16 D=128 L=4k-16k): cuDNN ~600, SDPA flash ~348,
    # our Triton kernel 475-503 non-causal. (H100 figures in shared/DESIGN.md give 0.83 for cuDNN.)
    "sdpa_cudnn": (0.87, 0.9),
    "sdpa_flash": (0.50, 0.9),
    "sdpa_efficient": (0.35, 0.9),
    "triton_flash": (0.70, 0.9),
    # Block-sparse Triton kernel: tile matmul rate fitted to bench/results/sparse_attention_h200.json
    # (32 timings, L=4k-32k, density 0.1-1) together with a per-query-block cost of 6 tiles (the
    # model's SPARSE_ROW_COST_TILES, fitted to the H100 kernels, is 3.5: graphopt.cost.sparse_attention).
    "triton_sparse": (0.68, 0.85),
    # FP4 / Q4 kernels, fitted to bench/results/{fp4,q4}_linear_h200.json (H200, triton 3.6); the
    # compute term is CUDA-core decode/epilogue work (see the op counts in graphopt/cost/fp4.py and
    # graphopt/cost/q4.py). fp4_gemv: decode + FMA of the 1-4 token word-tile kernel and bf16
    # decode of the 16-token MMA kernel at 0.13 of fp32 peak (fitted on the H100 to the word-tile
    # kernels, bench/results/fp4_linear_mma_decode_h100.json: 1 token 0.36-0.55 ps per weight
    # cold with the launch, 4-16 tokens 0.58-0.84); memory 0.65 (the 1-token kernel streams 0.63 of the copy bandwidth on
    # 5120->13824 once the 4 us launch is taken off; 0.34-0.53 with it on the six shapes).
    # fp4_gemm: 0.066 of fp32 peak for the fused GEMM's in-tile decode (4096 tokens: 0.92 ms for
    # 4096x4096). q4_gemv: the 1-token dp4a decode streams at 0.65 of copy bandwidth (H100,
    # narrow one-warp tiles: 0.021 ms on 5120->13824), its CUDA-core work at 0.16; q4_gemm: the
    # int8 GEMM (MMA + per-32-block epilogue + nibble unpack) at 0.09, fitted on both GPUs' rows
    # (0.12 would predict the m16 decode GEMM ~10% faster than measured and take 16-token layers
    # measured at 0.97-1.01x of cuBLAS on the H100; 0.09 predicts 4096 tokens ~1.8x slow, where
    # cuBLAS is 8-10x faster either way).
    "fp4_gemv": (0.13, 0.65),
    "fp4_gemm": (0.066, 0.8),
    "q4_gemv": (0.16, 0.65),
    "q4_gemm": (0.09, 0.8),
    # q4_swap: the operand-swapped decode GEMM ("swap" configs, 4-16 tokens), fitted to its tuned
    # H100 rows (bench/results/q4_linear_decode_dp4a_h100.json): 4 tokens 0.031-0.033 ms, at 0.50 of
    # the memory ceiling (deeper cp.async pipelines, 4 and 6 K steps, measure no faster, so it is
    # not the bytes in flight alone); 16 tokens 0.036-0.038 ms, bound by
    # the per-32-block epilogue and the nibble unpack (CUDA-core ops) with the int8 MMAs, at 0.14.
    "q4_swap": (0.14, 0.5),
    # q4_tma: the Gluon Q4 decode fed by TMA (kernels/q4_tma.py). Like the FP4 TMA kernel it is
    # bound by its instruction stream at 4-16 tokens (profiled), so its
    # fitted per-weight ops (graphopt.cost.q4) carry the time and the memory term is set
    # where it does not bind.
    "q4_tma": (0.13, 0.9),
    "fft_chain": (0.5, 0.7),
    "cpu_kernel": (1.0, 1.0),
}

# Our Triton attention kernels were fitted on Hopper, where TMA loads and wgmma put them ahead of
# SDPA's flash backend (FlashAttention-2, which uses neither). Nothing of ours was measured on an
# older GPU, where both kinds run the same mma.sync instructions: there these families are taken
# as no better per FLOP than SDPA flash, so a rewrite can win only by doing less work (skipped
# blocks), never from an efficiency measured elsewhere.
HOPPER_FITTED_FAMILIES: tuple[str, ...] = ("triton_flash", "triton_sparse")
HOPPER = (9, 0)


def family_efficiency(hw: HardwareSpec, family: str) -> tuple[float, float]:
    """(compute, memory) efficiency of a kernel family on `hw` (see KERNEL_EFFICIENCY)."""
    if family not in KERNEL_EFFICIENCY:
        raise ValueError(f"unknown kernel family {family!r}; valid choices: {', '.join(KERNEL_EFFICIENCY)}")
    if not hw.is_gpu:
        return KERNEL_EFFICIENCY["cpu_kernel"]
    compute_eff, memory_eff = KERNEL_EFFICIENCY[family]
    if family in HOPPER_FITTED_FAMILIES and hw.compute_capability is not None and hw.compute_capability < HOPPER:
        compute_eff = min(compute_eff, KERNEL_EFFICIENCY["sdpa_flash"][0])
    return compute_eff, memory_eff


# cuBLAS and Triton pad the token dimension of a GEMM to a tile; below it, tensor-core time stops
# shrinking (the product is memory-bound there anyway, but this keeps the compute term honest).
MIN_GEMM_TILE_M = 64


@dataclass(frozen=True)
class Estimate:
    """Predicted time of one implementation and what it is made of."""

    name: str
    ms: float
    flops: float
    bytes: float
    launches: int
    bound: str  # "compute", "memory" or "launch"

    def __str__(self) -> str:
        return f"{self.name}: {self.ms:.4f} ms ({self.bound}-bound, {self.launches} launch(es))"


def _unit_rate(hw: HardwareSpec, unit: str) -> float:
    if not hw.is_gpu:
        return hw.fp32_flops
    if unit == "matrix":
        return hw.matrix_ceiling
    if unit == "int8":
        return hw.int8_ceiling
    if unit == "fp32":
        return hw.fp32_flops
    raise ValueError(f"unknown compute unit {unit!r}; valid choices: matrix, int8, fp32")


def roofline(
    hw: HardwareSpec,
    name: str,
    *,
    flops: float = 0.0,
    bytes_moved: float = 0.0,
    launches: int = 1,
    family: str = "cublas_gemm",
    unit: str = "matrix",
) -> Estimate:
    """Time of a kernel (or a chain of `launches` kernels) that does `flops` and moves `bytes_moved`."""
    compute_eff, memory_eff = family_efficiency(hw, family)
    compute_s = flops / (_unit_rate(hw, unit) * compute_eff) if flops else 0.0
    memory_s = bytes_moved / (hw.memory_ceiling * memory_eff) if bytes_moved else 0.0
    launch_s = launches * hw.launch_overhead
    body = max(compute_s, memory_s)
    bound = "compute" if compute_s >= memory_s else "memory"
    if launch_s > body:
        bound = "launch"
    return Estimate(name, (body + launch_s) * 1e3, flops, bytes_moved, launches, bound)


def chain(name: str, *parts: Estimate) -> Estimate:
    """Several kernels run one after another."""
    ms = sum(p.ms for p in parts)
    flops = sum(p.flops for p in parts)
    moved = sum(p.bytes for p in parts)
    launches = sum(p.launches for p in parts)
    dominant = max(parts, key=lambda p: p.ms).bound if parts else "launch"
    return Estimate(name, ms, flops, moved, launches, dominant)


# ---------------------------------------------------------------------------------------------
# Host path of a graphopt custom op
# ---------------------------------------------------------------------------------------------
# A graphopt::* op reaches its kernel through torch.library's Python dispatch, where a plain aten
# call from Inductor's wrapper does not. Called back to back on negligible GPU work (H100 machine,
# torch 2.11, bench/tools/probe_attention_host.py), in units of the same run's one-kernel torch op
# (11.8 us): a plain F.scaled_dot_product_attention call 1.5-1.7, graphopt::attention on an SDPA
# backend 7.4-9.2 under no_grad (7.7-19 with grad mode on), on the Triton kernel through the
# autotuner's own call path 10.9 (14.4). Through `launch_tuned` (the autotuner's call path skipped
# once it has chosen), as the op launches it, the Triton path measured a median of 6.9 units under
# no_grad over six repeats, and the SDPA backends' paths 6.2-10.1 in the same runs
# (bench/results/attention_op_host_h100.log), so both are priced alike. Where a
# call's GPU work is shorter than its host path, the host path sets the pace of a stream of such
# calls (unless they replay from a CUDA graph).
ATTENTION_OP_HOST_LAUNCHES = {"sdpa": 7.5, "triton": 7.5}


def attention_op_host_launches(backend: str) -> float:
    """graphopt::attention's host-path units for one of its backends (the Triton kernel or an SDPA one)."""
    return ATTENTION_OP_HOST_LAUNCHES["triton" if backend == "triton" else "sdpa"]


# graphopt::sparse_attention: four launches (the predictor's three, the kernel's one) behind the
# op's dispatch. Called back to back on negligible GPU work on an H100 host
# (bench/sparse_host_overhead.py): 226 us per call non-causal, 374 us causal in a stretch where
# the same run's other calls also took 1.6-2x longer; the predictor alone 98 / 127 us, the
# kernel's launcher 94 / 157 us. About 19 units of the 12 us torch op.
SPARSE_ATTENTION_OP_HOST_LAUNCHES = 19.0


def host_paced(hw: HardwareSpec, est: Estimate, host_launches: float, why: str) -> Estimate:
    """est, or the op's host time where that is longer: max(GPU estimate, host_launches units), the
    unit being the host time of a one-kernel torch op (HardwareSpec.host_op_overhead: measured by
    `graphopt calibrate`, else the H100 hosts' 12 us)."""
    host_ms = host_launches * hw.host_op_overhead * 1e3
    if host_ms <= est.ms:
        return est
    return Estimate(f"{est.name} ({why})", host_ms, est.flops, est.bytes, est.launches, "host")


# ---------------------------------------------------------------------------------------------
# Dense GEMM
# ---------------------------------------------------------------------------------------------
# Near the ridge point a GEMM does not hide all of its memory time under its tensor-core time (or
# the reverse): the weight stream and the MMA waves overlap only in part. This fraction of the
# smaller of the two terms is added to the larger. Fitted on an H100 (cuBLAS bf16, CUDA graph,
# bench/results/fft_fit_sweep_h100.json and the explorer log fft_chain_h100.log):
# 5120<->13824 at 256 tokens measured 0.066-0.075 ms, where the plain max() says 0.058 and this
# term 0.072; 16 and 4096 tokens move by <= 6% (0.0524-0.0652 and 0.72-0.86 ms measured across
# runs there).
GEMM_PARTIAL_OVERLAP = 0.3


def gemm(hw: HardwareSpec, m: int, n: int, k: int, *, dtype_bytes: int = 2, name: str = "dense GEMM (cuBLAS)") -> Estimate:
    """C[m, n] = A[m, k] @ B[k, n]: reads A and B once, writes C once."""
    flops = 2.0 * max(m, MIN_GEMM_TILE_M) * n * k
    moved = dtype_bytes * (m * k + k * n + m * n)
    est = roofline(hw, name, flops=flops, bytes_moved=moved, family="cublas_gemm")
    if not hw.is_gpu:
        return est
    # the overlap term uses the unpadded FLOPs: a decode GEMV's padded tile is not real MMA time
    compute_ms = roofline(hw, name, flops=2.0 * m * n * k, launches=0, family="cublas_gemm").ms
    memory_ms = roofline(hw, name, bytes_moved=moved, launches=0, family="cublas_gemm").ms
    return Estimate(est.name, est.ms + GEMM_PARTIAL_OVERLAP * min(compute_ms, memory_ms), est.flops, est.bytes, est.launches, est.bound)


def linear(hw: HardwareSpec, tokens: int, in_features: int, out_features: int, *, dtype_bytes: int = 2, bias: bool = False) -> Estimate:
    est = gemm(hw, tokens, out_features, in_features, dtype_bytes=dtype_bytes, name="dense linear (cuBLAS)")
    if bias:  # cuBLASLt fuses the bias epilogue; it costs one more read of out_features values
        est = Estimate(est.name, est.ms, est.flops, est.bytes + dtype_bytes * out_features, est.launches, est.bound)
    return est


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def attention_flops(b: int, h: int, lq: int, lk: int, d: int, *, causal: bool = False, d_v: int | None = None) -> float:
    """QK^T and PV matmul FLOPs; a causal square mask halves them."""
    d_v = d if d_v is None else d_v
    flops = 2.0 * b * h * lq * lk * (d + d_v)
    if causal:
        flops *= 0.5
    return flops


def naive_attention(
    hw: HardwareSpec,
    b: int,
    h: int,
    lq: int,
    lk: int,
    d: int,
    *,
    dtype_bytes: int = 2,
    has_mask: bool = False,
    softmax_fp32: bool = False,
    fused_pointwise: bool = True,
    kv_heads: int | None = None,
) -> Estimate:
    """Unfused attention: S = QK^T materialized (B*H*Lq*Lk), scale/mask/softmax, then P @ V.

    `fused_pointwise=True` models a downstream compiler (Inductor) that fuses scale, mask and
    softmax into one pass over S (read S, write P). Eager runs one pass per op instead.
    """
    kv_heads = h if kv_heads is None else kv_heads
    scores = float(b * h * lq * lk)
    qk = roofline(
        hw, "QK^T", flops=2.0 * b * h * lq * lk * d,
        bytes_moved=dtype_bytes * (b * h * lq * d + b * kv_heads * lk * d) + dtype_bytes * scores,
        family="cublas_gemm",
    )
    mask_bytes = dtype_bytes * scores if has_mask else 0.0
    acc_bytes = 4 if softmax_fp32 else dtype_bytes
    if fused_pointwise:
        soft = roofline(hw, "scale+mask+softmax", bytes_moved=dtype_bytes * scores * 2 + mask_bytes, family="pointwise")
    else:
        passes = [roofline(hw, "scale", bytes_moved=2 * dtype_bytes * scores, family="pointwise")]
        if has_mask:
            passes.append(roofline(hw, "mask", bytes_moved=2 * dtype_bytes * scores + mask_bytes, family="pointwise"))
        if softmax_fp32:
            passes.append(roofline(hw, "upcast", bytes_moved=(dtype_bytes + 4) * scores, family="pointwise"))
        passes.append(roofline(hw, "softmax", bytes_moved=2 * acc_bytes * scores, family="pointwise"))
        if softmax_fp32:
            passes.append(roofline(hw, "downcast", bytes_moved=(dtype_bytes + 4) * scores, family="pointwise"))
        soft = chain("scale+mask+softmax", *passes)
    pv = roofline(
        hw, "PV", flops=2.0 * b * h * lq * lk * d,
        bytes_moved=dtype_bytes * scores + dtype_bytes * (b * kv_heads * lk * d + b * h * lq * d),
        family="cublas_gemm",
    )
    return chain("naive attention", qk, soft, pv)


SDPA_BACKENDS: tuple[str, ...] = ("cudnn", "flash", "efficient", "math")
CAUSAL_DIAGONAL_TILE = 128  # key-block width of the fused kernels' diagonal tiles


# The least GPU time of one call: B=1, H=32, D=128, one query token, Lk=1 (cuDNN: Lk=256, it
# rejects Lk=1), CUDA-graph replays on an H100 (bench_attention.py --decode). A decode
# step pays it per attention whatever the cache length; prefill never gets near it.
ATTENTION_FLOOR_S: dict[str, float] = {"triton_flash": 2.4e-6, "sdpa_flash": 5.3e-6, "sdpa_efficient": 5.8e-6,
                                       "sdpa_cudnn": 5.9e-6}
# Our Triton kernel runs one program per (batch, head, query block) and does not split the keys:
# with one query token (32 programs) it streamed K and V at 1.38-1.55 TB/s for Lk = 2k-8k on the
# H100 (same run), about 45 GB/s per program, where cuDNN reached 2.6-3.1 TB/s.
TRITON_ATTENTION_BYTES_PER_S_PER_PROGRAM = 45e9
TRITON_ATTENTION_QUERY_BLOCK = 64
DECODE_ATTENTION_BLOCK_N = 64  # keys per step of the Triton attention kernels
# One 64-key step of one flash program, measured with one query token (bench_decode_attention.py,
# DECODE_ATTENTION_FIT's file): the program's loads and its two dots in sequence.
TRITON_FLASH_STEP_S = 2.0e-6


def fused_attention(
    hw: HardwareSpec,
    b: int,
    h: int,
    lq: int,
    lk: int,
    d: int,
    *,
    family: str,
    causal: bool = False,
    dtype_bytes: int = 2,
    has_mask: bool = False,
    kv_heads: int | None = None,
    name: str | None = None,
) -> Estimate:
    """A flash-style kernel: reads Q, K, V (and a mask) once, writes O once; no L x L traffic."""
    kv_heads = h if kv_heads is None else kv_heads
    moved = dtype_bytes * (2 * b * h * lq * d + 2 * b * kv_heads * lk * d)
    if has_mask:
        moved += dtype_bytes * b * h * lq * lk  # worst case: a full per-head bias
    flops = attention_flops(b, h, lq, lk, d, causal=causal)
    if causal:
        # Tiles straddling the diagonal are computed whole and masked: about one extra tile
        # column per row of tiles. On our H200 causal cuDNN ran at 0.75x (L=1k) to 0.93x (L=16k)
        # of its non-causal TFLOP/s, which this term reproduces within ~5%.
        # Capped at the full square: below lk = 2 tiles the term would price causal above non-causal.
        flops *= min(2.0, 1 + 2 * CAUSAL_DIAGONAL_TILE / max(lk, 1))
    est = roofline(hw, name or family, flops=flops, bytes_moved=moved, family=family)
    if not hw.is_gpu:
        return est
    launch_s = est.launches * hw.launch_overhead
    body_s, bound = est.ms * 1e-3 - launch_s, est.bound
    if family == "triton_flash":
        programs = b * h * -(-lq // TRITON_ATTENTION_QUERY_BLOCK)
        streamed_s = moved / (programs * TRITON_ATTENTION_BYTES_PER_S_PER_PROGRAM)
        # a decode call (a few query rows) has few programs, each walking all its keys in sequence,
        # load after load: that walk is its time (measured with one query token only)
        walk_s = -(-lk // DECODE_ATTENTION_BLOCK_N) * TRITON_FLASH_STEP_S if lq <= 16 else 0.0
        if max(streamed_s, walk_s) > body_s:
            body_s, bound = max(streamed_s, walk_s), "memory" if streamed_s >= walk_s else "latency"
    floor_s = ATTENTION_FLOOR_S.get(family, 0.0)
    if floor_s > body_s:
        body_s = floor_s
    return Estimate(est.name, (body_s + launch_s) * 1e3, est.flops, est.bytes, est.launches, bound)


# graphopt/kernels/decode_attention.py: one program per (batch, KV head, key chunk) steps through
# its chunk 64 keys at a time, then a merge kernel. Per-step time and the fixed cost of the two
# kernels: DECODE_ATTENTION_FIT (bench/results/decode_attention_<gpu>.json, fitted by
# bench/bench_decode_attention.py --fit on the rows it names; the other rows are held out).
DECODE_ATTENTION_FIT: dict[str, float] = {"step_s": 0.55e-6, "fixed_s": 0.5e-6}
# Programs per SM the split aims for: enough waves to cover a chunk's load latency.
DECODE_ATTENTION_PROGRAMS_PER_SM = 2


def decode_attention_splits(hw: HardwareSpec, b: int, kv_heads: int, lk: int) -> int:
    """Key chunks per (batch, KV head): about DECODE_ATTENTION_PROGRAMS_PER_SM programs per SM, each
    of at least two 64-key steps."""
    programs = DECODE_ATTENTION_PROGRAMS_PER_SM * max(1, hw.sm_count)
    most = max(1, -(-lk // (2 * DECODE_ATTENTION_BLOCK_N)))
    return max(1, min(most, -(-programs // max(1, b * kv_heads))))


def decode_attention_walk(hw: HardwareSpec, b: int, kv_heads: int, lk: int, splits: int) -> int:
    """64-key steps the split-key kernel takes in sequence: one chunk's steps times the waves of
    programs over the SMs."""
    keys_per_chunk = -(-lk // splits)
    steps = -(-keys_per_chunk // DECODE_ATTENTION_BLOCK_N)
    waves = -(-(b * kv_heads * splits) // max(1, DECODE_ATTENTION_PROGRAMS_PER_SM * hw.sm_count))
    return waves * steps


def decode_attention(hw: HardwareSpec, b: int, h: int, lq: int, lk: int, d: int, *, kv_heads: int,
                     dtype_bytes: int = 2, has_mask: bool = False, splits: int | None = None) -> Estimate:
    """The split-key decode kernel and its merge: K and V read once per KV head, and a chunk's
    64-key steps in sequence; the chunks run in parallel waves over the SMs."""
    splits = splits or decode_attention_splits(hw, b, kv_heads, lk)
    rows = max(16, 1 << max(0, (h // kv_heads * lq - 1).bit_length()))
    partials = b * kv_heads * splits * rows * (d + 2) * 4 * 2  # written, then read by the merge
    moved = dtype_bytes * (2 * b * kv_heads * lk * d + 2 * b * h * lq * d) + partials
    if has_mask:
        moved += b * lq * lk  # a decode step's mask: one bool per key and sequence
    flops = attention_flops(b, h, lq, lk, d)
    est = roofline(hw, "Triton split-key decode attention", flops=flops, bytes_moved=moved, launches=2,
                   family="triton_flash")
    if not hw.is_gpu:
        return est
    walk = decode_attention_walk(hw, b, kv_heads, lk, splits)
    latency_s = DECODE_ATTENTION_FIT["fixed_s"] + walk * DECODE_ATTENTION_FIT["step_s"]
    launch_s = est.launches * hw.launch_overhead
    body_s = est.ms * 1e-3 - launch_s
    bound = est.bound if body_s >= latency_s else "latency"
    return Estimate(est.name, (max(body_s, latency_s) + launch_s) * 1e3, est.flops, est.bytes, est.launches, bound)


def sdpa(
    hw: HardwareSpec,
    b: int,
    h: int,
    lq: int,
    lk: int,
    d: int,
    *,
    backend: str = "cudnn",
    causal: bool = False,
    dtype_bytes: int = 2,
    has_mask: bool = False,
    kv_heads: int | None = None,
) -> Estimate:
    """PyTorch scaled_dot_product_attention with one of its backends."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; valid choices: {', '.join(SDPA_BACKENDS)}")
    if backend == "math" or not hw.is_gpu:
        # The math backend (and the CPU) materializes scores like the naive form, in one op.
        est = naive_attention(hw, b, h, lq, lk, d, dtype_bytes=dtype_bytes, has_mask=has_mask, kv_heads=kv_heads)
        if hw.is_gpu or backend == "math":
            return Estimate(f"SDPA {backend}", est.ms, est.flops, est.bytes, est.launches, est.bound)
        # CPU SDPA is a fused flash-style kernel: no L x L materialization.
        return fused_attention(hw, b, h, lq, lk, d, family="cpu_kernel", causal=causal, dtype_bytes=dtype_bytes,
                               has_mask=has_mask, kv_heads=kv_heads, name="SDPA (CPU)")
    return fused_attention(hw, b, h, lq, lk, d, family=f"sdpa_{backend}", causal=causal, dtype_bytes=dtype_bytes,
                           has_mask=has_mask, kv_heads=kv_heads, name=f"SDPA {backend}")


# ---------------------------------------------------------------------------------------------
# Measured tables: per-shape timings that override the model where present.
# ---------------------------------------------------------------------------------------------
def _table_path(kind: str):
    return cache_dir() / f"measured_{kind}.json"


def shape_key(*parts) -> str:
    return "|".join(str(p) for p in parts)


def lookup_measured(kind: str, device_name: str, key: str) -> dict[str, float] | None:
    """Measured {implementation: ms} for one shape on one device, or None."""
    path = _table_path(kind)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get(device_name, {}).get(key)
    except (OSError, json.JSONDecodeError):
        return None


def record_measured(kind: str, device_name: str, key: str, timings_ms: dict[str, float]) -> None:
    path = _table_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    table: dict = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except json.JSONDecodeError:
            table = {}
    table.setdefault(device_name, {})[key] = {k: float(v) for k, v in timings_ms.items() if math.isfinite(v)}
    path.write_text(json.dumps(table, indent=2, sort_keys=True))


def fastest(estimates: list[Estimate]) -> Estimate:
    return min(estimates, key=lambda e: e.ms)
