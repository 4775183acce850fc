"""Sibling linears (several linears reading one input) fused into one 4-bit GEMM and a split
(graphopt.passes.fx_utils.sibling_groups / replace_siblings_with_call): what the callers of the
members see stays what eager gives them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import graphopt
from graphopt.compiler import recording_decisions
from graphopt.onnx_export import export_onnx


class ReturnedSiblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.q(x), self.k(x)


class StaticallyMerged(nn.Module):
    """Outputs viewed with the features merged into another dim, by static sizes."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        return self.q(x).view(b, t * 32), self.k(x).view(b * t, 16)


class SymbolicallyMerged(nn.Module):
    """Outputs viewed with the features merged into the token dim, by sizes read from the input
    (symbolic under dynamic shapes)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x):
        b = x.shape[0]
        return self.q(x).view(b, -1) + self.k(x).view(b, -1)


@pytest.mark.parametrize("pass_name", ["fp4_linear", "q4_linear"])
def test_siblings_returned_to_the_caller_are_contiguous(pass_name):
    """A member's value is a column slice of the fused output; one returned to the caller is made
    contiguous, as eager's linear output is (a caller's `.view(-1)` works)."""
    torch.manual_seed(0)
    model, x = ReturnedSiblings().eval(), torch.randn(2, 3, 64)
    with torch.no_grad(), recording_decisions() as decisions:
        outs = torch.compile(model, backend=graphopt.backend(passes={pass_name: True}, force=True))(x)
    assert [d.applied for d in decisions if d.pass_name == pass_name] == [True, True]
    for out, ref in zip(outs, model(x)):
        assert out.stride() == ref.stride() and out.is_contiguous()
        assert out.view(-1).shape == ref.view(-1).shape


@pytest.mark.parametrize("pass_name", ["fp4_linear", "q4_linear"])
def test_a_symbolic_view_merging_the_features_keeps_the_rewrites(pass_name):
    """Under dynamic shapes the view's sizes are symbolic: read at their hints, the merge is seen,
    the members run alone, and the compile keeps its rewrites instead of falling back."""
    torch.manual_seed(0)
    model = SymbolicallyMerged().eval()
    compiled = torch.compile(model, backend=graphopt.backend(passes={pass_name: True}, force=True), dynamic=True)
    with torch.no_grad(), recording_decisions() as decisions, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the unrewritten graph
        for tokens in (3, 5):
            x = torch.randn(2, tokens, 64)
            out = compiled(x)
            assert out.shape == model(x).shape
            assert (out - model(x)).abs().max() < 0.2 * model(x).abs().max()
    assert [d.applied for d in decisions if d.pass_name == pass_name] == [True, True], [d.reason for d in decisions]


def test_siblings_whose_output_is_viewed_across_rows_are_rewritten_alone(tmp_path):
    """A fused group's outputs are column slices of one tensor: a reader that views one with its
    features merged into another dim keeps that linear out of the group (each runs alone)."""
    model, x = StaticallyMerged().eval(), torch.randn(2, 3, 64)
    report = graphopt.explain(model, x, passes={"q4_linear": True}, force=True)
    assert report.counts["q4_linear"] == 2 and all(d.applied for d in report.decisions)
    export_onnx(model, (x,), tmp_path / "viewed.onnx", passes={"q4_linear": True}, force=True)
