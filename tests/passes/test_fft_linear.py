"""fft_linear pass: FFTChainLinear lowering, plan-driven dense rewrites and declines, ONNX."""

import onnx
import pytest
import torch

import graphopt
from graphopt.fft_distill import distill
from graphopt.kernels.fft_chain import FFTChainLinear


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fft = FFTChainLinear(40, 56, 16, 2, seed=1)
        self.dense = torch.nn.Linear(56, 24)

    def forward(self, x):
        return self.dense(torch.relu(self.fft(x)))


def _decisions(report, applied):
    return [d for d in report.decisions if d.pass_name == "fft_linear" and d.applied == applied]


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_rewrites_fft_chain_layer_and_declines_dense_without_plan(downstream):
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 40)
    with torch.no_grad():
        ref = model(x)
        report = graphopt.explain(model, x, passes={"fft_linear": True}, downstream=downstream)
    applied, declined = _decisions(report, True), _decisions(report, False)
    assert len(applied) == 1 and applied[0].implementation.startswith("fft_chain[")
    assert applied[0].details["spectrum_folded"]  # inference graph: coefficients are constants
    assert len(declined) == 1 and declined[0].location == "dense" and "no fft_linear plan" in declined[0].reason
    torch.testing.assert_close(report.output, ref, rtol=1e-5, atol=1e-6)


def test_pass_off_leaves_graph_alone():
    model = Net().eval()
    with torch.no_grad():
        report = graphopt.explain(model, torch.randn(4, 40), downstream="eager")
    assert report.counts.get("fft_linear", 0) == 0


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_dense_linear_rewritten_only_through_plan_within_budget(tmp_path):
    torch.manual_seed(1)
    model = TwoLayers().eval()
    with torch.no_grad():  # layer 0 is block-circulant plus tiny noise: it fits; layer 1 stays random
        from graphopt.kernels.fft_chain import FFTChainLinear as L

        model.layers[0].weight.copy_(L(32, 32, 16, 1, bias=False).to_dense().float() + 1e-4 * torch.randn(32, 32))
    calib = (torch.randn(256, 32),)
    plan = tmp_path / "plan.json"
    out = distill(model, calib, layer_start=0, layer_end=1, block_size=16, k=1, steps=30, lr=1e-3, plan_path=plan, show_progress=False)
    errs = {name: r["rel_error"] for name, r in out["layers"].items()}
    assert errs["layers.0"] < 0.05 < errs["layers.1"]
    x = torch.randn(5, 32)
    with torch.no_grad():
        ref = model(x)
        report = graphopt.explain(model, x, passes={"fft_linear": True}, plan=str(plan), force=True, downstream="eager")
    by_loc = {d.location: d for d in report.decisions if d.pass_name == "fft_linear"}
    assert by_loc["layers.0"].applied, by_loc["layers.0"].reason
    assert not by_loc["layers.1"].applied and "exceeds error_budget" in by_loc["layers.1"].reason
    # the rewritten model computes the fitted layer: close to the dense one (budget-sized error)
    assert graphopt.kernels.fft_chain.relative_error(report.output, ref) < 0.05
    # without force, the CPU cost model decides (and records why)
    with torch.no_grad():
        report = graphopt.explain(model, x, passes={"fft_linear": True}, plan=str(plan), downstream="eager", target="cpu")
    d0 = [d for d in report.decisions if d.pass_name == "fft_linear" and d.location == "layers.0"][0]
    assert d0.predicted_ms_before is not None and d0.predicted_ms_after is not None


def test_dense_linear_not_in_plan_is_declined(tmp_path):
    model = TwoLayers().eval()
    plan = tmp_path / "plan.json"
    distill(model, (torch.randn(64, 32),), layer_start=1, layer_end=1, block_size=16, k=1, steps=2, plan_path=plan, show_progress=False)
    with torch.no_grad():
        report = graphopt.explain(model, torch.randn(3, 32), passes={"fft_linear": True}, plan=str(plan), force=True,
                                  error_budget={"fft_linear": 10.0}, downstream="eager")
    by_loc = {d.location: d for d in report.decisions if d.pass_name == "fft_linear"}
    assert not by_loc["layers.0"].applied and "no fitted FFT-chain coefficients" in by_loc["layers.0"].reason
    assert by_loc["layers.1"].applied


