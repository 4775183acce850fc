"""The attention pass on forms that look like attention but are not what the op computes: each is
left as written (with a reason) and computes what eager does. Shared helpers: test_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from tests.passes.test_attention import L, PlainAttention, compile_and_compare, qkv


class WrittenBetweenScoresAndOutput(nn.Module):
    """A key buffer or an additive mask written in place after the model read it and before the
    PV matmul: the fused op (at the PV matmul) would read the new values."""

    def __init__(self, what="key"):
        super().__init__()
        self.what = what

    def forward(self, q, k, v):
        keys = k.clone()
        bias = torch.zeros(L, L, dtype=q.dtype)
        s = (q @ keys.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias
        p = torch.softmax(s, dim=-1)
        if self.what == "key":
            keys.mul_(5.0)
        else:
            bias.fill_(-1e4)
        return p @ v


@pytest.mark.parametrize("what", ["key", "mask"])
def test_a_write_between_the_scores_and_the_output_stops_the_rewrite(what):
    (d,) = compile_and_compare(WrittenBetweenScoresAndOutput(what), *qkv(), count=0)
    assert "writes a tensor in place inside the attention" in d.reason


def _scores(q, k):
    return q @ k.transpose(-2, -1)


class FloorDividedScores(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(torch.div(_scores(q, k), 2.0, rounding_mode="floor"), -1) @ v


class BiasAddedWithAlphaZero(nn.Module):
    def forward(self, q, k, v):
        bias = torch.arange(L * L, dtype=q.dtype).reshape(L, L) / (L * L)
        return torch.softmax(torch.add(_scores(q, k) * 0.25, bias, alpha=0), -1) @ v


class SharedQueriesOverABatch(nn.Module):
    """q of batch 1 against k and v of batch B (learned queries shared by the batch)."""

    def forward(self, q, k, v):
        return torch.softmax(_scores(q[:1], k) * 0.25, -1) @ v


class ValueWithOneHead(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v[:, :1])


@pytest.mark.parametrize("module", [FloorDividedScores(), BiasAddedWithAlphaZero(), SharedQueriesOverABatch(),
                                    ValueWithOneHead()], ids=lambda m: type(m).__name__)
def test_forms_the_op_does_not_compute_are_left_alone(module):
    q, k, v = qkv()
    (d,) = compile_and_compare(module, q * 3, k * 3, v, count=0, force=True)
    assert d.reason


def test_a_float64_mask_fill_of_finfo_min_is_kept_in_float64():
    """BLOOM's masked_fill with torch.finfo(float64).min on a float64 model: the rewrite's bias
    must not pass through float32, where that fill overflows."""
    class Float64Fill(nn.Module):
        def forward(self, q, k, v):
            keep = torch.ones(L, L, dtype=torch.bool).tril(1)  # off by one: a mask, not causal
            s = torch.where(keep, _scores(q, k) * q.shape[-1] ** -0.5, torch.finfo(q.dtype).min)
            return s.softmax(-1) @ v

    compile_and_compare(Float64Fill(), *qkv(dtype=torch.float64), count=1)


def test_sparse_attention_declines_keys_and_values_broadcast_over_the_batch():
    q, k, v = qkv(lq=48, lk=48, d=32)
    model = PlainAttention()
    report = graphopt.explain(model, q, k[:1], v[:1], passes={"attention": True, "sparse_attention": True},
                              force=True, downstream="eager")
    assert not report.counts.get("sparse_attention")
    with torch.no_grad():
        torch.testing.assert_close(report.output, model(q, k[:1], v[:1]))


class WiderBias(nn.Module):
    """Half-precision scores plus a bias in a wider dtype: eager's type promotion adds it, and takes
    the softmax, in the wider dtype."""

    def forward(self, q, k, v, bias):
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias
        return torch.softmax(s, dim=-1).to(v.dtype) @ v


def _wider_bias_errors(q, k, v, bias, **options):
    def reference(*tensors):
        return WiderBias()(*(t.double() for t in tensors))

    torch._dynamo.reset()
    with torch.no_grad():
        eager = WiderBias()(q, k, v, bias)
        compiled = torch.compile(WiderBias(), backend=graphopt.backend(**options))(q, k, v, bias)
    ref = reference(q, k, v, bias)
    decisions = graphopt.explain(WiderBias(), q, k, v, bias, **options).decisions
    return (eager.double() - ref).abs().max().item(), (compiled.double() - ref).abs().max().item(), decisions


@pytest.mark.parametrize("dt,offset", [(torch.bfloat16, 0.0), (torch.bfloat16, 300.0), (torch.float16, 1e5)])
def test_a_float32_bias_on_half_precision_scores_is_added_in_float32(dt, offset):
    """An ALiBi-like float32 bias (plus a large offset: one that bf16 rounds by more than the scores'
    spread, or past fp16's range): the rewrite keeps it in float32, as eager does, instead of rounding it
    to q's dtype."""
    gen = torch.Generator().manual_seed(3)
    heads, length = 4, 96
    q, k, v = (torch.randn(1, heads, length, 32, generator=gen).to(dt) for _ in range(3))
    slopes = torch.tensor([0.0371, 0.0193, 0.0073, 0.0517])
    bias = (slopes[:, None] * torch.arange(length).float()).reshape(1, heads, 1, length)
    bias = bias + offset + torch.randn(1, heads, length, length, generator=gen)
    eager_err, err, decisions = _wider_bias_errors(q, k, v, bias)
    assert [d.applied for d in decisions if d.pass_name == "attention"] == [True]
    assert err <= 1.5 * eager_err, (err, eager_err)


def test_a_float64_bias_on_float32_scores_is_left_as_written():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    bias = 1e5 + torch.randn(1, 2, 40, 40, generator=gen, dtype=torch.float64)
    eager_err, err, decisions = _wider_bias_errors(q, k, v, bias)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert not d.applied and "float64 mask to float32 scores" in d.reason
    assert err == eager_err


@pytest.mark.parametrize("rows", [64, 512])
def test_on_a_gpu_target_the_fused_sdpa_backends_do_not_take_a_wider_bias(rows):
    """SDPA's fused GPU backends take the mask in q's dtype: for a float32 bias on bf16 scores only the
    kernels that read it in float32 (graphopt's Triton kernels) are candidates; a bf16 bias goes to
    SDPA's backends as before."""
    q = torch.randn(1, 4, rows, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 64, 32, dtype=torch.bfloat16) for _ in range(2))
    wide = torch.randn(1, 4, rows, 64)

    def decision(bias):
        (d,) = [d for d in graphopt.explain(WiderBias(), q, k, v, bias, target="h100", graph_replay=True).decisions
                if d.pass_name == "attention"]
        return d

    d = decision(wide)
    assert not d.applied or d.implementation in ("triton", "triton_decode"), d.implementation
    for backend in ("cudnn", "efficient", "flash"):
        assert "would round it to bfloat16" in d.details.get("rejected", {backend: "would round it to bfloat16"})[backend]
    d = decision(wide.bfloat16())
    assert d.applied and "would round" not in str(d.details["rejected"]), d.details


