"""The FP4 tile tuner checks every candidate against the float64 reference product before timing it
(kernels run under TRITON_INTERPRET=1 without a GPU; the GPU tests time real tiles)."""

import pytest
import torch

from graphopt.kernels import fp4, tuning
from graphopt.kernels.fp4 import FORMATS, KernelConfig
from graphopt.kernels.fp4 import tune
from graphopt.kernels.fp4.launcher import _activation_rows
from tests.kernels.test_fp4 import DEVICE, _case


def _args(x, kw, b, n, k, fmt):
    """tune_config's argument tuple, as the launcher builds it."""
    x2, out_dtype = _activation_rows(x, k)
    return (x2, kw.codes, kw.scales.view(torch.uint8), kw.global_scale, b, n, k, fmt, out_dtype)


# fp16 and fp32 outputs: Triton's interpreter casts fp32 to bf16 by truncation (up to 2^-7 off where
# a GPU rounds to nearest), which leaves a bf16 output there no margin under the tuner's tolerance.
@pytest.mark.parametrize("fmt,dtype", [("nvfp4", torch.float16), ("mxfp4", torch.float32)])
def test_a_wrong_first_tile_is_left_out_and_the_right_ones_are_timed(monkeypatch, caplog, fmt, dtype):
    """The first candidate computes a wrong product and would time fastest: the tuner leaves it
    out with a warning and picks the fastest right tile. The integer-dot tile, which rounds its
    activations to int16, counts as right, also for fp32 output."""
    n, k = 40, 300
    x, kw, b, _ = _case(fmt, 2, n, k, dtype, True, seed=12)
    args = _args(x, kw, b, n, k, fmt)
    broken = KernelConfig(16, 2, 64, split_k=2, num_stages=1)
    integer_dots = KernelConfig(16, 2, 64, split_k=2, num_stages=1, int_dots=True)
    plain = KernelConfig(16, 2, 64, split_k=1, num_stages=1)
    real_launch = tune._launch

    def launch(path, cfg, *rest, **options):
        out = real_launch(path, cfg, *rest, **options)
        return out * 1.5 if cfg == broken else out

    monkeypatch.setattr(tune, "_launch", launch)
    speed = {broken: 1.0, integer_dots: 2.0, plain: 3.0}
    timed = []

    def time_config(cfg):
        timed.append(cfg)
        return speed[cfg]

    with caplog.at_level("WARNING", logger=tune.__name__):
        picked = tune._fastest_right("gemv", args, [broken, integer_dots, plain], time_config)
    assert picked == integer_dots
    assert timed == [integer_dots, plain]
    assert caplog.text.count("wrong product") == 1 and "split_k=2" in caplog.text


def test_a_tile_with_non_finite_output_is_left_out(monkeypatch):
    n, k = 24, 128
    x, kw, b, _ = _case("nvfp4", 1, n, k, torch.float16, False, seed=13)
    args = _args(x, kw, b, n, k, "nvfp4")
    nan_tile, right = KernelConfig(16, 1, 64, num_stages=1), KernelConfig(16, 1, 128, num_stages=1)
    real_launch = tune._launch

    def launch(path, cfg, *rest, **options):
        out = real_launch(path, cfg, *rest, **options)
        return out.index_fill(1, torch.tensor([3], device=out.device), float("nan")) if cfg == nan_tile else out

    monkeypatch.setattr(tune, "_launch", launch)
    assert tune._fastest_right("gemv", args, [nan_tile, right], lambda cfg: 1.0 if cfg == nan_tile else 2.0) == right
    assert tune._fastest_right("gemv", args, [nan_tile], lambda cfg: 1.0) is None


