"""Block-sparse attention (SpargeAttn style): predictor semantics, the torch reference against
float64 dense attention, and the Triton kernels against the reference: under TRITON_INTERPRET=1 on
CPU (tests/conftest.py), on CUDA tensors when a GPU is present (DEVICE)."""

import functools

import pytest
import torch
import torch.nn.functional as F

import graphopt  # noqa: F401  (registers graphopt::sparse_attention)
from graphopt.kernels import sparse_attention as sa


def dense_attention(q, k, v, *, is_causal=False, scale=None):
    """float64 SDPA (k/v repeated for GQA)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)


def rel_l1(out, ref):
    return ((out.double() - ref.double()).abs().sum() / ref.double().abs().sum()).item()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton path runs
# fp32 Triton vs references: the interpreter runs numpy fp32; on a GPU the fp32 dots are IEEE FMA
# chains whose summation order differs from cuBLAS / float64 SDPA.
FP32_TOL = dict(atol=2e-6, rtol=2e-5) if DEVICE == "cpu" else dict(atol=2e-5, rtol=1e-4)


def randn(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


# (B, H, Hkv, L, D): odd lengths not multiple of either block, GQA, MiniLM's D=32, a non-pow2 D
SHAPES = [(1, 2, 2, 200, 32), (2, 4, 2, 256, 64), (1, 3, 1, 333, 48)]


# -- 1. cdfthreshd=1 with simthreshd1=-1 is dense attention (causal: exact inside diagonal blocks)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_keep_all_thresholds_equal_dense_reference(shape, is_causal):
    B, H, Hkv, L, D = shape
    q, k, v = randn(B, H, L, D, seed=1), randn(B, Hkv, L, D, seed=2), randn(B, Hkv, L, D, seed=3)
    out, skipped = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, simthreshd1=-1.0, cdfthreshd=1.0,
                                                 return_sparsity=True)
    assert skipped == 0.0
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, is_causal=is_causal), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_keep_all_thresholds_equal_dense_triton(shape, is_causal):
    B, H, Hkv, L, D = shape
    q, k, v = on_device(randn(B, H, L, D, seed=4), randn(B, Hkv, L, D, seed=5), randn(B, Hkv, L, D, seed=6))
    out = sa.sparse_attention(q, k, v, is_causal=is_causal, simthreshd1=-1.0, cdfthreshd=1.0, implementation="triton")
    assert out.device.type == DEVICE
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, is_causal=is_causal), **FP32_TOL)


def test_causal_mask_inside_diagonal_block_is_token_exact():
    # Only the diagonal blocks are kept: query i must see exactly keys 0..i of them (query 0 sees
    # only key 0, so its output is v[0]); a block-level-only mask would mix in later keys.
    L, D = 128, 32
    q, k, v = on_device(randn(1, 1, L, D, seed=7), randn(1, 1, L, D, seed=8), randn(1, 1, L, D, seed=9))
    mask = torch.zeros(1, 1, 1, 2, dtype=torch.bool, device=DEVICE)
    mask[..., :] = True  # both key blocks cross the diagonal of query block 0
    lut, counts = sa.block_mask_to_lut(mask)
    for out in (sa.block_sparse_attention_reference(q, k, v, mask, is_causal=True),
                sa.block_sparse_attention(q, k, v, lut, counts, is_causal=True)):
        torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out.double(), dense_attention(q, k, v, is_causal=True), **FP32_TOL)


# -- 2. structured local + sink inputs reach real sparsity within the L1 budget -------------------
@pytest.mark.parametrize("is_causal", [False, True])
def test_structured_inputs_are_sparse_within_budget(is_causal):
    q, k, v = sa.local_sink_qkv(1, 2, 1024, 64, seed=11)
    out, skipped = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, return_sparsity=True)  # documented defaults
    error = rel_l1(out, dense_attention(q, k, v, is_causal=is_causal))
    assert skipped >= 0.5, f"only {skipped:.0%} of blocks skipped on local+sink inputs"
    assert error < 0.06, f"relative L1 {error:.4f} over the 0.06 budget at {skipped:.0%} sparsity"
    # what is kept is the sink column and a band around the diagonal, nothing far from it
    mask = sa.predict_block_mask(q, k, is_causal=is_causal)[0, 0]
    i, j = torch.nonzero(mask, as_tuple=True)
    assert ((j == 0) | ((j - 2 * i).abs() <= 4)).all()


# -- 3. unstructured random inputs fall back to near-dense --------------------------------------
@pytest.mark.parametrize("is_causal", [False, True])
def test_random_inputs_fall_back_to_dense(is_causal):
    q, k, v = randn(1, 2, 512, 64, seed=12), randn(1, 2, 512, 64, seed=13), randn(1, 2, 512, 64, seed=14)
    _, sim_q = sa.pool_blocks(q, sa.BLOCK_M)
    assert sim_q.max() < 0.6  # random tokens are not self-similar: every block is computed
    out, skipped = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, return_sparsity=True)
    assert skipped <= 0.05
    assert rel_l1(out, dense_attention(q, k, v, is_causal=is_causal)) < 1e-5


# -- 4. causality: later blocks never change earlier outputs -------------------------------------
@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_perturbing_later_blocks_never_changes_earlier_outputs(implementation):
    L, D, t = 384, 64, 256  # t: start of query block 2 (and key block 4)
    device = DEVICE if implementation == "triton" else "cpu"
    q, k, v = sa.local_sink_qkv(1, 2, L, D, seed=15, device=device)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[..., t:, :] = randn(1, 2, L - t, D, seed=16, device=device) * 5
    kwargs = dict(is_causal=True, cdfthreshd=0.9, pvthreshd=6.0, implementation=implementation)
    before, after = sa.sparse_attention(q, k, v, **kwargs), sa.sparse_attention(q2, k2, v2, **kwargs)
    assert torch.equal(before[..., :t, :], after[..., :t, :])
    assert not torch.equal(before[..., t:, :], after[..., t:, :])


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_fixed_mask_later_tokens_inside_a_block_do_not_leak(implementation):
    # With the block mask fixed, a token never sees later tokens even inside its own block.
    L, D, t = 256, 32, 150
    device = DEVICE if implementation == "triton" else "cpu"
    q, k, v = (randn(1, 1, L, D, seed=s, device=device) for s in (17, 18, 19))
    mask = sa.predict_block_mask(q, k, is_causal=True, simthreshd1=-1.0, cdfthreshd=1.0)
    k2, v2 = k.clone(), v.clone()
    k2[..., t:, :] += 3.0
    v2[..., t:, :] -= 3.0
    if implementation == "reference":
        run = lambda k_, v_: sa.block_sparse_attention_reference(q, k_, v_, mask, is_causal=True)  # noqa: E731
    else:
        lut, counts = sa.block_mask_to_lut(mask)
        run = lambda k_, v_: sa.block_sparse_attention(q, k_, v_, lut, counts, is_causal=True)  # noqa: E731
    assert torch.equal(run(k, v)[..., :t, :], run(k2, v2)[..., :t, :])


# -- 5. the Triton kernels under TRITON_INTERPRET=1 against the reference -----------------------
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference_on_predicted_mask(shape, is_causal):
    B, H, Hkv, L, D = shape
    q, k, v = on_device(randn(B, H, L, D, seed=21), randn(B, Hkv, L, D, seed=22), randn(B, Hkv, L, D, seed=23))
    # per-head thresholds, with a similarity threshold every block passes so the mask is sparse
    sim1 = torch.full((H,), -1.0, device=DEVICE)
    cdf = torch.linspace(0.3, 0.9, H, device=DEVICE)
    mask = sa.predict_block_mask(q, k, is_causal=is_causal, simthreshd1=sim1, cdfthreshd=cdf)
    assert not mask.all(), "test needs a sparse mask"
    lut, counts = sa.predict_block_lut(q, k, is_causal=is_causal, simthreshd1=sim1, cdfthreshd=cdf)
    assert torch.equal(sa.lut_to_block_mask(lut, counts), mask), "Triton predictor differs from the torch predictor"
    ref = sa.block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal)
    out = sa.block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal)
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("variant, loop_stages, slice_elements", [(v, sa.POOL_LOOP_STAGES, sa.POOL_SLICE_ELEMENTS)
                                                                   for v in sa.PREDICTOR_VARIANTS]
                         + [("v3", 0, 512), ("v3", 3, 2048)])  # the unrolled slice loop; a deeper pipeline
def test_triton_pooling_matches_reference(variant, loop_stages, slice_elements):
    # odd lengths (partial last blocks of both sizes), GQA, a head dim that is not a power of two
    q, k = on_device(randn(2, 4, 333, 48, seed=40), randn(2, 2, 333, 48, seed=41) + 0.5)
    pooled_q, sim_q, pooled_k, sim_k = sa.pool_qk_triton(q, k, variant=variant, loop_stages=loop_stages,
                                                         slice_elements=slice_elements)
    for got, want in zip((pooled_q, sim_q, pooled_k, sim_k), (*sa.pool_blocks(q, sa.BLOCK_M), *sa.pool_blocks(k, sa.BLOCK_N))):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _structured_mixture(B, H, Hkv, L, D, seed):
    """local+sink q/k (self-similar blocks) with some noisy query and key stretches (not similar)."""
    q, k, _ = sa.local_sink_qkv(B, H, L, D, seed=seed, noise=0.2)
    k = k[:, :Hkv].clone()
    q[:, :, 128:256] += randn(B, H, 128, D, seed=seed + 1) * 2
    k[:, :, L - 100:] += randn(B, Hkv, 100, D, seed=seed + 2) * 2
    return on_device(q, k)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sa.PREDICTOR_VARIANTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 3, 3, 333, 48), (2, 4, 2, 1000, 32)])
def test_triton_predictor_matches_reference(shape, is_causal, variant):
    B, H, Hkv, L, D = shape
    q, k = _structured_mixture(B, H, Hkv, L, D, seed=42)
    cases = [
        dict(),  # documented float defaults: the scalar-threshold kernel variant
        dict(simthreshd1=0.3, cdfthreshd=0.5),
        # per head: similarity off / on, cdf 1 (keep all), 0 (only the forced blocks), in between
        dict(simthreshd1=torch.tensor([-1.0, 0.6, 0.3, 0.9][:H], device=DEVICE),
             cdfthreshd=torch.tensor([0.7, 1.0, 0.0, 0.95][:H], device=DEVICE)),
    ]
    for thresholds in cases:
        mask = sa.predict_block_mask(q, k, is_causal=is_causal, **thresholds)
        lut, counts = sa.predict_block_lut(q, k, is_causal=is_causal, variant=variant, **thresholds)
        assert torch.equal(sa.lut_to_block_mask(lut, counts), mask), f"{variant}: mask differs for {thresholds}"
        # the lists are ascending and never empty
        for row, n in zip(lut.reshape(-1, lut.shape[-1]).tolist(), counts.reshape(-1).tolist()):
            assert n >= 1 and row[:n] == sorted(set(row[:n]))
    assert not mask.all() and (mask.sum(-1) > 1).any()  # the last case is neither dense nor trivial


def test_triton_predictor_keeps_tied_blocks_together():
    # key blocks 0,1 are copies of pattern A and 2,3 of pattern B: equal pooled scores, so the
    # top-cdf keeps or drops each pair as a whole (the bisection has no sort order to break ties)
    D = 32
    a, b = randn(1, 1, 64, D, seed=50), randn(1, 1, 64, D, seed=51)
    k = torch.cat([a, a, b, b], 2).to(DEVICE)
    q = (randn(1, 1, 512, D, seed=52) + torch.cat([a, b], 2).repeat(1, 1, 4, 1)).to(DEVICE)
    kwargs = dict(simthreshd1=-1.0, cdfthreshd=0.3)
    mask = sa.predict_block_mask(q, k, **kwargs)
    lut, counts = sa.predict_block_lut(q, k, **kwargs)
    assert torch.equal(sa.lut_to_block_mask(lut, counts), mask)
    assert torch.equal(mask[..., 0], mask[..., 1]) and torch.equal(mask[..., 2], mask[..., 3])
    assert (counts == 2).any()


def _assert_predictor_matches_reference(q, k, **kwargs):
    mask = sa.predict_block_mask(q, k, **kwargs)
    for variant in sa.PREDICTOR_VARIANTS:
        lut, counts = sa.predict_block_lut(q, k, variant=variant, **kwargs)
        assert torch.equal(sa.lut_to_block_mask(lut, counts), mask), f"predictor {variant} differs for {kwargs}"
    return mask


@pytest.mark.slow
@pytest.mark.parametrize("pivots", [1, 3])
def test_triton_predictor_search_modes_match_reference(monkeypatch, pivots):
    # v2 and v3 search the top-cdf threshold with 3 pivots (16 steps) on short rows and 1 (31 steps)
    # on long ones: force each mode at a tiny size. Unstructured random q/k (flat rows: t* is small and
    # many blocks are kept) and structured ones (peaked rows), odd L, GQA, per-head thresholds
    # including cdf 0 (only forced blocks), a cdf just below 1, and similarity above every block.
    from graphopt.kernels.sparse_attention import predictor  # where the launches read it

    config = predictor._lut_kernel_config
    monkeypatch.setattr(predictor, "_lut_kernel_config", lambda n, d: {**config(n, d), "PIVOTS": pivots,
                                                                       "SEARCH_STEPS": 16 if pivots == 3 else 31})
    monkeypatch.setitem(sa.V3_SHAPE, "pivots", pivots)
    random_qk = on_device(randn(1, 4, 700, 32, seed=60), randn(1, 2, 700, 32, seed=61))
    structured_qk = _structured_mixture(1, 4, 2, 700, 32, seed=62)
    per_head = dict(simthreshd1=torch.tensor([-1.0, 0.2, 2.0, 0.5], device=DEVICE),
                    cdfthreshd=torch.tensor([0.0, 0.3, 0.9, 0.99999], device=DEVICE))
    for (q, k), is_causal in ((random_qk, False), (structured_qk, True)):
        for kwargs in (dict(simthreshd1=-1.0, cdfthreshd=0.9), dict(simthreshd1=-1.0, cdfthreshd=0.5, scale=0.5), per_head):
            _assert_predictor_matches_reference(q, k, is_causal=is_causal, **kwargs)


def test_triton_predictor_ties_at_the_cdf_boundary():
    # Identical key blocks give exactly equal probabilities: a tie group straddling the cdf boundary
    # is kept whole (the mass before its first member decides), both variants, causal and not.
    D = 32
    a, b = randn(1, 1, 64, D, seed=63), randn(1, 1, 64, D, seed=64)
    k = torch.cat([a, a, a, b, b, b, a, b], 2)  # 8 key blocks: 4 copies of A, 4 of B
    q = randn(1, 1, 500, D, seed=65) * 0.1 + torch.cat([a, a], 2).repeat(1, 1, 4, 1)[:, :, :500]
    q, k = on_device(q, k[:, :, :500])  # L = 500: the last key block is partial (a different mean)
    for is_causal in (False, True):
        for cdf in (0.2, 0.45, 0.8):
            mask = _assert_predictor_matches_reference(q, k, is_causal=is_causal, simthreshd1=-1.0, cdfthreshd=cdf)
        assert (mask.sum(-1) > 1).any()
    # all key blocks equal: uniform rows, nothing is strictly larger than anything: all kept
    k_same = on_device(a.repeat(1, 1, 6, 1))[0]
    q_same = on_device(randn(1, 1, 384, D, seed=66))[0]
    mask = _assert_predictor_matches_reference(q_same, k_same, simthreshd1=-1.0, cdfthreshd=0.1)
    assert mask.all()


@pytest.mark.parametrize("prefetch_index,use_tma,pair_blocks,single_loop,length", [
    (0, 0, 0, 0, 450), (1, 0, 0, 0, 450), (1, 1, 0, 0, 450), (1, 0, 1, 0, 450), (1, 1, 1, 0, 450),
    (1, 1, 0, 1, 450), (1, 1, 0, 1, 448), (1, 1, 0, "merged", 450), (1, 1, 0, "merged", 448)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_kernel_loop_variants(prefetch_index, use_tma, pair_blocks, single_loop, length, is_causal):
    # the loop variants the GPU autotuner chooses between (index prefetch; K/V through pointers or
    # tensor descriptors; unmasked blocks one or two per step; the whole list in one loop, after the
    # masked suffix's loop or with the suffix merged into it at the 2 stages the tuner uses), on a
    # sparse mask with a partial last block (TMA zero-fills past Lk) or without one, rows with odd
    # and even numbers of kept blocks, and grouped-query heads
    B, H, L, D = 1, 4, length, 64
    q = randn(B, H, L, D, seed=60)
    k, v = (randn(B, 2, L, D, seed=s) for s in (61, 62))  # grouped-query: 2 query heads per kv head
    q, k, v = on_device(q, k, v)
    if use_tma and not sa.tma_loads_supported(q, k, v):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    n_q, n_k = sa.cdiv(L, sa.BLOCK_M), sa.cdiv(L, sa.BLOCK_N)
    mask = torch.rand(B, H, n_q, n_k, generator=torch.Generator().manual_seed(5)) < 0.6
    if is_causal:
        allowed, diagonal = sa.causal_block_geometry(n_q, n_k, L, L, sa.BLOCK_M, sa.BLOCK_N)
        mask = (mask & allowed) | diagonal
    mask = mask.to(DEVICE)
    assert not mask.all()
    lut, counts = sa.block_mask_to_lut(mask)
    assert {c % 2 for c in counts.flatten().tolist()} == {0, 1}
    ref = sa.block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal)
    config = {"PREFETCH_INDEX": prefetch_index, "USE_TMA": use_tma, "PAIR_BLOCKS": pair_blocks,
              "SINGLE_LOOP": int(bool(single_loop)), "MERGED_SUFFIX": int(single_loop == "merged"),
              "num_warps": 4, "num_stages": 1 if DEVICE == "cpu" else 2 if single_loop == "merged" else 3}
    out = sa.block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal, config=config)
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_pv_skipping_matches_reference(is_causal):
    q, k, v = sa.local_sink_qkv(1, 2, 512, 64, seed=24, noise=0.1, device=DEVICE)
    kwargs = dict(is_causal=is_causal, cdfthreshd=1.0, simthreshd1=-1.0)
    dense = dense_attention(q, k, v, is_causal=is_causal)
    no_skip = sa.reference_sparse_attention(q, k, v, **kwargs)
    ref = sa.reference_sparse_attention(q, k, v, pvthreshd=8.0, **kwargs)
    out = sa.sparse_attention(q, k, v, pvthreshd=8.0, implementation="triton", **kwargs)
    assert not torch.equal(ref, no_skip), "PV skipping never triggered"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # per-head thresholds (the kernel loads them): inf = never skip for head 1
    per_head_pv = torch.tensor([8.0, float("inf")], device=DEVICE)
    ref_heads = sa.reference_sparse_attention(q, k, v, pvthreshd=per_head_pv, **kwargs)
    out_heads = sa.sparse_attention(q, k, v, pvthreshd=per_head_pv, implementation="triton", **kwargs)
    torch.testing.assert_close(out_heads, ref_heads, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_heads[:, 1], no_skip[:, 1], atol=1e-5, rtol=1e-4)
    assert rel_l1(ref, dense) < 0.01  # skipped tiles weigh < 2^-8 of the row max each


def test_triton_half_precision_matches_reference():
    q, k, v = (t.to(device=DEVICE, dtype=torch.float16) for t in sa.local_sink_qkv(1, 2, 256, 32, seed=25))
    mask = sa.predict_block_mask(q, k, cdfthreshd=0.9)
    lut, counts = sa.block_mask_to_lut(mask)
    ref = sa.block_sparse_attention_reference(q.float(), k.float(), v.float(), mask)
    out = sa.block_sparse_attention(q, k, v, lut, counts)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_predictor_rules():
    q, k, _ = sa.local_sink_qkv(1, 1, 512, 64, seed=26)
    # cdfthreshd=1 keeps everything; causal keeps exactly the allowed blocks
    assert sa.predict_block_mask(q, k, cdfthreshd=1.0).all()
    allowed, diagonal = sa.causal_block_geometry(4, 8, 512, 512, sa.BLOCK_M, sa.BLOCK_N)
    assert torch.equal(sa.predict_block_mask(q, k, is_causal=True, cdfthreshd=1.0)[0, 0], allowed)
    # a tiny cdf keeps the top block of each row (causal: plus the diagonal blocks)
    tiny = sa.predict_block_mask(q, k, cdfthreshd=1e-6)
    assert (tiny.sum(-1) == 1).all()
    tiny_causal = sa.predict_block_mask(q, k, is_causal=True, cdfthreshd=1e-6)[0, 0]
    assert (tiny_causal & diagonal).equal(diagonal) and ((tiny_causal & ~diagonal).sum(-1) <= 1).all()
    assert not (tiny_causal & ~allowed).any()
    # a query block that is not self-similar is computed as a whole row; a key block as a column
    q2, k2 = q.clone(), k.clone()
    q2[..., 128:256, :] = randn(1, 1, 128, 64, seed=27) * 3
    k2[..., 64:128, :] = randn(1, 1, 64, 64, seed=28) * 3
    mask = sa.predict_block_mask(q2, k2, cdfthreshd=0.5)
    assert mask[0, 0, 1].all() and mask[0, 0, :, 1].all()
    assert not mask[0, 0, 0].all()


def test_sparse_attention_op_cpu_matches_reference():
    q, k, v = sa.local_sink_qkv(1, 2, 256, 32, seed=29)
    sim1, cdf, pv = torch.full((2,), 0.6), torch.tensor([0.9, 0.95]), torch.empty(0)
    out = torch.ops.graphopt.sparse_attention(q, k, v, 32**-0.5, True, sim1, cdf, pv, 0, "sdpa_cpu")
    ref = sa.reference_sparse_attention(q, k, v, is_causal=True, simthreshd1=sim1, cdfthreshd=cdf)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sparse_attention_op_runs_dense_below_its_length_gate(is_causal):
    """dense_below (set by the pass for symbolic lengths): calls with min(Lq, Lk) below it run
    dense attention, calls at or above it the sparse kernel."""
    q, k, v = sa.local_sink_qkv(1, 2, 256, 32, seed=31)
    sim1, cdf, pv = torch.full((2,), 0.6), torch.full((2,), 0.9), torch.empty(0)
    call = functools.partial(torch.ops.graphopt.sparse_attention, q, k, v, 32**-0.5, is_causal, sim1, cdf, pv)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=32**-0.5)
    sparse = sa.reference_sparse_attention(q, k, v, is_causal=is_causal, simthreshd1=sim1, cdfthreshd=cdf)
    assert not torch.allclose(dense, sparse, atol=1e-5), "local inputs should skip blocks"
    torch.testing.assert_close(call(257, "sdpa_cpu"), dense, atol=0, rtol=0)
    torch.testing.assert_close(call(256, "sdpa_cpu"), sparse, atol=0, rtol=0)
    with pytest.raises(ValueError, match="unknown dense_backend 'fast'.*valid choices: triton, flash"):
        call(0, "fast")
    if is_causal:  # a gated op (dense_below > 0) meeting Lq != Lk under causality: dense, top-left aligned
        short_q = q[:, :, :200]
        out = torch.ops.graphopt.sparse_attention(short_q, k, v, 32**-0.5, True, sim1, cdf, pv, 1, "sdpa_cpu")
        torch.testing.assert_close(out, F.scaled_dot_product_attention(short_q, k, v, is_causal=True, scale=32**-0.5),
                                   atol=0, rtol=0)


def test_input_errors_name_the_problem():
    q = randn(1, 2, 64, 32, seed=30)
    with pytest.raises(ValueError, match="one entry per head"):
        sa.sparse_attention(q, q, q, cdfthreshd=torch.tensor([0.9, 0.9, 0.9]))
    with pytest.raises(ValueError, match="Lq == Lk"):
        sa.sparse_attention(q, q[:, :, :32], q[:, :, :32], is_causal=True)
    with pytest.raises(ValueError, match="valid choices"):
        sa.sparse_attention(q, q, q, implementation="cuda")
    with pytest.raises(ValueError, match="multiple"):
        sa.sparse_attention(q, randn(1, 3, 64, 32, seed=31), randn(1, 3, 64, 32, seed=32))
    qd, = on_device(q)
    with pytest.raises(ValueError, match="valid keys"):
        sa.predictor_stages(qd, qd, v3_shape={"rows": 2})
    with pytest.raises(ValueError, match="precision"):
        sa.predictor_stages(qd, qd, v3_shape={"precision": "bf16"})
    with pytest.raises(ValueError, match="valid choices"):
        sa.predict_block_lut(qd, qd, variant="v4")


@pytest.mark.parametrize("implementation", ["triton", "reference"])
@pytest.mark.parametrize("lq, lk", [(70, 0), (0, 70), (0, 0)])
def test_no_queries_or_no_keys_give_sdpas_answer(implementation, lq, lk):
    """No queries or no keys give zeros, as SDPA returns: with Lk = 0 the Triton kernel reads no key
    block (block 0 would be a segfault under the interpreter, an illegal address on the GPU) and
    the reference's top-cdf does not fail."""
    q, k, v = randn(1, 2, lq, 16, seed=33), randn(1, 2, lk, 16, seed=34), randn(1, 2, lk, 16, seed=35)
    q, k, v = on_device(q, k, v) if implementation == "triton" else (q, k, v)
    out, skipped = sa.sparse_attention(q, k, v, implementation=implementation, return_sparsity=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and skipped == 0.0


def test_merged_suffix_config_needs_the_single_loop():
    # the merged masked suffix is a form of the single loop: asked for without it, a clear error
    q, k, v = on_device(*(randn(1, 1, 256, 32, seed=s) for s in (73, 74, 75)))
    lut, counts = sa.block_mask_to_lut(torch.ones(1, 1, 2, 4, dtype=torch.bool, device=q.device))
    with pytest.raises(ValueError, match="MERGED_SUFFIX=1 .* needs SINGLE_LOOP=1; valid choices: SINGLE_LOOP=1, or "
                                         "MERGED_SUFFIX=0"):
        sa.block_sparse_attention(q, k, v, lut, counts, is_causal=True,
                                  config={"MERGED_SUFFIX": 1, "num_warps": 4, "num_stages": 1})


def test_single_loop_config_rejects_pv_skipping():
    # the single-loop body has no PV skipping: an explicit config asking for both is a clear error
    q, k, v = on_device(*(randn(1, 1, 256, 32, seed=s) for s in (70, 71, 72)))
    if not sa.tma_loads_supported(q, k, v):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool, device=q.device)
    lut, counts = sa.block_mask_to_lut(mask)
    with pytest.raises(ValueError, match="SINGLE_LOOP=1 needs .* no PV skipping; valid choice here: SINGLE_LOOP=0"):
        sa.block_sparse_attention(q, k, v, lut, counts, pvthreshd=8.0,
                                  config={"USE_TMA": 1, "SINGLE_LOOP": 1, "num_warps": 4, "num_stages": 1})