class AliasBeforeUpdate(nn.Module):
    """An alias of the scores taken before an in-place mask update (a no-op cast, a view): in eager
    the alias sees the update."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1)
        alias = {"float": lambda: s.float(), "detach": lambda: s.detach(),
                 "narrow": lambda: s.narrow(-1, 0, s.shape[-1])}[self.kind]()
        s.masked_fill_(~keep, float("-inf"))
        return torch.softmax(alias * 0.125, -1) @ v


@pytest.mark.parametrize("kind", ["float", "detach", "narrow"])
def test_an_alias_taken_before_an_in_place_mask_update_sees_the_update(kind):
    q, k, v = qkv()
    keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(AliasBeforeUpdate(kind), backend=graphopt.backend())(q, k, v, keep)
    torch.testing.assert_close(got, AliasBeforeUpdate(kind)(q, k, v, keep))


class PromotingUpdate(nn.Module):
    """bf16 scores updated in place by a float32 bias (the in-place add keeps bf16), the probabilities
    also returned (so the attention is left as written)."""

    def forward(self, q, k, v, bias):
        s = q @ k.transpose(-2, -1)
        s.mul_(q.shape[-1] ** -0.5)
        s.add_(bias)
        p = torch.softmax(s, dim=-1)
        return p @ v, p


def test_an_in_place_update_that_would_promote_keeps_the_scores_dtype():
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(1, 1, 16, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(PromotingUpdate(), backend=graphopt.backend())(q, k, v, bias)
        want = PromotingUpdate()(q, k, v, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
