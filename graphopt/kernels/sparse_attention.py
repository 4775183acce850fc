"""Block-sparse attention in the style of SpargeAttn (arXiv 2502.18137): a cheap block-mask predictor
and a Triton flash-attention kernel that visits only the kept key blocks of each query block.

    out = sparse_attention(q, k, v, is_causal=True, simthreshd1=0.6, cdfthreshd=0.98)
    out, skipped = sparse_attention(q, k, v, return_sparsity=True)   # skipped: fraction of QK blocks

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0 (grouped-query attention reads
kv head h // (H // Hkv)). Thresholds are floats or per-head 1-D tensors of length H.

Predictor (one row per query block of BLOCK_M tokens, one column per key block of BLOCK_N tokens;
the predictor's block sizes are the kernel's):
  1. Mean-pool each block of Q and K.
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
  capturable): (1) pool Q and K blocks with their self-similarity into one fp32 workspace;
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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None
    tl = None

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import INTERPRET, cdiv, launch, launch_tuned
from graphopt.kernels.tile_order import causal_head_group

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None

if triton is not None:
    from graphopt.kernels.tile_order import query_block_order

BLOCK_M = 128  # query tokens per block (kernel tile rows, predictor row granularity)
BLOCK_N = 64  # key tokens per block (kernel tile columns, predictor column granularity)
LOG2E = 1.4426950408889634
DEFAULT_SIMTHRESHD1 = 0.6
DEFAULT_CDFTHRESHD = 0.98
IMPLEMENTATIONS = ("auto", "triton", "reference")


# ---------------------------------------------------------------------------------------------
# Thresholds and block geometry
# ---------------------------------------------------------------------------------------------
def per_head(value, n_heads: int, name: str, device=None) -> torch.Tensor:
    """A threshold as a float32 (H,) tensor: a float is broadcast, a 1-D tensor must have H entries."""
    if value is None:
        value = math.inf
    if isinstance(value, torch.Tensor):
        t = value.detach().to(dtype=torch.float32, device=device).reshape(-1)
        if t.numel() == 1:
            return t.expand(n_heads).contiguous()
        if t.numel() != n_heads:
            raise ValueError(f"{name} has {t.numel()} entries; it must be a float or a 1-D tensor with one entry per head ({n_heads})")
        return t.contiguous()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((n_heads,), float(value), dtype=torch.float32, device=device)
    raise ValueError(f"{name} must be a float or a 1-D tensor of per-head values, got {type(value).__name__}")


def pv_skipping_requested(pvthreshd) -> bool:
    """None, inf or an empty tensor: off. A finite float or an (H,) tensor (inf entries never skip): on."""
    if pvthreshd is None:
        return False
    if isinstance(pvthreshd, torch.Tensor):
        return pvthreshd.numel() > 0
    return not math.isinf(float(pvthreshd))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"sparse_attention expects (B, H, L, D) tensors; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[3] != D or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"incompatible shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (k and v must be (B, Hkv, Lk, D))")
    if H % k.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    if is_causal and Lq != k.shape[2]:
        raise ValueError(f"is_causal=True needs Lq == Lk (got {Lq} and {k.shape[2]}); the causal diagonal is the main one")
    return H // k.shape[1], v.shape[3]


def _no_blocks(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No queries or no keys: no blocks to predict or visit (the predictor's "at least one block
    per row" has nothing to keep, and the kernel would read a key block that is not there)."""
    return q.shape[2] == 0 or k.shape[2] == 0


def _empty_result(q: torch.Tensor, v: torch.Tensor, return_sparsity: bool):
    """SDPA's answer without keys (an empty softmax times an empty V: zeros); nothing skipped."""
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    return (out, 0.0) if return_sparsity else out


def causal_block_geometry(n_q: int, n_k: int, lq: int, lk: int, block_m: int, block_n: int, device=None):
    """(allowed, diagonal) bool (nQ, nK): blocks with a (query, key) pair at/below the diagonal, and
    the blocks the diagonal crosses (some key after some query: token mask needed, always kept)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    last_query = torch.clamp((i + 1) * block_m, max=lq) - 1
    last_key = torch.clamp((j + 1) * block_n, max=lk) - 1
    allowed = j * block_n <= last_query
    diagonal = allowed & (last_key > i * block_m)
    return allowed, diagonal


def allowed_block_count(b: int, h: int, lq: int, lk: int, is_causal: bool, block_m: int, block_n: int) -> int:
    n_q, n_k = cdiv(lq, block_m), cdiv(lk, block_n)
    if not is_causal:
        return b * h * n_q * n_k
    allowed, _ = causal_block_geometry(n_q, n_k, lq, lk, block_m, block_n)
    return b * h * int(allowed.sum())


# ---------------------------------------------------------------------------------------------
# Torch reference: predictor, compact index list, and the block-sparse attention it drives
# ---------------------------------------------------------------------------------------------
def pool_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pooled blocks and their self-similarity: x (B, H, L, D) -> (B, H, n, D), (B, H, n) fp32."""
    B, H, L, D = x.shape
    n = cdiv(L, block)
    xf = F.pad(x.float(), (0, 0, 0, n * block - L)).view(B, H, n, block, D)  # padded tokens are 0
    counts = torch.clamp(L - torch.arange(n, device=x.device) * block, max=block).to(torch.float32)
    pooled = xf.sum(3) / counts[:, None]
    unit = xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # zero (padded) tokens stay zero
    self_similarity = unit.sum(3).pow(2).sum(-1) / counts**2
    return pooled, self_similarity


def top_cdf_keep(probs: torch.Tensor, cdfthreshd: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest set of largest entries whose mass reaches cdfthreshd (ties kept)."""
    sorted_p, _ = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    smallest_kept = torch.where(mass_before < cdfthreshd, sorted_p, torch.inf).amin(-1, keepdim=True)
    return probs >= smallest_kept


def predict_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Kept QK blocks, bool (B, H, nQ, nK), nQ = ceil(Lq / block_m), nK = ceil(Lk / block_n)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    group = H // k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    sim1 = per_head(simthreshd1, H, "simthreshd1", q.device).view(1, H, 1)
    cdf = per_head(cdfthreshd, H, "cdfthreshd", q.device).view(1, H, 1, 1)
    pooled_q, sim_q = pool_blocks(q, block_m)  # (B, H, nQ, D), (B, H, nQ)
    pooled_k, sim_k = pool_blocks(k, block_n)  # (B, Hkv, nK, D), (B, Hkv, nK)
    if group > 1:
        pooled_k, sim_k = pooled_k.repeat_interleave(group, 1), sim_k.repeat_interleave(group, 1)
    n_q, n_k = pooled_q.shape[2], pooled_k.shape[2]
    if is_causal:
        allowed, diagonal = causal_block_geometry(n_q, n_k, Lq, Lk, block_m, block_n, q.device)
    else:
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        diagonal = torch.zeros_like(allowed)
    q_similar = (sim_q > sim1)[..., :, None]  # (B, H, nQ, 1)
    k_similar = (sim_k > sim1)[..., None, :]  # (B, H, 1, nK)
    scores = pooled_q @ pooled_k.transpose(-1, -2) * scale  # (B, H, nQ, nK)
    candidates = k_similar & allowed
    probs = torch.softmax(scores.masked_fill(~candidates, -torch.inf), dim=-1).nan_to_num(0.0)
    keep = top_cdf_keep(probs, cdf) & candidates
    keep |= ~q_similar | ~k_similar | (cdf >= 1.0) | diagonal
    keep &= allowed
    # At least one block per row: the allowed block with the highest pooled score.
    best = scores.masked_fill(~allowed, -torch.inf).argmax(-1, keepdim=True)
    empty = ~keep.any(-1, keepdim=True)
    keep |= empty & (torch.arange(n_k, device=q.device) == best)
    return keep


def block_mask_to_lut(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact per-row index list: lut int32 (B, H, nQ, nK) whose first counts[b, h, i] entries are
    the kept key-block indices of row i in ascending order; counts int32 (B, H, nQ)."""
    counts = block_mask.sum(-1, dtype=torch.int32)
    order = torch.sort((~block_mask).to(torch.uint8), dim=-1, stable=True).indices  # kept first, ascending
    return order.to(torch.int32).contiguous(), counts.contiguous()


def lut_to_block_mask(lut: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Inverse of `block_mask_to_lut`: bool (B, H, nQ, nK)."""
    n_k = lut.shape[-1]
    valid = torch.arange(n_k, device=lut.device) < counts[..., None]
    wide = torch.zeros(*lut.shape[:-1], n_k + 1, dtype=torch.bool, device=lut.device)  # column nK: discard
    wide.scatter_(-1, torch.where(valid, lut.long(), n_k), True)
    return wide[..., :n_k]


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    pvthreshd=None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Attention over the kept blocks, visited in ascending key-block order exactly as the kernel
    does (online softmax, PV skipping decided per tile from the running max). fp32 math (fp64 for
    fp64 inputs); returns q.dtype."""
    group, _ = _check_inputs(q, k, v, is_causal)
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    scale = D**-0.5 if scale is None else float(scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_q, n_k = cdiv(Lq, block_m), cdiv(Lk, block_n)
    if block_mask.shape != (B, H, n_q, n_k):
        raise ValueError(f"block_mask has shape {tuple(block_mask.shape)}; expected {(B, H, n_q, n_k)} for blocks {block_m}x{block_n}")
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    qb = F.pad(q.to(work), (0, 0, 0, n_q * block_m - Lq)).view(B, H, n_q, block_m, D) * (scale * LOG2E)
    kb = F.pad(k.to(work), (0, 0, 0, n_k * block_n - Lk)).view(B, H, n_k, block_n, D)
    vb = F.pad(v.to(work), (0, 0, 0, n_k * block_n - Lk)).view(B, H, n_k, block_n, Dv)
    q_pos = torch.arange(n_q * block_m, device=q.device).view(n_q, block_m)
    row_valid = q_pos < Lq  # (nQ, BM)
    pv = per_head(pvthreshd, H, "pvthreshd", q.device).to(work).view(1, H, 1, 1) if pv_skipping_requested(pvthreshd) else None
    m = torch.full((B, H, n_q, block_m), -torch.inf, dtype=work, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, H, n_q, block_m, Dv, dtype=work, device=q.device)
    for j in range(n_k):
        active = block_mask[..., j]  # (B, H, nQ)
        if not bool(active.any()):
            continue
        s = torch.einsum("bhqmd,bhnd->bhqmn", qb, kb[:, :, j])  # (B, H, nQ, BM, BN), log2 units
        k_pos = torch.arange(j * block_n, (j + 1) * block_n, device=q.device)
        valid = (k_pos < Lk).expand(n_q, block_m, block_n)
        if is_causal:
            valid = valid & (k_pos[None, None, :] <= q_pos[:, :, None])
        s = s.masked_fill(~valid, -torch.inf)
        tile_max = s.amax(-1)  # (B, H, nQ, BM)
        if pv is not None:
            below = (tile_max < m - pv) | ~row_valid
            active = active & ~below.all(-1)
        m_new = torch.where(active[..., None], torch.maximum(m, tile_max), m)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_safe)
        p = torch.exp2(s - m_safe[..., None])
        a = active[..., None]
        l = torch.where(a, l * alpha + p.sum(-1), l)
        acc = torch.where(a[..., None], acc * alpha[..., None] + p @ vb[:, :, j][:, :, None], acc)
        m = m_new
    out = acc / l[..., None]
    return out.reshape(B, H, n_q * block_m, Dv)[:, :, :Lq].to(q.dtype)


def reference_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    pvthreshd=None,
    return_sparsity: bool = False,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
):
    """Plain-torch sparse attention with the semantics of `sparse_attention` (runs anywhere)."""
    _check_inputs(q, k, v, is_causal)
    if _no_blocks(q, k):
        return _empty_result(q, v, return_sparsity)
    mask = predict_block_mask(q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
                              cdfthreshd=cdfthreshd, block_m=block_m, block_n=block_n)
    out = block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal, scale=scale, pvthreshd=pvthreshd,
                                           block_m=block_m, block_n=block_n)
    if return_sparsity:
        B, H, Lq, _ = q.shape
        total = allowed_block_count(B, H, Lq, k.shape[2], is_causal, block_m, block_n)
        return out, 1.0 - int(mask.sum()) / total
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
PREDICTOR_ROWS = 16  # query blocks per program of the LUT kernel (the pooled-score dot needs >= 16)