@pytest.mark.parametrize("is_causal", [False, True])
def test_single_loop_host_and_device_descriptors(is_causal):
    # whole blocks and (B, H, L) dims that collapse: the single loop takes the launcher's
    # descriptors over all heads' rows by default; each program's own descriptors (the fallback
    # for other layouts) must give the same output. Two batches and grouped-query heads, so a
    # wrong row offset reads another head's keys or writes another head's output.
    B, H, Hkv, L, D = 2, 4, 2, 256, 64
    q = randn(B, H, L, D, seed=80)
    k, v = (randn(B, Hkv, L, D, seed=s) for s in (81, 82))
    q, k, v = on_device(q, k, v)
    if not sa.tma_loads_supported(q, k, v):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    assert sa.host_descriptors_supported(q, k, v, q, sa.BLOCK_M, sa.BLOCK_N)
    n_q, n_k = L // sa.BLOCK_M, L // sa.BLOCK_N
    mask = torch.rand(B, H, n_q, n_k, generator=torch.Generator().manual_seed(8)) < 0.6
    if is_causal:
        allowed, diagonal = sa.causal_block_geometry(n_q, n_k, L, L, sa.BLOCK_M, sa.BLOCK_N)
        mask = (mask & allowed) | diagonal
    mask = mask.to(DEVICE)
    lut, counts = sa.block_mask_to_lut(mask)
    ref = sa.block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal)
    base = {"USE_TMA": 1, "SINGLE_LOOP": 1, "num_warps": 4, "num_stages": 1 if DEVICE == "cpu" else 2}
    for host in (1, 0):
        out = sa.block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal, config={**base, "HOST_DESCRIPTORS": host})
        torch.testing.assert_close(out, ref, **FP32_TOL)
    # a layout whose heads do not collapse into rows (HF's (B, L, H, D) transposed) falls back
    q_t = on_device(randn(B, L, H, D, seed=83))[0].transpose(1, 2)
    assert not sa.host_descriptors_supported(q_t, k, v, q, sa.BLOCK_M, sa.BLOCK_N)
    out = sa.block_sparse_attention(q_t, k, v, lut, counts, is_causal=is_causal, config=base)
    torch.testing.assert_close(out, sa.block_sparse_attention_reference(q_t, k, v, mask, is_causal=is_causal), **FP32_TOL)


