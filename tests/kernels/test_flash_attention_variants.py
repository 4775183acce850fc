"""The flash-attention kernel's score variants against a float64 reference: logit soft-capping
(cap * tanh(s / cap), Gemma 2) and ALiBi (slope * (j - i), BLOOM / MPT), alone, together, with a
bias, causal and GQA; forward and backward. On CPU the kernels run under TRITON_INTERPRET=1 with
one small block configuration, so odd lengths cover full, partial and diagonal blocks."""

from __future__ import annotations

import math

import pytest
import torch

from graphopt.kernels.flash_attention import (
    alibi_bias,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    reference_attention,
    supports,
)

from tests.kernels.test_flash_attention import DEVICE, GRAD_TOL, OUT_TOL, _qkv


def _slopes(heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes, 2^(-8 i / H) (the BLOOM / MPT formula for a power-of-two H)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=DEVICE)


def _inputs(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed=0):
    return _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed, qk_scale=2.0)  # scores large enough to cap


# (batch, heads, kv_heads, Lq, Lk, head_dim, causal, softcap, alibi, bias, dtype)
CASES = {
    "softcap": (1, 2, 2, 37, 37, 64, False, 5.0, False, None, torch.float32),
    "softcap-causal-gqa": (1, 4, 2, 37, 45, 64, True, 5.0, False, None, torch.float32),
    "softcap-padding-mask-fp16": (2, 2, 2, 37, 37, 64, False, 30.0, False, "mask", torch.float16),
    "alibi": (1, 4, 4, 37, 37, 64, False, 0.0, True, None, torch.float32),
    "alibi-causal-gqa-fp16": (1, 4, 1, 45, 45, 64, True, 0.0, True, None, torch.float16),
    "alibi-additive-bias": (2, 2, 2, 19, 37, 40, False, 0.0, True, "float", torch.float32),
    "softcap-alibi-causal": (1, 2, 2, 33, 33, 32, True, 8.0, True, None, torch.float32),
    # a cap past the fixed shift's range and an additive bias: the soft-capped forward's running max
    "softcap-wide-cap": (1, 2, 2, 37, 37, 64, False, 70.0, False, None, torch.float32),
    "softcap-additive-bias": (1, 2, 2, 19, 37, 40, True, 6.0, False, "float", torch.float32),
}


def _bias(kind, batch, heads, len_q, len_k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "mask":  # (B, 1, 1, Lk) padding, key 0 always visible
        mask = torch.rand(batch, 1, 1, len_k, generator=gen) > 0.3
        mask[..., 0] = True
        return mask.to(DEVICE)
    if kind == "float":
        return torch.randn(1, heads, len_q, len_k, generator=gen).to(DEVICE)
    return None


def _case(name):
    batch, heads, kv_heads, len_q, len_k, head_dim, causal, softcap, alibi, bias, dtype = CASES[name]
    q, k, v = _inputs(batch, heads, kv_heads, len_q, len_k, head_dim, dtype)
    return (q, k, v, _bias(bias, batch, heads, len_q, len_k), dict(scale=head_dim ** -0.5, is_causal=causal,
                                                                   softcap=softcap, alibi_slopes=_slopes(heads) if alibi else None))


def _reference64(q, k, v, bias, options, return_lse=False):
    return reference_attention(q.double(), k.double(), v.double(), bias, return_lse=return_lse, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_float64_reference(name):
    q, k, v, bias, options = _case(name)
    out, lse = flash_attention_forward(q, k, v, bias, **options)
    ref, ref_lse = _reference64(q, k, v, bias, options, return_lse=True)
    tol = OUT_TOL[q.dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_float64_reference(name):
    q, k, v, bias, options = _case(name)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, q.dtype)
    out, lse = flash_attention_forward(q, k, v, bias, **options)
    grads = flash_attention_backward(grad_out, q, k, v, bias, out, lse, **options)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference_attention(*leaves, bias, **options).backward(grad_out.double())
    for got, want, what in zip(grads, (t.grad for t in leaves), "qkv"):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, atol=GRAD_TOL[q.dtype] * scale, rtol=GRAD_TOL[q.dtype],
                                   msg=lambda m: f"d{what}: {m}")


def test_each_soft_capped_forward_mode_is_exercised():
    """The soft-capped forward shifts by a constant where the scores are bounded (no additive
    bias, no ALiBi, cap * log2(e) within the shift's range, bf16 or fp32) and keeps a running max
    otherwise; the cases above cover both."""
    from graphopt.kernels.flash_attention.launchers import _forward_softcap_mode
    from graphopt.kernels.flash_attention.reference import BIAS_ADDITIVE, BIAS_BOOL, BIAS_NONE, LOG2E

    kinds = {None: BIAS_NONE, "mask": BIAS_BOOL, "float": BIAS_ADDITIVE}
    modes = {name: _forward_softcap_mode(bool(c[7]), c[7] * LOG2E, kinds[c[9]], c[8], c[10]) for name, c in CASES.items()}
    assert modes["softcap"] == modes["softcap-causal-gqa"] == 2
    assert modes["softcap-wide-cap"] == modes["softcap-additive-bias"] == modes["softcap-alibi-causal"] == 1
    assert modes["softcap-padding-mask-fp16"] == 1  # fp16 weights would flush below 2^-24
    assert modes["alibi"] == 0


@pytest.mark.parametrize("cap", [5.0, 63.0])
def test_soft_capped_rows_near_the_negative_cap_keep_their_weights(cap):
    """Every score of a row near -cap (query opposite to all keys): with the constant shift the
    weights are the smallest the forward makes (2^-120 at the widest cap it serves) and must not
    underflow; the row is then the mean of V, as in the reference."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(1, 1, 40, 32, generator=gen).abs() + 1.0
    q = -k[:, :, :9].mean(dim=2, keepdim=True).repeat(1, 1, 9, 1) * torch.linspace(50, 400, 9).view(1, 1, 9, 1)
    v = torch.randn(1, 1, 40, 32, generator=gen)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    options = dict(scale=1.0, is_causal=False, softcap=cap)
    out, lse = flash_attention_forward(q, k, v, **options)
    ref, ref_lse = _reference64(q, k, v, None, options, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, atol=OUT_TOL[torch.float32], rtol=OUT_TOL[torch.float32])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3 * cap, rtol=1e-4)


def test_the_variants_change_the_result():
    """The flags reach the kernel: soft-capped or ALiBi output differs from plain attention's."""
    q, k, v, bias, options = _case("softcap-alibi-causal")
    plain = flash_attention_forward(q, k, v, scale=options["scale"], is_causal=True)[0]
    for what in ({"softcap": options["softcap"]}, {"alibi_slopes": options["alibi_slopes"]}):
        varied = flash_attention_forward(q, k, v, scale=options["scale"], is_causal=True, **what)[0]
        assert float((varied - plain).abs().max()) > 1e-2, what


def test_autograd_function_with_both_variants():
    q, k, v, bias, options = _case("softcap-alibi-causal")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, **options).square().sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference_attention(*ref, **options).square().sum().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-2 * float(want.grad.abs().max()), rtol=2e-2)


