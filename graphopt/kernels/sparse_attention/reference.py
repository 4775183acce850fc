"""Block-sparse attention in plain torch: the block geometry, the thresholds, the predictor
(`predict_block_mask`), the compact block lists, and the attention over kept blocks
(`block_sparse_attention_reference`, `reference_sparse_attention`). The Triton kernels match these
exactly; the op's CPU implementation is `reference_sparse_attention`. Semantics: see
graphopt.kernels.sparse_attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphopt.kernels.launch import cdiv

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


def _threshold_args(value, n_heads: int, name: str, device) -> tuple[torch.Tensor | None, float]:
    """A threshold as kernel arguments: (None, value) for a float (no tensor, no launch), or
    (fp32 (H,) tensor on `device`, 0.0) for per-head values."""
    if value is None:
        return None, math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None, float(value)
    return per_head(value, n_heads, name, device), 0.0


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
    n = (L + block - 1) // block  # no negative floor division (cdiv's): ONNX exports it as truncation
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


def block_statistics(q: torch.Tensor, k: torch.Tensor, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The predictor's per-block statistics, the only part of it that reads all of Q and K:
    (pooled_q (B, H, nQ, D), sim_q (B, H, nQ), pooled_k (B, Hkv, nK, D), sim_k (B, Hkv, nK)), fp32
    (`pool_blocks`). Plain torch ops: the sparse_attention pass can emit them into the graph, next
    to the kernels that produce Q and K, and pass them to graphopt::sparse_attention."""
    return (*pool_blocks(q, block_m), *pool_blocks(k, block_n))


def checked_block_statistics(statistics, lq: int, lk: int, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """`statistics` as four contiguous fp32 tensors, after checking that they are `block_statistics`
    of queries of length lq and keys of length lk at blocks of block_m / block_n tokens."""
    if not isinstance(statistics, (tuple, list)) or len(statistics) != 4 \
            or not all(isinstance(t, torch.Tensor) for t in statistics):
        raise ValueError("block statistics must be four tensors (pooled_q, sim_q, pooled_k, sim_k), as "
                         "block_statistics(q, k) returns them")
    pooled_q, sim_q, pooled_k, sim_k = statistics
    n_q, n_k = cdiv(lq, block_m), cdiv(lk, block_n)
    ok = pooled_q.dim() == 4 and pooled_k.dim() == 4
    if ok:
        B, H, _, D = pooled_q.shape
        Hkv = pooled_k.shape[1]
        ok = (pooled_q.shape[2] == n_q and pooled_k.shape == (B, Hkv, n_k, D) and tuple(sim_q.shape) == (B, H, n_q)
              and tuple(sim_k.shape) == (B, Hkv, n_k) and Hkv > 0 and H % Hkv == 0)
    if not ok:
        raise ValueError(f"block statistics of shapes {[tuple(t.shape) for t in statistics]} do not match Lq={lq}, "
                         f"Lk={lk} at blocks {block_m}x{block_n}: expected pooled_q (B, H, {n_q}, D), sim_q (B, H, "
                         f"{n_q}), pooled_k (B, Hkv, {n_k}, D), sim_k (B, Hkv, {n_k}) with H % Hkv == 0")
    if not all(t.is_floating_point() for t in statistics) or len({t.device for t in statistics}) != 1:
        raise ValueError("block statistics must be floating-point tensors on one device; got "
                         f"{[(t.dtype, str(t.device)) for t in statistics]}")
    return tuple(t.to(torch.float32).contiguous() for t in statistics)


def select_block_mask(
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
) -> torch.Tensor:
    """Kept QK blocks, bool (B, H, nQ, nK), from the block statistics of `block_statistics` for
    queries of length lq and keys of length lk (reads only the pooled rows)."""
    pooled_q, sim_q, pooled_k, sim_k = checked_block_statistics(statistics, lq, lk, block_m, block_n)
    device = pooled_q.device
    B, H, n_q, D = pooled_q.shape
    group = H // pooled_k.shape[1]
    n_k = pooled_k.shape[2]
    scale = D**-0.5 if scale is None else float(scale)
    sim1 = per_head(simthreshd1, H, "simthreshd1", device).view(1, H, 1)
    cdf = per_head(cdfthreshd, H, "cdfthreshd", device).view(1, H, 1, 1)
    if group > 1:
        pooled_k, sim_k = pooled_k.repeat_interleave(group, 1), sim_k.repeat_interleave(group, 1)
    if is_causal:
        allowed, diagonal = causal_block_geometry(n_q, n_k, lq, lk, block_m, block_n, device)
    else:
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
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
    keep |= empty & (torch.arange(n_k, device=device) == best)
    return keep


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
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"the predictor needs q (B, H, Lq, D) and k (B, Hkv, Lk, D) with H % Hkv == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return select_block_mask(block_statistics(q, k, block_m, block_n), q.shape[2], k.shape[2], is_causal=is_causal,
                             scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, block_m=block_m,
                             block_n=block_n)


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
    statistics=None,
):
    """Plain-torch sparse attention with the semantics of `sparse_attention` (runs anywhere).
    statistics: `block_statistics(q, k, block_m, block_n)` computed by the caller, or None."""
    _check_inputs(q, k, v, is_causal)
    if _no_blocks(q, k):
        return _empty_result(q, v, return_sparsity)
    if statistics is None:
        statistics = block_statistics(q, k, block_m, block_n)
    mask = select_block_mask(statistics, q.shape[2], k.shape[2], is_causal=is_causal, scale=scale,
                             simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, block_m=block_m, block_n=block_n)
    out = block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal, scale=scale, pvthreshd=pvthreshd,
                                           block_m=block_m, block_n=block_n)
    if return_sparsity:
        B, H, Lq, _ = q.shape
        total = allowed_block_count(B, H, Lq, k.shape[2], is_causal, block_m, block_n)
        return out, 1.0 - int(mask.sum()) / total
    return out
