"""Triton flash attention (graphopt/kernels/flash_attention/) against a float64 reference.

On CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) with one small block
configuration (BLOCK_M 32 / BLOCK_N 16 forward), so lengths like 37 or 45 cover full blocks, partial
blocks and, with causal, diagonal blocks. bfloat16 is not run here: the interpreter's tl.dot
misreads bfloat16 operands (triton 3.9); bench/bench_attention.py checks bf16 on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from graphopt.kernels import flash_attention as fa
from graphopt.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    reference_attention,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp32 runs through TF32 dots on a GPU (~1e-3 relative); the interpreter is exact to ~1e-6. A wrong
# mask, scale or block bound shows up as errors of 0.1 and more.
OUT_TOL = {torch.float32: 5e-3, torch.float16: 1e-2}
GRAD_TOL = {torch.float32: 2e-2, torch.float16: 3e-2}


def _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed=0, qk_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, len_q, head_dim, generator=gen) * qk_scale
    k = torch.randn(batch, kv_heads, len_k, head_dim, generator=gen) * qk_scale
    v = torch.randn(batch, kv_heads, len_k, head_dim, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def _reference_grads(q, k, v, bias, grad_out, scale, is_causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q64, k64, v64, bias, scale=scale, is_causal=is_causal)
    out.backward(grad_out.double())
    return q64.grad, k64.grad, v64.grad


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# (batch, heads, kv_heads, Lq, Lk, head_dim, causal, dtype)
CASES = {
    "odd-noncausal": (1, 2, 2, 37, 37, 64, False, torch.float32),
    "odd-causal": (1, 2, 2, 37, 37, 64, True, torch.float32),
    "gqa-causal-lq<lk-fp16": (1, 4, 2, 19, 45, 64, True, torch.float16),
    "causal-lq>lk": (1, 2, 1, 45, 19, 64, True, torch.float32),
    "d128-gqa4-noncausal": (1, 4, 1, 33, 70, 128, False, torch.float32),
    "d40-padded-fp16": (2, 2, 2, 37, 37, 40, False, torch.float16),
    "d8-padded-causal": (1, 1, 1, 20, 20, 8, True, torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_float64_reference(case):
    batch, heads, kv_heads, len_q, len_k, head_dim, causal, dtype = CASES[case]
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype)
    scale = head_dim ** -0.5
    out, lse = flash_attention_forward(q, k, v, scale=scale, is_causal=causal)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), scale=scale, is_causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, heads, len_q) and lse.dtype == torch.float32
    _close(out, ref, OUT_TOL[dtype], "out")
    _close(lse, ref_lse, OUT_TOL[dtype], "lse (natural log)")


@pytest.mark.parametrize("case", list(CASES))
def test_backward_matches_float64_reference(case):
    batch, heads, kv_heads, len_q, len_k, head_dim, causal, dtype = CASES[case]
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed=1)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    out, lse = flash_attention_forward(q, k, v, scale=scale, is_causal=causal)
    dq, dk, dv = flash_attention_backward(grad_out, q, k, v, None, out, lse, scale=scale, is_causal=causal)
    ref_dq, ref_dk, ref_dv = _reference_grads(q, k, v, None, grad_out, scale, causal)
    assert dk.shape == k.shape and dv.shape == v.shape  # summed over the GQA group
    for name, got, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        _close(got, ref, GRAD_TOL[dtype], name)


def _bias(kind, batch, heads, len_q, len_k, dtype):
    gen = torch.Generator().manual_seed(3)
    if kind == "bool-padding-(B,1,1,Lk)":
        mask = torch.ones(batch, 1, 1, len_k, dtype=torch.bool)
        mask[0, ..., -7:] = False  # padded keys of sample 0
        mask[1, ..., :3] = False  # left padding of sample 1
        return mask.to(DEVICE)
    if kind == "bool-(Lq,Lk)":
        return (torch.rand(len_q, len_k, generator=gen) > 0.3).to(DEVICE)
    if kind == "additive-(1,H,Lq,Lk)":
        return torch.randn(1, heads, len_q, len_k, generator=gen).to(DEVICE, dtype)
    if kind == "additive-(B,1,1,Lk)":
        return torch.randn(batch, 1, 1, len_k, generator=gen).to(DEVICE, dtype)
    if kind == "hf-causal-min-(1,1,Lq,Lk)":  # transformers-style additive mask with finfo.min
        upper = torch.ones(len_q, len_k, dtype=torch.bool).triu(1)
        return torch.zeros(1, 1, len_q, len_k).masked_fill(upper, torch.finfo(dtype).min).to(DEVICE, dtype)
    raise ValueError(kind)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("kind,dtype", [
    ("bool-padding-(B,1,1,Lk)", torch.float32),
    ("bool-(Lq,Lk)", torch.float16),
    ("additive-(1,H,Lq,Lk)", torch.float32),
    ("additive-(B,1,1,Lk)", torch.float16),
    ("hf-causal-min-(1,1,Lq,Lk)", torch.float32),
])
def test_bias_and_mask_with_broadcasting(kind, dtype, causal):
    batch, heads, kv_heads, len_q, len_k, head_dim = 2, 4, 2, 37, 45, 64
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed=4)
    bias = _bias(kind, batch, heads, len_q, len_k, dtype)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    scale = 0.125
    out, lse = flash_attention_forward(q, k, v, bias, scale=scale, is_causal=causal)
    ref = reference_attention(q.double(), k.double(), v.double(), bias, scale=scale, is_causal=causal)
    _close(out, ref, OUT_TOL[dtype], "out")
    dq, dk, dv = flash_attention_backward(grad_out, q, k, v, bias, out, lse, scale=scale, is_causal=causal)
    for name, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), _reference_grads(q, k, v, bias, grad_out, scale, causal)):
        _close(got, expected, GRAD_TOL[dtype], name)


def test_fully_masked_rows_give_zero_output_and_finite_gradients():
    q, k, v = _qkv(1, 2, 2, 21, 37, 64, torch.float32, seed=6)
    mask = torch.rand(1, 2, 21, 37, generator=torch.Generator().manual_seed(7)) > 0.5
    mask[0, 0, 3] = False  # row 3 of head 0 attends nothing
    mask[0, 1, 20] = False
    mask = mask.to(DEVICE)
    out, lse = flash_attention_forward(q, k, v, mask, scale=0.125, is_causal=False)
    assert torch.all(out[0, 0, 3] == 0) and torch.all(out[0, 1, 20] == 0)
    assert lse[0, 0, 3] == float("-inf") and lse[0, 1, 20] == float("-inf")
    assert torch.isfinite(lse[0, 0, :3]).all()
    _close(out, reference_attention(q.double(), k.double(), v.double(), mask, scale=0.125, is_causal=False), OUT_TOL[torch.float32], "out")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    grads = flash_attention_backward(grad_out, q, k, v, mask, out, lse, scale=0.125, is_causal=False)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, mask, grad_out, 0.125, False)):
        assert torch.isfinite(got).all(), name
        _close(got, expected, GRAD_TOL[torch.float32], name)


def test_non_contiguous_inputs():
    """The pass hands over views: (B, L, H, D).transpose(1, 2) and a key with a non-unit last stride."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 29, 4, 64, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, L, D) view
    k = torch.randn(2, 2, 64, 29, generator=gen).to(DEVICE).transpose(-1, -2)  # stride(-1) != 1
    v = torch.randn(2, 29, 2, 64, generator=gen).to(DEVICE).transpose(1, 2)
    out, _ = flash_attention_forward(q, k, v, scale=0.125, is_causal=True)
    _close(out, reference_attention(q.double(), k.double(), v.double(), scale=0.125, is_causal=True), OUT_TOL[torch.float32], "out")


