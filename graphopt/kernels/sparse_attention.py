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

Kernel: online-softmax flash attention over the row's list. Under `is_causal` the token-level
causal mask is applied inside the diagonal blocks (SpargeAttn's fast path masks only at block
level), so no output ever depends on later keys, values or queries; `is_causal` requires Lq == Lk
(the diagonal is the main one, as in SDPA). Keys beyond Lk in the last block are masked.

PV skipping (`pvthreshd`, log2 units, None or inf = off): after QK^T of a tile, if for every
(valid) query row of the tile the tile's row max is below the running row max minus `pvthreshd`,
the tile's exp and P.V are skipped: its weights are all below 2^-pvthreshd of the row's largest.
This is lossy and changes results; the block mask alone (PV skipping off) is exact on the blocks
it keeps.

Caveats: inference only (no autograd). The Triton path needs D <= 256 and q, k, v of one dtype
(fp16, bf16 or fp32; fp32 uses IEEE dot products). `return_sparsity` synchronizes the device to
return a Python float; the fraction counts blocks skipped among those dense attention would
compute (under causality, the blocks at or below the diagonal).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None
    tl = None

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
    n_q, n_k = triton_cdiv(lq, block_m), triton_cdiv(lk, block_n)
    if not is_causal:
        return b * h * n_q * n_k
    allowed, _ = causal_block_geometry(n_q, n_k, lq, lk, block_m, block_n)
    return b * h * int(allowed.sum())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Torch reference: predictor, compact index list, and the block-sparse attention it drives
