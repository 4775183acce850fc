"""The cost model against hand computations."""

import pytest

from graphopt import cost_model as cm
from graphopt.cost import coefficients
from graphopt.hardware import SPECS

H100 = SPECS["h100"]
OVERLAP = coefficients.value(H100, "gemm.partial_overlap")


def test_large_gemm_is_compute_bound_at_the_matrix_ceiling():
    n = 8192
    est = cm.gemm(H100, n, n, n)
    memory_s = 2 * 3 * n * n / (H100.memory_ceiling * cm.family_efficiency(H100, "cublas_gemm")[1])
    # the compute term, plus the part of the (smaller) memory term it does not hide
    expected_s = 2 * n**3 / H100.matrix_ceiling + OVERLAP * memory_s + H100.launch_overhead
    assert est.bound == "compute"
    assert est.ms == pytest.approx(expected_s * 1e3, rel=1e-9)


def test_one_token_linear_is_memory_bound_on_the_weights():
    est = cm.linear(H100, 1, 5120, 13824)
    weight_bytes = 2 * (5120 * 13824 + 5120 + 13824)
    compute_s = 2 * 5120 * 13824 / H100.matrix_ceiling  # one token's real MACs, not the padded tile
    expected_s = (weight_bytes / (H100.memory_ceiling * cm.family_efficiency(H100, "cublas_gemm")[1])
                  + OVERLAP * compute_s + H100.launch_overhead)
    assert est.bound == "memory"
    assert est.ms == pytest.approx(expected_s * 1e3, rel=1e-9)
    # shared/DESIGN.md measured 0.0636 ms on an H100; the model should be in that neighbourhood
    assert 0.03 < est.ms < 0.09


def test_naive_attention_counts_the_score_matrix_traffic():
    b, h, l, d = 2, 32, 4096, 128
    est = cm.naive_attention(H100, b, h, l, l, d, fused_pointwise=False)
    scores = b * h * l * l
    # at least: write S, read+write S for scale, read+write for softmax, read P
    assert est.bytes >= 2 * scores * 6
    assert est.launches == 4
    fused = cm.naive_attention(H100, b, h, l, l, d, fused_pointwise=True)
    assert fused.ms < est.ms and fused.launches == 3


def test_sdpa_moves_no_score_matrix_and_beats_naive():
    b, h, l, d = 2, 32, 4096, 128
    naive = cm.naive_attention(H100, b, h, l, l, d)
    cudnn = cm.sdpa(H100, b, h, l, l, d, backend="cudnn")
    assert cudnn.bytes == 2 * (4 * b * h * l * d)
    assert cudnn.flops == 4 * b * h * l * l * d
    assert cudnn.ms < naive.ms
    # shared/DESIGN.md: cuDNN 0.88 ms at this shape on an H100 (uncalibrated model within 25%)
    assert cudnn.ms == pytest.approx(0.88, rel=0.25)


def test_causal_halves_attention_flops():
    full = cm.attention_flops(1, 1, 1024, 1024, 64)
    assert cm.attention_flops(1, 1, 1024, 1024, 64, causal=True) == full / 2


@pytest.mark.parametrize("spec", ["h100", "a100", "cpu"])
@pytest.mark.parametrize("length", [1, 64, 128, 200, 256, 1024, 8192])
def test_causal_fused_attention_is_never_priced_above_non_causal(spec, length):
    """The diagonal-tile term (one extra tile column per row of tiles) stays bounded at short
    lengths, so short causal attention is not declined where the same non-causal one is rewritten
    (unbounded, it would price L=64 at 2.5x the non-causal FLOPs)."""
    hw = SPECS[spec]
    for family in ("sdpa_flash", "triton_flash"):
        full = cm.fused_attention(hw, 1, 8, length, length, 64, family=family)
        causal = cm.fused_attention(hw, 1, 8, length, length, 64, family=family, causal=True)
        assert causal.flops <= full.flops and causal.ms <= full.ms * (1 + 1e-9), (family, causal, full)


def test_launch_bound_tiny_work():
    est = cm.roofline(H100, "tiny", flops=10, bytes_moved=100, launches=3, family="pointwise")
    assert est.bound == "launch"
    assert est.ms == pytest.approx(3 * H100.launch_overhead * 1e3, rel=1e-3)


