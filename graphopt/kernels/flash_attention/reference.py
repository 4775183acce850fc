"""The flash-attention kernel family's plain-torch reference, and what the Triton kernel handles
(`supports`): the contract the kernels are tested against."""

from __future__ import annotations

import importlib.util
import math

import torch

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import INTERPRET as _INTERPRET  # fixed at import, as Triton reads it

HAS_TRITON = importlib.util.find_spec("triton") is not None  # a hard dependency on Linux

MAX_HEAD_DIM = 128
MAX_GRID_Y = 65535  # CUDA limit of the second grid dimension, which holds batch * heads in the backward
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_BIAS_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# How the kernel reads `bias` (a constexpr: each kind is its own compiled kernel).
BIAS_NONE, BIAS_ADDITIVE, BIAS_BOOL = 0, 1, 2




def alibi_bias(slopes: torch.Tensor, len_q: int, len_k: int) -> torch.Tensor:
    """ALiBi as the kernel applies it: slopes[h] * (j - i) for query i, key j; (H, Lq, Lk) float32.
    Per query row it differs from BLOOM's slopes * j and MPT's slopes * (j - Lk + 1) by a constant,
    which softmax ignores."""
    i = torch.arange(len_q, device=slopes.device, dtype=torch.float32)[:, None]
    j = torch.arange(len_k, device=slopes.device, dtype=torch.float32)[None, :]
    return slopes.float()[:, None, None] * (j - i)


# =============================================================================================
# Reference (plain torch)
# =============================================================================================
def reference_attention(q, k, v, bias=None, *, scale, is_causal, return_lse=False, softcap=0.0, alibi_slopes=None):
    """softmax(s + bias) @ v with s = q @ k^T * scale, soft-capped to softcap * tanh(s / softcap)
    when softcap > 0, plus ALiBi (alibi_bias) when slopes are given; materializes the scores.

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
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, len_q, len_k).to(compute)
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
def supports(q, k, v, bias=None, *, softcap=0.0, alibi_slopes=None) -> tuple[bool, str]:
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
    if not (isinstance(softcap, (int, float)) and 0 <= softcap < math.inf):
        return False, f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}"
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (heads,):
            return False, f"alibi_slopes must be a ({heads},) tensor, one slope per query head"
        if alibi_slopes.device != q.device or not alibi_slopes.is_floating_point():
            return False, f"alibi_slopes must be floating point on {q.device}"
    return True, "ok"


def _check(q, k, v, bias, where: str, scale=None, softcap=0.0, alibi_slopes=None) -> None:
    ok, why = supports(q, k, v, bias, softcap=softcap, alibi_slopes=alibi_slopes)
    if not ok:
        raise ValueError(f"{where}: {why}")
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"{where}: scale must be > 0 (the running max is taken before scaling), got {scale}")