@pytest.mark.parametrize("fused", [("rms_norm", "residual"), ("silu_gate",)], ids="+".join)
def test_a_fused_call_is_checked_and_timed_with_its_neighbours(monkeypatch, fused):
    """With the neighbours a call took in, each tile runs with them (in torch around the tiles that
    do not take them) against the float64 reference of the whole computation: the right tiles pass,
    a tile that skips the epilogue does not."""
    from graphopt.kernels.linear_fusion import example_fusion

    n, k = 24, 128
    torch.manual_seed(14)
    fusion = example_fusion(fused, 1, k, n, torch.float16, DEVICE)
    x, kw, b, _ = _case("nvfp4", 1, n, k, torch.float16, True, seed=14)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(15)).to(x.device, x.dtype)
    x2, out_dtype = _activation_rows(x, k)
    args = (x2, kw.codes, kw.scales.view(torch.uint8), kw.global_scale, b, n, k, "nvfp4", out_dtype)
    skips, right = KernelConfig(16, 1, 64, num_stages=1), KernelConfig(16, 1, 128, num_stages=1)
    real_call = tune._call

    def call(path, cfg, args, fusion):
        out = real_call(path, cfg, args, fusion)
        return out - fusion.residual if cfg == skips and fusion.residual is not None else out

    monkeypatch.setattr(tune, "_call", call)
    picked = tune._fastest_right("gemv", args, [skips, right], lambda cfg: 1.0 if cfg == skips else 2.0, fusion)
    assert picked == (right if "residual" in fused else skips)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path,tokens", [("gemv", 1), ("gemv", 2), ("gemv", 4), ("gemv", 16), ("gemv", 40),
                                         ("gemv", 64), ("gemm", 64), ("gemm", 200)])
def test_every_candidate_tile_the_tuner_may_pick_computes_the_product(fmt, path, tokens):
    """The tuner picks whichever candidate is fastest, so every one must be right: split-K
    reductions, inline-asm decodes and the TMA kernel run only on the GPU (the interpreter runs
    other code paths), at a layer size where split-K splits a short K and at an odd one."""
    wrong = []
    for n, k, seed in ((256, 512, 1), (200, 1000, 2)):
        x, kw, b, ref = _case(fmt, tokens, n, k, torch.bfloat16, True, seed=seed)
        candidates = fp4._candidates(path, _args(x, kw, b, n, k, fmt), allow_gluon=True)
        assert candidates, (path, tokens, n, k)
        for cfg in candidates:
            y = fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, b, n, k, fmt, path=path, config=cfg)
            err = (y.double().cpu() - ref).abs().max().item()
            if not err <= 8e-3 * ref.abs().max().item() + 1e-6:
                wrong.append(f"{cfg} at {tokens}x{n}x{k}: max error {err:.3g}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("path,tokens", [("gemv", 1), ("gemv", 4), ("gemv", 16), ("gemm", 200)])
def test_the_tuner_leaves_out_a_tile_whose_product_is_wrong(monkeypatch, tmp_path, caplog, path, tokens):
    """Only the untuned default computes the right product here (every other tile's output is
    corrupted): the tuner must pick the default, whatever the others' speed."""
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    fresh = {}  # nothing tuned earlier in this process: the launcher's default is the fixed one
    monkeypatch.setattr(fp4.launcher, "_TUNED", fresh)
    monkeypatch.setattr(tune, "_TUNED", fresh)
    n, k = 256, 512
    x, kw, b, _ = _case("nvfp4", tokens, n, k, torch.bfloat16, True, seed=3)
    args = _args(x, kw, b, n, k, "nvfp4")
    default = fp4.default_config(path, args)
    assert len(fp4._candidates(path, args, allow_gluon=False)) > 1
    real_launch = tune._launch

    def corrupted(path, cfg, *rest, **options):
        out = real_launch(path, cfg, *rest, **options)
        return out if cfg == default else out * 1.5

    monkeypatch.setattr(tune, "_launch", corrupted)
    with caplog.at_level("WARNING", logger=tune.__name__):
        picked = fp4.tune_config(path, args, allow_gluon=False)
    assert picked == default
    assert "wrong product" in caplog.text
