"""Cost model of block-sparse attention (graphopt.kernels.sparse_attention): the predictor and the
block-sparse kernel at a given sparsity, the dense attention it replaces, the host path of the ops
where it is priced, and the break-even sequence length. The sparse_attention pass compares these
at compile time."""

from __future__ import annotations

from graphopt import cost_model
from graphopt.cost import coefficients
from graphopt.cost_model import Estimate
from graphopt.kernels.sparse_attention import BLOCK_M, BLOCK_N

PREDICTOR_LAUNCHES = 3  # pool Q and K (with self-similarity); pooled scores; top-cdf + compact lists
# The sparse_attention pass emits the pooling into the graph (block sums and self-similarity of Q
# and of K: STATISTICS_LAUNCHES kernels under Inductor, the per-token norms fused into the kernel
# that writes Q and K); the op's predictor is then its last two launches, on the pooled rows.
SELECTION_LAUNCHES = 2
STATISTICS_LAUNCHES = 4

# Coefficients of the GPU's data file (graphopt.cost.coefficients):
#  - efficiency.triton_sparse: the matmul rate of a kept 128 x 64 tile;
#  - sparse_attention.row_cost_tiles: each query block (row) also costs some tiles' worth of time
#    (Q load, pipeline fill, epilogue, store) whatever its density;
#  - sparse_attention.predictor_pool_memory_efficiency: the predictor's pooling launch reads Q and K
#    at this fraction of the memory ceiling;
#  - sparse_attention.predictor_s_per_score: seconds per (query block, key block) pooled score for
#    the scores GEMM and the selection, beyond their launches.


def _fitted(hw, name: str) -> float:
    return coefficients.value(hw, f"sparse_attention.{name}")


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def kept_tile_count(lq: int, lk: int, *, causal: bool, density: float) -> float:
    """Kept (query block, key block) tiles per head: `density` of those dense attention computes
    (under causality the tiles at or below the diagonal, diagonal tiles whole)."""
    n_q, n_k = _blocks(lq, BLOCK_M), _blocks(lk, BLOCK_N)
    if causal:
        allowed = sum(min(n_k, _blocks(min((i + 1) * BLOCK_M, lq), BLOCK_N)) for i in range(n_q))
    else:
        allowed = n_q * n_k
    return density * allowed


def estimate_predictor(hw, b: int, h: int, hkv: int, lq: int, lk: int, d: int, *, dtype_bytes: int = 2,
                       statistics_in_graph: bool = False) -> Estimate:
    """Pool Q and K blocks (read each once, at predictor_pool_memory_efficiency of the memory
    ceiling), then the pooled scores, top-cdf selection and compact lists (their bytes at the
    pointwise rate, three launches), plus predictor_s_per_score per pooled score.
    statistics_in_graph: the block statistics come from the graph (`estimate_block_statistics`):
    no pooling launch and no read of Q and K here, two launches."""
    n_q, n_k = _blocks(lq, BLOCK_M), _blocks(lk, BLOCK_N)
    pooled = 0 if statistics_in_graph else dtype_bytes * (b * h * lq * d + b * hkv * lk * d)
    launches = SELECTION_LAUNCHES if statistics_in_graph else PREDICTOR_LAUNCHES
    moved = 4 * (b * h * n_q * (d + 1) + b * hkv * n_k * (d + 1))  # pooled blocks, read back by the LUT launch
    moved += 4 * b * h * n_q * (n_k + 1)  # compact lists and counts written
    flops = 2.0 * b * h * n_q * n_k * d
    est = cost_model.roofline(hw, "sparse attention predictor", flops=flops, bytes_moved=moved,
                              launches=launches, family="pointwise", unit="fp32")
    if not hw.is_gpu:
        return cost_model.roofline(hw, "sparse attention predictor", flops=flops, bytes_moved=moved + pooled,
                                   launches=launches, family="pointwise", unit="fp32")
    pool_ms = pooled / (hw.memory_ceiling * _fitted(hw, "predictor_pool_memory_efficiency")) * 1e3
    est = Estimate(est.name, est.ms + pool_ms, flops, moved + pooled, est.launches,
                   "memory" if pool_ms > est.ms else est.bound)
    select_ms = b * h * n_q * n_k * _fitted(hw, "predictor_s_per_score") * 1e3
    return Estimate(est.name, est.ms + select_ms, flops, est.bytes, est.launches,
                    "latency" if select_ms > est.ms else est.bound)