def _attention_configs():
    """Hopper-oriented search space (BLOCK_M x BLOCK_N are fixed: they are the predictor's blocks).

    PREFETCH_INDEX=1 reads the next kept block index one iteration ahead (the K/V addresses of a
    tile then never wait on a LUT load); 0 leaves the indirect load to Triton's pipeliner. Which
    one pipelines better depends on the Triton version, so both are tuned. PAIR_BLOCKS=1 runs the
    unmasked kept blocks two per step (see _attend_pairs)."""
    configs = [triton.Config({"PREFETCH_INDEX": p, "USE_TMA": 0, "PAIR_BLOCKS": 0}, num_warps=8, num_stages=s)
               for p in (1, 0) for s in (3, 4, 2)]
    configs += [triton.Config({"PREFETCH_INDEX": p, "USE_TMA": 0, "PAIR_BLOCKS": 0}, num_warps=4, num_stages=s)
                for p in (1, 0) for s in (3, 2)]
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0}, num_warps=w, num_stages=s)
                for w, s in ((8, 2), (8, 3), (8, 4), (4, 3))]
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": t, "PAIR_BLOCKS": 1}, num_warps=8, num_stages=s)
                for t in (1,) for s in (2, 3)]  # with pointer loads the pair spills (sm_90, 8 warps)
    # one loop over the whole list in one warp group (252 registers at D=128 on sm_90, no spills);
    # at 2 stages with the masked suffix merged into it (MERGED_SUFFIX), at 3 in a loop of its own
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0, "SINGLE_LOOP": 1,
                               "MERGED_SUFFIX": int(s == 2)}, num_warps=4, num_stages=s) for s in (2, 3)]
    return configs


def _prune_attention_configs(configs, named_args, **kwargs):
    """A 128 x 128 fp32 accumulator in 4 warps is 128 registers per thread before anything else:
    head dims >= 128 use 8 warps (or the lean single loop in 4), head dims <= 32 use 4 (too little
    work for 8), 64 tries both. The single loop needs tensor descriptors for all four tensors and no
    PV skipping; from head dim 128 it runs at 2 stages only."""
    def arg(name, default=None):
        return kwargs.get(name, named_args.get(name, default))

    head_dim = arg("HEAD_DIM", 128)
    if head_dim >= 128:
        # the 3-stage single loop: on the H100 (D=128, 8k and 16k, 32 heads, 25-100% density)
        # slower than the 2-stage one in 11 of 12 rows (a tie in the 12th), yet the tuner, timing
        # at the first call's density, picked it in 2 of 5 runs
        configs = [c for c in configs if not (c.kwargs.get("SINGLE_LOOP") and c.num_stages > 2)]
    if not tma_loads_supported(named_args["k_ptr"], named_args["v_ptr"]):
        configs = [c for c in configs if not c.kwargs.get("USE_TMA")]
    if not single_loop_supported(named_args["q_ptr"], named_args["k_ptr"], named_args["v_ptr"], named_args["o_ptr"],
                                 head_dim, bool(arg("PV_SKIP", False))):
        configs = [c for c in configs if not c.kwargs.get("SINGLE_LOOP")]
    if head_dim >= 128:
        kept = [c for c in configs if c.num_warps == 8 or c.kwargs.get("SINGLE_LOOP")]
    elif head_dim <= 32:
        kept = [c for c in configs if c.num_warps == 4]
    else:
        kept = list(configs)
    return kept or configs


