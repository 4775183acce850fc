"""kernels/linear_fusion.py: the torch form of the neighbours a one-token linear takes in is the
model's own computation, op for op; bad arguments are named."""

import pytest
import torch
import torch.nn.functional as F

from graphopt.kernels import fp4
from graphopt.kernels.linear_fusion import FUSIONS, NO_FUSION, LinearFusion, example_fusion, interleave_gate_up

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_forms_are_llamas_rms_norm_silu_gate_and_residual_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=gen))
    h = (torch.randn(2, 3, 96, generator=gen) * 5).to(dtype)
    fusion = LinearFusion(norm_weight=norm.weight.detach(), norm_eps=1e-5)
    assert torch.equal(fusion.prologue(h), norm(h))
    gate, up = torch.randn(2, 2, 3, 96, generator=gen).to(dtype)
    interleaved = torch.stack((gate, up), -1).flatten(-2)  # the product of interleaved gate / up rows
    assert torch.equal(LinearFusion(gated=True).epilogue(interleaved), F.silu(gate) * up)
    residual = torch.randn(2, 3, 40, generator=gen).to(dtype)
    y = torch.randn(2, 3, 40, generator=gen).to(dtype)
    assert torch.equal(LinearFusion(residual=residual).epilogue(y), residual + y)
    assert NO_FUSION.prologue(h) is h and NO_FUSION.epilogue(y) is y and not NO_FUSION.active


def test_interleaving_puts_each_gate_row_beside_its_up_row():
    weight = torch.arange(12.0).reshape(6, 2)  # gate rows 0-2, up rows 3-5
    assert interleave_gate_up(weight)[:, 0].tolist() == [0.0, 6.0, 2.0, 8.0, 4.0, 10.0]
    x = torch.randn(5, 2)
    product = x @ interleave_gate_up(weight).T
    gate, up = (x @ weight.T).split([3, 3], -1)
    assert torch.equal(LinearFusion(gated=True).epilogue(product), F.silu(gate) * up)
    with pytest.raises(ValueError, match="7 rows, expected an even count"):
        interleave_gate_up(torch.ones(7, 2))


def test_the_options_name_the_same_neighbours():
    from graphopt.config import DECODE_FUSIONS

    assert DECODE_FUSIONS == FUSIONS


def test_bad_arguments_name_the_problem():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"x has 64 features; the weight expects 128"):
        NO_FUSION.check(x, 128, 16)
    with pytest.raises(ValueError, match="a gated epilogue needs an even number of output features .* got 15"):
        LinearFusion(gated=True).check(x, 64, 15)
    with pytest.raises(ValueError, match=r"residual must be torch.float32 \(1, 8\)"):
        LinearFusion(gated=True, residual=torch.ones(1, 16)).check(x, 64, 16)
    with pytest.raises(ValueError, match=r"norm_weight must be torch.float32 \(64,\) \(x's dtype\), got torch.float32 \(32,\)"):
        LinearFusion(norm_weight=torch.ones(32), norm_eps=1e-5).check(x, 64, 16)
    with pytest.raises(ValueError, match=r"norm_weight must be torch.float32 \(64,\) \(x's dtype\), got torch.bfloat16"):
        LinearFusion(norm_weight=torch.ones(64, dtype=torch.bfloat16), norm_eps=1e-5).check(x, 64, 16)
    with pytest.raises(ValueError, match="residual is on meta but x is on cpu"):
        LinearFusion(residual=torch.ones(1, 16, device="meta")).check(x, 64, 16)
    with pytest.raises(ValueError, match="norm_eps must be > 0"):
        LinearFusion(norm_weight=torch.ones(64)).check(x, 64, 16)
    with pytest.raises(ValueError, match=r"residual must be torch.float32 \(1, 16\)"):
        LinearFusion(residual=torch.ones(16)).check(x, 64, 16)
    with pytest.raises(ValueError, match="unknown fused neighbours \\['gelu'\\]; valid choices: rms_norm, silu_gate, residual"):
        example_fusion(("gelu",), 1, 64, 16, torch.float32, "cpu")


def test_the_fp4_op_on_the_cpu_runs_the_neighbours_around_its_reference():
    """graphopt::fp4_linear with the fusion arguments equals the unfused op between the torch forms."""
    import graphopt.ops  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(1)
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(48, 64, generator=gen) * 0.1, "nvfp4"))
    args = (kw.codes, kw.codes, kw.scales, kw.global_scale, None, 48, 64, "nvfp4", "")
    for fused in ((), ("rms_norm",), ("silu_gate", "residual"), FUSIONS):
        torch.manual_seed(len(fused))
        fusion = example_fusion(fused, 1, 64, 48, torch.float32, "cpu")
        x = torch.randn(1, 64, generator=gen)
        got = torch.ops.graphopt.fp4_linear(x, *args, norm_weight=fusion.norm_weight, norm_eps=fusion.norm_eps,
                                            gated=fusion.gated, residual=fusion.residual)
        want = fusion.epilogue(torch.ops.graphopt.fp4_linear(fusion.prologue(x), *args))
        assert got.shape == (1, 24 if fusion.gated else 48) and torch.equal(got, want)
    with pytest.raises(ValueError, match="x has 32 features; the weight expects 64"):
        torch.ops.graphopt.fp4_linear(torch.randn(1, 32), *args, gated=True)


def test_a_fused_call_is_tuned_under_its_own_key_and_unfused_keys_stay_as_they_were():
    from graphopt.kernels.fp4.launcher import _tuned_key

    x2 = torch.randn(1, 64)
    args = (x2, torch.zeros(48, 32, dtype=torch.uint8), None, None, None, 48, 64, "nvfp4", torch.float32)
    plain, fused = _tuned_key("gemv", args, True), _tuned_key("gemv", args, True, ("rms_norm",))
    assert plain == ("gemv", 1, 48, 64, "nvfp4", torch.float32, False, x2.device.index, True)  # the tuning files' keys
    assert fused[:-2] == plain[:-2] + (("rms_norm",),) and fused[-2:] == plain[-2:]
