"""The q4_linear pass: plain linears, quantize->GEMM fusion of both idioms, cost-model choices,
declines, and the two ONNX forms in onnxruntime."""

import math

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.cost.q4 import ctas_per_sm, estimate_q4_fused, estimate_q4_separate
from graphopt.hardware import SPECS
from graphopt.kernels import q4
from graphopt.onnx_export import capture_rewritten, export_onnx, run_onnxruntime
from tests.passes.sibling_models import SiblingsOnALinear

ON = dict(passes={"q4_linear": True}, downstream="eager")


def _targets(module):
    return [str(n.target) for n in module.gm.graph.nodes if n.op == "call_function"]


class MLP(torch.nn.Module):
    def __init__(self, k=64, hidden=96, n=40):
        super().__init__()
        self.up = torch.nn.Linear(k, hidden)
        self.down = torch.nn.Linear(hidden, n, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _q4_mlp_reference(model, x):
    """The same computation written with the references: what the rewritten graph must produce."""
    h = q4.reference_q4_linear(x, *q4.quantize_weight(model.up.weight), model.up.bias)
    return q4.reference_q4_linear(torch.relu(h), *q4.quantize_weight(model.down.weight), None)


def test_linears_are_rewritten_and_compute_q4_x_q8_1():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(2, 3, 64)
    report = graphopt.explain(model, x, force=True, **ON)
    assert report.counts["q4_linear"] == 2
    for d in report.applied("q4_linear"):
        assert d.details["memory_saved_bytes"] > 0 and d.details["sqnr_db"] > 15
    assert torch.allclose(report.output, _q4_mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def test_llama_tiny_compiles_with_q4_linear_forced():
    from graphopt.models import build

    model, inputs = build("tiny-llama", seq_len=8, device="cpu", dtype=torch.float32)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    with torch.no_grad():
        eager = model(*inputs).logits
    report = graphopt.explain(model, *inputs, force=True, **ON)
    applied = report.applied("q4_linear")
    # q/k/v/o, gate, up per layer and lm_head; down_proj (in_features 172) is not a multiple of 32
    assert len(applied) == 2 * 6 + 1
    declined = [d for d in report.declined("q4_linear") if "multiple of 32" in d.reason]
    assert len(declined) == 2
    logits = report.output.logits
    sqnr = 10 * math.log10(eager.pow(2).sum() / (logits - eager).pow(2).sum())
    assert sqnr > 12, sqnr


class Gated(torch.nn.Module):
    """Three linears reading one input (q/k/v-like), then one that does not."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32))
        self.out = torch.nn.Linear(64, 40, bias=False)

    def forward(self, x):
        return self.out(self.q(x) * torch.cat([self.k(x), self.v(x)], dim=-1))


def test_sibling_linears_share_one_q4_gemm_with_unchanged_outputs():
    """q, k and v read the same input: one graphopt::q4_linear on their concatenated Q4_0 weight
    (row-wise blocks, so each weight is quantized exactly as on its own) and a split, giving what
    the one-by-one rewrite gives; `out` stays alone. fuse_sibling_linears=False keeps four."""
    torch.manual_seed(3)
    model, x = Gated().eval(), torch.randn(2, 5, 64)
    fused, decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True})
    single, single_decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True},
                                                 fuse_sibling_linears=False)
    assert _targets(fused).count("graphopt.q4_linear.default") == 2
    assert _targets(single).count("graphopt.q4_linear.default") == 4
    assert [d.location for d in decisions if d.applied and "siblings" in d.reason] == ["q", "k", "v"]
    assert [d.details["sqnr_db"] for d in decisions] == [d.details["sqnr_db"] for d in single_decisions]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), single(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fuse", [True, False])
def test_linears_reading_a_rewritten_linear_read_its_replacement(fuse):
    """a and b read proj's output: after proj is rewritten they must read the new node (a stale
    reference to the erased one would break the graph), grouped or not."""
    torch.manual_seed(4)
    model, x = SiblingsOnALinear(64).eval(), torch.randn(3, 64)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True},
                                             fuse_sibling_linears=fuse)
    assert sum(d.applied for d in decisions) == 3
    assert _targets(rewritten).count("graphopt.q4_linear.default") == (2 if fuse else 3)
    h = q4.reference_q4_linear(x, *q4.quantize_weight(model.proj.weight), None)
    expected = (q4.reference_q4_linear(h, *q4.quantize_weight(model.a.weight), None)
                * q4.reference_q4_linear(h, *q4.quantize_weight(model.b.weight), None))
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), expected, rtol=1e-5, atol=1e-5)


def test_declines_with_reasons():
    torch.manual_seed(1)
    model, x = MLP().eval(), torch.randn(4, 64)
    strict = graphopt.explain(model, x, force=True, error_budget={"q4_linear": 40.0}, **ON)
    assert strict.counts["q4_linear"] == 0
    assert all("below the budget" in d.reason for d in strict.declined("q4_linear"))

    class Computed(torch.nn.Module):  # weight computed in the graph: cannot be frozen
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 64))

        def forward(self, x):
            return F.linear(x, self.w * 2)

    report = graphopt.explain(Computed().eval(), x, force=True, **ON)
    assert report.counts.get("q4_linear", 0) == 0
    # Training graph: weights require grad under autograd, so nothing is frozen.
    compiled = torch.compile(MLP(), backend="graphopt", options=dict(force=True, **ON))
    from graphopt import compiler as backend_module

    with backend_module.recording_decisions() as sink:
        compiled(x).sum().backward()
    assert sink and not any(d.applied for d in sink if d.pass_name == "q4_linear")
    assert any("requires grad" in d.reason for d in sink if d.pass_name == "q4_linear")


def test_fit_regression_cost_model_picks_per_token_count_on_h200():
    import dataclasses

    from graphopt import cost_model

    # The H200 the measurement ran on, with its measured ceilings (bf16 matmul, copy, launch).
    h200 = dataclasses.replace(SPECS["h200"], measured_bf16_flops=690e12, measured_memory_bandwidth=4.22e12,
                               measured_launch_overhead_s=6e-6)

    # As measured on H200 (bench/results/q4_linear_h200.json): the 1-token fused gemv beats cuBLAS
    # bf16 (1.02-1.17x); at 256-4096 tokens the kernels are about 0.1x, fused or separate. (Its
    # 4- and 16-token rows timed other decode kernels; the model predicts graphopt's, which the
    # H100 measured at 1.65-1.74x and 1.30-1.54x: tests/cost/test_fit_regression.py.)
    dense = cost_model.linear(h200, 1, 5120, 13824)
    assert estimate_q4_fused(h200, 1, 5120, 13824).ms < dense.ms
    for tokens in (256, 4096):
        dense = cost_model.linear(h200, tokens, 5120, 13824)
        fused = estimate_q4_fused(h200, tokens, 5120, 13824)
        separate = estimate_q4_separate(h200, tokens, 5120, 13824)
        assert dense.ms < min(fused.ms, separate.ms), tokens
    # A tile whose bf16 staging exceeds shared memory is infeasible; one that fits once is derated.
    huge = q4.TileConfig("gemm", 256, 256, 2, 8, 4)
    assert ctas_per_sm(h200, huge, 2) == 0 and math.isinf(estimate_q4_fused(h200, 4096, 4096, 4096, config=huge).ms)


@pytest.mark.slow
def test_auto_declines_dense_at_many_tokens_on_h100():
    model, x = MLP(k=2048, hidden=2048, n=2048).eval(), torch.randn(4096, 2048)
    options = {k: v for k, v in ON.items() if k != "downstream"}
    one_token = capture_rewritten(model, (x[:1],), target="h100", **options)[1]
    assert all(d.applied for d in one_token if d.pass_name == "q4_linear")
    many = capture_rewritten(model, (x,), target="h100", passes={"q4_linear": True})[1]
    assert not any(d.applied for d in many if d.pass_name == "q4_linear")
    assert all("no win" in d.reason for d in many if d.pass_name == "q4_linear")


class Prequantized(torch.nn.Module):
    def __init__(self, n=40, k=96):
        super().__init__()
        qweight, scales = q4.quantize_weight(torch.randn(n, k))
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        xq = torch.ops.graphopt.quantize_q8_1(x)
        return torch.ops.graphopt.q4_q8_gemm(xq, self.qweight, self.scales, self.bias, x.dtype)


def test_quantize_then_gemm_ops_fuse_with_unchanged_outputs():
    model, x = Prequantized().eval(), torch.randn(3, 96)
    with torch.no_grad():
        eager = model(x)
    rewritten, decisions = capture_rewritten(model, (x,), passes={"q4_linear": True}, q4_mode="fused")
    targets = _targets(rewritten)
    assert "graphopt.q4_linear.default" in targets and not any("quantize_q8_1" in t for t in targets)
    assert [d.details.get("fusion") for d in decisions if d.applied] == ["quantize_q8_1+q4_q8_gemm"]
    with torch.no_grad():
        assert torch.allclose(rewritten(x), eager, rtol=1e-6, atol=1e-6)
    # Negative: q4_mode="separate" keeps the two kernels.
    kept, decisions = capture_rewritten(model, (x,), passes={"q4_linear": True}, q4_mode="separate")
    assert any("quantize_q8_1" in t for t in _targets(kept)) and not any(d.applied for d in decisions)


class FakeQuantLinear(torch.nn.Module):
    """QAT style: fake-quantized activations, a weight that lies on a Q4_0 grid."""

    def __init__(self, k=64, n=24, per_row=False, on_grid=True):
        super().__init__()
        w = torch.randn(n, k)
        self.weight = torch.nn.Parameter(q4.dequantize_q4_0(q4.quantize_q4_0(w)) if on_grid else w)
        self.bias = torch.nn.Parameter(torch.randn(n))
        self.per_row = per_row

    def forward(self, x):
        s = x.abs().amax(-1, keepdim=True) / 127 if self.per_row else 0.02
        xq = torch.round(x / s).clamp(-128, 127) * s
        return F.linear(xq, self.weight, self.bias)


@pytest.mark.parametrize("per_row", [False, True])
def test_fake_quant_idiom_fuses_with_unchanged_outputs(per_row):
    torch.manual_seed(2)
    model, x = FakeQuantLinear(per_row=per_row).eval(), torch.randn(2, 5, 64)
    with torch.no_grad():
        eager = model(x)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True})
    targets = _targets(rewritten)
    assert "graphopt.q4_linear_static.default" in targets
    assert not any("round" in t or "clamp" in t for t in targets)
    assert [d.details.get("fusion") for d in decisions if d.applied] == ["fake_quant+linear"]
    with torch.no_grad():
        out = rewritten(x)
    assert (out - eager).abs().max() <= 2e-6 * eager.abs().max()


def test_fake_quant_idiom_not_fused_when_weight_is_off_grid():
    model, x = FakeQuantLinear(on_grid=False).eval(), torch.randn(3, 64)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True})
    assert "graphopt.q4_linear_static.default" not in _targets(rewritten)
    assert any("Q4_0 grid" in d.reason for d in decisions if not d.applied)
    # The plain rewrite still quantizes the linear itself (dynamic Q8_1 of the fake-quant output).
    assert "graphopt.q4_linear.default" in _targets(rewritten)


@pytest.mark.parametrize("form", ["standard", "matmulnbits"])
def test_onnx_forms_run_in_onnxruntime(form, tmp_path):
    import onnx

    torch.manual_seed(3)
    model, x = MLP().eval(), torch.randn(2, 3, 64)
    path = export_onnx(model, (x,), tmp_path / f"q4_{form}.onnx", onnx_forms={"graphopt::q4_linear": form},
                       passes={"q4_linear": True}, force=True)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("DequantizeLinear" if form == "standard" else "MatMulNBits") == 2
    got = torch.from_numpy(run_onnxruntime(path, x)[0])
    # ONNX computes what the op computes: Q8_1 activations times the Q4_0 weights (in float32, the
    # op in float64), so the two agree to float32 rounding, far closer than weight-only Q4 does.
    with torch.no_grad():
        ours = _q4_mlp_reference(model, x)
        up = q4.dequantize_q4_0(q4.quantize_q4_0(model.up.weight))
        down = q4.dequantize_q4_0(q4.quantize_q4_0(model.down.weight))
        weight_only = torch.relu(x @ up.T + model.up.bias) @ down.T
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=1e-5)
    assert (weight_only - ours).abs().max() > 100 * (got - ours).abs().max()


def test_cpu_target_declines_without_force():
    """Off the GPU the op runs its torch reference (dequantize + dense), which can only lose."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(2, 3, 64)
    report = graphopt.explain(model, x, target="cpu", **ON)
    assert report.counts["q4_linear"] == 0
    declined = report.declined("q4_linear")
    assert len(declined) == 2 and all("no win on generic CPU" in d.reason for d in declined)
    torch.testing.assert_close(report.output, model(x))


def test_fake_quant_with_a_float64_scalar_scale_keeps_eager_dtype():
    """A 0-dim float64 scale does not promote float32 activations in eager torch; the fused op
    must return float32 too (float64, which the CUDA kernel rejects, would be wrong)."""

    class Scalar64(FakeQuantLinear):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.tensor(0.02, dtype=torch.float64))

        def forward(self, x):
            return F.linear(torch.round(x / self.s).clamp(-128, 127) * self.s, self.weight, self.bias)

    torch.manual_seed(3)
    model, x = Scalar64().eval(), torch.randn(2, 5, 64)
    with torch.no_grad():
        eager = model(x)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, passes={"q4_linear": True})
    assert "graphopt.q4_linear_static.default" in _targets(rewritten)
    with torch.no_grad():
        out = rewritten(x)
    assert eager.dtype == out.dtype == torch.float32
    assert (out - eager).abs().max() <= 2e-6 * eager.abs().max()