def tma_loads_supported(*tensors: torch.Tensor) -> bool:
    """Whether tiles of these (B, H, L, D) tensors can move through tensor descriptors (TMA): a
    Hopper or newer GPU, a Triton with tl.make_tensor_descriptor, 16-byte aligned rows and base
    addresses. Called on every launch, so it stays cheap (the capability is cached)."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    first = tensors[0]
    if not INTERPRET and not (first.is_cuda and compute_capability(first.device.index)[0] >= 9):
        return False
    for t in tensors:
        b, h, m, d = t.stride()
        size = t.element_size()
        if d != 1 or t.data_ptr() % 16 or (b * size) % 16 or (h * size) % 16 or (m * size) % 16:
            return False
    return True


def _single_loop_body_supported(head_dim: int, pv_skip: bool) -> bool:
    """The single loop's own limits: descriptor tiles as wide as the head dim (a power of two),
    and no PV skipping."""
    return not pv_skip and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def single_loop_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, head_dim: int,
                          pv_skip: bool) -> bool:
    """The single-loop body reads Q, K, V and writes O through descriptors whose tile width is the
    head dim (a power of two), and has no PV skipping."""
    return _single_loop_body_supported(head_dim, pv_skip) and tma_loads_supported(q, k, v, out)


def host_descriptors_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                               block_m: int, block_n: int) -> bool:
    """Whether the single loop can take descriptors built on the host over all heads' rows,
    (B*H*L, D) views: each tensor's (B, H, L) dims collapse into one row dim, and whole blocks
    tile every head (a partial block would read, and for O write, the next head's rows). Row
    coordinates are int32 in the kernel and in TMA."""
    if _TensorDescriptor is None or q.shape[2] % block_m or k.shape[2] % block_n:
        return False
    if max(t.shape[0] * t.shape[1] * t.shape[2] for t in (q, k)) >= 2**31:
        return False
    for t in (q, k, v, out):
        stride_b, stride_h, stride_m, _ = t.stride()
        _, heads, length, _ = t.shape
        if stride_h != length * stride_m or stride_b != heads * stride_h:
            return False
    return True


def _host_descriptors(q, k, v, out, block_m: int, block_n: int) -> tuple:
    """Descriptors over each tensor's (B*H*L, D) rows; built directly from shapes and strides
    (host_descriptors_supported checked that the rows collapse), one per launch."""
    def rows(t, block_rows):
        B, H, L, D = t.shape
        return _TensorDescriptor(t, [B * H * L, D], [t.stride(2), 1], [block_rows, D])
    return rows(q, block_m), rows(k, block_n), rows(v, block_n), rows(out, block_m)


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need a small global scratch per launch; give Triton a torch
    allocator unless the program already installed one."""
    from triton.runtime import _allocation

    current = _allocation._allocator.get() if hasattr(_allocation._allocator, "get") else _allocation._allocator
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


if triton is not None:

    # ------------------------------------------------------------------------ attention kernel
    @triton.jit
    def _load_kv_tile(ptrs, desc, start_n, keys, offs_d, Lk, stride_n, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
                      MASKED: tl.constexpr, TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr, desc_row0=0):
        """One K or V tile of BLOCK_N keys from `start_n`: (BLOCK_D, BLOCK_N) K^T when TRANSPOSED,
        else (BLOCK_N, BLOCK_D). USE_TMA: through the tensor descriptor (zero fill past Lk and
        HEAD_DIM in hardware), whose row of key 0 is desc_row0; else pointer loads, masked only
        where MASKED / PAD_D need it."""
        if USE_TMA:
            tile = desc.load([desc_row0 + start_n, 0])  # (BLOCK_N, BLOCK_D)
            if TRANSPOSED:
                tile = tl.trans(tile)
        else:
            ptrs = ptrs + start_n * stride_n
            if TRANSPOSED:
                key_ok = keys[None, :] < Lk
                d_ok = offs_d[:, None] < HEAD_DIM
            else:
                key_ok = keys[:, None] < Lk
                d_ok = offs_d[None, :] < HEAD_DIM
            if MASKED:
                if PAD_D:
                    tile = tl.load(ptrs, mask=key_ok & d_ok, other=0.0)
                else:
                    tile = tl.load(ptrs, mask=key_ok, other=0.0)
            else:
                if PAD_D:
                    tile = tl.load(ptrs, mask=d_ok, other=0.0)
                else:
                    tile = tl.load(ptrs)
        return tile

    @triton.jit
    def _attend_tile(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, start_n, desc_row0, offs_m, offs_n, offs_d, neg_pv_thresh,
        stride_kn, stride_vn, Lq, Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    ):
        """One (BLOCK_M x BLOCK_N) tile of online softmax (log2 domain): QK^T, token masks only when
        MASKED (a diagonal or a partial last block), optional PV skip, then P.V into `acc`.
        desc_row0: the head's first row in the K/V descriptors (0 for per-head descriptors built
        on the device; head * Lk for the host's descriptors over all heads' rows)."""
        keys = start_n + offs_n  # (BLOCK_N,)
        kt = _load_kv_tile(kt_ptrs, k_desc, start_n, keys, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D, MASKED, True, USE_TMA,
                           desc_row0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) raw products, fp32
        if MASKED:
            # One compare and one select per element; the scale stays in the FMA below. Causal
            # attention has Lq == Lk (checked on the host), so key <= row also keeps every key of a
            # stored row below Lk (rows past Lq are computed from zero-filled keys, never stored).
            if IS_CAUSAL:
                valid = keys[None, :] <= offs_m[:, None]
            else:
                valid = keys[None, :] < Lk
            qk = tl.where(valid, qk, float("-inf"))
        # max of the raw products, then scaled (qk_scale > 0, so this is the max of the scaled ones)
        tile_max = tl.max(qk, 1) * qk_scale
        if PV_SKIP:
            # Skip only if every valid row's tile max is below its running max - pvthreshd.
            gap = tl.where(offs_m < Lq, tile_max - m_i, float("-inf"))
            run = tl.max(gap, 0) >= neg_pv_thresh
        else:
            run = True
        if run:
            m_new = tl.maximum(m_i, tile_max)
            if MASKED:
                # A row may have seen only masked keys so far: shift by 0 instead of -inf (no NaN).
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_shift = m_new
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
            alpha = tl.math.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_kv_tile(v_ptrs, v_desc, start_n, keys, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D, MASKED, False,
                              USE_TMA, desc_row0)
            # P.V accumulates into the rescaled accumulator inside the MMA (no separate add).
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attend_tile_branch(acc, l_i, m_i, q, k_desc, v_desc, start_n, desc_row0, offs_m, offs_n, masked, Lk, qk_scale,
                            IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """_attend_tile through tensor descriptors with the token mask under a uniform runtime
        branch (`masked`), so masked and unmasked tiles share one pipelined loop."""
        keys = start_n + offs_n
        kt = tl.trans(k_desc.load([desc_row0 + start_n, 0]))
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if masked:
            if IS_CAUSAL:
                qk = tl.where(keys[None, :] <= offs_m[:, None], qk, float("-inf"))
            else:
                qk = tl.where(keys[None, :] < Lk, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([desc_row0 + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _attend_list(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, lo, hi, next_index, offs_m, offs_n, offs_d,
        neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH_INDEX: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Tiles lut_row[lo:hi]. PREFETCH_INDEX: `next_index` holds lut_row[lo] on entry and the
        entry after hi - 1 (clamped to the list) on exit."""
        for it in range(lo, hi):
            if PREFETCH_INDEX:
                block_index = next_index
                next_index = tl.load(lut_row + tl.minimum(it + 1, hi - 1), eviction_policy="evict_last")
            else:
                block_index = tl.load(lut_row + it, eviction_policy="evict_last")
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, block_index * BLOCK_N, 0, offs_m, offs_n, offs_d,
                neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, PAD_D, MASKED, IS_CAUSAL, PV_SKIP,
                DOT_PRECISION, USE_TMA)
        return acc, l_i, m_i, next_index

    @triton.jit
    def _attend_pairs(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, lo, hi, offs_n, offs_d, stride_kn, stride_vn,
        Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Unmasked tiles lut_row[lo:hi] (hi - lo even) two per step: two QK^T tiles share one
        running-max update and one rescale of the (BLOCK_M, D) accumulator, which is what a
        2 * BLOCK_N key tile costs in a dense kernel, though the two blocks need not be adjacent.
        The pair's indices are read one step ahead."""
        next0 = tl.load(lut_row + lo, mask=hi > lo, other=0)
        next1 = tl.load(lut_row + lo + 1, mask=hi > lo, other=0)
        for it in range(lo, hi, 2):
            start0 = next0 * BLOCK_N
            start1 = next1 * BLOCK_N
            ahead = tl.minimum(it + 2, hi - 2)
            next0 = tl.load(lut_row + ahead, eviction_policy="evict_last")
            next1 = tl.load(lut_row + ahead + 1, eviction_policy="evict_last")
            kt0 = _load_kv_tile(kt_ptrs, k_desc, start0, start0 + offs_n, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D,
                                False, True, USE_TMA)
            kt1 = _load_kv_tile(kt_ptrs, k_desc, start1, start1 + offs_n, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D,
                                False, True, USE_TMA)
            qk0 = tl.dot(q, kt0, input_precision=DOT_PRECISION)
            qk1 = tl.dot(q, kt1, input_precision=DOT_PRECISION)
            m_new = tl.maximum(m_i, tl.maximum(tl.max(qk0, 1), tl.max(qk1, 1)) * qk_scale)
            p0 = tl.math.exp2(qk0 * qk_scale - m_new[:, None])
            p1 = tl.math.exp2(qk1 * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + (tl.sum(p0, 1) + tl.sum(p1, 1))
            v0 = _load_kv_tile(v_ptrs, v_desc, start0, start0 + offs_n, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D,
                               False, False, USE_TMA)
            v1 = _load_kv_tile(v_ptrs, v_desc, start1, start1 + offs_n, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D,
                               False, False, USE_TMA)
            acc = tl.dot(p0.to(v0.dtype), v0, acc * alpha[:, None], input_precision=DOT_PRECISION)
            acc = tl.dot(p1.to(v1.dtype), v1, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL: tl.constexpr):
        """(query block, batch * head, batch, head, kv head) of this program of the 1-D grid, in
        tile_order's launch order (under causality the heaviest query blocks of a group of heads
        first)."""
        pid_m, pid_bh = query_block_order(N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        b = pid_bh // H
        h = pid_bh % H
        return pid_m, pid_bh, b, h, h // KV_GROUP

    @triton.jit
    def _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """(length, first block) of the blocks needing a token mask. Kept blocks are ascending, so
        these are a suffix of the list, consecutive blocks known without it: under causality the
        blocks the diagonal crosses (which the list must hold), else a partial last block."""
        if IS_CAUSAL:
            first_masked = (pid_m * BLOCK_M + 1) // BLOCK_N
            last_allowed = (tl.minimum((pid_m + 1) * BLOCK_M, Lq) - 1) // BLOCK_N
            n_masked = last_allowed - first_masked + 1
        else:
            first_masked = N_K_BLOCKS - 1
            last_block = tl.load(lut_row + tl.maximum(count - 1, 0))
            n_masked = ((Lk % BLOCK_N != 0) & (last_block == first_masked) & (count > 0)).to(tl.int32)
        return n_masked, first_masked

    @triton.jit
    def _head_descriptor(ptr, b, h, stride_b, stride_h, stride_row, rows, HEAD_DIM: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr):
        """A device-side descriptor over one head's (rows, HEAD_DIM) matrix."""
        return tl.make_tensor_descriptor(ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h,
                                         shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_ROWS, HEAD_DIM])

    @triton.jit
    def _attend_single_loop(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, q_hdesc, k_hdesc, v_hdesc, o_hdesc,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PARTIAL_KEYS: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
        MERGED_SUFFIX: tl.constexpr = False,
    ):
        """The row's unmasked blocks in one branch-free loop, in one warp group, after its masked
        suffix (diagonal or partial blocks, at most BLOCK_M // BLOCK_N + 1) in a short loop of its
        own: less live state than the default body's three loops, so a 128 x 128 fp32 accumulator
        fits 4 warps (the default body spills hundreds of bytes there; this one 40 at 2 stages, in
        triton 3.9's sm_90 build). Q, K, V and O all go through tensor descriptors (HEAD_DIM is a
        power of two; the launcher checks alignment).

        HOST_DESCRIPTORS: the launcher built the four descriptors (q_hdesc ...) over all heads'
        rows, (B*H*L, D), when whole blocks tile every head; else each program builds its own on
        the device, four global writes and a proxy fence before its first load. On the H100 at 8k
        tokens that made up about 2.5 of a program's 10 us of fixed cost (bench/sparse_fixed_cost.py).

        MERGED_SUFFIX (causal or a partial last key block): the masked suffix joins the main loop
        instead, its mask under a branch (_attend_tile_branch). Only at 2 stages: at 3 the merged
        loop spills 120 bytes (sm_90, triton 3.9; 1.16-1.2x slower on the H100)."""
        pid_m, pid_bh, b, h, kv_h = _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        if HOST_DESCRIPTORS:
            q_desc, k_desc, v_desc, o_desc = q_hdesc, k_hdesc, v_hdesc, o_hdesc
            q_row0 = pid_bh * Lq  # this head's first row in the (B*H*Lq, D) views
            kv_row0 = (b * (H // KV_GROUP) + kv_h) * Lk
        else:
            q_desc = _head_descriptor(q_ptr, b, h, stride_qb, stride_qh, stride_qm, Lq, HEAD_DIM, BLOCK_M)
            k_desc = _head_descriptor(k_ptr, b, kv_h, stride_kb, stride_kh, stride_kn, Lk, HEAD_DIM, BLOCK_N)
            v_desc = _head_descriptor(v_ptr, b, kv_h, stride_vb, stride_vh, stride_vn, Lk, HEAD_DIM, BLOCK_N)
            o_desc = _head_descriptor(o_ptr, b, h, stride_ob, stride_oh, stride_om, Lq, HEAD_DIM, BLOCK_M)
            q_row0 = 0
            kv_row0 = 0
        row = pid_bh * N_Q_BLOCKS + pid_m
        lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
        count = tl.load(count_ptr + row)
        # The list's first entry, read before Q's load, which waits in place: the first K/V loads
        # wait on the pipeliner's own read of this entry, issued after Q arrives, and that read
        # then hits L1 instead of making a trip to memory of its own. (The select keeps the read:
        # entries are never negative.)
        first_entry = tl.load(lut_row)
        count = tl.where(first_entry < 0, 0, count)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = q_desc.load([q_row0 + pid_m * BLOCK_M, 0])  # zero rows past Lq
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if IS_CAUSAL or PARTIAL_KEYS:
            n_masked, first_masked = _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M, BLOCK_N,
                                                    IS_CAUSAL)
        else:
            n_masked = 0  # whole key blocks, no causal mask: nothing to mask, and no read of the list's end
        # n_plain before the suffix loop: computed after it, the causal build spilled 8 more bytes
        # (sm_90, triton 3.9)
        n_plain = tl.maximum(count - n_masked, 0)
        if (IS_CAUSAL or PARTIAL_KEYS) and MERGED_SUFFIX:
            # The whole list in one pipelined loop, the masked suffix (its last n_masked entries) last,
            # its token mask under a uniform branch: a loop of the suffix's own (below) fills a
            # pipeline of its own, one more memory latency before the main loop. On the H100 (causal, 8k and 16k, 32 heads) 1.2-3.7% faster
            # at 10-25% density, -2.3% to +0.9% at 50%, 0.5-1% slower at 100%. No row
            # sees only masked keys, so the max needs no -inf guard: the list holds every block the
            # diagonal crosses (the launcher's precondition), and the first of them starts at the
            # query block's first token; a partial last key block starts below Lk.
            for it in range(0, count):
                start_n = tl.load(lut_row + it, eviction_policy="evict_last") * BLOCK_N
                acc, l_i, m_i = _attend_tile_branch(
                    acc, l_i, m_i, q, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, it >= n_plain, Lk, qk_scale,
                    IS_CAUSAL, DOT_PRECISION)
        else:
            if IS_CAUSAL or PARTIAL_KEYS:
                # The masked suffix first, in a loop of its own (at most BLOCK_M // BLOCK_N + 1 tiles):
                # pipelined, so a tile's K and V loads are in flight together and the next tile's load
                # overlaps this one. As straight-line code each load would wait on its own, K then V,
                # tile after tile (1-4% slower on the H100's causal rows). Its blocks come from
                # _masked_suffix, not the list, so its first loads wait on Q only.
                for j in tl.range(0, n_masked, num_stages=2):
                    start_n = (first_masked + j) * BLOCK_N
                    acc, l_i, m_i = _attend_tile(
                        acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, offs_d, 0.0,
                        stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, False, True, IS_CAUSAL, False,
                        DOT_PRECISION, True)
            for it in range(0, n_plain):
                start_n = tl.load(lut_row + it, eviction_policy="evict_last") * BLOCK_N
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, offs_d, 0.0,
                    stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, False, False, IS_CAUSAL, False,
                    DOT_PRECISION, True)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty row (count 0) gives 0
        o_desc.store([q_row0 + pid_m * BLOCK_M, 0], out.to(o_desc.dtype))  # rows past Lq are clipped

    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, SEQ_BUCKET, HEAD_GROUP,
        q_hdesc, k_hdesc, v_hdesc, o_hdesc,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, PV_PER_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PREFETCH_INDEX: tl.constexpr, USE_TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
        SINGLE_LOOP: tl.constexpr = False, PARTIAL_KEYS: tl.constexpr = False, HOST_DESCRIPTORS: tl.constexpr = False,
        TMA_ELIGIBLE: tl.constexpr = 0, MERGED_SUFFIX: tl.constexpr = False,
    ):
        """1-D grid of nQ * B*H programs (order: tile_order.query_block_order): one query block of one
        head; visits the kept key blocks of its LUT row.
        PAIR_BLOCKS (without PV skipping): unmasked blocks two per step (_attend_pairs).
        USE_TMA: K/V tiles through device-side tensor descriptors (Hopper TMA; the launcher
        checks alignment), else pointer loads.
        SINGLE_LOOP: the masked suffix, then the unmasked blocks in one loop (_attend_single_loop;
        MERGED_SUFFIX: both in one loop);
        PARTIAL_KEYS: Lk is not a multiple of BLOCK_N (the single loop's masked suffix).
        HOST_DESCRIPTORS: q_hdesc ... o_hdesc are the launcher's descriptors for the single loop
        (None otherwise; the default body never reads them).
        TMA_ELIGIBLE (not read; an autotuning key): 0 no descriptors possible, 1 for K/V, 2 for all four
        tensors and the single loop. The autotuner prunes USE_TMA / SINGLE_LOOP configs by alignment
        only when it tunes a key, so alignment must be part of the key: else a config chosen for
        aligned tensors would run on misaligned ones.
        The last dimension of q, k, v, o is contiguous (the launcher guarantees it). SEQ_BUCKET is
        only an autotuning key (the sequence length's power-of-two bucket)."""
        if SINGLE_LOOP:
            _attend_single_loop(
                q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, KV_GROUP, Lq, Lk,
                N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, q_hdesc, k_hdesc, v_hdesc, o_hdesc, HEAD_DIM, BLOCK_M,
                BLOCK_N, IS_CAUSAL, DOT_PRECISION, PARTIAL_KEYS, HOST_DESCRIPTORS, MERGED_SUFFIX)
        else:
            _attend_block_lists(
                q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh, stride_qb, stride_qh,
                stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh,
                stride_om, H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, HEAD_DIM, BLOCK_D, BLOCK_M,
                BLOCK_N, IS_CAUSAL, PV_SKIP, PV_PER_HEAD, DOT_PRECISION, PREFETCH_INDEX, USE_TMA, PAIR_BLOCKS)

    @triton.jit
    def _attend_block_lists(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, PV_PER_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PREFETCH_INDEX: tl.constexpr, USE_TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    ):
        """The kernel's default body: pairs of unmasked blocks, then single unmasked blocks, then the
        masked suffix (diagonal or partial blocks), each its own loop."""
        PAD_D: tl.constexpr = HEAD_DIM != BLOCK_D
        pid_m, pid_bh, b, h, kv_h = _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        if PAD_D:
            q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < Lq, other=0.0)  # (BLOCK_M, BLOCK_D)
        kt_ptrs = k_ptr + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_ptr + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
        if USE_TMA:
            k_desc = tl.make_tensor_descriptor(k_ptr + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh,
                                               shape=[Lk, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(v_ptr + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh,
                                               shape=[Lk, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
        else:
            k_desc = k_ptr  # unused
            v_desc = v_ptr
        row = pid_bh * N_Q_BLOCKS + pid_m
        lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
        count = tl.load(count_ptr + row)
        neg_pv_thresh = 0.0
        if PV_SKIP:
            if PV_PER_HEAD:
                neg_pv_thresh = -tl.load(pv_thresh_ptr + h)
            else:
                neg_pv_thresh = -pv_thresh
        n_masked, _ = _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M, BLOCK_N, IS_CAUSAL)
        n_plain = tl.maximum(count - n_masked, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        single_lo = 0
        if PAIR_BLOCKS and not PV_SKIP:
            single_lo = n_plain - n_plain % 2
            acc, l_i, m_i = _attend_pairs(
                acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, 0, single_lo, offs_n, offs_d,
                stride_kn, stride_vn, Lk, qk_scale, HEAD_DIM, PAD_D, BLOCK_N, DOT_PRECISION, USE_TMA)
        next_index = tl.load(lut_row + tl.minimum(single_lo, tl.maximum(count - 1, 0)), mask=count > 0, other=0)
        acc, l_i, m_i, next_index = _attend_list(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, single_lo, n_plain, next_index, offs_m, offs_n, offs_d,
            neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
            HEAD_DIM, PAD_D, BLOCK_N, False, IS_CAUSAL, PV_SKIP, DOT_PRECISION, PREFETCH_INDEX, USE_TMA)
        if PREFETCH_INDEX:
            next_index = tl.load(lut_row + tl.minimum(n_plain, tl.maximum(count - 1, 0)))
        acc, l_i, m_i, next_index = _attend_list(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, n_plain, count, next_index, offs_m, offs_n,
            offs_d, neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
            HEAD_DIM, PAD_D, BLOCK_N, True, IS_CAUSAL, PV_SKIP, DOT_PRECISION, PREFETCH_INDEX, USE_TMA)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty row (count 0) gives 0
        o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
        if PAD_D:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Lq)

    _sparse_attention_kernel_tuned = triton.autotune(
        configs=_attention_configs(),
        key=["HEAD_DIM", "IS_CAUSAL", "PV_SKIP", "DOT_PRECISION", "SEQ_BUCKET", "PARTIAL_KEYS", "HOST_DESCRIPTORS",
             "TMA_ELIGIBLE"],
        prune_configs_by={"early_config_prune": _prune_attention_configs},
    )(_sparse_attention_kernel)

    # ------------------------------------------------------------------------ predictor kernels
    @triton.jit
    def _mask_tile(pid_r, pid_c, pid_bh, H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS: tl.constexpr,
                   COLS: tl.constexpr):
        """The (ROWS query blocks x COLS key blocks) tile of one head's block mask that a predictor
        program owns: its head h; query block indices `rows` and key block indices `cols` with
        their bounds masks; and their int64 rows in the workspace's pooled_q / sim_q (`q_rows`,
        B*H*nQ of them) and pooled_k / sim_k (`k_rows`, B*HKV*nK, the head's KV group)."""
        h = pid_bh % H
        kv_bh = (pid_bh // H) * (H // KV_GROUP) + h // KV_GROUP
        rows = pid_r * ROWS + tl.arange(0, ROWS)
        cols = pid_c * COLS + tl.arange(0, COLS)
        q_rows = (pid_bh * N_Q_BLOCKS + rows).to(tl.int64)
        k_rows = (kv_bh * N_K_BLOCKS + cols).to(tl.int64)
        return h, rows, rows < N_Q_BLOCKS, cols, cols < N_K_BLOCKS, q_rows, k_rows

    @triton.jit
    def _store_block_lists(keep, best, cols, q_rows, row_ok, lut_ptr, count_ptr, N_K_BLOCKS):
        """Rows of the (ROWS, N_K_POW2) keep mask -> lut[row, :count] (ascending kept block
        indices) and count[row]. A row that kept nothing keeps `best`, its allowed block with the
        highest pooled score."""
        none_kept = (tl.sum(keep, 1) == 0).to(tl.int32)
        keep = keep | (none_kept[:, None] & (cols[None, :] == best[:, None]).to(tl.int32))
        position = tl.cumsum(keep, 1) - 1
        lut_rows = lut_ptr + q_rows[:, None] * N_K_BLOCKS
        tl.store(lut_rows + position, cols[None, :] + tl.zeros_like(keep), mask=(keep != 0) & row_ok[:, None])
        tl.store(count_ptr + q_rows, tl.sum(keep, 1), mask=row_ok)

    # Predictor "v2" (its pooling is also v3's): one program per block with all its loads in flight
    # at once (40-50 registers at D=128, so ~5 programs per SM stream Q and K), and a LUT kernel
    # whose masks are rebuilt rather than kept live (no spills up to nK = 512), with a 3-pivot
    # threshold search (16 steps instead of 31) where the rows are short.
    @triton.jit
    def _pool_slice_sums(x_base, stride_l, stride_d, L, first, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SUB: tl.constexpr):
        """Sums of x and of x / |x| over the SUB tokens from `first` (those < L): two (BLOCK_D,) fp32."""
        offs_l = first + tl.arange(0, SUB)
        ptrs = x_base + offs_l[:, None] * stride_l + offs_d[None, :] * stride_d
        if BLOCK_D == HEAD_DIM:  # no mask along D: vectorized loads
            x = tl.load(ptrs, mask=offs_l[:, None] < L, other=0.0).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=(offs_l[:, None] < L) & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        inv_norm = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-12)  # (SUB,): one division per token
        return tl.sum(x, 0), tl.sum(x * inv_norm[:, None], 0)  # padded tokens add 0

    @triton.jit
    def _pool_block_sums(
        x_base, stride_l, stride_d, L, start,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
        LOOP_STAGES: tl.constexpr,
    ):
        """Sums of x and of x / |x| over the tokens [start, min(start + BLOCK, L)): two (BLOCK_D,)
        fp32 vectors, read in SUB-token slices, each reduced over its tokens at once (within the
        warp, at one warp per program) into (BLOCK_D,) accumulators: few registers, so many
        programs fit an SM.
        LOOP_STAGES 0: the slice loop is unrolled (the compiler may hoist loads); n >= 1: a loop
        pipelined over n stages."""
        offs_d = tl.arange(0, BLOCK_D)
        x_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        unit_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if LOOP_STAGES == 0:
            for s in tl.static_range(0, BLOCK, SUB):
                x_sum, unit_sum = _pool_slice_sums(x_base, stride_l, stride_d, L, start + s, offs_d, HEAD_DIM, BLOCK_D, SUB)
                x_acc += x_sum
                unit_acc += unit_sum
        else:
            for s in tl.range(0, BLOCK, SUB, num_stages=LOOP_STAGES):
                x_sum, unit_sum = _pool_slice_sums(x_base, stride_l, stride_d, L, start + s, offs_d, HEAD_DIM, BLOCK_D, SUB)
                x_acc += x_sum
                unit_acc += unit_sum
        return x_acc, unit_acc

    @triton.jit
    def _pool_blocks_kernel(
        q_ptr, k_ptr, work_ptr,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        H, HKV, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, N_Q_PROGRAMS,
        off_sim_q, off_pooled_k, off_sim_k,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SUB_M: tl.constexpr, SUB_N: tl.constexpr, LOOP_STAGES: tl.constexpr,
    ):
        """1-D grid, one program per block: programs [0, B*H*nQ) pool query block `pid` (it is row
        pid of pooled_q / sim_q), the next B*HKV*nK key block `pid - B*H*nQ`, into one fp32 workspace
        laid out as pooled_q (B*H, nQ, D) | sim_q (B*H, nQ) | pooled_k (B*HKV, nK, D) | sim_k (B*HKV, nK)."""
        pid = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_D)
        if pid < N_Q_PROGRAMS:
            bh = pid // N_Q_BLOCKS
            start = (pid % N_Q_BLOCKS) * BLOCK_M
            base = q_ptr + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
            x_sum, unit_sum = _pool_block_sums(base, stride_ql, stride_qd, Lq, start, HEAD_DIM, BLOCK_D, BLOCK_M, SUB_M,
                                               LOOP_STAGES)
            count = tl.minimum(Lq - start, BLOCK_M).to(tl.float32)
            tl.store(work_ptr + pid.to(tl.int64) * HEAD_DIM + offs_d, x_sum / count, mask=offs_d < HEAD_DIM)
            tl.store(work_ptr + off_sim_q + pid, tl.sum(unit_sum * unit_sum, 0) / (count * count))
        else:
            row = pid - N_Q_PROGRAMS
            bh = row // N_K_BLOCKS
            start = (row % N_K_BLOCKS) * BLOCK_N
            base = k_ptr + (bh // HKV).to(tl.int64) * stride_kb + (bh % HKV).to(tl.int64) * stride_kh
            x_sum, unit_sum = _pool_block_sums(base, stride_kl, stride_kd, Lk, start, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N,
                                               LOOP_STAGES)
            count = tl.minimum(Lk - start, BLOCK_N).to(tl.float32)
            tl.store(work_ptr + off_pooled_k + row.to(tl.int64) * HEAD_DIM + offs_d, x_sum / count, mask=offs_d < HEAD_DIM)
            tl.store(work_ptr + off_sim_k + row, tl.sum(unit_sum * unit_sum, 0) / (count * count))

    @triton.jit
    def _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                        N_K_POW2: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """int32 0/1 (ROWS, N_K_POW2): existing key blocks with a (query, key) pair at/below the diagonal."""
        allowed = col_ok.to(tl.int32)[None, :] + tl.zeros([ROWS, N_K_POW2], dtype=tl.int32)
        if IS_CAUSAL:
            last_query = tl.minimum((rows + 1) * BLOCK_M, Lq) - 1  # (ROWS,)
            allowed = allowed & (cols[None, :] * BLOCK_N <= last_query[:, None]).to(tl.int32)
        return allowed

    @triton.jit
    def _mass_above(probs, bits):
        """F(t) per row: the mass of the probabilities strictly above t, t given by its fp32 bits (ROWS,)."""
        t = bits.to(tl.float32, bitcast=True)
        return tl.sum(tl.where(probs > t[:, None], probs, 0.0), 1)

    @triton.jit
    def _pooled_scores(work_ptr, q_rows, row_ok, k_rows, col_ok, off_pooled_k, HEAD_DIM: tl.constexpr,
                       D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       PRECISION: tl.constexpr):
        """Unscaled pooled scores (ROWS, COLS) = pooled_q[q_rows] (ROWS, D) @ pooled_k[k_rows]^T, in
        D chunks chained through the accumulator: with "ieee", one fp32 FMA chain over D per
        score whatever the chunking (v2 and v3)."""
        scores = tl.zeros([ROWS, COLS], dtype=tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, D_CHUNK):
            offs_d = d0 + tl.arange(0, D_CHUNK)
            pq = tl.load(work_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :],
                         mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            pkt = tl.load(work_ptr + off_pooled_k + k_rows[None, :] * HEAD_DIM + offs_d[:, None],
                          mask=col_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
            scores = tl.dot(pq, pkt, scores, input_precision=PRECISION)
        return scores

    @triton.jit
    def _select_blocks(
        scores, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
        work_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        Lq, Lk, N_K_BLOCKS, off_sim_q, off_sim_k,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """From scaled pooled scores (ROWS, N_K_POW2) of one head to lut[row, :count] and counts:
        masked row softmax, top-cdf threshold search, forced blocks, compaction (v2 and v3)."""
        if PER_HEAD:
            sim_thresh = tl.load(sim_thresh_ptr + h)
            cdf_thresh = tl.load(cdf_thresh_ptr + h)
        cdf_thresh = cdf_thresh + tl.zeros([ROWS], dtype=tl.float32)  # (ROWS,): a tensor in every mode
        # Boolean algebra in int32 (0/1): the interpreter and the compiler agree on it. The (ROWS,
        # N_K_POW2) masks are cheap to rebuild, so they are rebuilt where needed, not kept live.
        q_similar = (tl.load(work_ptr + off_sim_q + q_rows, mask=row_ok, other=0.0) > sim_thresh).to(tl.int32)
        k_similar = (tl.load(work_ptr + off_sim_k + k_rows, mask=col_ok, other=0.0) > sim_thresh).to(tl.int32)
        allowed = _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL)
        # at least one block per row: the allowed block with the highest pooled score (taken here:
        # the scores are dead after the softmax)
        best = tl.argmax(tl.where(allowed != 0, scores, float("-inf")), 1)  # (ROWS,)
        candidates = allowed & k_similar[None, :]
        logits = tl.where(candidates != 0, scores, float("-inf"))
        row_max = tl.max(logits, 1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        weights = tl.where(candidates != 0, tl.exp(logits - row_max[:, None]), 0.0)
        probs = weights / tl.maximum(tl.sum(weights, 1), 1e-30)[:, None]
        # Top-cdf: sorted descending, a block is kept iff the mass sorted before it is < cdf; for
        # the first of equal values that mass is F(p) = sum of the probs > p, non-increasing in p,
        # so the kept blocks are exactly probs >= t*, t* = the smallest fp32 t >= 0 with F(t) < cdf.
        # Non-negative fp32 values are ordered like their bit patterns: t* is searched (F as
        # computed is monotone, so t* does not depend on how it is searched) over bit patterns in
        # (lo, hi] with F(lo) >= cdf (lo = -1: below 0) and
        # F(hi) < cdf: hi starts at the row's largest probability (F = 0 there, < cdf if cdf > 0;
        # <= 1.0 + 2 ulp, so 31 halvings or 16 quarterings reach hi = lo + 1). PIVOTS = 3 quarters
        # (lo, hi] per step with three independent row sums; a pivot equal to lo is not evaluated.
        lo = tl.full([ROWS], -1, dtype=tl.int32)
        hi = tl.max(probs, 1).to(tl.int32, bitcast=True)
        for _ in range(SEARCH_STEPS):
            if PIVOTS == 3:
                mid2 = lo + (hi - lo) // 2
                mid1 = lo + (mid2 - lo) // 2
                mid3 = mid2 + (hi - mid2) // 2
                below1 = (mid1 > lo) & (_mass_above(probs, mid1) < cdf_thresh)
                below2 = (mid2 > lo) & (_mass_above(probs, mid2) < cdf_thresh)
                below3 = (mid3 > lo) & (_mass_above(probs, mid3) < cdf_thresh)
                new_hi = tl.where(below1, mid1, tl.where(below2, mid2, tl.where(below3, mid3, hi)))
                lo = tl.where(below1, lo, tl.where(below2, mid1, tl.where(below3, mid2, mid3)))
                hi = new_hi
            else:
                mid = lo + (hi - lo) // 2
                below = (mid > lo) & (_mass_above(probs, mid) < cdf_thresh)
                hi = tl.where(below, mid, hi)
                lo = tl.where(below, lo, mid)
        top = ((probs >= hi.to(tl.float32, bitcast=True)[:, None]) & (cdf_thresh > 0.0)[:, None]).to(tl.int32)
        allowed = _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL)
        keep_whole_row = (q_similar == 0).to(tl.int32) | (cdf_thresh >= 1.0).to(tl.int32)  # (ROWS,)
        keep = (top & k_similar[None, :]) | (k_similar == 0).to(tl.int32)[None, :] | keep_whole_row[:, None]
        if IS_CAUSAL:  # the blocks the diagonal crosses
            last_key = tl.minimum((cols + 1) * BLOCK_N, Lk) - 1  # (N_K_POW2,)
            keep = keep | (last_key[None, :] > rows[:, None] * BLOCK_M).to(tl.int32)
        keep = keep & allowed
        _store_block_lists(keep, best, cols, q_rows, row_ok, lut_ptr, count_ptr, N_K_BLOCKS)

    @triton.jit
    def _predict_lut_kernel_v2(
        work_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, scale,
        off_sim_q, off_pooled_k, off_sim_k,
        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), B*H): ROWS rows of the block mask, from the pooled scores to the
        compact ascending lists lut[row, :count] the attention kernel reads, in registers."""
        h, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), 0, tl.program_id(1), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, N_K_POW2)
        scores = _pooled_scores(work_ptr, q_rows, row_ok, k_rows, col_ok, off_pooled_k,
                                HEAD_DIM, D_CHUNK, BLOCK_D, ROWS, N_K_POW2, "ieee")
        _select_blocks(scores * scale, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
                       work_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
                       Lq, Lk, N_K_BLOCKS, off_sim_q, off_sim_k,
                       BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL, PER_HEAD, PIVOTS, SEARCH_STEPS)

    # v3 (the default): v2's LUT launch split in two. v2 runs one program per 16 query blocks (the
    # fp32 dot needs 16 rows), so at 8k (64 rows per head) only 64 programs run its serial 16-step
    # search, with cross-warp row sums. v3 computes the pooled scores as a small tiled GEMM on the
    # tensor cores (3xTF32), then selects in one-warp programs of one row (`V3_SHAPE`): the row
    # sums are warp shuffles with no barrier, and there are 16 times more programs.
    @triton.jit
    def _pooled_scores_kernel(
        work_ptr, H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, scale, off_pooled_k, off_scores,
        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), cdiv(nK, COLS), B*H): scores[q_row, col] = scale * pooled_q . pooled_k,
        into the workspace (B*H*nQ, nK). PRECISION "ieee": one fp32 FMA chain over D per score, as
        in v2; "tf32x3": three TF32 tensor-core products (about fp32 accuracy, other rounding)."""
        _, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), tl.program_id(1), tl.program_id(2), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, COLS)
        scores = _pooled_scores(work_ptr, q_rows, row_ok, k_rows, col_ok, off_pooled_k,
                                HEAD_DIM, D_CHUNK, BLOCK_D, ROWS, COLS, PRECISION)
        tl.store(work_ptr + off_scores + q_rows[:, None] * N_K_BLOCKS + cols[None, :], scores * scale,
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _select_blocks_kernel(
        work_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, off_sim_q, off_sim_k, off_scores,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), B*H), launched with one warp: the scores written by
        `_pooled_scores_kernel` -> `_select_blocks`. (With more warps Triton splits a row's
        columns across warps, and every row sum of the search then crosses shared memory.)"""
        h, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), 0, tl.program_id(1), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, N_K_POW2)
        scores = tl.load(work_ptr + off_scores + q_rows[:, None] * N_K_BLOCKS + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        _select_blocks(scores, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
                       work_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
                       Lq, Lk, N_K_BLOCKS, off_sim_q, off_sim_k,
                       BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL, PER_HEAD, PIVOTS, SEARCH_STEPS)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
PREDICTOR_VARIANTS = ("v3", "v2")  # v3: default; v2: scores and selection in one LUT launch


def _require_triton(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton sparse attention path needs triton; use implementation='reference'")
    if not INTERPRET and not all(t.is_cuda for t in tensors):
        raise ValueError("the Triton sparse attention path needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "valid choices on CPU: implementation='reference' or 'auto'")


def _threshold_args(value, n_heads: int, name: str, device) -> tuple[torch.Tensor | None, float]:
    """A threshold as kernel arguments: (None, value) for a float (no tensor, no launch), or
    (fp32 (H,) tensor on `device`, 0.0) for per-head values."""
    if value is None:
        return None, math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None, float(value)
    return per_head(value, n_heads, name, device), 0.0


def _predictor_geometry(q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int, variant: str = "v3") -> dict:
    if variant not in PREDICTOR_VARIANTS:
        raise ValueError(f"predictor variant={variant!r} is not valid; valid choices: {', '.join(PREDICTOR_VARIANTS)}")
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"the predictor needs q (B, H, Lq, D) and k (B, Hkv, Lk, D) with H % Hkv == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}={block}: the Triton predictor needs a power of two >= 16")
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    n_q, n_k = cdiv(Lq, block_m), cdiv(Lk, block_n)

    def aligned(n: int) -> int:  # sections start on 64-byte boundaries (vector loads of pooled_k)
        return cdiv(n, 16) * 16

    off_sim_q = aligned(B * H * n_q * D)
    off_pooled_k = off_sim_q + aligned(B * H * n_q)
    off_sim_k = off_pooled_k + aligned(B * Hkv * n_k * D)
    off_scores = off_sim_k + aligned(B * Hkv * n_k)  # v3 only: the pooled scores (B*H*nQ, nK)
    work_size = off_scores + (B * H * n_q * n_k if variant == "v3" else 0)
    return dict(B=B, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, n_q=n_q, n_k=n_k, variant=variant, off_sim_q=off_sim_q,
                off_pooled_k=off_pooled_k, off_sim_k=off_sim_k, off_scores=off_scores, work_size=work_size)


# v2 pooling launch: elements per load slice, warps per program, and the slice loop's pipeline
# stages (0: unrolled). H100 sweeps (bench/sparse_pool_configs.py), D=128, bf16:
# - H=32 (sparse_pool_configs_h100_h32_session23.*): with each slice reduced at once into
#   (D,) accumulators, one warp, 1024-element slices (8 tokens) and a 2-stage loop read Q and K at
#   2.74 / 2.84 TB/s at 8k / 16k (0.92-0.96 of the copy), 49.1 / 94.4 us, against 55.0 / 106.0 us
#   in the same run for 2048-element slices summed into (16, D) accumulators (255 registers per
#   thread offline, so 8 programs per SM). 512-2048-element slices with 2-4
#   stages were within 2%; the unrolled loop 3-10% slower; 2 warps 2-7x slower (likely because
#   the per-token norm then spans both warps).
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
# key blocks, else 1). H100 sweeps (bench/results/sparse_predictor_h100_v3*.json, L = 8k-32k):
# - one row per selection program beat 2 and 4;
# - 3 pivots (16 steps of three independent row sums) won at 128 key blocks (4.7 against 5.5 us),
#   1 pivot (31 steps) at 256 and 512 (7.5 against 9.1 us, 20 against 26 us);
# - "tf32x3" scores (three TF32 tensor-core products, error ~1e-6 relative) took 3.1 / 6.7 / 19 us
#   at 8k / 16k / 32k, "ieee" (one fp32 FMA chain per score, v2's) 7.4 / 22 / 83 us. Against the
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


def _predictor_launchers(q, k, *, is_causal, scale, simthreshd1, cdfthreshd, block_m, block_n, variant,
                         v3_shape: dict | None = None):
    """(pool, lut, work, lut_out, counts): the predictor's pooling and LUT stages as closures over buffers
    allocated here; calling pool() then lut() fills lut_out and counts. No host synchronization."""
    _require_triton(q, k)
    g = _predictor_geometry(q, k, block_m, block_n, variant)
    B, H, D, n_q, n_k = g["B"], g["H"], g["D"], g["n_q"], g["n_k"]
    scale = D**-0.5 if scale is None else float(scale)
    sim_tensor, sim_value = _threshold_args(simthreshd1, H, "simthreshd1", q.device)
    cdf_tensor, cdf_value = _threshold_args(cdfthreshd, H, "cdfthreshd", q.device)
    per_head_thresholds = sim_tensor is not None or cdf_tensor is not None
    if per_head_thresholds:  # one kernel variant: both per head
        sim_tensor = sim_tensor if sim_tensor is not None else per_head(sim_value, H, "simthreshd1", q.device)
        cdf_tensor = cdf_tensor if cdf_tensor is not None else per_head(cdf_value, H, "cdfthreshd", q.device)
    work = torch.empty(g["work_size"], device=q.device, dtype=torch.float32)
    lut = torch.empty(B, H, n_q, n_k, device=q.device, dtype=torch.int32)
    counts = torch.empty(B, H, n_q, device=q.device, dtype=torch.int32)
    n_k_pow2 = max(16, triton.next_power_of_2(n_k))
    block_d = max(16, triton.next_power_of_2(D))
    args = (work, sim_tensor if per_head_thresholds else work, cdf_tensor if per_head_thresholds else work,
            sim_value, cdf_value, lut, counts, H, H // g["Hkv"], g["Lq"], g["Lk"], n_q, n_k, scale,
            g["off_sim_q"], g["off_pooled_k"], g["off_sim_k"])
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, ROWS=PREDICTOR_ROWS, N_K_POW2=n_k_pow2,
                IS_CAUSAL=is_causal, PER_HEAD=per_head_thresholds)
    grid = (cdiv(n_q, PREDICTOR_ROWS), B * H)

    def pool():
        _launch_pool(q, k, g, block_m, block_n, work)

    def lut_v2():
        _predict_lut_kernel_v2[grid](*args, **meta, **_lut_kernel_config(n_k_pow2, block_d))

    shape = _v3_shape(v3_shape)
    score_rows, score_cols = shape["score_rows"], min(shape["score_cols"], n_k_pow2)
    pivots = shape["pivots"] or (3 if n_k_pow2 <= 128 else 1)
    tf32_ok = not q.is_cuda or compute_capability(q.device.index)[0] >= 8
    precision = shape["precision"] if tf32_ok else "ieee"  # TF32 tensor cores need sm_80+
    select_args = args[:13]  # the LUT kernels' arguments up to (not including) the scale

    def scores_v3():
        launch(
            _pooled_scores_kernel, (cdiv(n_q, score_rows), cdiv(n_k, score_cols), B * H),
            work, H, H // g["Hkv"], n_q, n_k, scale, g["off_pooled_k"], g["off_scores"],
            HEAD_DIM=D, D_CHUNK=max(16, min(block_d, 4096 // score_cols)), BLOCK_D=block_d,
            ROWS=score_rows, COLS=score_cols, PRECISION=precision, num_warps=shape["score_warps"])

    def select_v3():
        launch(
            _select_blocks_kernel, (cdiv(n_q, shape["select_rows"]), B * H),
            *select_args, g["off_sim_q"], g["off_sim_k"], g["off_scores"],
            BLOCK_M=block_m, BLOCK_N=block_n, ROWS=shape["select_rows"], N_K_POW2=n_k_pow2, IS_CAUSAL=is_causal,
            PER_HEAD=per_head_thresholds, PIVOTS=pivots, SEARCH_STEPS=16 if pivots == 3 else 31,
            num_warps=1)

    def lut_v3():
        scores_v3()
        select_v3()
    lut_v3.parts = {"scores": scores_v3, "select": select_v3}  # timed one by one in the benchmark

    lut_launch = {"v2": lut_v2, "v3": lut_v3}[variant]
    return pool, lut_launch, work, lut, counts


def pool_qk_triton(q: torch.Tensor, k: torch.Tensor, block_m: int = BLOCK_M, block_n: int = BLOCK_N, *,
                   variant: str = "v3", slice_elements: int = POOL_SLICE_ELEMENTS, num_warps: int = POOL_WARPS,
                   loop_stages: int = POOL_LOOP_STAGES):
    """The predictor's first launch on its own, as views of its workspace: pooled_q (B, H, nQ, D),
    sim_q (B, H, nQ), pooled_k (B, Hkv, nK, D), sim_k (B, Hkv, nK), all fp32 (see `pool_blocks`)."""
    _require_triton(q, k)
    g = _predictor_geometry(q, k, block_m, block_n, variant)
    work = _launch_pool(q, k, g, block_m, block_n, slice_elements=slice_elements, num_warps=num_warps,
                        loop_stages=loop_stages)
    B, H, Hkv, D, n_q, n_k = g["B"], g["H"], g["Hkv"], g["D"], g["n_q"], g["n_k"]
    return (work[: B * H * n_q * D].view(B, H, n_q, D), work[g["off_sim_q"]: g["off_sim_q"] + B * H * n_q].view(B, H, n_q),
            work[g["off_pooled_k"]: g["off_pooled_k"] + B * Hkv * n_k * D].view(B, Hkv, n_k, D),
            work[g["off_sim_k"]: g["off_sim_k"] + B * Hkv * n_k].view(B, Hkv, n_k))


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
    launches (pool Q and K with self-similarity; pooled scores; softmax + top-cdf + LUT), three
    allocations, no host synchronization: it can be captured in a CUDA graph. Float thresholds go
    to the kernels as scalars (no tensor is built). variant: "v3" (default); "v2" (scores and
    selection in one launch, compared with v3 in the benchmark)."""
    pool, lut_launch, _, lut, counts = _predictor_launchers(
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
    pool, lut_launch, _, lut, counts = _predictor_launchers(
        q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd,
        block_m=BLOCK_M, block_n=BLOCK_N, variant=variant, v3_shape=v3_shape)
    return pool, lut_launch, (lut, counts)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lut: torch.Tensor,
    counts: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    pvthreshd=None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    config: dict | None = None,
) -> torch.Tensor:
    """The Triton kernel over a given compact block list (lut, counts) from `block_mask_to_lut` or
    `predict_block_lut`. Under `is_causal` every diagonal-crossing block must be in the list.

    config: None = autotuned on a GPU (the interpreter uses one fixed config); or an explicit
    {"PREFETCH_INDEX": 0/1, "USE_TMA": 0/1, "PAIR_BLOCKS": 0/1, "SINGLE_LOOP": 0/1, "MERGED_SUFFIX": 0/1,
    "num_warps": ..., "num_stages": ..., "HOST_DESCRIPTORS": 0/1}
    (tests, ablations). HOST_DESCRIPTORS (single loop only) defaults to 1 wherever
    `host_descriptors_supported` holds."""
    _require_triton(q, k, v)
    group, Dv = _check_inputs(q, k, v, is_causal)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if Dv != D:
        raise ValueError(f"the Triton path needs v's head dim equal to q's (got {Dv} and {D})")
    if D > 256:
        raise ValueError(f"the Triton path supports head dims up to 256, got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    n_q, n_k = cdiv(Lq, block_m), cdiv(Lk, block_n)
    if lut.shape != (B, H, n_q, n_k) or counts.shape != (B, H, n_q):
        raise ValueError(f"lut {tuple(lut.shape)} / counts {tuple(counts.shape)} do not match blocks {block_m}x{block_n} "
                         f"of q {tuple(q.shape)}, k {tuple(k.shape)}: expected {(B, H, n_q, n_k)} / {(B, H, n_q)}")
    if lut.dtype != torch.int32 or not lut.is_contiguous():
        lut = lut.to(torch.int32).contiguous()
    if counts.dtype != torch.int32 or not counts.is_contiguous():
        counts = counts.to(torch.int32).contiguous()
    # the kernel assumes a contiguous head dim (vectorized loads); other strides are free
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = D**-0.5 if scale is None else float(scale)
    pv_skip = pv_skipping_requested(pvthreshd)  # decided on the host, without a device sync
    pv_tensor, pv_value = _threshold_args(pvthreshd if pv_skip else None, H, "pvthreshd", q.device)
    out = torch.empty(B, H, Lq, D, device=q.device, dtype=q.dtype)  # (B, H, Lq, D)
    args = (q, k, v, out, lut, counts, pv_tensor if pv_tensor is not None else counts, pv_value if pv_skip else 0.0,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, group, Lq, Lk, n_q, n_k, scale * LOG2E, min(max(triton.next_power_of_2(Lk), 1024), 32768),
            causal_head_group(B * H, group, Lk, D, k.element_size()) if is_causal else 1)
    meta = dict(HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
                IS_CAUSAL=is_causal, PV_SKIP=pv_skip, PV_PER_HEAD=pv_tensor is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PARTIAL_KEYS=Lk % block_n != 0)
    grid = (n_q * B * H,)
    if config is None and INTERPRET:
        config = {"PREFETCH_INDEX": 1, "PAIR_BLOCKS": 1, "num_warps": 4, "num_stages": 1}
    use_tma = int(config.get("USE_TMA", 0)) if config is not None else None
    single_loop = int(config.get("SINGLE_LOOP", 0)) if config is not None else 0
    if config is not None and int(config.get("MERGED_SUFFIX", 0)) and not single_loop:
        raise ValueError("config MERGED_SUFFIX=1 merges the single loop's masked suffix and needs SINGLE_LOOP=1; "
                         "valid choices: SINGLE_LOOP=1, or MERGED_SUFFIX=0")
    # the launcher's checks run on every call: each tensor is checked once
    tma_kv = tma_loads_supported(k, v)
    tma_all = tma_kv and tma_loads_supported(q, out)
    if use_tma and not tma_kv:
        raise ValueError("config USE_TMA=1 needs a Hopper+ GPU, tl.make_tensor_descriptor and 16-byte aligned K/V "
                         "rows; valid choice here: USE_TMA=0")
    single_ok = tma_all and _single_loop_body_supported(D, pv_skip)
    if single_loop and not single_ok:
        raise ValueError("config SINGLE_LOOP=1 needs tensor descriptors for q, k, v and the output (USE_TMA's "
                         "conditions), a power-of-two head dim and no PV skipping; valid choice here: SINGLE_LOOP=0")
    if (config is None or use_tma or single_loop) and tma_kv and not INTERPRET:
        _ensure_descriptor_allocator()
    host_possible = (config is None or single_loop) and single_ok \
        and host_descriptors_supported(q, k, v, out, block_m, block_n)
    host_descriptors = bool(int(config.get("HOST_DESCRIPTORS", host_possible))) if config is not None else host_possible
    if host_descriptors and not host_possible:
        raise ValueError("config HOST_DESCRIPTORS=1 needs the single loop, (B, H, L) dims of q, k, v that collapse into "
                         f"rows, and lengths that are multiples of the blocks ({block_m} queries, {block_n} keys); "
                         "valid choice here: HOST_DESCRIPTORS=0")
    args += _host_descriptors(q, k, v, out, block_m, block_n) if host_descriptors else (None,) * 4
    meta["HOST_DESCRIPTORS"] = host_descriptors
    meta["TMA_ELIGIBLE"] = 2 if single_ok else 1 if tma_kv else 0
    # through the compiled kernel once a call with the same key has compiled (or tuned) it: the
    # JIT's launch path re-derives the specialization of 33 arguments on every call
    if config is None:
        launch_tuned(_sparse_attention_kernel_tuned, lambda _meta: grid, *args, **meta)
    else:
        launch(_sparse_attention_kernel, grid, *args, **meta, PREFETCH_INDEX=int(config.get("PREFETCH_INDEX", 1)),
               USE_TMA=use_tma, PAIR_BLOCKS=int(config.get("PAIR_BLOCKS", 0)), SINGLE_LOOP=single_loop,
               MERGED_SUFFIX=int(config.get("MERGED_SUFFIX", 0)),
               num_warps=config.get("num_warps", 8), num_stages=config.get("num_stages", 3))
    return out


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    pvthreshd=None,
    return_sparsity: bool = False,
    implementation: str = "auto",
):
    """Predicted block-sparse attention on (B, H, L, D) tensors (see the module docstring).

    implementation: "auto" (Triton on CUDA, the torch reference elsewhere), "triton" (also on CPU
    under TRITON_INTERPRET=1), or "reference". The Triton path is 3 launches (2 predictor + 1
    attention) with no host synchronization unless `return_sparsity` is asked for.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not valid; valid choices: {', '.join(IMPLEMENTATIONS)}")
    _check_inputs(q, k, v, is_causal)
    if _no_blocks(q, k):
        return _empty_result(q, v, return_sparsity)
    use_triton = implementation == "triton" or (implementation == "auto" and q.is_cuda and triton is not None)
    if not use_triton:
        return reference_sparse_attention(q, k, v, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
                                          cdfthreshd=cdfthreshd, pvthreshd=pvthreshd, return_sparsity=return_sparsity)
    lut, counts = predict_block_lut(q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd)
    out = block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal, scale=scale, pvthreshd=pvthreshd)
    if return_sparsity:
        B, H, Lq, _ = q.shape
        total = allowed_block_count(B, H, Lq, k.shape[2], is_causal, BLOCK_M, BLOCK_N)
        return out, 1.0 - int(counts.sum()) / total
    return out


# ---------------------------------------------------------------------------------------------
# Synthetic inputs with real block structure (tests, tuner checks and benchmarks)
# ---------------------------------------------------------------------------------------------
def local_sink_qkv(
    batch: int, heads: int, length: int, head_dim: int, *, window: int = 256, sink: int = 64, noise: float = 0.3,
    seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, L, D) whose attention is local (a band of roughly `window` tokens: q and k
    share sinusoidal position features with periods from 2*window to 32*window) plus a sink (the
    first `sink` keys carry a feature every query matches), with Gaussian token noise. Neighbouring
    tokens are similar, so blocks are self-similar, as in trained language models."""
    gen = torch.Generator().manual_seed(seed)
    n_freq = (head_dim - 2) // 2
    pos = torch.arange(length, dtype=torch.float64)
    periods = torch.logspace(math.log10(2 * window), math.log10(32 * window), n_freq, dtype=torch.float64)
    angles = 2 * math.pi * pos[:, None] / periods[None, :]
    features = torch.cat([angles.cos(), angles.sin()], -1) * math.sqrt(14 * math.sqrt(head_dim) / n_freq)  # (L, 2F)
    q = torch.zeros(batch, heads, length, head_dim, dtype=torch.float64)
    k = torch.zeros_like(q)
    q[..., : 2 * n_freq] = features
    k[..., : 2 * n_freq] = features
    sink_amplitude = math.sqrt(10 * math.sqrt(head_dim))  # sink logit 10 vs 14 at the band centre
    q[..., -1] = 0.5 * sink_amplitude
    k[..., :sink, -1] = 2 * sink_amplitude
    q += noise * torch.randn(q.shape, generator=gen, dtype=torch.float64)
    k += noise * torch.randn(k.shape, generator=gen, dtype=torch.float64)
    v = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


__all__ = [
    "BLOCK_M", "BLOCK_N", "DEFAULT_SIMTHRESHD1", "DEFAULT_CDFTHRESHD", "sparse_attention", "reference_sparse_attention",
    "predict_block_mask", "predict_block_lut", "pool_qk_triton", "block_mask_to_lut", "lut_to_block_mask", "block_sparse_attention",
    "block_sparse_attention_reference", "pool_blocks", "causal_block_geometry", "per_head", "local_sink_qkv",
]
