"""Roofline cost model: predicted time of each candidate implementation on a target GPU.

Every estimate is built the same way. Count the FLOPs (or integer ops) a candidate does and the
fewest bytes it must move through device memory. Divide each by the rate of the unit that does it,
scaled by how well that kernel family uses the unit (`family_efficiency`). Take the larger of the
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

from graphopt.cost import coefficients
from graphopt.hardware import HardwareSpec, cache_dir

# (compute, memory) efficiency of each kernel family relative to the device ceilings: the
# "efficiency.<family>" coefficients of the GPU's data file (graphopt.cost.coefficients), which name
# the run each was fitted to. On the CPU every family is priced at the CPU's own rates.
CPU_EFFICIENCY = (1.0, 1.0)

# Our Triton attention kernels were fitted on Hopper, where TMA loads and wgmma put them ahead of
# SDPA's flash backend (FlashAttention-2, which uses neither). Nothing of ours was measured on an
# older GPU, where both kinds run the same mma.sync instructions: there these families are taken
# as no better per FLOP than SDPA flash, so a rewrite can win only by doing less work (skipped
# blocks), never from an efficiency measured elsewhere.
HOPPER_FITTED_FAMILIES: tuple[str, ...] = ("triton_flash", "triton_sparse")
HOPPER = (9, 0)


def kernel_families(hw: HardwareSpec) -> list[str]:
    """The kernel families the cost model prices (those with an efficiency in the data file)."""
    return [name.removeprefix("efficiency.") for name in coefficients.for_hardware(hw).names("efficiency.")]


def family_efficiency(hw: HardwareSpec, family: str) -> tuple[float, float]:
    """(compute, memory) efficiency of a kernel family on `hw`."""
    fitted = coefficients.for_hardware(hw)
    name = f"efficiency.{family}"
    if name not in fitted.values and family != "cpu_kernel":
        raise ValueError(f"unknown kernel family {family!r}; valid choices: {', '.join(kernel_families(hw))}")
    if not hw.is_gpu or family == "cpu_kernel":
        return CPU_EFFICIENCY
    compute_eff, memory_eff = fitted[name]
    if family in HOPPER_FITTED_FAMILIES and hw.compute_capability is not None and hw.compute_capability < HOPPER:
        compute_eff = min(compute_eff, fitted["efficiency.sdpa_flash"][0])
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
# call from Inductor's wrapper does not. Its host time per call, in units of a one-kernel torch op
# called back to back (HardwareSpec.host_op_overhead), is a coefficient: "attention.op_host_launches.
# <sdpa|triton>" for graphopt::attention, "sparse_attention.op_host_launches" for
# graphopt::sparse_attention (four launches behind the op's dispatch). Where a call's GPU work is
# shorter than its host path, the host path sets the pace of a stream of such calls (unless they
# replay from a CUDA graph).
def attention_op_host_launches(hw: HardwareSpec, backend: str) -> float:
    """graphopt::attention's host-path units for one of its backends (the Triton kernel or an SDPA one)."""
    return coefficients.value(hw, f"attention.op_host_launches.{'triton' if backend == 'triton' else 'sdpa'}")


def sparse_attention_op_host_launches(hw: HardwareSpec) -> float:
    """graphopt::sparse_attention's host-path units."""
    return coefficients.value(hw, "sparse_attention.op_host_launches")


def host_paced(hw: HardwareSpec, est: Estimate, host_launches: float, why: str) -> Estimate:
    """est, or the op's host time where that is longer: max(GPU estimate, host_launches units), the
    unit being the host time of a one-kernel torch op (HardwareSpec.host_op_overhead: measured by
    `graphopt calibrate`, else HardwareSpec.host_op_s, from the H100 hosts)."""
    host_ms = host_launches * hw.host_op_overhead * 1e3
    if host_ms <= est.ms:
        return est
    return Estimate(f"{est.name} ({why})", host_ms, est.flops, est.bytes, est.launches, "host")


# ---------------------------------------------------------------------------------------------
# Dense GEMM
# ---------------------------------------------------------------------------------------------
# Near the ridge point a GEMM does not hide all of its memory time under its tensor-core time (or
# the reverse): the weight stream and the MMA waves overlap only in part. The coefficient
# "gemm.partial_overlap" is the fraction of the smaller of the two terms added to the larger.
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
    return Estimate(est.name, est.ms + coefficients.value(hw, "gemm.partial_overlap") * min(compute_ms, memory_ms), est.flops, est.bytes, est.launches, est.bound)


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


# Coefficients of the fused kernels (graphopt.cost.coefficients): "attention.floor_s.<family>", the
# least GPU time of one call (a decode step pays it per attention whatever the cache length;
# prefill never gets near it); "attention.triton_bytes_per_s_per_program", the rate at which one
# program of our Triton kernel streams K and V (it runs one program per (batch, head, query block)
# and does not split the keys, so a one-token query has few programs); "attention.triton_flash_step_s",
# one 64-key step of one such program: its loads and its two dots in sequence.
TRITON_ATTENTION_QUERY_BLOCK = 64
DECODE_ATTENTION_BLOCK_N = 64  # keys per step of the Triton attention kernels
DECODE_QUERY_ROWS = 16  # up to this many query rows a call is a decode call: its keys are walked, not tiled

