"""nn.MultiheadAttention through the attention pass: its F.multi_head_attention_forward call is
written out and its attention rewritten where the attention weights are not read, with every mask
form it takes; outputs (and gradients) equal eager's. The calls it cannot write out keep their
node, with the reason recorded."""

from __future__ import annotations

import copy

import pytest
import torch

import graphopt
from graphopt import compiler as backend_module

E, HEADS, N, L, S = 32, 4, 2, 5, 7


def _inputs(cross: bool, batch_first: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, L, E, generator=g)
    y = torch.randn(N, S, E, generator=g) if cross else x
    return (x, y) if batch_first else (x.transpose(0, 1), y.transpose(0, 1))


def _masks(kind: str, source_len: int):
    g = torch.Generator().manual_seed(3)
    attn_mask = padding = None
    if kind in ("bool", "both"):
        attn_mask = torch.rand(L, source_len, generator=g) > 0.7  # True hides
        attn_mask[:, 0] = False
    if kind == "float_3d":
        attn_mask = torch.randn(N * HEADS, L, source_len, generator=g)
    if kind in ("padding", "both"):
        padding = torch.zeros(N, source_len, dtype=torch.bool)
        padding[1, -2:] = True
    if kind == "float_padding":
        padding = torch.zeros(N, source_len)
        padding[0, -3:] = -1e4
    return attn_mask, padding


class Attend(torch.nn.Module):
    def __init__(self, mha, attn_mask, padding, need_weights=True, return_weights=False):
        super().__init__()
        self.mha, self.attn_mask, self.padding = mha, attn_mask, padding
        self.need_weights, self.return_weights = need_weights, return_weights

    def forward(self, x, y):
        out, weights = self.mha(x, y, y, attn_mask=self.attn_mask, key_padding_mask=self.padding,
                                need_weights=self.need_weights)
        return (out, weights) if self.return_weights else out


@pytest.mark.parametrize("masks", ["none", "bool", "float_3d", "padding", "float_padding", "both"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "length_first"])
def test_multihead_attention_is_rewritten(batch_first, cross, masks):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=batch_first).eval()
    x, y = _inputs(cross, batch_first)
    module = Attend(mha, *_masks(masks, S if cross else L))
    report = graphopt.explain(module, x, y, downstream="eager")
    (d,) = [d for d in report.decisions if d.pass_name == "attention"]
    assert d.applied and d.location == "mha", d.reason
    with torch.no_grad():
        torch.testing.assert_close(report.output, module(x, y), atol=1e-5, rtol=1e-4)


class CrossAttend(torch.nn.Module):
    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def forward(self, x, k, v):
        return self.mha(x, k, v)[0]


def test_separate_projection_weights_and_dynamic_lengths():
    torch.manual_seed(0)
    module = CrossAttend(torch.nn.MultiheadAttention(E, HEADS, kdim=24, vdim=16, batch_first=True).eval())
    with backend_module.recording_decisions(reset=True) as decisions, torch.no_grad():
        compiled = torch.compile(module, backend="graphopt", options={"downstream": "eager"}, dynamic=True)
        for length in (5, 9):
            g = torch.Generator().manual_seed(length)
            x, k = torch.randn(N, length, E, generator=g), torch.randn(N, length + 2, 24, generator=g)
            v = torch.randn(N, length + 2, 16, generator=g)
            torch.testing.assert_close(compiled(x, k, v), module(x, k, v), atol=1e-5, rtol=1e-4)
    assert [d.applied for d in decisions if d.pass_name == "attention"] == [True]  # one graph, every length


def test_training_gradients_match():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True).train()  # dropout 0
    x, y = _inputs(True, True)
    eager, compiled = Attend(copy.deepcopy(mha), *_masks("both", S)), Attend(copy.deepcopy(mha), *_masks("both", S))
    with backend_module.recording_decisions(reset=True) as decisions:
        out = torch.compile(compiled, backend="graphopt", options={"downstream": "eager"})(x, y)
    assert [d.applied for d in decisions if d.pass_name == "attention"] == [True]
    out.square().sum().backward()
    expected = eager(x, y)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_training_dropout_becomes_sdpa_dropout():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, dropout=0.25, batch_first=True).train()
    x, y = _inputs(False, True)
    with backend_module.recording_decisions(reset=True) as decisions:
        out = torch.compile(Attend(mha, None, None), backend="graphopt", options={"downstream": "eager"})(x, y)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert d.applied and d.details["dropout_p"] == 0.25
    assert out.shape == (N, L, E) and torch.isfinite(out).all()


@pytest.mark.parametrize("how, reason", [
    ("weights_read", "attention weights are read"),
    ("bias_kv", "bias_k / bias_v"),
])
def test_calls_that_stay_as_written(how, reason):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True, add_bias_kv=how == "bias_kv").eval()
    x, y = _inputs(False, True)
    module = Attend(mha, None, None, return_weights=how == "weights_read")
    report = graphopt.explain(module, x, y, downstream="eager")
    (d,) = [d for d in report.decisions if d.pass_name == "attention"]
    assert not d.applied and reason in d.reason, d.reason
    with torch.no_grad():
        expected = module(x, y)
    for got, want in zip(report.output if isinstance(expected, tuple) else [report.output],
                         expected if isinstance(expected, tuple) else [expected]):
        torch.testing.assert_close(got, want)


def test_a_call_whose_attention_is_declined_stays_as_written():
    """With attention_dropout off, the written-out attention (dropout active) is declined: the
    written-out ops go again and the graph calls F.multi_head_attention_forward as before."""
    import torch.nn.functional as F

    from graphopt.passes import run_passes

    torch.manual_seed(0)
    module = Attend(torch.nn.MultiheadAttention(E, HEADS, dropout=0.25, batch_first=True).train(), None, None)
    x, y = _inputs(False, True)
    graphs, decisions = [], []

    def capture(gm, example_inputs):
        config = graphopt.GraphOptConfig(downstream="eager", attention_dropout=False)
        decisions.extend(run_passes(gm, example_inputs, config, graphopt.hardware.get_spec("cpu")).decisions)
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(4)
    out = torch.compile(module, backend=capture)(x, y)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert not d.applied and "dropout active in training" in d.reason
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert F.multi_head_attention_forward in targets and torch.softmax not in targets
    torch.manual_seed(4)
    torch.testing.assert_close(out, module(x, y))  # the same call, the same random stream
