"""Attention with dropout active on its probabilities (training): the attention pass rewrites it to
SDPA with dropout_p (attention_dropout=True, the default), which draws another random mask than
eager from the same distribution. Judged over many seeds: the fraction of dropped probabilities
and the output's mean match eager's (and the theory), and the gradients are those of the mask the
call drew. With the option off, the attention is left as written and the decline says why."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt import compiler as backend_module

B, H, LQ, LK = 2, 2, 6, 8
P = 0.3
SEEDS = 300


def attention(q, k, v, bias):
    probs = torch.softmax(q @ k.transpose(-2, -1) * 0.5 + bias, dim=-1)
    return F.dropout(probs, p=P, training=True) @ v


def operands(device: str, seed: int = 0):
    """q, k, a float bias, and v = the identity over keys: the output is then the dropped-out
    probabilities themselves, P * mask / (1 - p)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, LQ, 16, generator=g), torch.randn(B, H, LK, 16, generator=g)
    bias = torch.randn(B, 1, LQ, LK, generator=g)
    v = torch.eye(LK).expand(B, H, LK, LK).contiguous()
    return [t.to(device) for t in (q, k, v, bias)]


def probabilities64(q, k, bias):
    return torch.softmax(q.double() @ k.double().transpose(-2, -1) * 0.5 + bias.double(), dim=-1)


def samples(fn, args, seeds=SEEDS) -> torch.Tensor:
    out = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        out.append(fn(*args).detach().double())
    return torch.stack(out)  # (seeds, B, H, LQ, LK)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_dropout_statistics_match_eager(device, downstream):
    args = operands(device)
    with backend_module.recording_decisions(reset=True) as decisions:
        compiled = torch.compile(attention, backend="graphopt", options={"downstream": downstream})
        ours = samples(compiled, args)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert d.applied and d.details["dropout_p"] == P, d.reason
    eager = samples(attention, args)
    probs = probabilities64(*args[:2], args[3])
    n = ours[..., 0].numel() * LK
    sigma = math.sqrt(P * (1 - P) / n)  # of a dropped fraction over n independent entries
    dropped = {name: float((s == 0).double().mean()) for name, s in (("graphopt", ours), ("eager", eager))}
    for name, fraction in dropped.items():
        assert abs(fraction - P) < 5 * sigma, (name, fraction)
    assert abs(dropped["graphopt"] - dropped["eager"]) < 5 * math.sqrt(2) * sigma, dropped
    # survivors are scaled by 1 / (1 - p): each entry is 0 or P / (1 - p)
    survivors = ours != 0
    expanded = (probs / (1 - P)).expand_as(ours)
    torch.testing.assert_close(ours[survivors], expanded[survivors], atol=1e-6, rtol=1e-5)
    # the output's mean over seeds is the probabilities (unbiased), as eager's is
    entry_sigma = probs * math.sqrt(P / (1 - P)) / math.sqrt(SEEDS)
    for name, s in (("graphopt", ours), ("eager", eager)):
        z = (s.mean(0) - probs) / entry_sigma
        assert float(z.abs().max()) < 5, (name, float(z.abs().max()))
    z = (ours.mean(0) - eager.mean(0)) / (math.sqrt(2) * entry_sigma)
    assert float(z.abs().max()) < 5.5


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_dropout_gradients_follow_the_mask_drawn(downstream):
    """d/dq, d/dk, d/dv, d/dbias of the compiled call equal float64 autograd of
    (softmax(scores) * mask / (1 - p)) @ v with the mask read off its output (v is the identity)."""
    q, k, v, bias = (t.requires_grad_(True) for t in operands("cpu", seed=3))
    weights = torch.randn(B, H, LQ, LK, generator=torch.Generator().manual_seed(9))
    compiled = torch.compile(attention, backend="graphopt", options={"downstream": downstream})
    for seed in range(3):
        torch.manual_seed(seed)
        out = compiled(q, k, v, bias)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v, bias))
        mask = (out != 0).double()
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]
        probs = torch.softmax(leaves[0] @ leaves[1].transpose(-2, -1) * 0.5 + leaves[3], dim=-1)
        ref = (probs * mask / (1 - P)) @ leaves[2]
        ref_grads = torch.autograd.grad((ref * weights.double()).sum(), leaves)
        assert 0.1 < float(1 - mask.mean()) < 0.5  # the call dropped some, not all
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_with_the_option_off_active_dropout_is_declined_and_left_as_written():
    args = operands("cpu")
    with backend_module.recording_decisions(reset=True) as decisions:
        compiled = torch.compile(attention, backend="graphopt",
                                 options={"downstream": "eager", "attention_dropout": False})
        torch.manual_seed(5)
        out = compiled(*args)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert not d.applied and "dropout active in training (p=0.3)" in d.reason and "attention_dropout" in d.reason
    torch.manual_seed(5)
    torch.testing.assert_close(out, attention(*args))  # the same dropout call, the same random stream


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="attention_dropout must be True or False"):
        graphopt.GraphOptConfig(attention_dropout="yes")