# SDPA's cuDNN and memory-efficient backends on a decode call run one program per (batch, head) that
# walks every key; they do not split the keys. "attention.sdpa_decode_step_s.<backend>" is one 64-key
# step of such a program (a wave of programs over the SMs at a time), and
# "attention.sdpa_decode_memory_efficiency.<backend>" the share of the copy bandwidth they stream K and
# V at once there are programs enough to be bandwidth-bound (batch 8 and up).
SDPA_DECODE_BACKENDS: tuple[str, ...] = ("cudnn", "efficient")


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
        # column per row of tiles. On the H200, causal cuDNN falls further below its non-causal
        # TFLOP/s at short lengths than at long ones, which this term follows (the SDPA cuDNN rows
        # of bench/results/cost_model_h200.json).
        # Capped at the full square: below lk = 2 tiles the term would price causal above non-causal.
        flops *= min(2.0, 1 + 2 * CAUSAL_DIAGONAL_TILE / max(lk, 1))
    est = roofline(hw, name or family, flops=flops, bytes_moved=moved, family=family)
    if not hw.is_gpu:
        return est
    fitted = coefficients.for_hardware(hw)
    launch_s = est.launches * hw.launch_overhead
    body_s, bound = est.ms * 1e-3 - launch_s, est.bound
    streamed_s = walk_s = 0.0
    steps = -(-lk // DECODE_ATTENTION_BLOCK_N)
    if family == "triton_flash":
        programs = b * h * -(-lq // TRITON_ATTENTION_QUERY_BLOCK)
        streamed_s = moved / (programs * fitted["attention.triton_bytes_per_s_per_program"])
        # a decode call (a few query rows) has few programs, each walking all its keys in sequence,
        # load after load: that walk is its time (measured with one query token only)
        walk_s = steps * fitted["attention.triton_flash_step_s"] if lq <= DECODE_QUERY_ROWS else 0.0
    elif family.startswith("sdpa_") and family[5:] in SDPA_DECODE_BACKENDS and lq <= DECODE_QUERY_ROWS:
        waves = -(-b * h // max(1, hw.sm_count))
        walk_s = steps * waves * fitted[f"attention.sdpa_decode_step_s.{family[5:]}"]
        streamed_s = moved / (hw.memory_ceiling * fitted[f"attention.sdpa_decode_memory_efficiency.{family[5:]}"])
    if max(streamed_s, walk_s) > body_s:
        body_s, bound = max(streamed_s, walk_s), "memory" if streamed_s >= walk_s else "latency"
    floor_s = fitted.values.get(f"attention.floor_s.{family}", 0.0)
    if floor_s > body_s:
        body_s = floor_s
    return Estimate(est.name, (body_s + launch_s) * 1e3, est.flops, est.bytes, est.launches, bound)


# graphopt/kernels/decode_attention.py: one program per (batch, KV head, key chunk) steps through
# its chunk 64 keys at a time, then a merge kernel. Coefficients "decode_attention.step_s" (one step)
# and "decode_attention.fixed_s" (the two kernels' fixed cost beyond their launches), checked by
# bench/bench_decode_attention.py --fit.
# Programs per SM the split aims for: enough waves to cover a chunk's load latency.
DECODE_ATTENTION_PROGRAMS_PER_SM = 2


def decode_attention_splits(hw: HardwareSpec, b: int, kv_heads: int, lk: int) -> int:
    """Key chunks per (batch, KV head): about DECODE_ATTENTION_PROGRAMS_PER_SM programs per SM, each
    of at least two 64-key steps, or of one step where two-step chunks would leave more than half the
    SMs without a program (a short cache at batch 1: there one more program per SM costs less than
    a second step in sequence; bench/results/decode_attention_splits_h200.json)."""
    programs = DECODE_ATTENTION_PROGRAMS_PER_SM * max(1, hw.sm_count)
    wanted = -(-programs // max(1, b * kv_heads))
    splits = min(max(1, -(-lk // (2 * DECODE_ATTENTION_BLOCK_N))), wanted)
    if 2 * b * kv_heads * splits < hw.sm_count:
        splits = min(max(1, -(-lk // DECODE_ATTENTION_BLOCK_N)), wanted)
    return max(1, splits)


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
    latency_s = coefficients.value(hw, "decode_attention.fixed_s") + walk * coefficients.value(hw, "decode_attention.step_s")
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
    repeated_from: int | None = None,
) -> Estimate:
    """PyTorch scaled_dot_product_attention with one of its backends. `repeated_from`: the call gets
    K and V repeated to `kv_heads` heads from that many (GQA written as repeat_kv, or a backend
    without native GQA), and pays the copy."""
    if repeated_from is not None and kv_heads is not None and repeated_from < kv_heads:
        call = sdpa(hw, b, h, lq, lk, d, backend=backend, causal=causal, dtype_bytes=dtype_bytes, has_mask=has_mask,
                    kv_heads=kv_heads)
        return chain(call.name, kv_repeat(hw, b, repeated_from, kv_heads, lk, d, dtype_bytes=dtype_bytes), call)
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


def kv_repeat(hw: HardwareSpec, b: int, kv_heads: int, heads: int, lk: int, d: int, *, dtype_bytes: int = 2) -> Estimate:
    """K and V copied from `kv_heads` to `heads` heads (repeat_kv, repeat_interleave): one copy each."""
    moved = dtype_bytes * 2 * b * lk * d * (kv_heads + heads)
    if not hw.is_gpu:
        return roofline(hw, "K/V repeat", bytes_moved=moved, launches=2, family="pointwise")
    copy_s, launch_s = moved / hw.memory_ceiling, 2 * hw.launch_overhead  # memory_ceiling is the copy rate
    return Estimate("K/V repeat", (copy_s + launch_s) * 1e3, 0.0, moved, 2, "memory" if copy_s >= launch_s else "launch")


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