def test_autograd_function_matches_reference_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 23, 23, 64, torch.float32, seed=10))
    out = flash_attention(q, k, v, is_causal=True)  # default scale 1/sqrt(64)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = reference_attention(q.double(), k.double(), v.double(), scale=1 / math.sqrt(64), is_causal=True)
    _close(out.detach(), ref, OUT_TOL[torch.float32], "out")
    for name, got, expected in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, None, grad_out, 0.125, True)):
        _close(got, expected, GRAD_TOL[torch.float32], name)


def test_bias_requiring_grad_is_refused_in_backward():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 16, 16, 16, torch.float32, seed=12))
    bias = torch.randn(1, 1, 16, 16, device=DEVICE, requires_grad=True)
    out = flash_attention(q, k, v, bias)
    with pytest.raises(NotImplementedError, match="bias"):
        out.sum().backward()


def test_reference_follows_sdpa_conventions():
    """Top-left causal (also for Lq != Lk), GQA head grouping and bool masks mean what SDPA means."""
    q, k, v = (t.double() for t in _qkv(2, 4, 2, 9, 14, 16, torch.float32, seed=13))
    mask = (torch.rand(2, 1, 9, 14, generator=torch.Generator().manual_seed(14)) > 0.3).to(q.device)
    mask[..., 0] = True  # SDPA's math path gives NaN on fully masked rows; keep every row alive
    for kwargs in ({"is_causal": True}, {"is_causal": False, "attn_mask": mask}):
        ours = reference_attention(q, k, v, kwargs.get("attn_mask"), scale=0.3, is_causal=kwargs["is_causal"])
        sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True, **kwargs)
        torch.testing.assert_close(ours, sdpa)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(DEVICE, dtype)


