"""Attention of a few query rows against a long key/value cache, split over the keys (decode).

In a decode step each sequence has one query token (or a few) and Lk cached keys. A
flash-attention kernel that gives each block of query rows one program has only B*H programs,
each streaming all Lk keys alone, so most of the GPU waits. Here the keys are cut into `splits`
chunks. One program takes one (batch, KV head, chunk) and all the query rows of the query heads
that share that KV head (GQA), so each K/V element is read once; it writes its unnormalised
output with the running max and sum of its rows. A second kernel merges the chunks of each row by
their log-sum-exp.

Supported: q (B, H, Lq, D), k and v (B, Hkv, Lk, D) with H a multiple of Hkv, fp16/bf16/fp32,
D <= 256, (H / Hkv) * Lq <= MAX_ROWS; a bias broadcastable to (B, H, Lq, Lk), bool (True keeps
the key, as SDPA's attn_mask) or additive. No causal flag: a decode step's mask is given as a
bias. A row whose keys are all masked gives NaN, as SDPA's math does. fp32 inputs multiply in
full fp32 precision.

The number of chunks is the caller's choice (the attention pass's, at compile time,
`graphopt.cost_model.decode_attention_splits`); the launcher only checks, allocates and launches.
"""

from __future__ import annotations

import torch

from graphopt.kernels.launch import INTERPRET, launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference
    triton = None

MAX_ROWS = 64  # query rows per KV head: (H / Hkv) * Lq
BLOCK_N = 16 if INTERPRET else 64  # keys per inner step
BIAS_NONE, BIAS_BOOL, BIAS_ADDITIVE = 0, 1, 2
LOG2E = 1.4426950408889634