def estimate_block_statistics(hw, b: int, h: int, hkv: int, lq: int, lk: int, d: int, *,
                              dtype_bytes: int = 2) -> Estimate:
    """The predictor's block statistics as the graph computes them under Inductor (its Triton
    schedule for a LLaMA block: the per-token norm fuses into the RoPE kernel that writes Q and K;
    the block sums are one reduction kernel per tensor that reads Q or K once more, and the
    self-similarity one small kernel each): Q and K read at the pooling launch's fitted efficiency
    (predictor_pool_memory_efficiency: the same streaming read), the fp32 statistics written at the
    pointwise rate, STATISTICS_LAUNCHES launches. Not yet fitted to a GPU run of the graph
    (bench/bench_sparse_attention.py --in-model measures it)."""
    n_q, n_k = _blocks(lq, BLOCK_M), _blocks(lk, BLOCK_N)
    read = dtype_bytes * (b * h * lq * d + b * hkv * lk * d)
    written = 8 * (b * h * n_q * (d + 1) + b * hkv * n_k * (d + 1))  # sums written, read back, scaled
    flops = 5.0 * d * (b * h * lq + b * hkv * lk)  # square, norm, scale, two sums per element
    name = "sparse attention block statistics (graph)"
    if not hw.is_gpu:
        return cost_model.roofline(hw, name, flops=flops, bytes_moved=read + written, launches=STATISTICS_LAUNCHES,
                                   family="pointwise", unit="fp32")
    est = cost_model.roofline(hw, name, flops=flops, bytes_moved=written, launches=STATISTICS_LAUNCHES,
                              family="pointwise", unit="fp32")
    read_ms = read / (hw.memory_ceiling * _fitted(hw, "predictor_pool_memory_efficiency")) * 1e3
    return Estimate(name, est.ms + read_ms, flops, read + written, est.launches,
                    "memory" if read_ms > est.ms else est.bound)


def estimate_sparse_kernel(hw, b: int, h: int, hkv: int, lq: int, lk: int, d: int, *, causal: bool, sparsity: float,
                           dtype_bytes: int = 2) -> Estimate:
    """The block-sparse flash kernel alone: kept tiles plus row_cost_tiles per query block,
    at the triton_sparse tile rate; Q and O once, K/V once per head (L2 reuse) scaled by density."""
    density = max(0.0, min(1.0, 1.0 - sparsity))
    n_q, n_k = _blocks(lq, BLOCK_M), _blocks(lk, BLOCK_N)
    tile_flops = 2.0 * BLOCK_M * BLOCK_N * (d + d)
    flops = b * h * tile_flops * (kept_tile_count(lq, lk, causal=causal, density=density) + _fitted(hw, "row_cost_tiles") * n_q)
    moved = dtype_bytes * (2 * b * h * lq * d + 2 * b * hkv * lk * d * max(density, 1.0 / max(1, n_k)))
    moved += 4 * b * h * n_q * (n_k + 1)  # compact lists read
    return cost_model.roofline(hw, "Triton block-sparse attention", flops=flops, bytes_moved=moved, family="triton_sparse")


def estimate_sparse_attention(hw, b: int, h: int, hkv: int, lq: int, lk: int, d: int, *, causal: bool, sparsity: float,
                              dtype_bytes: int = 2, host_launches: float = 0.0,
                              statistics_in_graph: bool = False) -> Estimate:
    """The predictor and the block-sparse flash kernel keeping (1 - sparsity) of the tiles dense
    attention computes; with `host_launches` (units of `cost_model.host_paced`), at least the op's
    host path. statistics_in_graph: the predictor's block statistics computed in the graph
    (`estimate_block_statistics`) and the op's predictor on them, else the op pools Q and K."""
    kernel = estimate_sparse_kernel(hw, b, h, hkv, lq, lk, d, causal=causal, sparsity=sparsity, dtype_bytes=dtype_bytes)
    parts = [estimate_predictor(hw, b, h, hkv, lq, lk, d, dtype_bytes=dtype_bytes, statistics_in_graph=statistics_in_graph)]
    if statistics_in_graph:
        parts.insert(0, estimate_block_statistics(hw, b, h, hkv, lq, lk, d, dtype_bytes=dtype_bytes))
    est = cost_model.chain(f"sparse attention ({sparsity:.0%} of blocks skipped)", *parts, kernel)
    return cost_model.host_paced(hw, est, host_launches, "graphopt::sparse_attention host path")