# ---------------------------------------------------------------------------------------------
def pool_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean-pooled blocks and their self-similarity: x (B, H, L, D) -> (B, H, n, D), (B, H, n) fp32."""
    B, H, L, D = x.shape
    n = triton_cdiv(L, block)
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
    n_q, n_k = triton_cdiv(Lq, block_m), triton_cdiv(Lk, block_n)
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
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _attention_configs():
    if _interpreting():
        return [triton.Config({}, num_warps=4, num_stages=1)]
    # BLOCK_M x BLOCK_N are fixed (they are the predictor's blocks); warps and pipeline depth are
    # tuned. Hopper (H100/H200) prefers 8 warps with 3 stages at D=128; smaller D likes 4 warps.
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3, 4)]


if triton is not None:

    @triton.jit
    def _attend_tile(
        acc, l_i, m_i, q, k_base, v_base, block_index, offs_m, offs_n, offs_d, neg_pv_thresh,
        stride_kn, stride_kd, stride_vn, stride_vd, Lq, Lk, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One (BLOCK_M x BLOCK_N) tile of online softmax: QK^T, masks, optional PV skip, P.V."""
        start_n = block_index * BLOCK_N
        keys = start_n + offs_n  # (BLOCK_N,)
        d_valid = offs_d < HEAD_DIM
        kt_ptrs = k_base + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(keys[None, :] < Lk) & d_valid[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=d_valid[:, None], other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            valid = keys[None, :] < Lk
            if IS_CAUSAL:
                valid = valid & (keys[None, :] <= offs_m[:, None])
            qk = tl.where(valid, qk, float("-inf"))
        tile_max = tl.max(qk, 1)  # (BLOCK_M,)
        run = True
        if PV_SKIP:
            # Skip only if every valid row's tile max is below its running max - pvthreshd.
            gap = tl.where(offs_m < Lq, tile_max - m_i, float("-inf"))
            run = tl.max(gap, 0) >= neg_pv_thresh
        if run:
            m_new = tl.maximum(m_i, tile_max)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd  # (BLOCK_N, BLOCK_D)
            if MASKED:
                v = tl.load(v_ptrs, mask=(keys[:, None] < Lk) & d_valid[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=_attention_configs(), key=["HEAD_DIM", "IS_CAUSAL", "PV_SKIP", "DOT_PRECISION"])
    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Grid (nQ, B*H): one query block of one head; visits the kept key blocks of its LUT row."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        kv_h = h // KV_GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        q_ptrs = q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & d_valid[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        k_base = k_ptr + b * stride_kb + kv_h * stride_kh
        v_base = v_ptr + b * stride_vb + kv_h * stride_vh
        row = pid_bh * N_Q_BLOCKS + pid_m
        lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
        count = tl.load(count_ptr + row)
        neg_pv_thresh = 0.0
        if PV_SKIP:
            neg_pv_thresh = -tl.load(pv_thresh_ptr + h)
        # Kept blocks are ascending, so the blocks needing a token mask are a suffix of the list:
        # under causality the blocks the diagonal crosses (always kept), else a partial last block.
        if IS_CAUSAL:
            first_diagonal = (pid_m * BLOCK_M + 1) // BLOCK_N
            last_allowed = (tl.minimum((pid_m + 1) * BLOCK_M, Lq) - 1) // BLOCK_N
            n_masked = last_allowed - first_diagonal + 1
        else:
            last_block = tl.load(lut_row + count - 1)
            n_masked = ((Lk % BLOCK_N != 0) & (last_block == N_K_BLOCKS - 1)).to(tl.int32)
        n_plain = count - n_masked
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for it in range(0, n_plain):
            block_index = tl.load(lut_row + it)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, block_index, offs_m, offs_n, offs_d, neg_pv_thresh,
                stride_kn, stride_kd, stride_vn, stride_vd, Lq, Lk, qk_scale,
                HEAD_DIM, BLOCK_N, False, IS_CAUSAL, PV_SKIP, DOT_PRECISION)
        for it in range(n_plain, count):
            block_index = tl.load(lut_row + it)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_base, v_base, block_index, offs_m, offs_n, offs_d, neg_pv_thresh,
                stride_kn, stride_kd, stride_vn, stride_vd, Lq, Lk, qk_scale,
                HEAD_DIM, BLOCK_N, True, IS_CAUSAL, PV_SKIP, DOT_PRECISION)
        out = acc / l_i[:, None]
        o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & d_valid[None, :])

    @triton.jit
    def _pool_blocks_kernel(
        x_ptr, pooled_ptr, sim_ptr,
        stride_xb, stride_xh, stride_xl, stride_xd,
        H, L, N_BLOCKS,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Grid (n_blocks, B*H): mean of a block's tokens -> pooled (B, H, n, D) fp32 and its mean
        pairwise cosine similarity -> sim (B, H, n) fp32."""
        pid = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_l = pid * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = x_ptr + b * stride_xb + h * stride_xh + offs_l[:, None] * stride_xl + offs_d[None, :] * stride_xd
        x = tl.load(ptrs, mask=(offs_l[:, None] < L) & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        count = tl.minimum(L - pid * BLOCK, BLOCK).to(tl.float32)
        pooled = tl.sum(x, 0) / count  # (BLOCK_D,)
        norm = tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-12)
        unit_sum = tl.sum(x / norm[:, None], 0)
        sim = tl.sum(unit_sum * unit_sum, 0) / (count * count)
        row = pid_bh * N_BLOCKS + pid
        tl.store(pooled_ptr + row.to(tl.int64) * HEAD_DIM + offs_d, pooled, mask=offs_d < HEAD_DIM)
        tl.store(sim_ptr + row, sim)

    @triton.jit
    def _predict_lut_kernel(
        scores_ptr, sim_q_ptr, sim_k_ptr, sim_thresh_ptr, cdf_thresh_ptr, lut_ptr, count_ptr,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_K_POW2: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ):
        """Grid (nQ, B*H): one row of the block mask (top-cdf of the pooled-score softmax), written
        as the compact ascending list lut[row, :count] the attention kernel reads."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        h = pid_bh % H
        b = pid_bh // H
        kv_bh = b * (H // KV_GROUP) + h // KV_GROUP
        row = pid_bh * N_Q_BLOCKS + pid_m
        cols = tl.arange(0, N_K_POW2)
        in_range = cols < N_K_BLOCKS
        scores = tl.load(scores_ptr + row.to(tl.int64) * N_K_BLOCKS + cols, mask=in_range, other=float("-inf")) * scale
        sim_thresh = tl.load(sim_thresh_ptr + h)
        cdf_thresh = tl.load(cdf_thresh_ptr + h)
        q_similar = tl.load(sim_q_ptr + row) > sim_thresh
        k_similar = tl.load(sim_k_ptr + kv_bh * N_K_BLOCKS + cols, mask=in_range, other=0.0) > sim_thresh
        allowed = in_range
        diagonal = cols < 0
        if IS_CAUSAL:
            last_query = tl.minimum((pid_m + 1) * BLOCK_M, Lq) - 1
            last_key = tl.minimum((cols + 1) * BLOCK_N, Lk) - 1
            allowed = allowed & (cols * BLOCK_N <= last_query)
            diagonal = allowed & (last_key > pid_m * BLOCK_M)
        candidates = k_similar & allowed
        logits = tl.where(candidates, scores, float("-inf"))
        row_max = tl.max(logits, 0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        weights = tl.where(candidates, tl.exp(logits - row_max), 0.0)
        probs = weights / tl.maximum(tl.sum(weights, 0), 1e-30)
        sorted_probs = tl.sort(probs, descending=True)
        mass_before = tl.cumsum(sorted_probs, 0) - sorted_probs
        smallest_kept = tl.min(tl.where(mass_before < cdf_thresh, sorted_probs, float("inf")), 0)
        # Boolean algebra in int32 (0/1): the interpreter and the compiler agree on it.
        keep_whole_row = ((q_similar == 0) | (cdf_thresh >= 1.0)).to(tl.int32)  # scalar
        keep = ((probs >= smallest_kept) & candidates).to(tl.int32)
        keep = keep | (k_similar == 0).to(tl.int32) | diagonal.to(tl.int32) | keep_whole_row
        keep = keep & allowed.to(tl.int32)
        best = tl.argmax(tl.where(allowed, scores, float("-inf")), 0)
        none_kept = (tl.sum(keep, 0) == 0).to(tl.int32)
        keep = keep | (none_kept & (cols == best).to(tl.int32))
        position = tl.cumsum(keep, 0) - 1
        tl.store(lut_ptr + row.to(tl.int64) * N_K_BLOCKS + position, cols, mask=keep > 0)
        tl.store(count_ptr + row, tl.sum(keep, 0))


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def _require_triton(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton sparse attention path needs triton; use implementation='reference'")
    if not _interpreting() and not all(t.is_cuda for t in tensors):
        raise ValueError("the Triton sparse attention path needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "valid choices on CPU: implementation='reference' or 'auto'")


def pool_blocks_triton(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `pool_blocks`: (B, H, L, D) -> pooled (B, H, n, D) fp32, sim (B, H, n) fp32."""
    B, H, L, D = x.shape
    n = triton_cdiv(L, block)
    pooled = torch.empty(B, H, n, D, device=x.device, dtype=torch.float32)
    sim = torch.empty(B, H, n, device=x.device, dtype=torch.float32)
    _pool_blocks_kernel[(n, B * H)](
        x, pooled, sim, *x.stride(), H, L, n,
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK=block, num_warps=8 if block * D >= 8192 else 4,
    )
    return pooled, sim


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The predictor on the Triton path (4 launches: pool Q, pool K, pooled QK^T, per-row top-cdf
    + compaction): lut int32 (B, H, nQ, nK) and counts int32 (B, H, nQ), as `block_mask_to_lut`."""
    _require_triton(q, k)
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = D**-0.5 if scale is None else float(scale)
    pooled_q, sim_q = pool_blocks_triton(q, block_m)  # (B, H, nQ, D), (B, H, nQ)
    pooled_k, sim_k = pool_blocks_triton(k, block_n)  # (B, Hkv, nK, D), (B, Hkv, nK)
    n_q, n_k = pooled_q.shape[2], pooled_k.shape[2]
    # (B, Hkv, group*nQ, D) @ (B, Hkv, D, nK): query heads of one kv head share its pooled keys.
    scores = (pooled_q.view(B, Hkv, group * n_q, D) @ pooled_k.transpose(-1, -2)).view(B, H, n_q, n_k)
    lut = torch.empty(B, H, n_q, n_k, device=q.device, dtype=torch.int32)
    counts = torch.empty(B, H, n_q, device=q.device, dtype=torch.int32)
    n_k_pow2 = triton.next_power_of_2(n_k)
    _predict_lut_kernel[(n_q, B * H)](
        scores, sim_q, sim_k, per_head(simthreshd1, H, "simthreshd1", q.device),
        per_head(cdfthreshd, H, "cdfthreshd", q.device), lut, counts,
        H, group, Lq, Lk, n_q, n_k, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, N_K_POW2=n_k_pow2, IS_CAUSAL=is_causal,
        num_warps=4 if n_k_pow2 <= 256 else 8,
    )
    return lut, counts


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
) -> torch.Tensor:
    """The Triton kernel over a given compact block list (lut, counts) from `block_mask_to_lut` or
    `predict_block_lut`. Under `is_causal` every diagonal-crossing block must be in the list."""
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
    n_q, n_k = triton_cdiv(Lq, block_m), triton_cdiv(Lk, block_n)
    if lut.shape != (B, H, n_q, n_k) or counts.shape != (B, H, n_q):
        raise ValueError(f"lut {tuple(lut.shape)} / counts {tuple(counts.shape)} do not match blocks {block_m}x{block_n} "
                         f"of q {tuple(q.shape)}, k {tuple(k.shape)}: expected {(B, H, n_q, n_k)} / {(B, H, n_q)}")
    lut = lut.to(torch.int32).contiguous()
    counts = counts.to(torch.int32).contiguous()
    scale = D**-0.5 if scale is None else float(scale)
    pv_skip = pv_skipping_requested(pvthreshd)  # decided on the host, without a device sync
    pv = per_head(pvthreshd if pv_skip else None, H, "pvthreshd", q.device)
    out = torch.empty(B, H, Lq, D, device=q.device, dtype=q.dtype)  # (B, H, Lq, D)
    _sparse_attention_kernel[(n_q, B * H)](
        q, k, v, out, lut, counts, pv,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, group, Lq, Lk, n_q, n_k, scale * LOG2E,
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        IS_CAUSAL=is_causal, PV_SKIP=pv_skip, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
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
    under TRITON_INTERPRET=1), or "reference".
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not valid; valid choices: {', '.join(IMPLEMENTATIONS)}")
    _check_inputs(q, k, v, is_causal)
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
    "predict_block_mask", "predict_block_lut", "block_mask_to_lut", "lut_to_block_mask", "block_sparse_attention",
    "block_sparse_attention_reference", "pool_blocks", "causal_block_geometry", "per_head", "local_sink_qkv",
]