NEGATIVE = {
    "float64": (lambda: (_t(1, 2, 8, 64, dtype=torch.float64),) * 3 + (None,), "dtype torch.float64 not supported"),
    "mixed dtypes": (lambda: (_t(1, 2, 8, 64), _t(1, 2, 8, 64, dtype=torch.float16), _t(1, 2, 8, 64), None),
                     "share one dtype"),
    "head dim 256": (lambda: (_t(1, 2, 8, 256),) * 3 + (None,), "head dim 256 not supported"),
    "heads not a multiple": (lambda: (_t(1, 3, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), None),
                             "multiple of key/value heads"),
    "value head dim differs": (lambda: (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 32), None), "same shape"),
    "3-D input": (lambda: (_t(2, 8, 64),) * 3 + (None,), "must be 4-D"),
    "bias not broadcastable": (lambda: (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 3, 8, 8)),
                               "does not broadcast"),
    "bias float64": (lambda: (_t(1, 2, 8, 64),) * 3 + (_t(8, 8, dtype=torch.float64),), "bias dtype"),
    "empty sequence": (lambda: (_t(1, 2, 0, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), None), "empty input"),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_supports_declines_with_a_clear_reason(case):
    build, expected = NEGATIVE[case]
    q, k, v, bias = build()
    ok, why = supports(q, k, v, bias)
    assert not ok and expected in why, why
    with pytest.raises(ValueError, match="flash_attention_forward: "):
        flash_attention_forward(q, k, v, bias, scale=1.0, is_causal=False)


def test_non_positive_scale_is_refused():
    q, k, v = _qkv(1, 1, 1, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="scale must be > 0"):
        flash_attention_forward(q, k, v, scale=-0.5, is_causal=False)


def test_supports_accepts_real_model_shapes():
    # LLaMA-7B (32 heads, D 128), Mistral GQA (32/8), GPT-2 (12 heads, D 64), MiniLM-style D 32, Phi D 80
    for heads, kv_heads, head_dim in ((32, 32, 128), (32, 8, 128), (12, 12, 64), (12, 12, 32), (32, 32, 80)):
        q, k = torch.empty(1, heads, 5, head_dim, device=DEVICE), torch.empty(1, kv_heads, 5, head_dim, device=DEVICE)
        assert supports(q, k, k, torch.ones(1, 1, 5, 5, dtype=torch.bool, device=DEVICE)) == (True, "ok")


def test_supports_needs_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(fa.reference, "_INTERPRET", False)
    q = torch.empty(1, 2, 8, 64)
    ok, why = supports(q, q, q)
    assert not ok and "CUDA device" in why


def test_prune_keeps_fp32_tiles_small():
    configs = [fa._config(128, 128, 8, 3), fa._config(64, 64, 4, 3), fa._config(64, 32, 4, 2)]
    kept = fa._prune(configs, {"q_ptr": torch.empty(1, dtype=torch.float32), "SEQ_BUCKET": 4096})
    assert [c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in kept] == [4096, 2048]
    kept = fa._prune(configs, {"q_ptr": torch.empty(1, dtype=torch.bfloat16), "SEQ_BUCKET": 4096})
    assert len(kept) == 3
