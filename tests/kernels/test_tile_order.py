"""Launch order of the attention kernels' programs (graphopt/kernels/tile_order.py): the 1-D program
id -> (query block, batch * head) map under the interpreter (or on a GPU), and both attention kernels
with head groups that do not divide batch * heads."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphopt.kernels import tile_order
from graphopt.kernels.tile_order import causal_head_group, query_block_order

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _order_kernel(out_ptr, n_q_blocks, head_group, IS_CAUSAL: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_bh = query_block_order(n_q_blocks, head_group, IS_CAUSAL)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_bh)


def _launch_order(n_q_blocks, n_bh, head_group, is_causal):
    out = torch.full((n_q_blocks * n_bh, 2), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(n_q_blocks * n_bh,)](out, n_q_blocks, head_group, IS_CAUSAL=is_causal)
    return [tuple(row) for row in out.cpu().tolist()]


@pytest.mark.parametrize("n_q_blocks, n_bh, head_group", [(5, 7, 3), (4, 6, 6), (3, 5, 1), (6, 4, 8), (1, 3, 2)])
def test_causal_order_is_a_permutation_heaviest_first_per_group(n_q_blocks, n_bh, head_group):
    order = _launch_order(n_q_blocks, n_bh, head_group, True)
    assert sorted(order) == [(m, bh) for m in range(n_q_blocks) for bh in range(n_bh)]
    group = min(head_group, n_bh)
    for first in range(0, n_bh, group):  # each group occupies a contiguous run of programs
        size = min(group, n_bh - first)
        run = order[first * n_q_blocks:(first + size) * n_q_blocks]
        assert {bh for _, bh in run} == set(range(first, first + size))
        blocks = [m for m, _ in run]
        assert blocks == sorted(blocks, reverse=True), "query blocks must go heaviest (last) first"
        assert [bh for _, bh in run[:size]] == list(range(first, first + size)), "the group's heads vary fastest"


def test_non_causal_order_is_unchanged():
    assert _launch_order(4, 3, 2, False) == [(m, bh) for bh in range(3) for m in range(4)]


def test_head_group_keeps_keys_and_values_within_the_budget():
    # bf16, D=128: one KV head's keys and values take 4 MB at 8k tokens, 16 MB at 32k
    assert causal_head_group(16, 1, 8192, 128, 2) == 8
    assert causal_head_group(16, 1, 32768, 128, 2) == 2
    assert causal_head_group(16, 1, 131072, 128, 2) == 1  # one head over budget still runs
    assert causal_head_group(32, 4, 8192, 128, 2) == 32  # GQA: 8 KV heads serve 32 query heads
    assert causal_head_group(3, 1, 64, 32, 4) == 3  # never more than there are rows


def _three_heads_per_group(monkeypatch, len_k, head_dim, elem_bytes):
    """An L2 budget that holds three heads' keys and values, so with 8 (batch, head) rows the last
    group is partial."""
    monkeypatch.setattr(tile_order, "L2_BUDGET_BYTES", 3 * 2 * len_k * head_dim * elem_bytes)
    assert causal_head_group(8, 1, len_k, head_dim, elem_bytes) == 3


def test_flash_attention_with_partial_head_groups(monkeypatch):
    from graphopt.kernels.flash_attention import flash_attention_forward, reference_attention

    _three_heads_per_group(monkeypatch, 70, 32, 4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 70, 32, generator=gen).to(DEVICE) for _ in range(3))
    out, _ = flash_attention_forward(q, k, v, scale=32**-0.5, is_causal=True)
    ref = reference_attention(q.double(), k.double(), v.double(), None, scale=32**-0.5, is_causal=True)
    torch.testing.assert_close(out.double(), ref, atol=5e-3, rtol=5e-3)


def test_sparse_attention_with_partial_head_groups(monkeypatch):
    from graphopt.kernels import sparse_attention as sa

    _three_heads_per_group(monkeypatch, 333, 32, 4)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 333, 32, generator=gen).to(DEVICE) for _ in range(3))
    sim1 = torch.full((4,), -1.0, device=DEVICE)
    cdf = torch.linspace(0.3, 0.9, 4, device=DEVICE)
    lut, counts = sa.predict_block_lut(q, k, is_causal=True, simthreshd1=sim1, cdfthreshd=cdf)
    mask = sa.lut_to_block_mask(lut, counts)
    assert not mask.all(), "test needs a sparse mask"
    ref = sa.block_sparse_attention_reference(q, k, v, mask, is_causal=True)
    out = sa.block_sparse_attention(q, k, v, lut, counts, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
