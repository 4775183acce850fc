"""Every attention form of PyTorch's own test of Inductor's fused-attention rewrite
(test/inductor/test_fused_attention.py), written anew here and compiled with
`backend="graphopt"` on the CPU in float32: each is rewritten (or, where Inductor must not rewrite
it either, left alone with the reason), its output equals eager's within 1e-4 relative, with the
batch dimension static and dynamic, and, where the form has no dropout, so do the gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from graphopt import compiler as backend_module

OPTIONS = {"passes": {"attention": True}, "force": True, "downstream": "eager", "target": "cpu"}
BHLD = (4, 2, 16, 32)  # (batch, heads, length, head dim), as PyTorch's test; some forms read (B, L, H, D)


def checkpointed(fn):
    def run(*args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)
    run.__name__ = f"checkpointed_{fn.__name__}"
    return run


# ---------------------------------------------------------------------------------------------
# The forms
# ---------------------------------------------------------------------------------------------
def scaled_div(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def scaled_mul(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def div_then_dropout(q, k, v, training):
    probs = torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def mul_then_dropout(q, k, v, training):
    probs = torch.matmul(q, k.transpose(-2, -1)).mul(0.4).softmax(dim=-1)
    return F.dropout(probs, p=0.2, inplace=False, training=training).matmul(v)


def _causal_additive(lq, lk, device):
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=0)
    return keep.masked_fill(torch.logical_not(keep), -float("inf"))  # True -> 1.0, hidden -> -inf


def causal_additive_mask(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + _causal_additive(q.size(-2), k.size(-2), q.device)
    return torch.softmax(scores, dim=-1) @ v


def all_false_bool_added(q, k, v):
    nothing = torch.zeros(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).bool()
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + nothing, dim=-1) @ v


def causal_additive_dropout(q, k, v, training):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + _causal_additive(q.size(-2), k.size(-2), q.device)
    return F.dropout(torch.softmax(scores, dim=-1), 0.5, training) @ v


def blhd_cast_tiny_dropout(query, key, value, training):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    probs = torch.dropout(torch.softmax(scores, dim=-1), 1e-11, training)
    return probs.to(query.dtype) @ v


def blhd_cast(query, key, value):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    return torch.softmax(scores, dim=-1).to(query.dtype) @ v


def blhd_prescaled_tiny_dropout(query, key, value, training):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    q = q / math.sqrt(q.size(-1))
    probs = torch.dropout(torch.softmax((q @ k.transpose(-2, -1)).to(torch.float32), dim=-1), 1e-11, training)
    return probs.to(query.dtype) @ v


def blhd_prescaled(query, key, value):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    q = q / math.sqrt(q.size(-1))
    return torch.softmax((q @ k.transpose(-2, -1)).to(torch.float32), dim=-1).to(query.dtype) @ v


def tensor_scale_factor(q, k, v, factor, divide):
    scores = torch.matmul(q, k.transpose(-2, -1))
    factor = factor.detach()
    scores = scores.div(factor) if divide else scores.mul(factor)
    return scores.softmax(dim=-1).matmul(v)


def additive_mask(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def blhd_transposed(query, key, value):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(key.shape[-1])).softmax(dim=-1).matmul(v)


def blhd_dropout_on_output(query, key, value, training):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(key.shape[-1])).softmax(dim=-1).matmul(v)
    return F.dropout(out, p=0.4, training=training, inplace=False)


def div_clone(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def mul_clone(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def blhd_clone(query, key, value):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(key.shape[-1])).softmax(dim=-1).clone().matmul(v)


def bmm_unscaled_dropout(q, k, v, training):
    probs = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(probs, p=0.5, training=training), v)


def blhd_causal_additive(query, key, value):
    mask = _causal_additive(query.size(1), key.size(1), query.device)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    return (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1).matmul(v)


def _padding_fill(q, k, scores):
    keep = torch.ones(q.size(0), k.size(-2), dtype=torch.bool, device=q.device).tril(diagonal=0)
    hidden = (keep == 0).view((q.size(0), 1, 1, k.size(-2))).expand_as(scores)
    return scores.masked_fill(hidden, -float("inf"))


def blhd_expand_as_mask(query, key, value):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    return torch.matmul(F.softmax(_padding_fill(q, k, scores), dim=-1), v)


def blhd_causal_additive_dropout(query, key, value, training):
    mask = _causal_additive(query.size(1), key.size(1), query.device)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    probs = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def blhd_random_float_mask_dropout(query, key, value, training):
    mask = torch.randn(query.size(1), key.size(1), dtype=torch.float, device=query.device).tril(diagonal=0)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    probs = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def blhd_expand_as_mask_dropout(query, key, value, training):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    probs = F.dropout(F.softmax(_padding_fill(q, k, scores), dim=-1), p=0.4, training=training, inplace=False)
    return torch.matmul(probs, v)


def gpt2_where_full_scale(query, key, value, causal):
    q, k, v = (t.permute([0, 2, 1, 3]) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores = scores.div(torch.full((), math.sqrt(v.size(-1)), dtype=q.dtype, device=q.device))
    lowest = torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
    scores = torch.where(causal, scores, lowest)
    return F.dropout(scores.softmax(dim=-1), 0.0).matmul(v), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])


def gpt2_where_plus_mask_dropout(q, k, v, causal, mask, training):
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores = scores.div(torch.full((), math.sqrt(v.size(-1)), dtype=scores.dtype, device=scores.device))
    lowest = torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
    scores = torch.where(causal, scores, lowest) + mask
    probs = scores.softmax(dim=-1).type(v.dtype)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def blhd_prescaled_expand_as_dropout(query, key, value, training):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q = q / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1))
    probs = F.dropout(F.softmax(_padding_fill(q, k, scores), dim=-1), p=0.4, training=training, inplace=False)
    return torch.matmul(probs, v)


def inplace_add_fp32_softmax(query, key, value, mask):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += mask
    return scores.float().softmax(dim=-1).type(v.dtype).matmul(v)


def inplace_add_returns_kv(query, key, value, mask):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += mask
    return scores.float().softmax(dim=-1).type(v.dtype).matmul(v), k, v


def inplace_add_zero_mask(query, key, value):
    zero = torch.full((1, 1, 1, query.size(1)), 0.0, device=query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += zero
    return scores.float().softmax(dim=-1).type(v.dtype).matmul(v), k, v


def bmm_views_around_mask(query, key, value, mask):
    b, h, length, d = query.shape
    q = query.view(b * h, length, d)
    k = key.reshape(b * h, length, d)
    v = value.reshape(b * h, length, d)
    scores = torch.bmm(q, k.transpose(1, 2)).view(b, h, length, length) + mask
    probs = F.softmax(scores.view(b * h, length, length), dim=-1)
    return torch.bmm(probs, v).view(b, h, length, d)


def inplace_add_dropout(query, key, value, mask, training):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += mask
    probs = F.dropout(scores.float().softmax(dim=-1).type(v.dtype), p=0.1, training=training)
    return probs.matmul(v)


def inplace_add_dropout_returns_kv(query, key, value, mask, training):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += mask
    probs = F.dropout(scores.float().softmax(dim=-1).type(v.dtype), p=0.1, training=training)
    return probs.matmul(v), k, v


def inplace_add_zero_mask_dropout(query, key, value, training):
    zero = torch.full((1, 1, 1, query.size(1)), 0.0, dtype=query.dtype, device=query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores += zero
    probs = F.dropout(scores.float().softmax(dim=-1).type(v.dtype), p=0.1, training=training)
    return probs.matmul(v), k, v


def add_method_in_place(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.size(-1) ** -0.5)
    scores.add_(mask)
    return scores.softmax(-1) @ v


def masked_fill_in_place(q, k, v, hidden):
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    scores.masked_fill_(hidden, float("-inf"))
    return scores.softmax(-1) @ v


def mask_added_into_in_place(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)
    mask = mask.clone()
    mask += scores  # the mask tensor is written, not the scores
    return mask.softmax(-1) @ v


def returns_probabilities(q, k, v):
    probs = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return probs.matmul(v), probs


def sdpa_with_expanded_scalar_mask(q, k, v, one):
    # an SDPA call whose mask is one padded, sliced value expanded over the heads (insignificant strides)
    mask = F.pad(one, (0, 7))[..., :1].expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---------------------------------------------------------------------------------------------
# The cases: inputs, and what graphopt must do
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    fn: Callable
    extra: Callable[[int, torch.Generator], list] = lambda b, g: []  # inputs after q, k, v (batch b)
    qkv_shape: tuple = BHLD
    rewritten: int = 1  # attention rewrites expected
    reason: str | None = None  # of the decline, when not rewritten
    dropout: bool = False  # takes a `training` flag; its dropout is active when True
    grads: bool = True  # compare gradients (forms without active dropout)
    batched_mask: bool = False  # the extra tensor inputs have the batch dim too (dynamic with q, k, v)
    options: dict = field(default_factory=dict)  # over OPTIONS
    notes: list = field(default_factory=list)


def _mask(*shape):
    return lambda b, g: [torch.randn(*[b if s == "B" else s for s in shape], generator=g)]


def _causal_bool(n):
    return lambda b, g: [torch.ones(n, n, dtype=torch.bool).tril(diagonal=0)]


CASES = {
    "1_div_sqrt_d": Case(scaled_div),
    "1_checkpointed": Case(checkpointed(scaled_div)),
    "2_mul_inverse_sqrt_d": Case(scaled_mul),
    "2_checkpointed": Case(checkpointed(scaled_mul)),
    "3_div_dropout": Case(div_then_dropout, dropout=True),
    "3_checkpointed": Case(checkpointed(div_then_dropout), dropout=True),
    "4_mul_dropout": Case(mul_then_dropout, dropout=True),
    "4_checkpointed": Case(checkpointed(mul_then_dropout), dropout=True),
    "5_causal_additive": Case(causal_additive_mask),
    "5_checkpointed": Case(checkpointed(causal_additive_mask)),
    "5_all_false_bool_added": Case(all_false_bool_added),
    "5_all_false_bool_checkpointed": Case(checkpointed(all_false_bool_added)),
    "6_causal_additive_dropout": Case(causal_additive_dropout, dropout=True),
    "6_checkpointed": Case(checkpointed(causal_additive_dropout), dropout=True),
    "7_permuted_cast_tiny_dropout": Case(blhd_cast_tiny_dropout, qkv_shape=(2, 8, 4, 16), dropout=True),
    "7_checkpointed": Case(checkpointed(blhd_cast_tiny_dropout), qkv_shape=(2, 8, 4, 16), dropout=True),
    "8_permuted_cast": Case(blhd_cast, qkv_shape=(2, 8, 4, 16)),
    "8_checkpointed": Case(checkpointed(blhd_cast), qkv_shape=(2, 8, 4, 16)),
    "9_prescaled_tiny_dropout": Case(blhd_prescaled_tiny_dropout, qkv_shape=(2, 8, 4, 16), dropout=True),
    "9_checkpointed": Case(checkpointed(blhd_prescaled_tiny_dropout), qkv_shape=(2, 8, 4, 16), dropout=True),
    "10_prescaled": Case(blhd_prescaled, qkv_shape=(2, 8, 4, 16)),
    "10_checkpointed": Case(checkpointed(blhd_prescaled), qkv_shape=(2, 8, 4, 16)),
    # Inductor must not rewrite these two either: a tensor-valued scale (one per batch row here)
    "tensor_factor_div": Case(tensor_scale_factor, extra=lambda b, g: [torch.randn(4, 1, 1, generator=g), True],
                              qkv_shape=(2, 4, 4, 4), rewritten=0, reason="multiplied by a non-constant"),
    "tensor_factor_mul": Case(tensor_scale_factor, extra=lambda b, g: [torch.randn(4, 1, 1, generator=g), False],
                              qkv_shape=(2, 4, 4, 4), rewritten=0, reason="multiplied by a non-constant"),
    # ... and masks Inductor leaves alone, which graphopt rewrites exactly: an int mask (cast to the
    # scores' dtype, as eager promotes it) and a float added to every score (no change to softmax)
    "int_mask": Case(additive_mask, extra=lambda b, g: [torch.randn(b, 4, 4, 4, generator=g).mul(3).to(torch.int)],
                     qkv_shape=(2, 4, 4, 4), batched_mask=True),
    "python_float_mask": Case(additive_mask, extra=lambda b, g: [2.0], qkv_shape=(2, 4, 4, 4)),
    "11_transposed": Case(blhd_transposed),
    "12_dropout_on_the_output": Case(blhd_dropout_on_output, dropout=True,
                                     notes=["dropout on the attention output, not the probabilities"]),
    "13_prev_clone": Case(div_clone),
    "13_prev_checkpointed": Case(checkpointed(div_clone)),
    "14_prev_mul_clone": Case(mul_clone),
    "14_prev_checkpointed": Case(checkpointed(mul_clone)),
    "15_prev_transposed_clone": Case(blhd_clone),
    "13_bmm_unscaled_dropout": Case(bmm_unscaled_dropout, qkv_shape=(4, 8, 16), dropout=True),
    "14_permuted_causal_additive": Case(blhd_causal_additive),
    "15_expand_as_mask": Case(blhd_expand_as_mask),
    "16_permuted_causal_dropout": Case(blhd_causal_additive_dropout, dropout=True),
    "16_batch_1": Case(blhd_causal_additive_dropout, qkv_shape=(1, 2, 16, 32), dropout=True),
    "16_random_float_mask": Case(blhd_random_float_mask_dropout, dropout=True),
    "16_random_float_mask_batch_1": Case(blhd_random_float_mask_dropout, qkv_shape=(1, 2, 16, 32), dropout=True),
    "17_expand_as_mask_dropout": Case(blhd_expand_as_mask_dropout, dropout=True),
    "18_gpt2_where": Case(gpt2_where_full_scale, extra=_causal_bool(2)),
    "18_gpt2_where_batch_1": Case(gpt2_where_full_scale, extra=_causal_bool(2), qkv_shape=(1, 2, 16, 32)),
    "19_where_plus_mask_dropout": Case(gpt2_where_plus_mask_dropout, dropout=True,
                                       extra=lambda b, g: [*_causal_bool(16)(b, g), torch.randn(16, 16, generator=g)]),
    "20_prescaled_expand_as_dropout": Case(blhd_prescaled_expand_as_dropout, dropout=True),
    "21_inplace_add": Case(inplace_add_fp32_softmax, extra=_mask(1, 1, 1, 2)),
    "21_inplace_add_batch_1": Case(inplace_add_fp32_softmax, extra=_mask(1, 1, 1, 2), qkv_shape=(1, 2, 16, 32)),
    "22_inplace_add_returns_kv": Case(inplace_add_returns_kv, extra=_mask(1, 1, 2, 2)),
    "22_batch_1": Case(inplace_add_returns_kv, extra=_mask(1, 1, 2, 2), qkv_shape=(1, 2, 16, 32)),
    "22_transposed_mask": Case(inplace_add_returns_kv, extra=lambda b, g: [_mask(1, 1, 2, 2)(b, g)[0].transpose(2, 3)]),
    "23_inplace_add_zero_mask": Case(inplace_add_zero_mask),
    "23_batch_1": Case(inplace_add_zero_mask, qkv_shape=(1, 2, 16, 32)),
    "24_bmm_views_around_mask": Case(bmm_views_around_mask, extra=_mask(1, 1, 16, 16)),
    "25_inplace_add_dropout": Case(inplace_add_dropout, extra=_mask(1, 1, 1, 2), dropout=True),
    "26_inplace_add_dropout_returns_kv": Case(inplace_add_dropout_returns_kv, extra=_mask(1, 1, 1, 2), dropout=True),
    "27_zero_mask_dropout": Case(inplace_add_zero_mask_dropout, dropout=True),
    # the same in-place forms through the tensor methods (Dynamo records add_ / mul_ / masked_fill_)
    "inplace_add_method": Case(add_method_in_place, extra=_mask(1, 1, 16, 16)),
    "inplace_masked_fill_method": Case(masked_fill_in_place, extra=lambda b, g: [
        torch.cat([torch.zeros(16, 1, dtype=torch.bool), torch.rand(16, 15, generator=g) > 0.6], dim=1)]),
    # ... and the scores added into the mask in place: the mask tensor is written, left as written
    "inplace_add_into_the_mask": Case(mask_added_into_in_place, extra=_mask("B", 2, 16, 16), batched_mask=True,
                                      rewritten=0, reason="writes the scores into another tensor in place"),
    # Inductor must not rewrite it: the probabilities are returned too
    "probabilities_reused": Case(returns_probabilities, qkv_shape=(2, 4, 8, 16), rewritten=0, reason="users"),
    # an SDPA call, already PyTorch's own kernel on the CPU: left as it is, with the reason
    "sdpa_expanded_scalar_mask": Case(sdpa_with_expanded_scalar_mask, qkv_shape=(1, 32, 1, 128),
                                      extra=lambda b, g: [torch.randn(1, 1, 1, 1, generator=g)], rewritten=0,
                                      reason="SDPA call left as it is", options={"force": False}),
}


def _inputs(case: Case, batch: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, *case.qkv_shape[1:])
    return [torch.randn(shape, generator=g) for _ in range(3)] + case.extra(batch, g)


def _leaves(args: list, grad: bool) -> list:
    return [a.detach().clone().requires_grad_(grad) if torch.is_tensor(a) and a.is_floating_point() and i < 3
            else a for i, a in enumerate(args)]


def assert_relative_close(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """max |got - expected| <= rel * max |expected| (elementwise relative error means nothing at 0)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    got, expected = got.detach(), expected.detach()
    err, scale = float((got - expected).abs().max()), float(expected.abs().max())
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel:g} * max |expected| {scale:.3g}"


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _run(case: Case, dynamic: bool, training: bool, downstream: str = "eager"):
    """Eager and compiled outputs (and gradients of q, k, v where compared) at the case's batch, and,
    with the batch dim dynamic, at a second batch size through the same compiled graph."""
    grads = case.grads and not (case.dropout and training)
    flag = [training] if case.dropout else []
    batches = (case.qkv_shape[0], case.qkv_shape[0] + 2) if dynamic else (case.qkv_shape[0],)
    options = {**OPTIONS, **case.options, "downstream": downstream}
    compiled = torch.compile(case.fn, backend="graphopt", options=options, fullgraph=True)
    results = []
    for i, batch in enumerate(batches):
        args = _inputs(case, batch, seed=i)
        eager_args, compiled_args = _leaves(args, grads), _leaves(args, grads)
        if dynamic:
            for t in compiled_args[:3] + (compiled_args[3:] if case.batched_mask else []):
                torch._dynamo.mark_dynamic(t, 0)
        torch.manual_seed(1234)
        expected = _flat(case.fn(*eager_args, *flag))
        torch.manual_seed(1234)
        got = _flat(compiled(*compiled_args, *flag))
        pairs = [(expected, got)]
        if grads:
            expected[0].sum().backward()
            got[0].sum().backward()
            pairs.append(([a.grad for a in eager_args[:3]], [a.grad for a in compiled_args[:3]]))
        results.append(pairs)
    return results