def reference_decode_attention(q, k, v, bias=None, *, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v in float64 arithmetic of the inputs, K/V heads repeated
    for GQA; returned in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    scores = q.double() @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.double()
    return (scores.softmax(-1) @ v).to(q.dtype)


def supports(q, k, v, bias=None) -> tuple[bool, str]:
    """(ok, why not) for these tensors (real or fake)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "decode attention needs 4-D (B, H, L, D) q, k, v"
    b, h, lq, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d or v.shape[3] != d:
        return False, f"decode attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}"
    if h % k.shape[1]:
        return False, f"decode attention: {h} query heads are not a multiple of {k.shape[1]} KV heads"
    if (h // k.shape[1]) * lq > MAX_ROWS:
        return False, f"decode attention takes at most {MAX_ROWS} query rows per KV head, got {(h // k.shape[1]) * lq}"
    if d > 256:
        return False, f"decode attention: head dim {d} > 256"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"decode attention needs q, k, v of one float dtype (fp16, bf16, fp32), got {q.dtype}, {k.dtype}, {v.dtype}"
    if bias is not None:
        try:
            torch.broadcast_shapes(tuple(bias.shape), (b, h, lq, k.shape[2]))
        except RuntimeError:
            return False, f"decode attention: bias {tuple(bias.shape)} does not broadcast to {(b, h, lq, k.shape[2])}"
        if bias.dim() != 4:
            return False, "decode attention: the bias must be 4-D"
        if bias.dtype != torch.bool and not bias.dtype.is_floating_point:
            return False, f"decode attention: bias must be bool or floating point, got {bias.dtype}"
    return True, ""


if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, part_ptr, stats_ptr,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_bb, stride_bh, stride_bm, stride_bn,
        kv_heads, len_q, len_k, groups, keys_per_split, qk_scale,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        BIAS_KIND: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One (batch * KV head, chunk): rows r = g * len_q + i are query head kv*groups+g, row i.
        Writes the chunk's unnormalised output (ROWS, D_PAD) fp32 and its rows' (max, sum), both in
        the log2 domain."""
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bh // kv_heads
        kv = pid_bh % kv_heads
        rows = tl.arange(0, ROWS)
        row_ok = rows < groups * len_q
        head = kv * groups + rows // len_q
        pos = rows % len_q
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qm + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (ROWS, D_PAD)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, len_k)
        m_i = tl.full([ROWS], -1.0e30, tl.float32)  # finite: a fully masked block keeps alpha = 1
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        k_base = k_ptr + b * stride_kb + kv * stride_kh
        v_base = v_ptr + b * stride_vb + kv * stride_vh
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            # V is requested with K, before the scores need K: a chunk of one or two steps then
            # waits for one memory round trip per step, not two
            kt = tl.load(k_base + n[None, :] * stride_kn + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            vt = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = (s * qk_scale).to(tl.float32)  # (ROWS, BLOCK_N), log2 domain; Inductor passes the scale as fp64
            if BIAS_KIND != 0:
                bias = tl.load(bias_ptr + b * stride_bb + head[:, None] * stride_bh + pos[:, None] * stride_bm
                               + n[None, :] * stride_bn, mask=row_ok[:, None] & n_ok[None, :], other=0)
                if BIAS_KIND == 1:
                    s = tl.where(bias != 0, s, float("-inf"))
                else:
                    s = s + bias.to(tl.float32) * 1.4426950408889634
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        chunk = pid_bh * tl.num_programs(1) + split
        tl.store(part_ptr + (chunk * ROWS + rows[:, None]) * D_PAD + d[None, :], acc)
        tl.store(stats_ptr + (chunk * ROWS + rows) * 2, m_i)
        tl.store(stats_ptr + (chunk * ROWS + rows) * 2 + 1, l_i)

    @triton.jit
    def _decode_merge_kernel(
        part_ptr, stats_ptr, out_ptr, stride_ob, stride_oh, stride_om,
        kv_heads, len_q, groups, splits,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        """One (batch * KV head, row): the chunks' outputs weighted by exp2(max_s - max), over the
        total sum."""
        pid_bh = tl.program_id(0)
        row = tl.program_id(1)
        b = pid_bh // kv_heads
        kv = pid_bh % kv_heads
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < splits
        stat = (pid_bh * splits + s) * ROWS + row
        m = tl.load(stats_ptr + stat * 2, mask=s_ok, other=-1.0e30)
        l = tl.load(stats_ptr + stat * 2 + 1, mask=s_ok, other=0.0)
        weight = tl.where(s_ok, tl.exp2(m - tl.max(m, 0)), 0.0)
        d = tl.arange(0, D_PAD)
        part = tl.load(part_ptr + stat[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(part * weight[:, None], 0) / tl.sum(l * weight, 0)
        head = kv * groups + row // len_q
        tl.store(out_ptr + b * stride_ob + head * stride_oh + (row % len_q) * stride_om + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_attention(q, k, v, bias=None, *, scale: float, splits: int) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the keys cut into `splits` chunks (see the module
    docstring); q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (B, H, Lq, D) in q's dtype."""
    ok, why = supports(q, k, v, bias)
    if not ok:
        raise ValueError(why)
    if splits < 1:
        raise ValueError(f"decode attention: splits must be >= 1, got {splits}")
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    batch, heads, len_q, head_dim = q.shape
    kv_heads, len_k = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    rows = max(16, triton.next_power_of_2(groups * len_q))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    # whole BLOCK_N steps per chunk; fewer chunks when the keys run out
    keys_per_split = triton.cdiv(triton.cdiv(len_k, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(len_k, keys_per_split)
    part = torch.empty((batch * kv_heads * splits * rows, d_pad), dtype=torch.float32, device=q.device)
    stats = torch.empty((batch * kv_heads * splits * rows, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, heads, len_q, head_dim), dtype=q.dtype, device=q.device)
    if bias is None:
        bias_arg, bias_kind, bias_strides = q, BIAS_NONE, (0, 0, 0, 0)
    else:
        bias_kind = BIAS_BOOL if bias.dtype == torch.bool else BIAS_ADDITIVE
        # a bool mask goes in as it is (Triton loads it as i1); no dtype view, which Inductor would
        # lower to a bitcast that Triton refuses for bool
        bias_arg = bias.expand(batch, heads, len_q, len_k)
        bias_strides = tuple(bias_arg.stride())
    launch(_decode_split_kernel, (batch * kv_heads, splits),
           q, k, v, bias_arg, part, stats,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), *bias_strides,
           kv_heads, len_q, len_k, groups, keys_per_split, float(scale) * LOG2E,
           HEAD_DIM=head_dim, D_PAD=d_pad, ROWS=rows, BLOCK_N=BLOCK_N, BIAS_KIND=bias_kind,
           IEEE=q.dtype == torch.float32, num_warps=4)
    launch(_decode_merge_kernel, (batch * kv_heads, groups * len_q),
           part, stats, out, out.stride(0), out.stride(1), out.stride(2),
           kv_heads, len_q, groups, splits,
           HEAD_DIM=head_dim, D_PAD=d_pad, ROWS=rows, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out