class BiasVariants(torch.nn.Module):
    """F.linear with a bias of the given shape (broadcast), and addmm with it."""

    def __init__(self, bias_shape, use_addmm=False):
        super().__init__()
        # addmm as GPT-2's Conv1D writes it: the weight stored (in, out)
        self.weight = torch.nn.Parameter(torch.randn(*((64, 48) if use_addmm else (48, 64))) * 0.05)
        self.bias = torch.nn.Parameter(torch.randn(bias_shape))
        self.use_addmm = use_addmm

    def forward(self, x):
        if self.use_addmm:
            return torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("pass_name", ["q4_linear", "fp4_linear"])
@pytest.mark.parametrize("use_addmm", [False, True])
def test_a_bias_that_only_broadcasts_is_declined(pass_name, use_addmm):
    """A (1,) bias broadcasts in eager; the ops take exactly (N,), so the layer stays dense
    (rewritten, it would be refused by the CUDA launcher at run time)."""
    model, x = BiasVariants((1,), use_addmm).eval(), torch.randn(6, 64)
    report = graphopt.explain(model, x, force=True, passes={pass_name: True}, downstream="eager")
    assert report.counts[pass_name] == 0
    assert any("is not a (48,) vector" in d.reason for d in report.declined(pass_name))
    with torch.no_grad():
        assert torch.equal(report.output, model(x))


