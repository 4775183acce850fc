"""The Triton kernels of flash attention: forward (online softmax over key blocks), and backward
(delta = rowsum(dO * O), then dK/dV per key block and dQ per query block). Soft-capping (SOFTCAP)
and ALiBi (ALIBI) are constexpr flags: each combination is its own compiled kernel, and the plain
kernel keeps its unmasked fast path."""

from __future__ import annotations

import triton
import triton.language as tl

from graphopt.kernels.flash_attention.configs import _KEY, _bwd_dkdv_configs, _bwd_dq_configs, _fwd_configs, _prune
from graphopt.kernels.launch import INTERPRET as _INTERPRET
from graphopt.kernels.tile_order import query_block_order


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

# On the GPU, tanh is one MUFU instruction (tanh.approx.f32, absolute error ~5e-4: below bf16's
# rounding of the capped scores); the interpreter has no PTX, so it takes 2 sigmoid(2x) - 1.
_FAST_TANH = tl.constexpr(not _INTERPRET)


@triton.jit
def _tanh(x):
    if _FAST_TANH:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = 2.0 * tl.sigmoid(2.0 * x) - 1.0
    return y

@triton.jit
def _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, rows, cols, Lq, Lk, qk_scale,
                   cap_log2, alibi, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Scores in the log2 domain: qk * scale * log2(e) (SOFTCAP: cap * tanh(qk * scale / cap) *
    log2(e), with qk_scale = scale / cap and cap_log2 = cap * log2(e)), plus ALIBI's `alibi` (a
    vector broadcast along qk's rows or columns: see _alibi), plus bias * log2(e) or -inf where masked.

    `rows`/`cols` are query/key indices laid out like `qk` ([:, None] / [None, :] or the
    transpose); they are clamped into range, so the bias loads need no mask (out-of-range rows
    and columns are discarded or zeroed by the callers).
    """
    if SOFTCAP:
        scores = _tanh(qk * qk_scale) * cap_log2
    else:
        scores = qk * qk_scale
    if ALIBI:
        scores += alibi
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

FIXED_SHIFT_MAX_CAP_LOG2 = 92.0  # the largest cap * log2(e) the fixed shift serves (see below)


@triton.jit
def _fixed_score_shift(cap_log2):
    """The constant subtracted from soft-capped scores (log2 domain, in [-cap_log2, cap_log2])
    instead of a running max: exp2 of the shifted scores spans [2^(S - 2 cap_log2), 2^S] with S =
    max(0, 2 cap_log2 - 120), so no weight underflows fp32/bf16 (>= 2^-120) and, for cap_log2 <=
    FIXED_SHIFT_MAX_CAP_LOG2, none exceeds 2^64 (the sums of a row stay far from fp32's range)."""
    return cap_log2 - tl.maximum(2.0 * cap_log2 - 120.0, 0.0)


@triton.jit
def _alibi_slope(alibi_ptr, off_h, ALIBI: tl.constexpr):
    """Head off_h's ALiBi slope times log2(e) (0 without ALiBi)."""
    if ALIBI:
        slope = tl.load(alibi_ptr + off_h).to(tl.float32) * 1.4426950408889634
    else:
        slope = 0.0
    return slope


@triton.jit
def _alibi(slope_log2, idx, ref):
    """ALiBi slope * (j - i) is computed as slope * (idx - ref) along ONE axis, with `ref` a fixed
    index of the other axis (the program's first query row, or first key): a vector per tile, one
    add per score. It differs from slope * (j - i) by slope * (i - ref) per query row, which softmax
    ignores; the log-sum-exp is corrected by that amount where it is stored or read."""
    return slope_log2 * (idx - ref).to(tl.float32)

# ---------------------------------------------------------------------------------- forward
@triton.jit
def _mask_block(scores, offs_m, offs_n, Lk, IS_CAUSAL: tl.constexpr):
    """-inf at keys past Lk and, under causality, above the diagonal (top-left: j <= i)."""
    valid = offs_n[None, :] < Lk
    if IS_CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    return tl.where(valid, scores, float("-inf"))


@triton.jit
def _fwd_key_blocks(acc, l_i, m_i, q, k_base, v_base, bias_base,
                    stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                    offs_m, offs_d, lo, hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [lo, hi). MASKED: the blocks may cross Lk or the diagonal.
    ALiBi relative to the block's first query row start_m."""
    PAD_D: tl.constexpr = HEAD_DIM != D_PAD
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k_t = _load_tile(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],  # (D_PAD, BLOCK_N)
                         offs_d, HEAD_DIM, offs_n, Lk, PAD_D, MASKED)
        qk = tl.dot(q, k_t)  # (BLOCK_M, BLOCK_N) fp32
        if SOFTCAP == 2:
            # Soft-capped scores never exceed cap_log2, so the shift m_i stays fixed (see
            # _fixed_score_shift): no running max, no rescaling of acc and l_i.
            scores = _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, offs_m[:, None],
                                    offs_n[None, :], Lq, Lk, qk_scale, cap_log2, 0.0, BIAS_KIND, SOFTCAP, ALIBI)
            if MASKED:
                scores = _mask_block(scores, offs_m, offs_n, Lk, IS_CAUSAL)
            p = tl.exp2(scores - m_i[:, None])
            l_i += tl.sum(p, 1)
            v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                           offs_n, Lk, offs_d, HEAD_DIM, MASKED, PAD_D)
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            if BIAS_KIND == 0 and not MASKED and not SOFTCAP and not ALIBI:
                # Hot path: max of the raw products (qk_scale > 0), then one FMA per element.
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.exp2(qk * qk_scale - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
            else:
                scores = _biased_scores(qk, bias_base, stride_bias_m, stride_bias_n, offs_m[:, None],
                                        offs_n[None, :], Lq, Lk, qk_scale, cap_log2,
                                        _alibi(slope_log2, offs_n, start_m)[None, :], BIAS_KIND, SOFTCAP, ALIBI)
                if MASKED:
                    scores = _mask_block(scores, offs_m, offs_n, Lk, IS_CAUSAL)
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
    q_ptr, k_ptr, v_ptr, bias_ptr, alibi_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_ob, stride_oh, stride_om,
    H, Lq, Lk, GQA_GROUP, qk_scale, cap_log2, SEQ_BUCKET, HEAD_GROUP,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    slope_log2 = _alibi_slope(alibi_ptr, off_h, ALIBI)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],  # (BLOCK_M, D_PAD)
                   offs_m, Lq, offs_d, HEAD_DIM, True, PAD_D)

    if SOFTCAP == 2:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + _fixed_score_shift(cap_log2)
    else:
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
                                    offs_m, offs_d, 0, full_hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                                    HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, False, BLOCK_N)
    acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_base, v_base, bias_base,
                                    stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                                    offs_m, offs_d, full_hi, hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                                    HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, True, BLOCK_N)
    if BIAS_KIND != 0:  # fully masked rows: out 0, lse -inf
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    else:
        l_safe = l_i
        lse2 = m_i + tl.log2(l_i)
    if ALIBI:  # to the log-sum-exp of slope * (j - i) (see _alibi)
        lse2 -= _alibi(slope_log2, offs_m, start_m)
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
                           offs_n, offs_d, lo, hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_n,
                           HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                           SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
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
        if ALIBI:  # ALiBi relative to the program's first key start_n (see _alibi)
            lse2 += _alibi(slope_log2, offs_m, start_n)
        qk_t = tl.dot(k, q_t)  # (BLOCK_N, BLOCK_M)
        scores_t = _biased_scores(qk_t, bias_base, stride_bias_m, stride_bias_n, offs_m[None, :],
                                  offs_n[:, None], Lq, Lk, qk_scale, cap_log2,
                                  _alibi(slope_log2, offs_n, start_n)[:, None], BIAS_KIND, SOFTCAP, ALIBI)
        p_t = tl.exp2(scores_t - lse2[None, :])
        if MASKED and IS_CAUSAL:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
        do = _load_tile(do_base + offs_m[:, None] * stride_dom + offs_d[None, :],  # (BLOCK_M, D_PAD)
                        offs_m, Lq, offs_d, HEAD_DIM, MASKED, PAD_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # d(cap * tanh(u)) / d(cap * u) = 1 - tanh(u)^2
            th = _tanh(qk_t * qk_scale)
            ds_t = ds_t * (1.0 - th * th)
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv

@triton.autotune(configs=_bwd_dkdv_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _flash_attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, alibi_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, HKV, Lq, Lk, GQA_GROUP, qk_scale, cap_log2, sm_scale, SEQ_BUCKET,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
        slope_log2 = _alibi_slope(alibi_ptr, off_h, ALIBI)
        dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                        bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                        offs_n, offs_d, diag_lo, full_lo, Lq, Lk, qk_scale, cap_log2, slope_log2, start_n,
                                        HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, True, BLOCK_M)
        dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                        bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                        offs_n, offs_d, full_lo, tail_lo, Lq, Lk, qk_scale, cap_log2, slope_log2, start_n,
                                        HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, False, BLOCK_M)
        dk, dv = _bwd_dkdv_query_blocks(dk, dv, k, v, q_base, do_base, lse_ptr + row_base, delta_ptr + row_base,
                                        bias_base, stride_qm, stride_dom, stride_bias_m, stride_bias_n,
                                        offs_n, offs_d, tail_lo, m_end, Lq, Lk, qk_scale, cap_log2, slope_log2, start_n,
                                        HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, True, BLOCK_M)
    dk *= sm_scale
    store_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_ptr + off_b.to(tl.int64) * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dv_ptr + off_b.to(tl.int64) * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=store_mask)