def test_unknown_family_and_backend_are_clear_errors():
    with pytest.raises(ValueError, match="valid choices"):
        cm.roofline(H100, "x", flops=1, family="cutlass")
    with pytest.raises(ValueError, match="valid choices: cudnn, flash, efficient, math"):
        cm.sdpa(H100, 1, 1, 8, 8, 8, backend="xformers")


def test_triton_attention_is_no_better_than_sdpa_flash_before_hopper():
    """Our Triton attention families were fitted on Hopper (TMA, wgmma). On an older GPU they are
    priced at SDPA flash's efficiency, so only skipped work can make them win there."""
    b, h, l, d = 1, 32, 8192, 128
    for target in ("a100", "rtx3060", "rtx4090"):
        hw = SPECS[target]
        assert hw.compute_capability < cm.HOPPER
        flash = cm.sdpa(hw, b, h, l, l, d, backend="flash")
        triton = cm.fused_attention(hw, b, h, l, l, d, family="triton_flash")
        assert triton.ms >= flash.ms, target
        assert cm.family_efficiency(hw, "triton_sparse")[0] <= cm.family_efficiency(hw, "sdpa_flash")[0]
    # on Hopper, the measured advantage stands
    assert cm.fused_attention(H100, b, h, l, l, d, family="triton_flash").ms < cm.sdpa(H100, b, h, l, l, d, backend="flash").ms
    assert cm.family_efficiency(SPECS["h200"], "triton_sparse") == coefficients.value(SPECS["h200"], "efficiency.triton_sparse")


def test_slower_gpu_predicts_longer_times():
    assert cm.gemm(SPECS["rtx3060"], 4096, 4096, 4096).ms > cm.gemm(H100, 4096, 4096, 4096).ms * 10


def test_measured_table_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    key = cm.shape_key(1, 32, 4096, 4096, 128, True)
    assert cm.lookup_measured("attention", "GPU", key) is None
    cm.record_measured("attention", "GPU", key, {"cudnn": 1.0, "flash": 1.5})
    assert cm.lookup_measured("attention", "GPU", key) == {"cudnn": 1.0, "flash": 1.5}


def test_host_paced_estimate_takes_the_longer_of_gpu_and_host_time():
    hw = SPECS["h100"]
    host_ms = 7.5 * hw.host_op_overhead * 1e3
    short = cm.Estimate("kernel", host_ms / 3, 1e6, 1e6, 1, "launch")
    paced = cm.host_paced(hw, short, 7.5, "op host path")
    assert paced.bound == "host" and paced.ms == pytest.approx(host_ms) and "op host path" in paced.name
    assert (paced.flops, paced.bytes, paced.launches) == (short.flops, short.bytes, short.launches)
    long = cm.Estimate("kernel", host_ms * 3, 1e12, 1e9, 1, "compute")
    assert cm.host_paced(hw, long, 7.5, "op host path") is long


def test_graph_replay_option_switches_host_pricing_off():
    from graphopt.config import GraphOptConfig

    assert GraphOptConfig().prices_host_path
    assert not GraphOptConfig(graph_replay=True).prices_host_path
    assert not GraphOptConfig(cuda_graphs=True).prices_host_path
    with pytest.raises(ValueError, match="graph_replay must be True or False"):
        GraphOptConfig(graph_replay="yes")


def test_decode_attention_splits_fill_the_gpu_with_two_step_chunks_or_one_step_ones_on_a_short_cache():
    hw = SPECS["h100"]  # 132 SMs: 264 programs wanted
    # two-step chunks where they give at least half the SMs a program
    assert cm.decode_attention_splits(hw, 1, 8, 2048) == 2048 // (2 * cm.DECODE_ATTENTION_BLOCK_N)
    assert cm.decode_attention_splits(hw, 8, 8, 640) == -(-640 // (2 * cm.DECODE_ATTENTION_BLOCK_N))
    assert cm.decode_attention_splits(hw, 1, 8, 32768) == 33
    assert cm.decode_attention_splits(hw, 64, 8, 32768) == 1
    # batch 1, short cache: five two-step chunks per KV head would leave 92 of 132 SMs idle
    assert cm.decode_attention_splits(hw, 1, 8, 640) == 640 // cm.DECODE_ATTENTION_BLOCK_N
    assert cm.decode_attention_splits(hw, 1, 8, 1024) == 1024 // cm.DECODE_ATTENTION_BLOCK_N
    assert cm.decode_attention_splits(hw, 1, 8, 1) == 1
