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