def test_distill_fits_the_same_tiny_llama_as_every_other_command():
    """`graphopt fftchain distill --model tiny-llama` built its own, wider LlamaModel, so its plan
    named layers (layers.0.mlp...) that `explain --model tiny-llama` (model.layers.0.mlp...) never has."""
    from graphopt.fft_distill import resolve_model
    from graphopt.models import build

    def linears(model):
        return {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    distilled, (ids,) = resolve_model("tiny-llama")
    built, _ = build("tiny-llama", device="cpu", dtype=torch.float32)
    assert linears(distilled) == linears(built) and ids.shape[0] == 8


def test_a_layer_missing_from_the_plan_names_the_plans_layers(tmp_path):
    """A plan from another model (or another wrapping of it) shows in the reason: the layers it has."""
    model = TwoLayers().eval()
    plan = tmp_path / "plan.json"
    distill(model, (torch.randn(64, 32),), layer_start=1, layer_end=1, block_size=16, k=1, steps=2, plan_path=plan,
            show_progress=False)
    other = torch.nn.Sequential(torch.nn.Linear(32, 32)).eval()
    with torch.no_grad():
        report = graphopt.explain(other, torch.randn(3, 32), passes={"fft_linear": True}, plan=str(plan),
                                  downstream="eager")
    (decision,) = report.decisions
    assert "the plan has no fitted FFT-chain coefficients for it (its layers: layers.1)" in decision.reason


def test_a_fit_that_diverges_keeps_its_projection(tmp_path):
    """A learning rate that drives training to NaN: the held-out error NaN is not 'better' than the
    projection's, so the projection is kept and the plan records a finite error (a recorded NaN
    would pass the pass's budget check and make the model's output NaN)."""
    torch.manual_seed(4)
    model = TwoLayers().eval()
    out = distill(model, (torch.randn(64, 32),), layer_start=1, layer_end=1, block_size=16, k=1, steps=5, lr=1e30,
                  plan_path=tmp_path / "plan.json", show_progress=False)
    (entry,) = out["layers"].values()
    assert entry["kept"] == "projection" and entry["rel_error"] == entry["projection_rel_error"]
    assert 0 <= entry["rel_error"] < float("inf")
    assert torch.isfinite(out["modules"]["layers.1"].coeffs).all()


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_a_plan_fitted_to_other_weights_is_declined(tmp_path, downstream):
    """The plan records the weights it was fitted to. When they change under a compiled model (an
    in-place update, a checkpoint loaded), the frozen-weight guard recompiles and the pass declines
    the stale fit, so the model follows the new weights (not the old coefficients)."""
    torch.manual_seed(3)
    model = TwoLayers().eval()
    plan = tmp_path / "plan.json"
    distill(model, (torch.randn(64, 32),), layer_start=1, layer_end=1, block_size=16, k=1, steps=2, plan_path=plan,
            show_progress=False)
    options = dict(passes={"fft_linear": True}, plan=str(plan), force=True, error_budget={"fft_linear": 10.0},
                   downstream=downstream)
    x = torch.randn(3, 32)
    from graphopt import compiler as backend_module

    with backend_module.recording_decisions(reset=True) as sink, torch.no_grad():
        compiled = torch.compile(model, backend="graphopt", options=options)
        fitted = compiled(x)
        assert (fitted - model(x)).abs().max() > 1e-3  # the fit (2 steps) is not the dense layer
        model.layers[1].weight.normal_()
        torch.testing.assert_close(compiled(x), model(x))
    layer1 = [d for d in sink if d.pass_name == "fft_linear" and d.location == "layers.1"]
    assert [d.applied for d in layer1] == [True, False] and "fitted to other weights" in layer1[1].reason


def test_onnx_standard_dft_runs_in_onnxruntime(tmp_path):
    torch.manual_seed(2)
    model = Net().eval()
    x = torch.randn(2, 3, 40)
    path = graphopt.export_onnx(model, (x,), tmp_path / "fft.onnx", passes={"fft_linear": True})
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "DFT" in ops and "MatMul" in ops
    out = graphopt.onnx_export.run_onnxruntime(path, x)[0]
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-5)