@pytest.mark.parametrize("length", [512, 450])
def test_single_loop_row_with_no_kept_block_gives_zero(length):
    # an empty block list (count 0): the single loop reads the list's first entry before Q either
    # way (an unused slot), runs no tile and writes 0; the other rows are unaffected
    B, H, L, D = 1, 2, length, 64
    q, k, v = on_device(*(randn(B, H, L, D, seed=s) for s in (94, 95, 96)))
    if not sa.tma_loads_supported(q, k, v):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    n_q, n_k = sa.cdiv(L, sa.BLOCK_M), sa.cdiv(L, sa.BLOCK_N)
    mask = torch.rand(B, H, n_q, n_k, generator=torch.Generator().manual_seed(10)) < 0.5
    mask[0, 1, 2] = False  # head 1, query block 2: nothing kept
    mask[0, 0, 0, -1] = True  # a kept partial last block where L is not a multiple of BLOCK_N
    mask = mask.to(DEVICE)
    lut, counts = sa.block_mask_to_lut(mask)
    config = {"USE_TMA": 1, "SINGLE_LOOP": 1, "num_warps": 4, "num_stages": 1 if DEVICE == "cpu" else 2}
    out = sa.block_sparse_attention(q, k, v, lut, counts, config=config)
    ref = sa.block_sparse_attention_reference(q, k, v, mask)
    empty = slice(2 * sa.BLOCK_M, 3 * sa.BLOCK_M)
    assert torch.equal(out[0, 1, empty], torch.zeros_like(out[0, 1, empty]))
    keep = torch.ones(L, dtype=torch.bool)
    keep[empty] = False
    torch.testing.assert_close(out[0, 1, keep], ref[0, 1, keep], **FP32_TOL)
    torch.testing.assert_close(out[0, 0], ref[0, 0], **FP32_TOL)