def test_mixed_dtypes_under_autocast_are_declined():
    """Under autocast a linear reads fp32 and returns bf16; the op returns its input's dtype, so
    the rewrite would change the dtype the rest of the graph sees."""
    model, x = MLP().eval(), torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = graphopt.explain(model, x, force=True, **ON)
    by_layer = {d.location.rsplit(".", 1)[-1]: d for d in report.decisions if d.pass_name == "q4_linear"}
    assert not by_layer["up"].applied and "mixed dtypes" in by_layer["up"].reason  # fp32 in, bf16 out
    assert by_layer["down"].applied  # bf16 in, bf16 out
    assert report.output.dtype == torch.bfloat16


def test_a_weight_whose_block_scale_overflows_fp16_is_declined():
    """Q4_0 stores d = max / -8 in fp16: past ~5.2e5 it is inf and the SQNR NaN, which must fail the
    budget check rather than pass it (NaN < budget is False)."""
    model, x = torch.nn.Linear(64, 40).eval(), torch.randn(4, 64)
    with torch.no_grad():
        model.weight.mul_(1e7)
        eager = model(x)
    report = graphopt.explain(model, x, force=True, **ON)
    (decision,) = [d for d in report.decisions if d.pass_name == "q4_linear"]
    assert not decision.applied and math.isnan(decision.details["sqnr_db"])
    assert torch.isfinite(eager).all() and torch.equal(report.output, eager)


