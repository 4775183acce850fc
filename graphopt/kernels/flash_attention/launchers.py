"""The launchers of flash attention: they check inputs, allocate outputs and launch the kernels
(kernels.py) with the tile configuration autotuned per shape bucket; and the autograd wrapper."""

from __future__ import annotations

import math

import torch

from graphopt.kernels.flash_attention.configs import _seq_bucket
from graphopt.kernels.flash_attention.reference import BIAS_ADDITIVE, BIAS_BOOL, BIAS_NONE, HAS_TRITON, LOG2E, _check
from graphopt.kernels.launch import cdiv, launch_tuned, next_power_of_2
from graphopt.kernels.tile_order import causal_head_group

if HAS_TRITON:
    from graphopt.kernels.flash_attention.kernels import (
        FIXED_SHIFT_MAX_CAP_LOG2,
        _flash_attention_bwd_dkdv_kernel,
        _flash_attention_bwd_dq_kernel,
        _flash_attention_bwd_preprocess_kernel,
        _flash_attention_fwd_kernel,
    )


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


def _score_args(scale, softcap, alibi_slopes, like):
    """(qk_scale, cap_log2, slopes tensor to pass, SOFTCAP, ALIBI) for the kernels."""
    softcap = float(softcap or 0.0)
    qk_scale = float(scale) / softcap if softcap else float(scale) * LOG2E
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else like
    return qk_scale, softcap * LOG2E, slopes, bool(softcap), alibi_slopes is not None


def _forward_softcap_mode(softcapped: bool, cap_log2: float, bias_kind: int, alibi: bool, dtype: torch.dtype) -> int:
    """The forward kernel's SOFTCAP: 0 none; 2 soft-capped scores bounded above by the cap (no
    additive bias, no ALiBi, a cap the fixed shift serves, and weights in a dtype with fp32's
    exponent range: fp16 would flush the small ones), softmax shifted by a constant; 1 otherwise
    (a running max)."""
    if not softcapped:
        return 0
    bounded = (bias_kind != BIAS_ADDITIVE and not alibi and cap_log2 <= FIXED_SHIFT_MAX_CAP_LOG2
               and dtype in (torch.bfloat16, torch.float32))
    return 2 if bounded else 1


def flash_attention_forward(q, k, v, bias=None, *, scale, is_causal, softcap=0.0, alibi_slopes=None):
    """Triton forward. q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (out (B, H, Lq, D), lse (B, H, Lq) fp32).

    `lse` is the natural-log log-sum-exp of each row's scores (scale, soft-capping, ALiBi and bias
    included); -inf for fully masked rows, whose output is 0. softcap > 0: scores
    softcap * tanh(scale * q.k / softcap); alibi_slopes (H,): plus slope * (j - i).
    """
    _check(q, k, v, bias, "flash_attention_forward", scale, softcap, alibi_slopes)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    batch, heads, len_q, head_dim = q.shape
    kv_heads, len_k = k.shape[1], k.shape[2]
    out = torch.empty((batch, heads, len_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, len_q), dtype=torch.float32, device=q.device)
    bias_arg, bias_kind, bias_strides = _prepare_bias(bias, batch, heads, len_q, len_k, q)
    qk_scale, cap_log2, slopes, softcapped, alibi = _score_args(scale, softcap, alibi_slopes, q)

    def grid(meta):
        return (cdiv(len_q, meta["BLOCK_M"]) * batch * heads,)

    launch_tuned(
        _flash_attention_fwd_kernel, grid,
        q, k, v, bias_arg, slopes, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        out.stride(0), out.stride(1), out.stride(2),
        heads, len_q, len_k, heads // kv_heads, qk_scale, cap_log2, _seq_bucket(max(len_q, len_k)),
        causal_head_group(batch * heads, heads // kv_heads, len_k, head_dim, k.element_size()) if is_causal else 1,
        HEAD_DIM=head_dim, D_PAD=_head_dim_pad(head_dim), BIAS_KIND=bias_kind, IS_CAUSAL=bool(is_causal),
        SOFTCAP=_forward_softcap_mode(softcapped, cap_log2, bias_kind, alibi, q.dtype), ALIBI=alibi,
    )
    return out, lse


def flash_attention_backward(grad_out, q, k, v, bias, out, lse, *, scale, is_causal, softcap=0.0, alibi_slopes=None):
    """Triton backward -> (dq, dk, dv) shaped like q, k, v (dk/dv summed over each GQA group).

    `out` and `lse` are the forward's outputs (same softcap and alibi_slopes). No gradient for
    `bias` (used as a constant mask) nor for the slopes.
    """
    _check(q, k, v, bias, "flash_attention_backward", scale, softcap, alibi_slopes)
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
    qk_scale, cap_log2, slopes, softcapped, alibi = _score_args(scale, softcap, alibi_slopes, q)
    common = dict(HEAD_DIM=head_dim, D_PAD=d_pad, BIAS_KIND=bias_kind, IS_CAUSAL=bool(is_causal),
                  SOFTCAP=softcapped, ALIBI=alibi)

    def grid_dkdv(meta):
        return (cdiv(len_k, meta["BLOCK_N"]), batch * kv_heads)

    launch_tuned(
        _flash_attention_bwd_dkdv_kernel, grid_dkdv,
        q, k, v, bias_arg, slopes, grad_out, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        heads, kv_heads, len_q, len_k, heads // kv_heads, qk_scale, cap_log2, float(scale), seq_bucket,
        **common,
    )

    def grid_dq(meta):
        return (cdiv(len_q, meta["BLOCK_M"]), batch * heads)

    launch_tuned(
        _flash_attention_bwd_dq_kernel, grid_dq,
        q, k, v, bias_arg, slopes, grad_out, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides,
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        heads, len_q, len_k, heads // kv_heads, qk_scale, cap_log2, float(scale), seq_bucket,
        **common,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (no gradient for the bias or the slopes)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, is_causal, softcap=0.0, alibi_slopes=None):
        out, lse = flash_attention_forward(q, k, v, bias, scale=scale, is_causal=is_causal, softcap=softcap,
                                           alibi_slopes=alibi_slopes)
        ctx.save_for_backward(q, k, v, bias, out, lse, alibi_slopes)
        ctx.scale, ctx.is_causal, ctx.softcap = scale, is_causal, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse, slopes = ctx.saved_tensors
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[7]:
            raise NotImplementedError("flash_attention: the gradient with respect to `bias` or `alibi_slopes` is not "
                                      "computed; detach them or use reference_attention")
        dq, dk, dv = flash_attention_backward(grad_out, q, k, v, bias, out, lse, scale=ctx.scale, is_causal=ctx.is_causal,
                                              softcap=ctx.softcap, alibi_slopes=slopes)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q, k, v, bias=None, *, scale=None, is_causal=False, softcap=0.0, alibi_slopes=None):
    """Flash attention with autograd. scale defaults to 1/sqrt(D); see the module docstring."""
    _check(q, k, v, bias, "flash_attention", None, softcap, alibi_slopes)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return FlashAttentionFunction.apply(q, k, v, bias, float(scale), bool(is_causal), float(softcap), alibi_slopes)
