"""Block-sparse attention in the style of SpargeAttn (arXiv 2502.18137): a cheap block-mask predictor
and a Triton flash-attention kernel that visits only the kept key blocks of each query block.

    out = sparse_attention(q, k, v, is_causal=True, simthreshd1=0.6, cdfthreshd=0.98)
    out, skipped = sparse_attention(q, k, v, return_sparsity=True)   # skipped: fraction of QK blocks

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0 (grouped-query attention reads
kv head h // (H // Hkv)). Thresholds are floats or per-head 1-D tensors of length H.

Predictor (one row per query block of BLOCK_M tokens, one column per key block of BLOCK_N tokens;
the predictor's block sizes are the kernel's):
  1. Mean-pool each block of Q and K (with step 2: `block_statistics`, plain torch; the only step
     that reads all of Q and K, so the sparse_attention pass can emit it into the graph, next to
     the kernels that produce Q and K, and the op's predictor then reads only its pooled rows).
  2. Self-similarity of a block = mean cosine similarity over all pairs of its tokens (i = j pairs
     included: ||sum_i x_i/|x_i| ||^2 / n^2). A block at or below `simthreshd1` is "not similar":
     its pooled vector does not represent it, so it is always computed: a whole row for a query
     block, a whole column for a key block. `simthreshd1=-1` therefore marks every block similar.
  3. Pooled scores `pooled_q @ pooled_k^T * scale`, softmax per row over the similar (and, under
     causality, allowed) key blocks.
  4. Per row, keep the smallest set of highest-probability blocks whose mass reaches `cdfthreshd`:
     sort descending, keep the prefix whose exclusive cumulative sum is below `cdfthreshd`, then
     keep every block whose probability is >= the smallest kept one (ties are kept together).
     `cdfthreshd >= 1` keeps every block.
  5. Under `is_causal` only blocks with at least one (query, key) pair at or below the diagonal are
     candidates, and every block the diagonal crosses is always kept (it is the only place the
     first tokens of the query block see themselves). Every row keeps at least one block.
  The kernel reads the kept blocks of each row as a compact list: `lut[b, h, i, :counts[b, h, i]]`
  holds the kept key-block indices in ascending order.
  On the Triton path the predictor is three launches with no host synchronization (CUDA-graph
  capturable; two where the block statistics are given, `select_block_lut`): (1) pool Q and K
  blocks with their self-similarity into one fp32 workspace;
  (2) the pooled scores, a small GEMM per head; (3) per query block, in one warp: masked
  softmax, top-cdf and the compact list, in registers. Step 4 there needs no sort: a block is
  kept iff the mass of the strictly larger probabilities is < cdfthreshd, i.e. iff its
  probability is >= the smallest fp32 t with F(t) = sum(p > t) < cdfthreshd, found by searching
  the bit patterns of t from the row max (3 pivots, 16 steps on short rows; bisection, 31 steps,
  on long ones).

Kernel: online-softmax flash attention over the row's list. Under `is_causal` the token-level
causal mask is applied inside the diagonal blocks (SpargeAttn's fast path masks only at block
level), so no output ever depends on later keys, values or queries; `is_causal` requires Lq == Lk
(the diagonal is the main one, as in SDPA). Keys beyond Lk in the last block are masked.

PV skipping (`pvthreshd`, log2 units, None or inf = off): after QK^T of a tile, if for every
(valid) query row of the tile the tile's row max is below the running row max minus `pvthreshd`,
the tile's exp and P.V are skipped: its weights are all below 2^-pvthreshd of the row's largest.
This is lossy and changes results; the block mask alone (PV skipping off) is exact on the blocks
it keeps.

Kernel performance notes (Hopper): 128 x 64 tiles; tiles take the row max of the raw products
and one FMA into exp2 (scale folded with log2 e); a masked tile adds one compare and one select
per element; P.V accumulates into the rescaled accumulator inside the MMA; under causality the
heaviest (last) query blocks of a group of heads whose K/V fit in L2 start first (tile_order.py).
Two kernel bodies, autotuned: the default one (8 warps at D=128; pairs of unmasked blocks, then
single ones, then the masked suffix, so only diagonal / partial tiles are masked; whether the next
block index is prefetched one iteration ahead) and the single loop (4 warps, Q/K/V/O through
tensor descriptors, the masked suffix in a short loop before one branch-free loop over the
unmasked blocks). The single loop's descriptors are built once on the host when whole blocks
tile every head, else by each program on the device.

Caveats: inference only (no autograd). The Triton path needs D <= 256 and q, k, v of one dtype
(fp16, bf16 or fp32; fp32 uses IEEE dot products). `return_sparsity` synchronizes the device to
return a Python float; the fraction counts blocks skipped among those dense attention would
compute (under causality, the blocks at or below the diagonal).

Modules: `reference` (plain torch: geometry, thresholds, the block statistics and the predictor, the block lists, the
attention over kept blocks), `attention_kernel` (the Triton kernel and what its TMA paths need),
`predictor_kernels` and `predictor` (the Triton predictor and its launches), `api`
(`sparse_attention`, `block_sparse_attention`), `synthetic` (`local_sink_qkv`). Every public name
is importable from here.
"""