class TiedAndTransposed(torch.nn.Module):
    """One weight read by two linears (tied), the second spelled x @ W.T."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(96, 64) * 0.05)

    def forward(self, x):
        return F.linear(x, self.weight) + x @ self.weight.T


@pytest.mark.parametrize("pass_name", ["q4_linear", "fp4_linear"])
def test_tied_weights_share_one_quantized_copy_and_w_T_matches(pass_name):
    torch.manual_seed(4)
    model, x = TiedAndTransposed().eval(), torch.randn(3, 64)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, fuse_sibling_linears=False,
                                             passes={pass_name: True})
    applied = [d for d in decisions if d.applied and d.pass_name == pass_name]
    assert len(applied) == 2  # F.linear and x @ W.T
    saved = [d.details["memory_saved_bytes"] for d in applied]
    assert saved[0] > 0 and saved[1] == 0  # one quantized copy, counted once
    calls = [n for n in rewritten.gm.graph.nodes if n.op == "call_function" and pass_name in str(n.target)]
    assert len(calls) == 2 and calls[0].args[1:3] == calls[1].args[1:3]  # the same weight constants
    with torch.no_grad():
        out = rewritten(x)
        once = F.linear(x, model.weight)
    torch.testing.assert_close(out[:, :0], once[:, :0])
    assert (out - 2 * once).abs().max() <= 0.2 * (2 * once).abs().max()  # both halves quantized alike


def test_the_tma_decode_is_a_candidate_only_under_cuda_graphs(monkeypatch):
    """16 tokens on 1024 -> 11008 for the h100 target. Under CUDA graphs the separate mode's q4_tma
    decode is predicted fastest and taken; without them it is no candidate (its opaque op pays a
    Python launch path per call) and the fused kernel is taken."""
    from graphopt.kernels import q4_tma
    from graphopt.ops import quantized_linear

    if q4_tma.gluon is None:
        pytest.skip("this Triton has no Gluon: the TMA decode is never costed")
    monkeypatch.setattr(quantized_linear, "_q4_runs_kernels", lambda x: False)  # the capture's run: the fast reference
    model, x = torch.nn.Linear(1024, 11008, bias=False).eval(), torch.randn(16, 1024)
    options = dict(target="h100", passes={"q4_linear": True})
    graphed, decisions = capture_rewritten(model, (x,), cuda_graphs=True, **options)
    (decision,) = [d for d in decisions if d.pass_name == "q4_linear"]
    assert decision.applied and decision.implementation == "q4_linear separate"
    (call,) = [n for n in graphed.gm.graph.nodes if n.target is torch.ops.graphopt.q4_linear.default]
    assert call.args[4:] == ("separate", "")  # the weights are on the CPU: nothing tuned
    direct = [d for d in capture_rewritten(model, (x,), **options)[1] if d.pass_name == "q4_linear"]
    assert [d.applied for d in direct] == [True] and direct[0].implementation == "q4_linear fused"
    assert direct[0].details["tile"] == "untuned default"


@pytest.mark.parametrize("q4_mode", ["auto", "fused", "separate"])
def test_every_mode_rewrites_to_the_reference_off_the_gpu(q4_mode):
    """On the CPU target the op runs its torch reference whatever the mode option says; the mode
    choice that prices host paths (GPU kernel modes only) leaves that as it is."""
    model, x = MLP().eval(), torch.randn(3, 64)
    decisions = [d for d in capture_rewritten(model, (x,), q4_mode=q4_mode, force=True, **ON)[1]
                 if d.pass_name == "q4_linear"]
    assert decisions and all(d.applied and d.implementation == "q4_linear reference" for d in decisions)


def test_compiled_with_inductor_on_the_cpu_matches_the_q4_reference():
    """The ops are triton_ops: Inductor traces their bodies (the torch reference on the CPU) into
    its own code. The compiled model computes what the references compute."""
    torch.manual_seed(5)
    model, x = MLP().eval(), torch.randn(2, 3, 64)
    compiled = torch.compile(model, backend="graphopt", options={"passes": {"q4_linear": True}, "force": True})
    from graphopt import compiler

    with compiler.recording_decisions() as sink, torch.no_grad():
        out = compiled(x)
    assert sum(d.applied for d in sink if d.pass_name == "q4_linear") == 2
    torch.testing.assert_close(out, _q4_mlp_reference(model, x), rtol=1e-5, atol=1e-5)


def _tuner_without_tiles_for(monkeypatch, refused) -> list:
    """The pass as on a GPU (its tiles tuned at compile time) whose tuner finds no tile computing
    the product (NoCorrectTile) where `refused(n)` holds for a layer of n output features, and the
    untuned default ("") elsewhere. Returns the (tokens, N, K, mode) of each tuning call."""
    from graphopt.kernels.tuning import NoCorrectTile
    from graphopt.passes import q4_linear as pass_module

    calls = []

    def tune(x_shape, qweight, scales, bias, dtype, mode, allow_gluon):
        calls.append((x_shape[0], qweight.shape[0], x_shape[1], mode))
        if refused(qweight.shape[0]):
            raise NoCorrectTile(f"no Q4 {mode} tile computed the product for {x_shape}")
        return ""

    monkeypatch.setattr(pass_module, "_tunable", lambda ctx, info, qweight: True)
    monkeypatch.setattr(pass_module.q4k, "tune_q4_linear", tune)
    return calls


def test_layers_whose_mode_has_no_correct_tile_stay_dense(monkeypatch):
    """When no tile of a layer's mode, the default included, computes the product on the GPU
    (the tuner raises NoCorrectTile), the layer is not rewritten: it keeps its dense linear, with
    the reason naming its shape, and the model computes what it computes uncompiled. q/k/v,
    tuned as one GEMM, stay dense as a group: their members are not tuned one by one."""
    calls = _tuner_without_tiles_for(monkeypatch, lambda n: True)
    torch.manual_seed(4)
    model, x = Gated().eval(), torch.randn(2, 5, 64)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, target="h100", passes={"q4_linear": True})
    assert "graphopt.q4_linear.default" not in _targets(rewritten)
    assert [call[:3] for call in calls] == [(10, 128, 64), (10, 40, 64)]  # q/k/v as one, then out
    assert not any(d.applied for d in decisions)
    reasons = {d.location: d.reason for d in decisions}
    for name in ("q", "k", "v"):
        assert "product at 10x128x64, the sibling group (q, k, v) as one GEMM, on this GPU" in reasons[name]
    assert "no Q4" in reasons["out"] and "product at 10x40x64 on this GPU" in reasons["out"]
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_group_without_a_correct_tile_stays_dense_and_the_rest_is_rewritten(monkeypatch):
    """Only the q/k/v group's shape has no correct tile: the group keeps its three dense linears,
    `out` is rewritten, and it reads their dense outputs."""
    _tuner_without_tiles_for(monkeypatch, lambda n: n == 128)
    torch.manual_seed(5)
    model, x = Gated().eval(), torch.randn(2, 5, 64)
    rewritten, decisions = capture_rewritten(model, (x,), force=True, target="h100", passes={"q4_linear": True})
    assert [(d.location, d.applied) for d in decisions] == [("q", False), ("k", False), ("v", False), ("out", True)]
    assert _targets(rewritten).count("graphopt.q4_linear.default") == 1
    with torch.no_grad():
        h = model.q(x) * torch.cat([model.k(x), model.v(x)], dim=-1)
        expected = q4.reference_q4_linear(h, *q4.quantize_weight(model.out.weight))
        torch.testing.assert_close(rewritten(x), expected, rtol=1e-5, atol=1e-5)


def test_a_transformers_model_without_correct_tiles_computes_what_it_computes_uncompiled(monkeypatch):
    """A LlamaForCausalLM whose every Q4 shape has no correct tile: no linear is rewritten (q/k/v
    and gate/up declined as groups), and the compiled model's logits are the eager model's."""
    from graphopt.models import build

    _tuner_without_tiles_for(monkeypatch, lambda n: True)
    model, inputs = build("tiny-llama", seq_len=8, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        eager = model(*inputs).logits
    report = graphopt.explain(model, *inputs, force=True, **ON)
    assert report.counts["q4_linear"] == 0
    no_tile = [d for d in report.declined("q4_linear") if "no Q4" in d.reason]
    grouped = [d.location for d in no_tile if "sibling group" in d.reason]
    assert "model.layers.0.self_attn.k_proj" in grouped and "model.layers.0.mlp.up_proj" in grouped
    assert "model.layers.0.self_attn.o_proj" in [d.location for d in no_tile]
    torch.testing.assert_close(report.output.logits, eager, rtol=1e-5, atol=1e-5)


def test_a_fusion_without_a_correct_tile_keeps_the_two_ops(monkeypatch):
    """quantize_q8_1 -> q4_q8_gemm whose fused op has no correct tile: the two ops stay, with the
    reason, and compute what they compute uncompiled."""
    _tuner_without_tiles_for(monkeypatch, lambda n: True)
    torch.manual_seed(6)
    model, x = Prequantized().eval(), torch.randn(3, 96)
    rewritten, decisions = capture_rewritten(model, (x,), passes={"q4_linear": True}, q4_mode="fused")
    assert any("quantize_q8_1" in t for t in _targets(rewritten)) and "graphopt.q4_linear.default" not in _targets(rewritten)
    assert [d.applied for d in decisions] == [False]
    assert "no Q4 fused tile" in decisions[0].reason and "3x40x96 on this GPU" in decisions[0].reason
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x), rtol=0, atol=0)


def test_a_layer_held_only_as_q4_0_without_a_correct_tile_runs_a_dense_gemm(monkeypatch):
    """graphopt.quantize_ layers have no dense weight to keep: where neither mode has a correct
    tile, the call becomes q4.dequantized_q4_linear (through Inductor here), never the untuned
    default tile, and the output is the Q4 product the eager layers compute on the CPU."""
    from graphopt import compiler

    calls = _tuner_without_tiles_for(monkeypatch, lambda n: True)
    torch.manual_seed(7)
    model, x = graphopt.quantize_(MLP().eval(), format="q4_0"), torch.randn(2, 3, 64)
    with torch.no_grad():
        eager = model(x)
    rewritten, decisions = capture_rewritten(model, (x,), passes={"q4_linear": True}, target="h100")
    assert [call[1:] for call in calls] == [(96, 64, "fused"), (96, 64, "separate"), (40, 96, "fused"), (40, 96, "separate")]
    assert "graphopt.q4_linear.default" not in _targets(rewritten)
    assert _targets(rewritten).count(str(q4.dequantized_q4_linear)) == 2
    assert all(not d.applied and "no Q4 tile of either kernel mode" in d.reason for d in decisions)
    options = dict(passes={"q4_linear": True}, target="h100")
    with compiler.recording_decisions() as sink, torch.no_grad():
        compiled = torch.compile(model, backend=graphopt.backend(**options), fullgraph=True)(x)
    assert sum("dense fp32 GEMM" in d.reason for d in sink) == 2
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


class SplitGated(torch.nn.Module):
    """Two column-parallel siblings (gate/up) and a row-parallel down projection."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
        self.down = torch.nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("stage", ["sqnr", "tile"])
