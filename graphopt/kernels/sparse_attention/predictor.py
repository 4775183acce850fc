"""The predictor on the Triton path: the workspace geometry, the launch shapes, and the launches
that turn q and k into compact kept-block lists (`predict_block_lut`, as
`block_mask_to_lut(predict_block_mask(...))`), without host synchronization; or, where the block
statistics were computed elsewhere (the sparse_attention pass can emit them into the graph, next
to the kernels that produce Q and K), only the stages that read them
(`select_block_lut`)."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import INTERPRET, cdiv, launch
from graphopt.kernels.sparse_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    DEFAULT_CDFTHRESHD,
    DEFAULT_SIMTHRESHD1,
    _threshold_args,
    checked_block_statistics,
    per_head,
)

if triton is not None:
    from graphopt.kernels.sparse_attention.predictor_kernels import (
        _pool_blocks_kernel,
        _pooled_scores_kernel,
        _predict_lut_kernel_v2,
        _select_blocks_kernel,
    )

PREDICTOR_ROWS = 16  # query blocks per program of the LUT kernel (the pooled-score dot needs >= 16)
PREDICTOR_VARIANTS = ("v3", "v2")  # v3: default; v2: scores and selection in one LUT launch


def _require_triton(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton sparse attention path needs triton; use implementation='reference'")
    if not INTERPRET and not all(t.is_cuda for t in tensors):
        raise ValueError("the Triton sparse attention path needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "valid choices on CPU: implementation='reference' or 'auto'")


def _predictor_geometry(q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int, variant: str = "v3") -> dict:
    """Sizes, and the pooling launch's fp32 workspace: pooled_q (B*H, nQ, D) | sim_q (B*H, nQ) |
    pooled_k (B*HKV, nK, D) | sim_k (B*HKV, nK), each section 64-byte aligned."""
    _check_variant(variant)
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"the predictor needs q (B, H, Lq, D) and k (B, Hkv, Lk, D) with H % Hkv == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    _check_blocks(block_m, block_n)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    n_q, n_k = cdiv(Lq, block_m), cdiv(Lk, block_n)

    def aligned(n: int) -> int:  # sections start on 64-byte boundaries (vector loads of pooled_k)
        return cdiv(n, 16) * 16

    off_sim_q = aligned(B * H * n_q * D)
    off_pooled_k = off_sim_q + aligned(B * H * n_q)
    off_sim_k = off_pooled_k + aligned(B * Hkv * n_k * D)
    work_size = off_sim_k + B * Hkv * n_k
    return dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, n_q=n_q, n_k=n_k, off_sim_q=off_sim_q,
                off_pooled_k=off_pooled_k, off_sim_k=off_sim_k, work_size=work_size)


def _check_variant(variant: str) -> None:
    if variant not in PREDICTOR_VARIANTS:
        raise ValueError(f"predictor variant={variant!r} is not valid; valid choices: {', '.join(PREDICTOR_VARIANTS)}")


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}={block}: the Triton predictor needs a power of two >= 16")


def _statistics_views(work: torch.Tensor, g: dict) -> tuple[torch.Tensor, ...]:
    """The pooling workspace as pooled_q (B, H, nQ, D), sim_q (B, H, nQ), pooled_k (B, Hkv, nK, D),
    sim_k (B, Hkv, nK)."""
    B, H, Hkv, D, n_q, n_k = g["B"], g["H"], g["Hkv"], g["D"], g["n_q"], g["n_k"]
    return (work[: B * H * n_q * D].view(B, H, n_q, D), work[g["off_sim_q"]: g["off_sim_q"] + B * H * n_q].view(B, H, n_q),
            work[g["off_pooled_k"]: g["off_pooled_k"] + B * Hkv * n_k * D].view(B, Hkv, n_k, D),
            work[g["off_sim_k"]: g["off_sim_k"] + B * Hkv * n_k].view(B, Hkv, n_k))


# v2 pooling launch: elements per load slice, warps per program, and the slice loop's pipeline
# stages (0: unrolled). H100 sweeps, D=128, bf16:
# - H=32 (bench/results/sparse_pool_configs_h32_h100.json): with each slice reduced at once into
#   (D,) accumulators, one warp, 1024-element slices (8 tokens) and a 2-stage loop read Q and K
#   close to the copy rate at 8k and 16k, faster than 2048-element slices summed into (16, D)
#   accumulators (255 registers per thread offline, so 8 programs per SM). 512-2048-element
#   slices with 2-4 stages were close to it; the unrolled loop was slower, 2 warps far slower
#   (likely because the per-token norm then spans both warps).
# - H=16: one warp beat 2, 4 and 8 (fewer warps: more blocks in flight, no cross-warp
#   reductions).
POOL_SLICE_ELEMENTS = 1024
POOL_WARPS = 1
POOL_LOOP_STAGES = 2


def _launch_pool(q: torch.Tensor, k: torch.Tensor, g: dict, block_m: int, block_n: int,
                 work: torch.Tensor | None = None, *, slice_elements: int = POOL_SLICE_ELEMENTS,
                 num_warps: int = POOL_WARPS, loop_stages: int = POOL_LOOP_STAGES) -> torch.Tensor:
    """The pooling launch into the fp32 workspace (allocated when not given). v2 reads each block
    in slices of `slice_elements` (tokens x head dim) per load."""
    if work is None:
        work = torch.empty(g["work_size"], device=q.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(g["D"])
    offsets = (g["off_sim_q"], g["off_pooled_k"], g["off_sim_k"])
    # one program per block; a slice of SUB tokens is `slice_elements` elements
    n_q_programs = g["B"] * g["H"] * g["n_q"]
    sub = max(1, slice_elements // block_d)
    launch(
        _pool_blocks_kernel, (n_q_programs + g["B"] * g["Hkv"] * g["n_k"],),
        q, k, work, *q.stride(), *k.stride(),
        g["H"], g["Hkv"], g["Lq"], g["Lk"], g["n_q"], g["n_k"], n_q_programs, *offsets,
        HEAD_DIM=g["D"], BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        SUB_M=min(sub, block_m), SUB_N=min(sub, block_n), LOOP_STAGES=loop_stages, num_warps=num_warps,
    )
    return work


def _lut_kernel_config(n_k_pow2: int, block_d: int) -> dict:
    """v2 LUT launch shape: ~8 elements of each (PREDICTOR_ROWS, nK) row tensor per thread (4-16
    warps); three search pivots while that holds (latency-bound: short rows, few programs), one
    beyond (throughput-bound); D chunks of <= 4096 pooled-key values (no spills up to nK = 512)."""
    num_warps = max(4, min(16, PREDICTOR_ROWS * n_k_pow2 // 256))
    pivots = 3 if PREDICTOR_ROWS * n_k_pow2 <= 8 * 32 * num_warps else 1
    return dict(D_CHUNK=max(16, min(block_d, 4096 // n_k_pow2)), PIVOTS=pivots, SEARCH_STEPS=16 if pivots == 3 else 31,
                num_warps=num_warps)


# v3 launch shape: score tiles (score_rows x score_cols, score_warps warps, dot precision) and
# selection programs of one warp with select_rows rows and 1 or 3 search pivots (None: 3 up to 128
# key blocks, else 1). H100 sweeps (bench/results/sparse_predictor_{tiles,tile_shapes,pivots_precision,pdl}_h100.json, L = 8k-32k):
# - one row per selection program beat 2 and 4;
# - 3 pivots (16 steps of three independent row sums) won at 128 key blocks, 1 pivot (31 steps)
#   at 256 and 512;
# - "tf32x3" scores (three TF32 tensor-core products, error ~1e-6 relative) were faster than
#   "ieee" (one fp32 FMA chain per score, v2's) at 8k, 16k and 32k, the gap growing with L. Against the
#   torch predictor (cuBLAS fp32), tf32x3 changed 1 block of 524288 at 16k and none elsewhere;
# - 16 x 64 score tiles with 4 warps beat 32 x 64, 16 x 32, 16 x 128 and 8 warps.
V3_SHAPE = dict(select_rows=1, pivots=None, score_rows=16, score_cols=64, score_warps=4, precision="tf32x3")


def _v3_shape(overrides: dict | None) -> dict:
    shape = dict(V3_SHAPE)
    unknown = set(overrides or {}) - set(shape)
    if unknown:
        raise ValueError(f"unknown v3 launch-shape keys {sorted(unknown)}; valid keys: {', '.join(shape)}")
    shape.update(overrides or {})
    if shape["pivots"] not in (None, 1, 3) or shape["precision"] not in ("ieee", "tf32x3"):
        raise ValueError(f"v3 shape {shape}: pivots must be None (automatic), 1 or 3; precision 'ieee' or 'tf32x3'")
    return shape


def _selection_launchers(statistics, lq: int, lk: int, *, is_causal, scale, simthreshd1, cdfthreshd, block_m, block_n,
                         variant, v3_shape: dict | None = None):
    """(lut_launch, lut_out, counts): the predictor's stages after the pooling, reading only the
    block statistics (`checked_block_statistics`), as a closure over buffers allocated here;
    calling it fills lut_out and counts. No host synchronization."""
    _check_variant(variant)
    _check_blocks(block_m, block_n)
    pooled_q, sim_q, pooled_k, sim_k = statistics
    _require_triton(pooled_q, pooled_k)
    B, H, n_q, D = pooled_q.shape
    Hkv, n_k = pooled_k.shape[1], pooled_k.shape[2]
    device = pooled_q.device
    scale = D**-0.5 if scale is None else float(scale)
    sim_tensor, sim_value = _threshold_args(simthreshd1, H, "simthreshd1", device)
    cdf_tensor, cdf_value = _threshold_args(cdfthreshd, H, "cdfthreshd", device)
    per_head_thresholds = sim_tensor is not None or cdf_tensor is not None
    if per_head_thresholds:  # one kernel variant: both per head
        sim_tensor = sim_tensor if sim_tensor is not None else per_head(sim_value, H, "simthreshd1", device)
        cdf_tensor = cdf_tensor if cdf_tensor is not None else per_head(cdf_value, H, "cdfthreshd", device)
    lut = torch.empty(B, H, n_q, n_k, device=device, dtype=torch.int32)
    counts = torch.empty(B, H, n_q, device=device, dtype=torch.int32)
    n_k_pow2 = max(16, triton.next_power_of_2(n_k))
    block_d = max(16, triton.next_power_of_2(D))
    thresholds = (sim_tensor if per_head_thresholds else sim_q, cdf_tensor if per_head_thresholds else sim_q,
                  sim_value, cdf_value, lut, counts, H, H // Hkv, lq, lk, n_q, n_k)
    grid = (cdiv(n_q, PREDICTOR_ROWS), B * H)

    def lut_v2():
        _predict_lut_kernel_v2[grid](
            pooled_q, sim_q, pooled_k, sim_k, *thresholds, scale, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_N=block_n, ROWS=PREDICTOR_ROWS, N_K_POW2=n_k_pow2, IS_CAUSAL=is_causal, PER_HEAD=per_head_thresholds,
            **_lut_kernel_config(n_k_pow2, block_d))

    shape = _v3_shape(v3_shape)
    score_rows, score_cols = shape["score_rows"], min(shape["score_cols"], n_k_pow2)
    pivots = shape["pivots"] or (3 if n_k_pow2 <= 128 else 1)
    tf32_ok = not pooled_q.is_cuda or compute_capability(device.index)[0] >= 8
    precision = shape["precision"] if tf32_ok else "ieee"  # TF32 tensor cores need sm_80+
    scores = torch.empty(B * H * n_q * n_k if variant == "v3" else 0, device=device, dtype=torch.float32)

    def scores_v3():
        launch(
            _pooled_scores_kernel, (cdiv(n_q, score_rows), cdiv(n_k, score_cols), B * H),
            pooled_q, pooled_k, scores, H, H // Hkv, n_q, n_k, scale,
            HEAD_DIM=D, D_CHUNK=max(16, min(block_d, 4096 // score_cols)), BLOCK_D=block_d,
            ROWS=score_rows, COLS=score_cols, PRECISION=precision, num_warps=shape["score_warps"])

    def select_v3():
        launch(
            _select_blocks_kernel, (cdiv(n_q, shape["select_rows"]), B * H),
            scores, sim_q, sim_k, *thresholds,
            BLOCK_M=block_m, BLOCK_N=block_n, ROWS=shape["select_rows"], N_K_POW2=n_k_pow2, IS_CAUSAL=is_causal,
            PER_HEAD=per_head_thresholds, PIVOTS=pivots, SEARCH_STEPS=16 if pivots == 3 else 31,
            num_warps=1)

    def lut_v3():
        scores_v3()
        select_v3()
    lut_v3.parts = {"scores": scores_v3, "select": select_v3}  # timed one by one in the benchmark

    return {"v2": lut_v2, "v3": lut_v3}[variant], lut, counts


def _predictor_launchers(q, k, *, is_causal, scale, simthreshd1, cdfthreshd, block_m, block_n, variant,
                         v3_shape: dict | None = None):
    """(pool, lut, lut_out, counts): the pooling launch into a workspace and the selection stages
    reading it, as closures over buffers allocated here; calling pool() then lut() fills lut_out and
    counts. No host synchronization."""
    _require_triton(q, k)
    g = _predictor_geometry(q, k, block_m, block_n, variant)
    work = torch.empty(g["work_size"], device=q.device, dtype=torch.float32)
    lut_launch, lut, counts = _selection_launchers(
        _statistics_views(work, g), g["Lq"], g["Lk"], is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
        cdfthreshd=cdfthreshd, block_m=block_m, block_n=block_n, variant=variant, v3_shape=v3_shape)

    def pool():
        _launch_pool(q, k, g, block_m, block_n, work)

    return pool, lut_launch, lut, counts


def pool_qk_triton(q: torch.Tensor, k: torch.Tensor, block_m: int = BLOCK_M, block_n: int = BLOCK_N, *,
                   variant: str = "v3", slice_elements: int = POOL_SLICE_ELEMENTS, num_warps: int = POOL_WARPS,
                   loop_stages: int = POOL_LOOP_STAGES):
    """The predictor's first launch on its own, as views of its workspace: pooled_q (B, H, nQ, D),
    sim_q (B, H, nQ), pooled_k (B, Hkv, nK, D), sim_k (B, Hkv, nK), all fp32 (see `pool_blocks`)."""
    _require_triton(q, k)
    g = _predictor_geometry(q, k, block_m, block_n, variant)
    work = _launch_pool(q, k, g, block_m, block_n, slice_elements=slice_elements, num_warps=num_warps,
                        loop_stages=loop_stages)
    return _statistics_views(work, g)


def select_block_lut(
    statistics,
    lq: int,
    lk: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    variant: str = "v3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The predictor after the pooling, on the Triton path: from the block statistics
    (pooled_q, sim_q, pooled_k, sim_k) of `block_statistics` for query / key lengths lq / lk to
    lut int32 (B, H, nQ, nK) and counts int32 (B, H, nQ). It reads only the pooled rows (L / block
    of them), never Q or K: one launch for v2, two for v3 (pooled scores; softmax + top-cdf +
    LUT), no host synchronization."""
    stats = checked_block_statistics(statistics, lq, lk, block_m, block_n)
    lut_launch, lut, counts = _selection_launchers(
        stats, lq, lk, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd,
        block_m=block_m, block_n=block_n, variant=variant)
    lut_launch()
    return lut, counts