@triton.jit
def _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                       stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                       offs_m, offs_d, lo, hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
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
                                offs_n[None, :], Lq, Lk, qk_scale, cap_log2,
                                _alibi(slope_log2, offs_n, start_m)[None, :], BIAS_KIND, SOFTCAP, ALIBI)
        p = tl.exp2(scores - lse2[:, None])
        if MASKED:
            valid = offs_n[None, :] < Lk
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, v_t)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            th = _tanh(qk * qk_scale)
            ds = ds * (1.0 - th * th)
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq

@triton.autotune(configs=_bwd_dq_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _flash_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, alibi_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    H, Lq, Lk, GQA_GROUP, qk_scale, cap_log2, sm_scale, SEQ_BUCKET,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BIAS_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    slope_log2 = _alibi_slope(alibi_ptr, off_h, ALIBI)
    if ALIBI:  # ALiBi relative to the block's first query row start_m (see _alibi)
        lse2 += _alibi(slope_log2, offs_m, start_m)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, Lk)
        full_hi = (tl.minimum(start_m + 1, Lk) // BLOCK_N) * BLOCK_N
    else:
        hi = Lk
        full_hi = (Lk // BLOCK_N) * BLOCK_N
    dq = _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                            stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                            offs_m, offs_d, 0, full_hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                            HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, False, BLOCK_N)
    dq = _bwd_dq_key_blocks(dq, q, do, lse2, delta, k_base, v_base, bias_base,
                            stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                            offs_m, offs_d, full_hi, hi, Lq, Lk, qk_scale, cap_log2, slope_log2, start_m,
                            HEAD_DIM, D_PAD, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, True, BLOCK_N)
    dq *= sm_scale
    tl.store(dq_ptr + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