def test_alibi_is_relative_position_times_slope():
    slopes = torch.tensor([0.5, 0.25])
    bias = alibi_bias(slopes, 3, 4)
    assert bias.shape == (2, 3, 4)
    assert bias[0, 2].tolist() == [-1.0, -0.5, 0.0, 0.5] and bias[1, 0].tolist() == [0.0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize("what, why", [
    ({"softcap": -1.0}, "softcap must be a finite number >= 0"),
    ({"softcap": math.inf}, "softcap must be a finite number >= 0"),
    ({"alibi_slopes": torch.ones(3)}, "alibi_slopes must be a (2,) tensor"),
])
def test_supports_declines_bad_variant_arguments(what, why):
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    ok, reason = supports(q, k, v, None, **{k_: (t.to(DEVICE) if torch.is_tensor(t) else t) for k_, t in what.items()})
    assert not ok and why in reason


_BUILD_SM90 = """
import sys
from bench.offline_sm90 import compile_sm90, sass_and_resources
from graphopt.kernels.flash_attention import kernels

variant = sys.argv[1]
fn = kernels._flash_attention_fwd_kernel.fn
consts = dict(HEAD_DIM=128, D_PAD=128, BIAS_KIND=0, IS_CAUSAL=False, SOFTCAP=2 if variant == "softcap" else 0,
              ALIBI=variant == "alibi", BLOCK_M=128, BLOCK_N=64)
types = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
types.update(lse_ptr="*fp32", alibi_ptr="*fp32", qk_scale="fp32", cap_log2="fp32")
div16 = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("stride_") and not n.endswith("b"))]
sass, resources = sass_and_resources(compile_sm90(fn, types, consts, div16, 8, 3))
print("MUFU.TANH" in sass, sass.count("LDG"), resources)
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["softcap", "alibi"])
def test_variants_build_for_sm90(variant):
    """The GPU build of the forward kernel, offline (outside the interpreter, in a subprocess):
    soft-capping takes the hardware tanh (tanh.approx.f32, which the interpreter cannot run), and
    ALiBi reads nothing per tile (as many global loads as the plain kernel, plus its slope)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = {}
    for name in ("plain", variant):
        run = subprocess.run([sys.executable, "-c", _BUILD_SM90, name], capture_output=True, text=True, timeout=300,
                             env=env, cwd=Path(__file__).resolve().parents[2])
        assert run.returncode == 0, run.stderr[-2000:]
        tanh, loads, _ = run.stdout.split()[:3]
        results[name] = (tanh == "True", int(loads))
    assert results[variant][0] == (variant == "softcap")
    assert results[variant][1] <= results["plain"][1] + (1 if variant == "alibi" else 0)