def predict_block_lut(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    variant: str = "v3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The predictor on the Triton path: lut int32 (B, H, nQ, nK) and counts int32 (B, H, nQ), as
    `block_mask_to_lut(predict_block_mask(...))` (only lut[..., :counts] is defined). Three
    launches (pool Q and K with self-similarity; pooled scores; softmax + top-cdf + LUT), no host
    synchronization: it can be captured in a CUDA graph. Float thresholds go to the kernels as
    scalars (no tensor is built). variant: "v3" (default); "v2" (scores and selection in one
    launch, compared with v3 in the benchmark)."""
    pool, lut_launch, lut, counts = _predictor_launchers(
        q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd,
        block_m=block_m, block_n=block_n, variant=variant)
    pool()
    lut_launch()
    return lut, counts


def predictor_stages(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    variant: str = "v3",
    v3_shape: dict | None = None,
):
    """Benchmark hook: (pool, lut, outputs) where pool() is the pooling launch alone, lut() the LUT
    stage alone (reading what pool() last wrote; one launch, two for v3) and outputs = (lut,
    counts), filled in place. The buffers are allocated once here, so each call only launches
    (CUDA-graph capturable). v3_shape: overrides of `V3_SHAPE` (benchmarks)."""
    pool, lut_launch, lut, counts = _predictor_launchers(
        q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd,
        block_m=BLOCK_M, block_n=BLOCK_N, variant=variant, v3_shape=v3_shape)
    return pool, lut_launch, (lut, counts)
