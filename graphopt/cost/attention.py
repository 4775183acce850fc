"""Cost model of the attention family beside the roofline formulas in graphopt.cost_model (naive
attention, SDPA's backends, the fused and decode kernels): the estimate of graphopt's Triton
flash-attention kernel, and the key of the measured attention table that `graphopt calibrate`
writes and the attention pass reads at compile time."""

from __future__ import annotations

from graphopt import cost_model


def estimate_flash_attention(hw, batch, heads, len_q, len_k, head_dim, *, kv_heads=None, causal=False,
                             dtype_bytes=2, has_mask=False):
    """Roofline estimate of the forward kernel of graphopt.kernels.flash_attention (cost-model
    family `triton_flash`)."""
    return cost_model.fused_attention(hw, batch, heads, len_q, len_k, head_dim, family="triton_flash", causal=causal,
                                      dtype_bytes=dtype_bytes, has_mask=has_mask, kv_heads=kv_heads,
                                      name="Triton flash attention")


def attention_key(b, h, hkv, lq, lk, d, dt, is_causal: bool, bias_kind: str) -> str:
    """Key of the measured table (`graphopt calibrate`)."""
    return cost_model.shape_key(b, h, hkv, lq, lk, d, str(dt).replace("torch.", ""), "causal" if is_causal else "full", bias_kind)


__all__ = ["attention_key", "estimate_flash_attention"]