def _params():
    """Every case with a static and a dynamic batch; the checkpointed twins' dynamic runs are slow."""
    out = []
    for name in CASES:
        out.append(pytest.param(name, False, id=f"{name}-static"))
        marks = [pytest.mark.slow] if "checkpointed" in name else []
        out.append(pytest.param(name, True, id=f"{name}-dynamic_batch", marks=marks))
    return out


@pytest.mark.parametrize("name, dynamic", _params())
def test_pattern_is_rewritten_and_matches_eager(name, dynamic):
    case = CASES[name]
    with backend_module.recording_decisions(reset=True) as decisions:
        results = _run(case, dynamic, training=False)
    attention = [d for d in decisions if d.pass_name == "attention"]
    assert attention, "no decision recorded"
    if case.rewritten:
        assert all(d.applied for d in attention), [d.reason for d in attention]
    else:
        assert not any(d.applied for d in attention) and all(case.reason in d.reason for d in attention), \
            [d.reason for d in attention]
    for pairs in results:
        for expected, got in pairs:
            for e, o in zip(expected, got):
                assert_relative_close(o, e)


DROPOUT_CASES = [name for name, case in CASES.items() if case.dropout]


@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_pattern_with_dropout_active_is_rewritten_with_dropout(name):
    """Training: the dropout on the probabilities becomes SDPA's dropout_p (its statistics are tested
    in test_attention_dropout.py); dropout on the attention output stays as written."""
    case = CASES[name]
    on_probabilities = "dropout on the attention output, not the probabilities" not in case.notes
    with backend_module.recording_decisions(reset=True) as decisions:
        ((expected, got), *_), = _run(case, dynamic=False, training=True)
    (d,) = [d for d in decisions if d.pass_name == "attention"]
    assert d.applied, d.reason
    assert (d.details.get("dropout_p", 0) > 0) == on_probabilities, d.details
    for e, o in zip(expected, got):
        assert o.shape == e.shape and o.dtype == e.dtype and torch.isfinite(o).all()
    if not on_probabilities:  # the same dropout call, the same random stream
        assert_relative_close(got[0], expected[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1_checkpointed", "15_expand_as_mask", "21_inplace_add", "24_bmm_views_around_mask",
                                  "13_prev_clone"])
def test_pattern_under_inductor(name):
    """The same forms with Inductor compiling the rewritten graph (dynamic batch): still rewritten, and
    outputs and gradients equal eager's."""
    case = CASES[name]
    with backend_module.recording_decisions(reset=True) as decisions:
        results = _run(case, dynamic=True, training=False, downstream="inductor")
    attention = [d for d in decisions if d.pass_name == "attention"]
    assert attention and all(d.applied for d in attention), [d.reason for d in attention]
    for pairs in results:
        for expected, got in pairs:
            for e, o in zip(expected, got):
                assert_relative_close(o, e)
