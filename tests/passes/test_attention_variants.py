"""Soft-capped scores (Gemma 2's cap * tanh(s / cap)) and ALiBi through the attention pass: on a
GPU target the Triton kernel takes both (here its op runs its CPU body, the torch reference, and
the kernel itself is tested in tests/kernels/test_flash_attention_variants.py); on the CPU, SDPA
takes ALiBi as a bias and declines soft-capping with the reason."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import compiler as backend_module
from tests.conftest import tf32_allowed

B, H, L, D = 2, 4, 11, 16
CAP = 5.0


@pytest.fixture
def tf32():
    """The Triton kernel takes fp32 through TF32, which the lossless pass uses only when allowed."""
    with tf32_allowed():
        yield


def qkv(seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g) * (scale if i < 2 else 1) for i in range(3)]


class SoftCapped(nn.Module):
    """Gemma 2's eager attention: scale, cap * tanh(s / cap), then the causal mask."""

    def __init__(self, mask_before_cap=False):
        super().__init__()
        self.mask_before_cap = mask_before_cap
        self.register_buffer("causal", torch.full((L, L), float("-inf")).triu(1))

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        if self.mask_before_cap:
            scores = scores + self.causal
        scores = torch.tanh(scores / CAP) * CAP
        if not self.mask_before_cap:
            scores = scores + self.causal
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _slopes(heads):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


class MptAlibi(nn.Module):
    """MPT's ALiBi: a constant (1, H, 1, L) buffer slope * (j - L + 1), plus a causal mask."""

    def __init__(self):
        super().__init__()
        positions = torch.arange(1 - L, 1, dtype=torch.float32).view(1, 1, 1, L)
        self.register_buffer("alibi", positions * _slopes(H).view(1, H, 1, 1))

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(D) + self.alibi
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)
        return scores.masked_fill(causal, float("-inf")).softmax(-1) @ v


def _explain(module, *inputs, **options):
    options.setdefault("downstream", "eager")
    report = graphopt.explain(module, *inputs, **options)
    with torch.no_grad():
        expected = module(*inputs)
    return report, [d for d in report.decisions if d.pass_name == "attention"], expected


def test_soft_capped_attention_on_a_gpu_target_goes_to_the_triton_kernel(tf32):
    report, (d,), expected = _explain(SoftCapped(), *qkv(), target="h100", graph_replay=True)
    assert d.applied and d.implementation == "triton", d.reason
    assert d.details["softcap"] == CAP and d.details["is_causal"] and d.details["bias"] == "none"
    torch.testing.assert_close(report.output, expected, atol=1e-5, rtol=1e-4)


def test_soft_capped_attention_gradients(tf32):
    module = SoftCapped()
    eager_inputs = [t.requires_grad_() for t in qkv()]
    compiled_inputs = [t.detach().clone().requires_grad_() for t in eager_inputs]
    with backend_module.recording_decisions(reset=True) as decisions:
        out = torch.compile(copy.deepcopy(module), backend="graphopt",
                            options={"downstream": "eager", "target": "h100", "graph_replay": True})(*compiled_inputs)
    assert [d.applied for d in decisions if d.pass_name == "attention"] == [True]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    (module(*eager_inputs) * weights).sum().backward()
    for got, want in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)


def test_soft_capped_attention_on_the_cpu_is_declined_with_the_reason():
    report, (d,), expected = _explain(SoftCapped(), *qkv(), target="cpu")
    assert not d.applied and "SDPA has no soft-capping" in d.reason
    torch.testing.assert_close(report.output, expected)


def test_a_mask_added_before_the_soft_capping_is_declined(tf32):
    report, (d,), expected = _explain(SoftCapped(mask_before_cap=True), *qkv(), target="h100", graph_replay=True)
    assert not d.applied and "before their soft-capping" in d.reason
    torch.testing.assert_close(report.output, expected)


def test_constant_alibi_becomes_the_kernels_alibi_on_a_gpu_target(tf32):
    report, (d,), expected = _explain(MptAlibi(), *qkv(scale=1.0), target="h100", graph_replay=True)
    assert d.applied and d.implementation == "triton" and d.details["alibi"], d.reason
    assert d.details["bias"] == "none" and d.details["is_causal"]
    torch.testing.assert_close(report.output, expected, atol=1e-5, rtol=1e-4)


def test_constant_alibi_stays_a_bias_for_sdpa():
    report, (d,), expected = _explain(MptAlibi(), *qkv(scale=1.0), target="cpu")
    assert d.applied and not d.details["alibi"] and d.details["bias"] == "float"
    torch.testing.assert_close(report.output, expected, atol=1e-5, rtol=1e-4)


def test_a_bias_that_is_not_alibi_stays_a_bias(tf32):
    module = MptAlibi()
    module.alibi[0, 1, 0, 3] += 0.5  # one entry off the line
    report, (d,), expected = _explain(module, *qkv(scale=1.0), target="h100", graph_replay=True)
    assert d.applied and not d.details["alibi"] and d.details["bias"] == "float"
    torch.testing.assert_close(report.output, expected, atol=1e-5, rtol=1e-4)


def test_sparse_attention_declines_soft_capped_attention(tf32):
    report, _, expected = _explain(SoftCapped(), *qkv(), target="h100", graph_replay=True,
                                   passes={"sparse_attention": True})
    (sparse,) = report.declined("sparse_attention")
    assert "soft-capped" in sparse.reason
    assert report.counts["attention"] == 1
    torch.testing.assert_close(report.output, expected, atol=1e-5, rtol=1e-4)