def test_tensor_parallel_ranks_agree_to_keep_a_layer_dense(one_rank_mesh, monkeypatch, stage):
    """Another rank whose shard misses the SQNR budget, or whose tuner finds no correct tile,
    makes this rank keep the same layers dense (every rank rewrites the same layers): each
    layer's verdicts go through one all-reduce each (here of one real gloo rank, the other
    rank's verdict simulated), and the split model computes what it computes eagerly."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from graphopt import compiler
    from graphopt.passes import q4_linear as pass_module

    calls = _tuner_without_tiles_for(monkeypatch, lambda n: False)  # this rank finds tiles everywhere
    real_agree, verdicts = pass_module.all_ranks_agree, []

    def other_rank_refuses(shard, ok):  # an agreement right after a tuning call is about the tile
        now = "tile" if len(calls) > sum(v == "tile" for v, _ in verdicts) else "sqnr"
        verdicts.append((now, ok))
        return real_agree(shard, ok) and now != stage

    monkeypatch.setattr(pass_module, "all_ranks_agree", other_rank_refuses)
    torch.manual_seed(8)
    model = parallelize_module(SplitGated().eval(), one_rank_mesh,
                               {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
    options = dict(passes={"q4_linear": True}, force=True, target="h100", downstream="eager")
    with compiler.recording_decisions() as sink, torch.no_grad():
        out = torch.compile(model, backend=graphopt.backend(**options), fullgraph=True)(x)
    decisions = [d for d in sink if d.pass_name == "q4_linear"]
    assert [d.location for d in decisions] == ["gate", "up", "down"] and not any(d.applied for d in decisions)
    assert all(ok for _, ok in verdicts)  # this rank alone would have rewritten every layer
    if stage == "sqnr":  # the group's SQNR verdict, then each layer's own
        assert [v for v, _ in verdicts] == ["sqnr"] * 4 and not calls
        assert all("SQNR of another tensor-parallel rank's shard" in d.reason for d in decisions)
    else:  # gate/up tuned and declined as one group, then down
        assert [v for v, _ in verdicts] == ["sqnr", "tile", "sqnr", "tile"]
        assert [call[1] for call in calls] == [192, 64]
        assert all("on another tensor-parallel rank's GPU" in d.reason for d in decisions)
        assert "sibling group" in decisions[0].reason and "sibling group" in decisions[1].reason
    assert all("column-parallel" in d.details["shard"] for d in decisions[:2])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_tuned_tile_is_used_and_a_failed_timing_keeps_the_untuned_default(monkeypatch):
    """The other outcomes of compile-time tuning: a tile string goes into the op; any other
    failure than NoCorrectTile keeps the rewrite with the untuned default ("")."""
    from graphopt.kernels import tuning
    from graphopt.passes import q4_linear as pass_module

    monkeypatch.setattr(pass_module, "_tunable", lambda ctx, info, qweight: True)
    kernels = {}
    for outcome in ("tile", "error"):
        def tune(x_shape, qweight, scales, bias, dtype, mode, allow_gluon, outcome=outcome):
            if outcome == "error":
                raise RuntimeError("out of resources")
            return tuning.encode(q4.default_config(x_shape[0], mode == "fused"))

        monkeypatch.setattr(pass_module.q4k, "tune_q4_linear", tune)
        rewritten, decisions = capture_rewritten(MLP().eval(), (torch.randn(2, 64),), force=True, target="h100",
                                                 passes={"q4_linear": True})
        assert sum(d.applied for d in decisions) == 2
        kernels[outcome] = [n.args[5] for n in rewritten.gm.graph.nodes
                            if n.op == "call_function" and str(n.target) == "graphopt.q4_linear.default"]
    assert all(kernels["tile"]) and kernels["error"] == ["", ""]


@pytest.mark.parametrize("form", ["standard", "matmulnbits"])
@pytest.mark.parametrize("per_row", [False, True])
def test_the_fused_fake_quant_idiom_exports_and_runs_in_onnxruntime(form, per_row, tmp_path):
    """graphopt::q4_linear_static's ONNX forms compute the model's own fake-quantized activations
    times its (on-grid) weight."""
    import onnx

    torch.manual_seed(4)
    model, x = FakeQuantLinear(per_row=per_row).eval(), torch.randn(3, 64)
    path = export_onnx(model, (x,), tmp_path / f"fake_quant_{form}.onnx", passes={"q4_linear": True}, force=True,
                       onnx_forms={"graphopt::q4_linear_static": form})
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Round" in ops and ("DequantizeLinear" if form == "standard" else "MatMulNBits") in ops
    got = torch.from_numpy(run_onnxruntime(path, x)[0])
    with torch.no_grad():
        eager = model(x)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_a_per_tensor_scale_stays_fused_after_a_recompile_with_symbolic_shapes():
    """A 0-dim scale is per tensor whatever x's (symbolic) leading dims are."""
    from graphopt.compiler import recording_decisions

    model = FakeQuantLinear().eval()
    scale = torch.tensor(0.03)

    class WithScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, s):
            return F.linear(torch.round(x / s).clamp(-128, 127) * s, self.inner.weight, self.inner.bias)

    wrapped = WithScale().eval()
    torch._dynamo.reset()
    compiled = torch.compile(wrapped, backend=graphopt.backend(passes={"q4_linear": True}, force=True, downstream="eager"))
    with recording_decisions() as decisions, torch.no_grad():
        for tokens in (5, 7):  # the second length recompiles with a symbolic one
            x = torch.randn(2, tokens, 64)
            eager = wrapped(x, scale)
            assert (compiled(x, scale) - eager).abs().max() <= 2e-6 * eager.abs().max()
    torch._dynamo.reset()
    fused = [d for d in decisions if d.applied and d.details.get("fusion") == "fake_quant+linear"]
    assert len(fused) == 2