def estimate_dense(hw, backend: str, b, h, hkv, lq, lk, d, *, causal: bool, dtype_bytes: int = 2,
                   host_launches: float = 0.0) -> Estimate:
    """The dense attention the attention pass chose (its op's `backend` argument); with
    `host_launches`, at least its op's host path."""
    if backend == "triton":
        est = cost_model.fused_attention(hw, b, h, lq, lk, d, family="triton_flash", causal=causal,
                                         dtype_bytes=dtype_bytes, kv_heads=hkv, name="Triton flash (dense)")
    else:
        sdpa_backend = backend if backend in cost_model.SDPA_BACKENDS else "cudnn"
        est = cost_model.sdpa(hw, b, h, lq, lk, d, backend=sdpa_backend, causal=causal, dtype_bytes=dtype_bytes,
                              kv_heads=hkv)
    return cost_model.host_paced(hw, est, host_launches, "graphopt::attention host path")


def priced_host_launches(ctx, backend: str, dense_is_op: bool) -> tuple[float, float]:
    """(sparse, dense) host-path units for the estimates: zero where the host path is not priced
    (CUDA-graph replay, or not a GPU); the dense side only where it is a graphopt::attention node
    (a plain SDPA call's host path, about 1.6 units, is left out)."""
    if not (ctx.config.prices_host_path and ctx.hardware.is_gpu):
        return 0.0, 0.0
    hw = ctx.hardware
    return (cost_model.sparse_attention_op_host_launches(hw),
            cost_model.attention_op_host_launches(hw, backend) if dense_is_op else 0.0)


# The longest sequence the break-even search below considers, and its scan step (tokens).
BREAK_EVEN_SEARCH_LIMIT = 1 << 20
BREAK_EVEN_SCAN_STEP = 8


def break_even_length(hw, backend: str, b: int, h: int, hkv: int, d: int, *, causal: bool, sparsity: float,
                      dtype_bytes: int = 2, limit: int = BREAK_EVEN_SEARCH_LIMIT,
                      host_launches: tuple[float, float] = (0.0, 0.0), statistics_in_graph: bool = False) -> int | None:
    """The self-attention length L (Lq = Lk = L) from which predictor + sparse kernel are estimated
    faster than dense `backend`, or None if not even at `limit`. The sparse estimate's fixed parts
    (predictor launches, a row cost per query block) fall behind dense attention's L^2 as L grows,
    so the comparison flips from dense to sparse once, apart from a band just above the flip where
    block rounding makes the estimates trade places (up to 9% apart, over 1.15x of lengths). A
    binary search finds a winning length; a scan in steps of BREAK_EVEN_SCAN_STEP tokens up to
    twice it moves the answer past the last loss it samples. Losses narrower than the step can
    remain: over the hardware table, backends and a range of shapes, up to 7 lengths, estimated at
    most 2% slower (tests/passes/test_sparse_attention.py checks this). host_launches: the (sparse,
    dense) host-path units of `priced_host_launches`, which only move the flip to longer lengths."""
    def wins(length: int) -> bool:
        dense = estimate_dense(hw, backend, b, h, hkv, length, length, d, causal=causal, dtype_bytes=dtype_bytes,
                               host_launches=host_launches[1])
        sparse = estimate_sparse_attention(hw, b, h, hkv, length, length, d, causal=causal, sparsity=sparsity,
                                           dtype_bytes=dtype_bytes, host_launches=host_launches[0],
                                           statistics_in_graph=statistics_in_graph)
        return sparse.ms < dense.ms

    if not wins(limit):
        return None
    low, high = 1, limit  # wins(high) holds
    while low < high:
        mid = (low + high) // 2
        if wins(mid):
            high = mid
        else:
            low = mid + 1
    losses = [n for n in range(high, min(2 * high, limit), BREAK_EVEN_SCAN_STEP) if not wins(n)]
    return losses[-1] + 1 if losses else high


__all__ = ["BREAK_EVEN_SCAN_STEP", "BREAK_EVEN_SEARCH_LIMIT", "PREDICTOR_LAUNCHES", "SELECTION_LAUNCHES", "STATISTICS_LAUNCHES", "break_even_length",
           "estimate_block_statistics", "estimate_dense", "estimate_predictor",
           "estimate_sparse_attention", "estimate_sparse_kernel", "kept_tile_count", "priced_host_launches"]
