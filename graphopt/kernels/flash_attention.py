"""Flash attention in Triton: fused forward and backward, with causal masking, bias/mask and GQA.

    out = softmax(q @ k^T * scale + bias, causal-masked) @ v

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0. Query head h reads key/value
head h // (H // Hkv) (grouped-query attention); K and V are never repeated in memory.

Supported
- dtypes: bfloat16 and float16 (tensor-core dots, fp32 accumulation); float32 through the tensor
  cores' TF32 mode (about 10 mantissa bits in the products: expect ~1e-3 relative error, not 1e-6).
- head dims 1..128. Powers of two >= 16 (64, 128, ...) run as they are; other sizes (40, 80, 96, ...)
  are zero-padded inside the kernel to the next power of two (masked loads, no copy). Head dims
  above 128 are declined by `supports` (the tiles would not fit in shared memory with these configs).
- any Lq, Lk >= 1; lengths that are not multiples of the block size are handled with masked loads.
- `is_causal`: TOP-LEFT aligned, exactly like torch SDPA's `is_causal=True`: query i attends keys
  j <= i, whatever Lq and Lk are. (This is *not* the bottom-right alignment of KV-cache decoding,
  where the last query sees every key; pass an explicit mask for that.) Key blocks entirely above
  the diagonal are skipped; blocks entirely below it run without any masking.
- `bias`: None; a bool mask (True = attend, the SDPA convention); or an additive float tensor
  (fp16/bf16/fp32). Any shape broadcastable to (B, H, Lq, Lk) - e.g. (B, 1, 1, Lk) padding masks,
  (1, H, Lq, Lk) position biases, (Lq, Lk) - is read in place through stride-0 broadcast strides.
- rows whose keys are all masked produce 0 (and lse = -inf), like SDPA's "safe softmax".
- `scale` must be > 0 (the forward takes the running max of the unscaled products).

Outputs of the forward: `out` (B, H, Lq, D) in the input dtype and `lse` (B, H, Lq) float32, the
NATURAL-log log-sum-exp of each row's scaled, biased scores (SDPA's flash backend uses the same
convention); the kernel works in base 2 internally (exp2) and converts on store. Its programs form
a 1-D grid; under causality each group of heads whose K/V fit in L2 starts its heaviest (last)
query blocks first (tile_order.py).

Backward: `delta = rowsum(dO * O)` in a small kernel, then one kernel for dK/dV (one program per
key block and KV head, looping over the query heads of its GQA group and over query blocks, so dK/dV
are summed over the group without atomics) and one kernel for dQ (one program per query block and
head, looping over key blocks). The gradient with respect to `bias` is NOT computed: graphopt uses
the bias as a constant mask; the backward of `flash_attention` raises if the bias requires grad
(the forward runs).

Caveats
- No dropout. No TMA / tensor-descriptor path: plain pointer loads, software-pipelined by Triton
  (`num_stages`), which runs on every triton from 3.6 to 3.9.
- Under TRITON_INTERPRET=1 (CPU tests) a single small block configuration is used; on a GPU block
  sizes, num_warps and num_stages are autotuned per (head dim, causal, bias kind, sequence bucket).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    HAS_TRITON = False

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import INTERPRET as _INTERPRET  # fixed at import, as Triton reads it
from graphopt.kernels.launch import cdiv, launch_tuned, next_power_of_2
from graphopt.kernels.tile_order import causal_head_group

if HAS_TRITON:
    from graphopt.kernels.tile_order import query_block_order

MAX_HEAD_DIM = 128
MAX_GRID_Y = 65535  # CUDA limit of the second grid dimension, which holds batch * heads in the backward
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_BIAS_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# How the kernel reads `bias` (a constexpr: each kind is its own compiled kernel).
BIAS_NONE, BIAS_ADDITIVE, BIAS_BOOL = 0, 1, 2


# =============================================================================================
# Reference (plain torch)
# =============================================================================================
def reference_attention(q, k, v, bias=None, *, scale, is_causal, return_lse=False):
    """softmax(q @ k^T * scale + bias) @ v, materializing the (B, H, Lq, Lk) scores.

    Computes in float32 for half inputs (float64 stays float64) and returns `out` in q's dtype;
    with `return_lse=True` also the natural-log row log-sum-exp (B, H, Lq) in the compute dtype.
    Same conventions as the kernel: GQA by head groups, top-left causal (j <= i), bool mask True =
    attend, fully masked rows give 0 (lse -inf).
    """
    batch, heads, len_q, head_dim = q.shape
    kv_heads, len_k = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = heads // kv_heads
    k = k.to(compute).repeat_interleave(group, dim=1)  # (B, H, Lk, D)
    v = v.to(compute).repeat_interleave(group, dim=1)
    scores = (q.to(compute) @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if bias is not None:
        if bias.dtype == torch.bool:
            scores = scores.masked_fill(~bias, float("-inf"))
        else:
            scores = scores + bias.to(compute)
    if is_causal:
        allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril()  # j <= i
        scores = scores.masked_fill(~allowed, float("-inf"))
    fully_masked = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (B, H, Lq, 1)
    probs = torch.softmax(scores, dim=-1).masked_fill(fully_masked, 0.0)
    out = (probs @ v).to(q.dtype)
    if return_lse:
        return out, torch.logsumexp(scores, dim=-1)
    return out


# =============================================================================================
# What the kernel handles
# =============================================================================================
def supports(q, k, v, bias=None) -> tuple[bool, str]:
    """(True, "ok") when the Triton kernel handles these inputs, else (False, the reason)."""
    if not HAS_TRITON:
        return False, "triton is not installed"
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return False, f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return False, f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return False, f"bias must be None or a torch.Tensor, got {type(bias).__name__}"
    devices = {t.device for t in (q, k, v)} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        return False, f"all inputs must be on one device, got {', '.join(sorted(map(str, devices)))}"
    if q.device.type != "cuda" and not _INTERPRET:
        return False, f"the Triton kernel needs a CUDA device (inputs are on {q.device}); set TRITON_INTERPRET=1 to run it on CPU"
    if q.device.type == "cuda" and compute_capability(q.device.index) < (8, 0):
        return False, "the Triton kernel needs compute capability 8.0 (Ampere) or newer"
    if q.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {q.dtype} not supported; valid choices: float16, bfloat16, float32"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    batch, heads, len_q, head_dim = q.shape
    if k.shape != v.shape:
        return False, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    if k.shape[0] != batch:
        return False, f"batch sizes differ: q has {batch}, k/v have {k.shape[0]}"
    if k.shape[3] != head_dim:
        return False, f"key/value head dim ({k.shape[3]}) must equal the query head dim ({head_dim})"
    kv_heads, len_k = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        return False, f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return False, f"head dim {head_dim} not supported; valid: 1..{MAX_HEAD_DIM} (non-powers of two are padded)"
    if min(batch, heads, len_q, len_k) == 0:
        return False, f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}"
    if batch * heads > MAX_GRID_Y:
        return False, f"batch * heads = {batch * heads} exceeds the grid limit {MAX_GRID_Y}"
    if bias is not None:
        if bias.dtype not in SUPPORTED_BIAS_DTYPES:
            return False, f"bias dtype {bias.dtype} not supported; valid choices: bool (mask), float16, bfloat16, float32 (additive)"
        target = (batch, heads, len_q, len_k)
        if bias.dim() > 4:
            return False, f"bias has {bias.dim()} dims; it must broadcast to (B, H, Lq, Lk) = {target}"
        try:
            broadcast = torch.broadcast_shapes(tuple(bias.shape), target)
        except RuntimeError:
            broadcast = None
        if broadcast != target:
            return False, f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk) = {target}"
    return True, "ok"


def _check(q, k, v, bias, where: str, scale=None) -> None:
    ok, why = supports(q, k, v, bias)
    if not ok:
        raise ValueError(f"{where}: {why}")
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"{where}: scale must be > 0 (the running max is taken before scaling), got {scale}")


# =============================================================================================
# Autotune configurations
# =============================================================================================
def _seq_bucket(length: int) -> int:
    """Autotune key for sequence length: the next power of two, clamped to [256, 16384]."""
    return min(max(next_power_of_2(max(length, 1)), 256), 16384)


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _fwd_configs():
    if _INTERPRET:
        return [_config(32, 16, 4, 1)]  # BLOCK_M != BLOCK_N exercises the causal diagonal logic
    return [
        _config(128, 64, 8, 3), _config(128, 64, 8, 4), _config(128, 64, 4, 3),
        _config(128, 128, 8, 3), _config(128, 128, 8, 2),
        _config(64, 64, 4, 3), _config(64, 64, 4, 4), _config(64, 32, 4, 2),
    ]


def _bwd_dkdv_configs():
    if _INTERPRET:
        return [_config(16, 32, 4, 1)]
    return [_config(32, 128, 4, 3), _config(64, 128, 8, 3), _config(64, 64, 4, 3), _config(32, 64, 4, 2)]


def _bwd_dq_configs():
    if _INTERPRET:
        return [_config(32, 16, 4, 1)]
    return [_config(128, 32, 4, 3), _config(128, 64, 8, 3), _config(64, 64, 4, 3), _config(64, 32, 4, 2)]


def _prune(configs, named_args, **kwargs):
    """Drop tiles that cannot pay off: fp32 tiles are twice as large (shared memory), and short
    sequences do not fill 128-row blocks."""
    kept = list(configs)
    if named_args["q_ptr"].element_size() == 4:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    if named_args["SEQ_BUCKET"] <= 256:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs[-1:]


_KEY = ["HEAD_DIM", "IS_CAUSAL", "BIAS_KIND", "SEQ_BUCKET"]


# =============================================================================================
# Triton kernels
# =============================================================================================
if HAS_TRITON:

    @triton.jit
    def _load_tile(ptrs, row_idx, n_rows, col_idx, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
        """Load a 2-D tile, masking (to 0) rows >= n_rows and/or cols >= n_cols when asked."""
        if MASK_ROWS and MASK_COLS:
            tile = tl.load(ptrs, mask=(row_idx[:, None] < n_rows) & (col_idx[None, :] < n_cols), other=0.0)
        elif MASK_ROWS:
            tile = tl.load(ptrs, mask=row_idx[:, None] < n_rows, other=0.0)
        elif MASK_COLS:
            tile = tl.load(ptrs, mask=col_idx[None, :] < n_cols, other=0.0)
        else:
            tile = tl.load(ptrs)
        return tile

    @triton.jit
    def _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, rows, cols, Lq, Lk, qk_scale,
                       BIAS_KIND: tl.constexpr):
        """Scores in the log2 domain: qk * scale * log2(e), plus bias * log2(e) or -inf where masked.

        `rows`/`cols` are query/key indices laid out like `qk` ([:, None] / [None, :] or the
        transpose); they are clamped into range, so the bias loads need no mask (out-of-range rows
        and columns are discarded or zeroed by the callers).
        """
        scores = qk * qk_scale
        if BIAS_KIND != 0:
            bias_ptrs = (bias_base + tl.minimum(rows, Lq - 1).to(tl.int64) * stride_bias_m
                         + tl.minimum(cols, Lk - 1) * stride_bias_n)
            if BIAS_KIND == 1:
                # A bias of HF's finfo(float32).min overflows to -inf here, so a row masked
                # everywhere gives 0 (and zero gradients), where SDPA gives the mean of V. Clamping
                # it finite fixes the forward but not the backward, whose p = exp2(s - lse) then
                # loses log2(n) against the bias (p = 1, not 1/n). Such rows are padding.
                scores += tl.load(bias_ptrs).to(tl.float32) * 1.4426950408889634
            else:
                scores = tl.where(tl.load(bias_ptrs) != 0, scores, float("-inf"))
        return scores

    # ---------------------------------------------------------------------------------- forward
    @triton.jit
    def _fwd_key_blocks(acc, l_i, m_i, q, k_base, v_base, bias_base,
                        stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                        offs_m, offs_d, lo, hi, Lq, Lk, qk_scale,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                        IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online softmax over key blocks [lo, hi). MASKED: the blocks may cross Lk or the diagonal."""
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        offs_n0 = tl.arange(0, BLOCK_N)
        for start_n in tl.range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + offs_n0
            k_t = _load_tile(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],  # (D_PAD, BLOCK_N)
                             offs_d, HEAD_DIM, offs_n, Lk, PAD_D, MASKED)
            qk = tl.dot(q, k_t)  # (BLOCK_M, BLOCK_N) fp32
            if BIAS_KIND == 0 and not MASKED:
                # Hot path: max of the raw products (qk_scale > 0), then one FMA per element.
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.exp2(qk * qk_scale - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
            else:
                scores = _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, offs_m[:, None],
                                        offs_n[None, :], Lq, Lk, qk_scale, BIAS_KIND)
                if MASKED:
                    valid = offs_n[None, :] < Lk
                    if IS_CAUSAL:
                        valid = valid & (offs_n[None, :] <= offs_m[:, None])  # top-left: j <= i
                    scores = tl.where(valid, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                if BIAS_KIND != 0:
                    # A row may have seen only -inf so far; subtract 0 instead of -inf to avoid NaN.
                    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_shift = m_new
                p = tl.exp2(scores - m_shift[:, None])
                alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],  # (BLOCK_N, D_PAD)
                           offs_n, Lk, offs_d, HEAD_DIM, MASKED, PAD_D)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=_fwd_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _flash_attention_fwd_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
        stride_ob, stride_oh, stride_om,
        H, Lq, Lk, GQA_GROUP, qk_scale, SEQ_BUCKET, HEAD_GROUP,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program: BLOCK_M query rows of one (batch, head). out (B, H, Lq, D), lse (B, H, Lq).
        1-D grid; under causality the heaviest query blocks of each group of HEAD_GROUP heads start
        first (tile_order.query_block_order)."""
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        pid_m, pid_bh = query_block_order(tl.cdiv(Lq, BLOCK_M), HEAD_GROUP, IS_CAUSAL)
        off_b = pid_bh // H
        off_h = pid_bh % H
        off_kvh = off_h // GQA_GROUP
        q_base = q_ptr + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        k_base = k_ptr + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        bias_base = bias_ptr + off_b.to(tl.int64) * stride_bias_b + off_h.to(tl.int64) * stride_bias_h

        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],  # (BLOCK_M, D_PAD)
                       offs_m, Lq, offs_d, HEAD_DIM, True, PAD_D)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        if IS_CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, Lk)  # keys beyond the block's last row are skipped
            full_hi = (tl.minimum(start_m + 1, Lk) // BLOCK_N) * BLOCK_N  # blocks fully below the diagonal
        else:
            hi = Lk
            full_hi = (Lk // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_base, v_base, bias_base,
                                        stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                                        offs_m, offs_d, 0, full_hi, Lq, Lk, qk_scale,
                                        HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, False, BLOCK_N)
        acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_base, v_base, bias_base,
                                        stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                                        offs_m, offs_d, full_hi, hi, Lq, Lk, qk_scale,
                                        HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, True, BLOCK_N)
        if BIAS_KIND != 0:  # fully masked rows: out 0, lse -inf
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        else:
            l_safe = l_i
            lse2 = m_i + tl.log2(l_i)
        out = acc / l_safe[:, None]
        out_base = out_ptr + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        out_ptrs = out_base + offs_m[:, None] * stride_om + offs_d[None, :]
        if PAD_D:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < Lq)
        tl.store(lse_ptr + pid_bh.to(tl.int64) * Lq + offs_m, lse2 * 0.6931471805599453, mask=offs_m < Lq)

    # --------------------------------------------------------------------------------- backward
    @triton.jit
    def _flash_attention_bwd_preprocess_kernel(
        out_ptr, dout_ptr, delta_ptr,
        stride_ob, stride_oh, stride_om,
        stride_dob, stride_doh, stride_dom,
        H, Lq,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]   (B, H, Lq) fp32."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = pid_bh // H
        off_h = pid_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(out_ptr + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                    + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(dout_ptr + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                     + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + pid_bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)

    @triton.jit
    def _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_base,
                               stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                               offs_n, offs_d, lo, hi, Lq, Lk, qk_scale,
                               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                               IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
        """Accumulate dK, dV (BLOCK_N, D_PAD) of one key block over query blocks [lo, hi).

        Works on transposed scores sT = k @ q^T (BLOCK_N, BLOCK_M). Query rows beyond Lq load
        q = dO = 0 and lse = +inf, so their probabilities are exactly 0 without a per-element mask.
        """
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        offs_m0 = tl.arange(0, BLOCK_M)
        for start_m in tl.range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + offs_m0
            q_t = _load_tile(q_base + offs_m[None, :] * stride_qm + offs_d[:, None],  # (D_PAD, BLOCK_M)
                             offs_d, HEAD_DIM, offs_m, Lq, PAD_D, MASKED)
            if MASKED:
                lse = tl.load(lse_base + offs_m, mask=offs_m < Lq, other=float("inf"))
                delta = tl.load(delta_base + offs_m, mask=offs_m < Lq, other=0.0)
            else:
                lse = tl.load(lse_base + offs_m)
                delta = tl.load(delta_base + offs_m)
            lse2 = lse * 1.4426950408889634
            if BIAS_KIND != 0:  # fully masked rows (lse -inf) have probabilities 0
                lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
            qk_t = tl.dot(k, q_t)  # (BLOCK_N, BLOCK_M)
            scores_t = _biased_scores(qk_t, bias_base, stride_bias_m, stride_bias_n, offs_m[None, :],
                                      offs_n[:, None], Lq, Lk, qk_scale, BIAS_KIND)
            p_t = tl.exp2(scores_t - lse2[None, :])
            if MASKED and IS_CAUSAL:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
            do = _load_tile(do_base + offs_m[:, None] * stride_dom + offs_d[None, :],  # (BLOCK_M, D_PAD)
                            offs_m, Lq, offs_d, HEAD_DIM, MASKED, PAD_D)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
        return dk, dv

    @triton.autotune(configs=_bwd_dkdv_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _flash_attention_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
        stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        H, HKV, Lq, Lk, GQA_GROUP, qk_scale, sm_scale, SEQ_BUCKET,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program: BLOCK_N keys of one (batch, KV head); sums over the heads of its GQA group."""
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        pid_n = tl.program_id(0)
        pid_bhkv = tl.program_id(1)
        off_b = pid_bhkv // HKV
        off_kvh = pid_bhkv % HKV
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        k = _load_tile(k_ptr + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
                       + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, Lk, offs_d, HEAD_DIM, True, PAD_D)
        v = _load_tile(v_ptr + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
                       + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, Lk, offs_d, HEAD_DIM, True, PAD_D)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)

        # Query blocks: [diag_lo, full_lo) cross the diagonal (causal only), [full_lo, tail_lo) need
        # no mask at all, [tail_lo, m_end) is the partial last block.
        m_end = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
        m_full_end = (Lq // BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            diag_lo = (start_n // BLOCK_M) * BLOCK_M  # query i sees key j only when i >= j
            full_lo = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, m_end)
        else:
            diag_lo = 0
            full_lo = 0
        tail_lo = tl.maximum(full_lo, m_full_end)
        for g in range(0, GQA_GROUP):
            off_h = off_kvh * GQA_GROUP + g
            q_base = q_ptr + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            do_base = dout_ptr + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
            row_base = (off_b * H + off_h).to(tl.int64) * Lq
            bias_base = bias_ptr + off_b.to(tl.int64) * stride_bias_b + off_h.to(tl.int64) * stride_bias_h
            dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                            bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                            offs_n, offs_d, diag_lo, full_lo, Lq, Lk, qk_scale,
                                            HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, True, BLOCK_M)
            dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                            bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                            offs_n, offs_d, full_lo, tail_lo, Lq, Lk, qk_scale,
                                            HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, False, BLOCK_M)
            dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                            bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                            offs_n, offs_d, tail_lo, m_end, Lq, Lk, qk_scale,
                                            HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, True, BLOCK_M)
        dk *= sm_scale
        store_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
        tl.store(dk_ptr + off_b.to(tl.int64) * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
                 + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=store_mask)
        tl.store(dv_ptr + off_b.to(tl.int64) * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
                 + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                           stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                           offs_m, offs_d, lo, hi, Lq, Lk, qk_scale,
                           HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                           IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
        """Accumulate dQ (BLOCK_M, D_PAD) of one query block over key blocks [lo, hi)."""
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        offs_n0 = tl.arange(0, BLOCK_N)
        for start_n in tl.range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + offs_n0
            k_t = _load_tile(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],  # (D_PAD, BLOCK_N)
                             offs_d, HEAD_DIM, offs_n, Lk, PAD_D, MASKED)
            v_t = _load_tile(v_base + offs_n[None, :] * stride_vn + offs_d[:, None],
                             offs_d, HEAD_DIM, offs_n, Lk, PAD_D, MASKED)
            qk = tl.dot(q, k_t)  # (BLOCK_M, BLOCK_N)
            scores = _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, offs_m[:, None],
                                    offs_n[None, :], Lq, Lk, qk_scale, BIAS_KIND)
            p = tl.exp2(scores - lse2[:, None])
            if MASKED:
                valid = offs_n[None, :] < Lk
                if IS_CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(valid, p, 0.0)
            dp = tl.dot(do, v_t)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
        return dq

    @triton.autotune(configs=_bwd_dq_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
    @triton.jit
    def _flash_attention_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
        stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm,
        H, Lq, Lk, GQA_GROUP, qk_scale, sm_scale, SEQ_BUCKET,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program: dQ for BLOCK_M query rows of one (batch, head)."""
        PAD_D: tl.constexpr = HEAD_DIM != D_PAD
        pid_m = tl.program_id(0)
        if IS_CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        off_b = pid_bh // H
        off_h = pid_bh % H
        off_kvh = off_h // GQA_GROUP
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        q = _load_tile(q_ptr + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                       + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, Lq, offs_d, HEAD_DIM, True, PAD_D)
        do = _load_tile(dout_ptr + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                        + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, Lq, offs_d, HEAD_DIM, True, PAD_D)
        row_base = pid_bh.to(tl.int64) * Lq
        lse2 = tl.load(lse_ptr + row_base + offs_m, mask=offs_m < Lq, other=float("inf")) * 1.4426950408889634
        if BIAS_KIND != 0:
            lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(delta_ptr + row_base + offs_m, mask=offs_m < Lq, other=0.0)
        k_base = k_ptr + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        bias_base = bias_ptr + off_b.to(tl.int64) * stride_bias_b + off_h.to(tl.int64) * stride_bias_h
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        if IS_CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, Lk)
            full_hi = (tl.minimum(start_m + 1, Lk) // BLOCK_N) * BLOCK_N
        else:
            hi = Lk
            full_hi = (Lk // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                                stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                                offs_m, offs_d, 0, full_hi, Lq, Lk, qk_scale,
                                HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, False, BLOCK_N)
        dq = _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                                stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                                offs_m, offs_d, full_hi, hi, Lq, Lk, qk_scale,
                                HEAD_DIM, D_PAD, BIAS_KIND, IS_CAUSAL, True, BLOCK_N)
        dq *= sm_scale
        tl.store(dq_ptr + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
                 + offs_m[:, None] * stride_dqm + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))


# =============================================================================================
# Launchers
# =============================================================================================
def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with stride 1; other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _prepare_bias(bias, batch, heads, len_q, len_k, like):
    """(tensor to pass, BIAS_KIND, its 4 strides); broadcast dims get stride 0 (no copy)."""
    if bias is None:
        return like, BIAS_NONE, (0, 0, 0, 0)
    kind = BIAS_BOOL if bias.dtype == torch.bool else BIAS_ADDITIVE
    if kind == BIAS_BOOL:
        bias = bias.view(torch.uint8)  # same bytes; Triton loads it as uint8
    bias = bias.expand(batch, heads, len_q, len_k)
    return bias, kind, tuple(bias.stride())


def _head_dim_pad(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def flash_attention_forward(q, k, v, bias=None, *, scale, is_causal):
    """Triton forward. q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (out (B, H, Lq, D), lse (B, H, Lq) fp32).

    `lse` is the natural-log log-sum-exp of each row's scores (scale and bias included); -inf for
    fully masked rows, whose output is 0.
    """
    _check(q, k, v, bias, "flash_attention_forward", scale)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    batch, heads, len_q, head_dim = q.shape
    kv_heads, len_k = k.shape[1], k.shape[2]
    out = torch.empty((batch, heads, len_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, len_q), dtype=torch.float32, device=q.device)
    bias_arg, bias_kind, bias_strides = _prepare_bias(bias, batch, heads, len_q, len_k, q)

    def grid(meta):
        return (cdiv(len_q, meta["BLOCK_M"]) * batch * heads,)

    launch_tuned(
        _flash_attention_fwd_kernel, grid,
        q, k, v, bias_arg, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        out.stride(0), out.stride(1), out.stride(2),
        heads, len_q, len_k, heads // kv_heads, float(scale) * LOG2E, _seq_bucket(max(len_q, len_k)),
        causal_head_group(batch * heads, heads // kv_heads, len_k, head_dim, k.element_size()) if is_causal else 1,
        HEAD_DIM=head_dim, D_PAD=_head_dim_pad(head_dim), BIAS_KIND=bias_kind, IS_CAUSAL=bool(is_causal),
    )
    return out, lse


def flash_attention_backward(grad_out, q, k, v, bias, out, lse, *, scale, is_causal):
    """Triton backward -> (dq, dk, dv) shaped like q, k, v (dk/dv summed over each GQA group).

    `out` and `lse` are the forward's outputs. No gradient for `bias` (used as a constant mask).
    """
    _check(q, k, v, bias, "flash_attention_backward", scale)
    if grad_out.shape != q.shape:
        raise ValueError(f"flash_attention_backward: grad_out shape {tuple(grad_out.shape)} must equal q's {tuple(q.shape)}")
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    grad_out, out = _unit_last_stride(grad_out.to(q.dtype)), _unit_last_stride(out)
    lse = lse.float().contiguous()
    batch, heads, len_q, head_dim = q.shape
    kv_heads, len_k = k.shape[1], k.shape[2]
    d_pad = _head_dim_pad(head_dim)
    bias_arg, bias_kind, bias_strides = _prepare_bias(bias, batch, heads, len_q, len_k, q)
    seq_bucket = _seq_bucket(max(len_q, len_k))

    delta = torch.empty((batch, heads, len_q), dtype=torch.float32, device=q.device)
    preprocess_block = 64 if head_dim <= 64 else 32
    _flash_attention_bwd_preprocess_kernel[(cdiv(len_q, preprocess_block), batch * heads)](
        out, grad_out, delta,
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        heads, len_q, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=preprocess_block,
    )

    dq = torch.empty((batch, heads, len_q, head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, kv_heads, len_k, head_dim), dtype=k.dtype, device=k.device)
    dv = torch.empty((batch, kv_heads, len_k, head_dim), dtype=v.dtype, device=v.device)
    common = dict(HEAD_DIM=head_dim, D_PAD=d_pad, BIAS_KIND=bias_kind, IS_CAUSAL=bool(is_causal))
    qk_scale = float(scale) * LOG2E

    def grid_dkdv(meta):
        return (cdiv(len_k, meta["BLOCK_N"]), batch * kv_heads)

    launch_tuned(
        _flash_attention_bwd_dkdv_kernel, grid_dkdv,
        q, k, v, bias_arg, grad_out, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        heads, kv_heads, len_q, len_k, heads // kv_heads, qk_scale, float(scale), seq_bucket,
        **common,
    )

    def grid_dq(meta):
        return (cdiv(len_q, meta["BLOCK_M"]), batch * heads)

    launch_tuned(
        _flash_attention_bwd_dq_kernel, grid_dq,
        q, k, v, bias_arg, grad_out, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        heads, len_q, len_k, heads // kv_heads, qk_scale, float(scale), seq_bucket,
        **common,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (no gradient for the bias)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, is_causal):
        out, lse = flash_attention_forward(q, k, v, bias, scale=scale, is_causal=is_causal)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale, ctx.is_causal = scale, is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if ctx.needs_input_grad[3]:
            raise NotImplementedError("flash_attention: the gradient with respect to `bias` is not computed; "
                                      "detach the bias or use reference_attention")
        dq, dk, dv = flash_attention_backward(grad_out, q, k, v, bias, out, lse, scale=ctx.scale, is_causal=ctx.is_causal)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, bias=None, *, scale=None, is_causal=False):
    """Flash attention with autograd. scale defaults to 1/sqrt(D); see the module docstring."""
    _check(q, k, v, bias, "flash_attention")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return FlashAttentionFunction.apply(q, k, v, bias, float(scale), bool(is_causal))