def test_a_scale_with_more_dims_than_x_is_not_fused_and_the_rest_is_rewritten():
    class Wider(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fq = FakeQuantLinear()
            self.other = torch.nn.Linear(64, 8)

        def forward(self, x, s):
            return F.linear(torch.round(x / s).clamp(-128, 127) * s, self.fq.weight, self.fq.bias), self.other(x)

    model, x, s = Wider().eval(), torch.randn(5, 64), torch.tensor([[[0.03]]])
    report = graphopt.explain(model, x, s, passes={"q4_linear": True}, force=True)
    assert not [d for d in report.decisions if d.details.get("fusion") == "fake_quant+linear"]
    assert report.counts["q4_linear"] == 2  # both linears, by the plain rewrite
    with torch.no_grad():
        assert report.output[0].shape == model(x, s)[0].shape == (1, 5, 24)


def test_an_empty_batch_into_the_quantize_then_gemm_pair_does_not_stop_the_pass():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            qweight, scales = q4.quantize_weight(torch.randn(8, 64))
            self.register_buffer("qweight", qweight)
            self.register_buffer("scales", scales)
            self.other = torch.nn.Linear(64, 16)

        def forward(self, x):
            xq = torch.ops.graphopt.quantize_q8_1(x)
            return torch.ops.graphopt.q4_q8_gemm(xq, self.qweight, self.scales, None, torch.float32), self.other(x)

    report = graphopt.explain(Pair().eval(), torch.randn(0, 64), passes={"q4_linear": True}, force=True)
    assert all("pass failed" not in d.reason for d in report.decisions)
    assert report.counts["q4_linear"] == 2


def test_empty_linears_are_declined_and_left_dense_by_quantize():
    class Empty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.none_out = torch.nn.Linear(64, 0)
            self.fine = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.none_out(x), self.fine(x)

    report = graphopt.explain(Empty().eval(), torch.randn(2, 64), passes={"q4_linear": True}, force=True)
    reasons = {d.location: (d.applied, d.reason) for d in report.decisions}
    assert reasons["none_out"] == (False, "empty weight (0 x 64): nothing to rewrite")
    assert reasons["fine"][0]
    model = graphopt.quantize_(Empty(), format="q4_0")
    assert isinstance(model.none_out, torch.nn.Linear) and not isinstance(model.fine, torch.nn.Linear)


def test_a_linear_called_twice_on_one_input_is_one_sibling():
    """Its weight is stored once (the second call reads the first's constants)."""
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.q(x) + self.q(x)

    report = graphopt.explain(Twice().eval(), torch.randn(2, 64), passes={"q4_linear": True}, force=True)
    assert report.counts["q4_linear"] == 2
    assert 0 < report.memory_saved_bytes < 64 * 64 * 4


def test_the_ops_name_bad_arguments():
    qweight, scales = q4.quantize_weight(torch.randn(16, 64))
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="bias must be \\(16,\\)"):
        torch.ops.graphopt.q4_linear(x, qweight, scales, torch.randn(5), "fused")
    with pytest.raises(ValueError, match="floating point"):
        torch.ops.graphopt.q4_linear(x.long(), qweight, scales, None, "fused")
    with pytest.raises(ValueError, match="qmin <= qmax"):
        torch.ops.graphopt.q4_linear_static(x, torch.tensor(0.1), qweight, scales, None, 10, -10)
