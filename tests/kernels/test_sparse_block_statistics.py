"""The sparse predictor split in two: block statistics (`block_statistics`, plain torch, the only
part that reads all of Q and K) and the selection that reads only them (`select_block_mask`,
`select_block_lut`). Given the statistics, every path must give the masks and outputs of the
predictor that pools q and k itself. Triton runs in the interpreter on CPU (tests/conftest.py)."""

import pytest
import torch

import graphopt  # noqa: F401  (registers graphopt::sparse_attention)
from graphopt.kernels import sparse_attention as sa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton path runs

# (B, H, Hkv, L, D): odd lengths (a partial last block of both block sizes), GQA, one block only
SHAPES = [(1, 4, 2, 333, 32), (2, 2, 2, 200, 48), (1, 3, 1, 100, 16)]


def structured_qk(B, H, Hkv, L, D, seed):
    """local+sink q/k (self-similar blocks, so the top-cdf selection decides) with a noisy query
    stretch and key tail (blocks that are not self-similar: whole rows and columns kept)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = sa.local_sink_qkv(B, H, L, D, seed=seed, noise=0.3)
    k = k[:, :Hkv].clone()
    q[:, :, 20:90] += 2 * torch.randn(B, H, 70, D, generator=gen)
    k[:, :, L - 40:] += 2 * torch.randn(B, Hkv, 40, D, generator=gen)
    return q, k


THRESHOLDS = [dict(), dict(simthreshd1=0.3, cdfthreshd=0.6)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_selection_from_statistics_equals_the_predictor(shape, is_causal):
    B, H, Hkv, L, D = shape
    q, k = structured_qk(B, H, Hkv, L, D, seed=11)
    v = torch.randn(B, Hkv, L, D, generator=torch.Generator().manual_seed(12))
    stats = sa.block_statistics(q, k)
    assert [tuple(t.shape) for t in stats] == [(B, H, -(-L // 128), D), (B, H, -(-L // 128)),
                                               (B, Hkv, -(-L // 64), D), (B, Hkv, -(-L // 64))]
    sparse_somewhere = False
    for thresholds in THRESHOLDS:
        mask = sa.predict_block_mask(q, k, is_causal=is_causal, **thresholds)
        assert torch.equal(sa.select_block_mask(stats, L, L, is_causal=is_causal, **thresholds), mask)
        out, skipped = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, return_sparsity=True, **thresholds)
        given = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, statistics=stats, **thresholds)
        torch.testing.assert_close(given, out, atol=0, rtol=0)
        sparse_somewhere |= skipped > 0
    assert sparse_somewhere or L <= 128, "the inputs should make the predictor skip blocks"


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_triton_selection_from_statistics_equals_the_pooling_predictor(shape, is_causal):
    B, H, Hkv, L, D = shape
    q, k = (t.to(DEVICE) for t in structured_qk(B, H, Hkv, L, D, seed=21))
    v = torch.randn(B, Hkv, L, D, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    stats = sa.block_statistics(q, k)
    for thresholds in THRESHOLDS + [dict(simthreshd1=torch.tensor([-1.0, 0.5, 0.3, 0.9][:H], device=DEVICE),
                                         cdfthreshd=torch.tensor([0.7, 1.0, 0.0, 0.9][:H], device=DEVICE))]:
        mask = sa.predict_block_mask(q, k, is_causal=is_causal, **thresholds)
        for variant in sa.PREDICTOR_VARIANTS:
            lut, counts = sa.select_block_lut(stats, L, L, is_causal=is_causal, variant=variant, **thresholds)
            assert torch.equal(sa.lut_to_block_mask(lut, counts), mask), f"{variant} differs for {thresholds}"
    thresholds = THRESHOLDS[1]
    pooled_here = sa.sparse_attention(q, k, v, is_causal=is_causal, implementation="triton", **thresholds)
    given = sa.sparse_attention(q, k, v, is_causal=is_causal, implementation="triton", statistics=stats, **thresholds)
    torch.testing.assert_close(given, pooled_here, atol=0, rtol=0)


def test_triton_selection_reads_only_the_statistics():
    """select_block_lut gets no q or k: statistics of other tensors give their masks."""
    q, k = (t.to(DEVICE) for t in structured_qk(1, 2, 2, 300, 32, seed=31))
    q2, k2 = (t.to(DEVICE) for t in structured_qk(1, 2, 2, 300, 32, seed=32))
    for a, b in ((q, k), (q2, k2)):
        lut, counts = sa.select_block_lut(sa.block_statistics(a, b), 300, 300, cdfthreshd=0.5)
        assert torch.equal(sa.lut_to_block_mask(lut, counts), sa.predict_block_mask(a, b, cdfthreshd=0.5))


def test_op_with_statistics_equals_the_op_without():
    q, k = structured_qk(1, 4, 2, 333, 32, seed=41)
    v = torch.randn(1, 2, 333, 32, generator=torch.Generator().manual_seed(42))
    sim1, cdf, pv = torch.full((4,), 0.6), torch.tensor([0.5, 0.9, 0.95, 0.7]), torch.empty(0)
    args = (q, k, v, 32**-0.5, True, sim1, cdf, pv, 0, "sdpa_cpu")
    without = torch.ops.graphopt.sparse_attention(*args)
    assert not torch.allclose(without, sa.reference_sparse_attention(q, k, v, is_causal=True, cdfthreshd=1.0),
                              atol=1e-5), "the thresholds should skip blocks"
    torch.testing.assert_close(torch.ops.graphopt.sparse_attention(*args, *sa.block_statistics(q, k)), without,
                               atol=0, rtol=0)


def test_bad_statistics_name_the_problem():
    q, k = structured_qk(1, 2, 2, 200, 32, seed=51)
    v = k.clone()
    pooled_q, sim_q, pooled_k, sim_k = sa.block_statistics(q, k)
    args = (q, k, v, 32**-0.5, False, torch.full((2,), 0.6), torch.full((2,), 0.9), torch.empty(0), 0, "sdpa_cpu")
    with pytest.raises(ValueError, match="need all of pooled_q, sim_q, pooled_k, sim_k.*missing pooled_k, sim_k"):
        torch.ops.graphopt.sparse_attention(*args, pooled_q, sim_q)
    with pytest.raises(ValueError, match=r"do not match Lq=200, Lk=200.*expected pooled_q \(B, H, 2, D\)"):
        torch.ops.graphopt.sparse_attention(*args, pooled_q[:, :, :1], sim_q[:, :, :1], pooled_k, sim_k)
    with pytest.raises(ValueError, match="four tensors"):
        sa.select_block_mask((pooled_q, sim_q), 200, 200)
    with pytest.raises(ValueError, match="floating-point"):
        sa.select_block_mask((pooled_q, sim_q.int(), pooled_k, sim_k), 200, 200)
