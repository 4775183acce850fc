"""graphopt.cost.fp4: the FP4 paths' estimates, the path choice, and the path of every token count
that the fp4_linear pass hands to graphopt::fp4_linear."""

import pytest
import torch

from graphopt.cost import fp4 as fp4_cost
from graphopt.cost_model import linear
from graphopt.hardware import SPECS
from graphopt.kernels import fp4, fp4_tma


def test_device_path_is_the_cost_models_choice_and_cached(monkeypatch):
    """device_path is choose_fp4_path on the device's spec, computed once per shape and token count
    (the estimate is ~40 us of Python); without a GPU spec it is the kernels' static default_path."""
    from graphopt import hardware

    monkeypatch.setattr(hardware, "device_spec", lambda index: SPECS["h100"])
    fp4_cost.device_path.cache_clear()
    calls = []
    real = fp4_cost.choose_fp4_path
    monkeypatch.setattr(fp4_cost, "choose_fp4_path", lambda *a: calls.append(a) or real(*a))
    try:
        bf16 = torch.bfloat16
        for tokens in (1, 1, 4096, 4096, 1):
            assert (fp4_cost.device_path(0, tokens, 5120, 13824, "nvfp4", bf16)
                    == real(SPECS["h100"], tokens, 5120, 13824, "nvfp4", bf16))
        assert [c[1] for c in calls] == [1, 4096]
        monkeypatch.setattr(hardware, "device_spec", lambda index: SPECS["cpu"])  # no GPU: by token count
        assert fp4_cost.device_path(1, 1, 64, 64, "nvfp4", bf16) == "gemv"
        assert fp4_cost.device_path(1, 4096, 64, 64, "nvfp4", bf16) == "gemm"
        assert fp4_cost.device_path(None, 16, 64, 64, "nvfp4", bf16) == "gemv"  # the interpreter, no device
        assert fp4_cost.device_path(None, 17, 64, 64, "nvfp4", bf16) == "gemm"
    finally:
        fp4_cost.device_path.cache_clear()


@pytest.mark.parametrize("target", ["h100", "h200", "a100", "rtx4090"])
@pytest.mark.parametrize("k,n", [(5120, 13824), (13824, 5120), (4096, 4096), (2048, 8192), (64, 64)])
def test_path_ranges_give_every_token_count_its_buckets_path(monkeypatch, target, k, n):
    """The kernel string the pass builds from path_ranges gives a call of any token count the path
    device_path gives its power-of-two bucket; past the last bucket priced, the choice no longer
    changes (checked up to 2^40 tokens)."""
    from graphopt import hardware

    monkeypatch.setattr(hardware, "device_spec", lambda index: SPECS[target])
    fp4_cost.device_path.cache_clear()
    try:
        for fmt, dtype in (("nvfp4", torch.bfloat16), ("mxfp4", torch.float16)):
            ranges = fp4_cost.path_ranges(0, k, n, fmt, dtype)
            assert ranges[0][0] == 1 and ranges[-1][1] is None
            assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(ranges, ranges[1:]))
            kernel = fp4.kernel_string([(lo, hi, path, None) for lo, hi, path in ranges])
            for tokens in [*range(1, 70), 100, 255, 256, 257, 1000, 4096, 5000, 10**5, 2**24, 2**24 + 1, 2**40]:
                path, tile = fp4.kernel_choice(kernel, tokens)
                assert tile is None
                assert path == fp4_cost.device_path(0, fp4._token_bucket(tokens), k, n, fmt, dtype), (tokens, ranges)
    finally:
        fp4_cost.device_path.cache_clear()


def test_tma_decode_is_costed_only_where_the_tuner_can_pick_it():
    """The TMA kernel's estimate (sm_90+, NVFP4, bf16, K steps of 256) enters the gemv path's
    choice only where the kernels' _runs_here / _valid_config would let the tuner time it; elsewhere the
    Triton kernels' estimate stands, and on the H100 at 16 tokens it is the slower one."""
    h100, a100, bf16 = SPECS["h100"], SPECS["a100"], torch.bfloat16
    assert fp4_cost.tma_decode_applies(h100, 5120, "nvfp4", bf16) == (fp4_tma.gluon is not None)
    assert not fp4_cost.tma_decode_applies(h100, 5120, "nvfp4", torch.float16)
    assert not fp4_cost.tma_decode_applies(h100, 5120, "mxfp4", bf16)
    assert not fp4_cost.tma_decode_applies(a100, 5120, "nvfp4", bf16)
    assert not fp4_cost.tma_decode_applies(SPECS["cpu"], 5120, "nvfp4", bf16)
    assert not fp4_cost.tma_decode_applies(h100, 5120 + 128, "nvfp4", bf16)  # padded K not a multiple of 256
    if fp4_tma.gluon is None:
        return
    tma = fp4_cost.estimate_fp4_linear(h100, 16, 5120, 13824, "nvfp4", path="gemv")
    triton_only = fp4_cost.estimate_fp4_linear(h100, 16, 5120, 13824, "nvfp4", path="gemv", act_dtype=torch.float16)
    assert "TMA" in tma.name and "TMA" not in triton_only.name
    # L2-cold on the H100: 25.5 us on the TMA kernel, 40.4 us on the Triton one
    assert 0.022 < tma.ms < 0.029 < 0.036 < triton_only.ms < 0.045


def test_cost_model_picks_decode_for_few_tokens_and_prefill_for_many():
    hw = SPECS["h100"]
    for n, k in ((13824, 5120), (5120, 13824), (4096, 4096)):
        assert [fp4_cost.choose_fp4_path(hw, t, k, n, "nvfp4") for t in (1, 4, 16)] == ["gemv"] * 3
        assert fp4_cost.choose_fp4_path(hw, 4096, k, n, "nvfp4") == "dequant"  # the decode is a few % of cuBLAS
        assert fp4_cost.choose_fp4_path(hw, 256, k, n, "nvfp4") != "gemv"
    est = fp4_cost.estimate_fp4_linear(hw, 1, 5120, 13824, "nvfp4")
    # 4.5 bits per weight (+ 1/16 byte of scale per element for NVFP4)
    assert est.bytes >= 13824 * 5120 * (0.5 + 1 / 16)
    # Measured on an H100 (bench/results/fp4_linear_mma_decode_h100.json): 2.07x cold. The decode
    # kernel is bound by its dequantization work, not by the 3.6x fewer bytes.
    assert 1.5 < linear(hw, 1, 5120, 13824).ms / est.ms < 3.0
    cpu = SPECS["cpu"]
    assert fp4_cost.estimate_fp4_linear(cpu, 1, 5120, 13824).ms > linear(cpu, 1, 5120, 13824).ms