@pytest.mark.gpu
def test_autotuned_kernel_launches_directly_once_tuned():
    # after the first call tunes it, a call with the same shapes (fresh data, fresh host
    # descriptors) launches the chosen config's compiled kernel without the autotuner
    B, H, L, D = 1, 2, 512, 64
    n_q, n_k = L // sa.BLOCK_M, L // sa.BLOCK_N
    mask = (torch.rand(B, H, n_q, n_k, generator=torch.Generator().manual_seed(9)) < 0.6).to(DEVICE)
    lut, counts = sa.block_mask_to_lut(mask)

    def inputs(seed):
        return on_device(*(randn(B, H, L, D, seed=seed + i, dtype=torch.bfloat16) for i in range(3)))

    sa.block_sparse_attention(*inputs(90), lut, counts)
    tuner = sa._sparse_attention_kernel_tuned

    def autotuner_called(*args, **kwargs):
        raise AssertionError("the autotuner's call path was taken for a known launch key")

    tuner.run = autotuner_called
    try:
        q, k, v = inputs(93)
        out = sa.block_sparse_attention(q, k, v, lut, counts)
    finally:
        del tuner.run
    ref = sa.block_sparse_attention_reference(q, k, v, mask)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_tuned_descriptor_config_is_not_reused_on_misaligned_keys():
    """The autotuner prunes descriptor (TMA) configs by alignment only when it tunes a key. Its key
    lacked alignment, so after tuning on aligned K/V a call with the same shapes but K/V rows at a
    264-byte stride ran a descriptor config anyway (0.36 max error on the H100)."""
    B, H, L, D = 1, 8, 4000, 128
    q, k, v = on_device(*(randn(B, H, L, D, seed=s, dtype=torch.bfloat16) for s in (95, 96, 97)))
    lut, counts = sa.predict_block_lut(q, k)
    aligned = sa.block_sparse_attention(q, k, v, lut, counts)
    padded = [torch.cat([t, torch.zeros(B, H, L, 4, device=t.device, dtype=t.dtype)], -1)[..., :D] for t in (k, v)]
    assert not sa.tma_loads_supported(*padded) and torch.equal(padded[0], k)
    misaligned = sa.block_sparse_attention(q, *padded, lut, counts)
    torch.testing.assert_close(misaligned.float(), aligned.float(), atol=2e-2, rtol=2e-2)