from graphopt.kernels.launch import cdiv
from graphopt.kernels.sparse_attention import attention_kernel as _attention_kernel
from graphopt.kernels.sparse_attention import predictor as _predictor
from graphopt.kernels.sparse_attention import predictor_kernels as _predictor_kernels
from graphopt.kernels.sparse_attention.api import block_sparse_attention, sparse_attention
from graphopt.kernels.sparse_attention.attention_kernel import (
    host_descriptors_supported,
    single_loop_supported,
    tma_loads_supported,
)
from graphopt.kernels.sparse_attention.predictor import (
    POOL_LOOP_STAGES,
    POOL_SLICE_ELEMENTS,
    POOL_WARPS,
    PREDICTOR_ROWS,
    PREDICTOR_VARIANTS,
    V3_SHAPE,
    pool_qk_triton,
    predict_block_lut,
    predictor_stages,
    select_block_lut,
)
from graphopt.kernels.sparse_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    DEFAULT_CDFTHRESHD,
    DEFAULT_SIMTHRESHD1,
    IMPLEMENTATIONS,
    LOG2E,
    allowed_block_count,
    block_mask_to_lut,
    block_sparse_attention_reference,
    block_statistics,
    causal_block_geometry,
    checked_block_statistics,
    lut_to_block_mask,
    per_head,
    pool_blocks,
    predict_block_mask,
    pv_skipping_requested,
    reference_sparse_attention,
    select_block_mask,
    top_cdf_keep,
)
from graphopt.kernels.sparse_attention.synthetic import local_sink_qkv

# internals the tests and benchmarks reach through the family's path (the Triton ones exist where
# Triton is installed); the predictor's launch-shape helper is patched in its own module
_attention_configs = _attention_kernel._attention_configs
_prune_attention_configs = _attention_kernel._prune_attention_configs
_ensure_descriptor_allocator = _attention_kernel._ensure_descriptor_allocator
_lut_kernel_config = _predictor._lut_kernel_config
for _name in ("_sparse_attention_kernel", "_sparse_attention_kernel_tuned", "_attend_tile"):
    if hasattr(_attention_kernel, _name):
        globals()[_name] = getattr(_attention_kernel, _name)
if hasattr(_predictor_kernels, "_pool_blocks_kernel"):
    _pool_blocks_kernel = _predictor_kernels._pool_blocks_kernel
del _name

__all__ = [
    "BLOCK_M", "BLOCK_N", "DEFAULT_SIMTHRESHD1", "DEFAULT_CDFTHRESHD", "IMPLEMENTATIONS", "LOG2E", "POOL_LOOP_STAGES",
    "POOL_SLICE_ELEMENTS", "POOL_WARPS", "PREDICTOR_ROWS", "PREDICTOR_VARIANTS", "V3_SHAPE", "allowed_block_count",
    "block_mask_to_lut", "block_sparse_attention", "block_sparse_attention_reference", "block_statistics",
    "causal_block_geometry", "cdiv", "checked_block_statistics",
    "host_descriptors_supported", "local_sink_qkv", "lut_to_block_mask", "per_head", "pool_blocks", "pool_qk_triton",
    "predict_block_lut", "predict_block_mask", "predictor_stages", "pv_skipping_requested", "reference_sparse_attention",
    "select_block_lut", "select_block_mask", "single_loop_supported", "sparse_attention", "tma_loads_supported",
    "top_cdf_keep",
]