def test_tuning_space_runs_the_merged_single_loop_at_two_stages_from_head_dim_128():
    # from head dim 128 the single loop is tuned at 2 stages only, with the masked suffix merged (the
    # 3-stage loop lost on the H100 yet was picked when tuned at full density); smaller heads keep both
    q = on_device(randn(1, 1, 128, 128, seed=87))[0]
    if not sa.tma_loads_supported(q):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    named = {"q_ptr": q, "k_ptr": q, "v_ptr": q, "o_ptr": q}

    def single_loops(head_dim):
        kept = sa._prune_attention_configs(sa._attention_configs(), named, HEAD_DIM=head_dim, PV_SKIP=False)
        return sorted((c.num_stages, c.kwargs["MERGED_SUFFIX"]) for c in kept if c.kwargs.get("SINGLE_LOOP"))
    assert single_loops(128) == [(2, 1)]
    assert single_loops(64) == [(2, 1), (3, 0)]


def test_host_descriptors_config_names_its_conditions():
    # a length that is not a whole number of query blocks cannot use descriptors over all heads' rows
    q, k, v = on_device(*(randn(1, 2, 200, 32, seed=s) for s in (84, 85, 86)))
    if not sa.tma_loads_supported(q, k, v):
        pytest.skip("tensor descriptors need a Hopper+ GPU (or the interpreter) and a Triton that has them")
    assert not sa.host_descriptors_supported(q, k, v, q, sa.BLOCK_M, sa.BLOCK_N)
    lut, counts = sa.block_mask_to_lut(torch.ones(1, 2, 2, 4, dtype=torch.bool, device=q.device))
    with pytest.raises(ValueError, match="HOST_DESCRIPTORS=1 needs .* multiples of the blocks .* valid choice here: "
                                         "HOST_DESCRIPTORS=0"):
        sa.block_sparse_attention(q, k, v, lut, counts, config={"USE_TMA": 1, "SINGLE_LOOP": 1, "num_warps": 4,
                                                                "num_stages": 1, "HOST_DESCRIPTORS": 1})
