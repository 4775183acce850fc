"""fft_linear pass: FFTChainLinear lowering, plan-driven dense rewrites and declines, ONNX."""

import onnx
import pytest
import torch

import graphopt
from graphopt.fft_distill import distill
from graphopt.kernels import fft_chain as fft
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


# ---- operand tables as graph constants ------------------------------------------------------------
class TwoChains(torch.nn.Module):
    """Two FFT-chain layers of one block size (their DFT matrices are one constant per graph)."""

    def __init__(self, k=2):
        super().__init__()
        self.a = FFTChainLinear(40, 48, 16, k, seed=1)
        self.b = FFTChainLinear(48, 40, 16, k, seed=2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _forcing(monkeypatch, impl):
    """The CPU target only runs the torch path: make the cost model's choice `impl`, as on a GPU
    (the op still runs its torch reference on the CPU, so outputs stay checkable)."""
    from graphopt.cost import fft_chain as fft_cost

    choose = fft_cost.choose_implementation
    monkeypatch.setattr(fft_cost, "choose_implementation", lambda *a, **kw: (impl, choose(*a, **kw)[1]))


def _rewritten(model, *inputs, **options):
    """The graph as graphopt's backend rewrites it for a compiler, its decisions, and its output."""
    from graphopt.config import GraphOptConfig
    from graphopt.hardware import get_spec
    from graphopt.passes import run_passes

    config = GraphOptConfig.from_options({"passes": {"fft_linear": True}, **options})
    captured = {}

    def backend(gm, example_inputs):
        captured["ctx"] = run_passes(gm, example_inputs, config, get_spec(config.target, example_inputs))
        captured["gm"] = gm
        return gm

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return captured["gm"], captured["ctx"].decisions, out


def _table_args(gm):
    """{op node: {table name: get_attr target}} of every fft_chain_linear call."""
    op = torch.ops.graphopt.fft_chain_linear
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert calls
    tables = {}
    for call in calls:
        given = {name: call.kwargs.get(name) for name in fft.TABLE_NAMES}
        assert all(v is None or v.op == "get_attr" for v in given.values())
        tables[call] = {name: v.target for name, v in given.items() if v is not None}
    return tables


@pytest.mark.parametrize("impl", ["torch", "triton", "dft", "dft2", "dft2_pregather"])
def test_the_chosen_kernels_tables_are_graph_constants(monkeypatch, impl):
    """Inference: every table the chosen implementation reads is a get_attr constant equal to what
    operand_tables builds from the layer (none for the cuFFT paths); the two layers share their DFT
    matrices; the output is the model's."""
    _forcing(monkeypatch, impl)
    torch.manual_seed(5)
    model, x = TwoChains().eval(), torch.randn(2, 3, 40)
    with torch.no_grad():
        gm, decisions, out = _rewritten(model, x)
        ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert [d.implementation for d in decisions if d.applied] == [f"fft_chain[{impl}]"] * 2
    per_call = list(_table_args(gm).values())
    for tables, layer in zip(per_call, (model.a, model.b), strict=True):
        assert set(tables) == set(fft.tables_read(impl, layer.k))
        cr, ci = fft.spectral_coefficients(layer.coeffs.detach())
        expected = fft.operand_tables(impl, x.dtype, 16, layer.in_features, x.device, perms=layer.perms[1:],
                                      coeff_real=cr, coeff_imag=ci)
        for name, target in tables.items():
            assert torch.equal(getattr(gm, target), expected[name]), name
    if impl.startswith("dft"):
        assert per_call[0]["dft_forward"] == per_call[1]["dft_forward"]  # one constant
        if impl != "dft":
            assert per_call[0]["coeff_operand"] != per_call[1]["coeff_operand"]
        assert "operand tables" in decisions[0].reason and "built per call" not in decisions[0].reason
    else:
        assert "operand tables" not in decisions[0].reason


def test_trainable_coefficients_leave_g_to_each_call_and_train_as_eager(monkeypatch):
    """Training (grad mode, coefficients requiring grad): the spectrum is not a constant, so G is
    not built at compile time; the DFT matrices and the permutation's source index are. The
    compiled step's gradients are eager's."""
    _forcing(monkeypatch, "dft2")
    torch.manual_seed(6)
    model, x = TwoChains(), torch.randn(5, 40)
    gm, decisions, out = _rewritten(model, x)
    per_call = list(_table_args(gm).values())
    assert len(per_call) == 2
    for tables in per_call:
        assert set(tables) == {"dft_forward", "dft_inverse", "source_index"}
    assert "coeff_operand built per call" in decisions[0].reason
    out.square().mean().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    for got, want in zip(compiled_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_compiled_model_holds_its_tables_only_in_its_graph(monkeypatch):
    """The tables live as buffers of the compiled graph and nowhere else: once the compiled model
    is dropped, they are freed."""
    import gc
    import weakref

    from graphopt.compiler import recording_decisions

    _forcing(monkeypatch, "dft2_pregather")
    torch.manual_seed(7)
    model, x = TwoChains().eval(), torch.randn(3, 40)
    seen = []
    real_add = graphopt.passes.base.PassContext.add_constant

    def add_constant(self, tensor, hint):  # watch what the pass registers on the graph
        seen.append((hint, weakref.ref(tensor)))
        return real_add(self, tensor, hint)

    monkeypatch.setattr(graphopt.passes.base.PassContext, "add_constant", add_constant)
    torch._dynamo.reset()
    with torch.no_grad(), recording_decisions(reset=True):
        compiled = torch.compile(model, backend=graphopt.backend(passes={"fft_linear": True}, downstream="inductor"))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    tables = [ref for hint, ref in seen if hint.startswith(("fft_dft", "fft_source", "fft_coeff_operand"))]
    assert len(tables) == 2 + 2 * 2  # shared DFT matrices; a source index and G per layer
    assert all(ref() is not None for ref in tables)  # held by the compiled graph
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert [ref() for ref in tables] == [None] * len(tables)


@pytest.mark.parametrize("impl", ["dft2", "dft2_pregather"])
def test_onnx_export_of_a_dft_choice_carries_no_tables(monkeypatch, tmp_path, impl):
    """The ONNX form of the op is its own DFT program: an exported graph gets no Triton tables,
    and runs in onnxruntime with the model's output."""
    _forcing(monkeypatch, impl)
    torch.manual_seed(8)
    model, x = TwoChains().eval(), torch.randn(2, 40)
    path = graphopt.export_onnx(model, (x,), tmp_path / "fft.onnx", passes={"fft_linear": True})
    names = [i.name for i in onnx.load(str(path)).graph.initializer]
    assert not [n for n in names if any(t in n for t in ("dft_forward", "dft_inverse", "source_index", "coeff_operand"))]
    out = graphopt.onnx_export.run_onnxruntime(path, x)[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(x), rtol=1e-4, atol=1e-5)


def test_a_planned_dense_linear_gets_its_tables_as_constants(monkeypatch, tmp_path):
    """A dense linear rewritten through a plan: its coefficients and permutations are constants of
    the plan, so the chosen kernel gets every table it reads; the output is the fitted layer's."""
    torch.manual_seed(9)
    model = TwoLayers().eval()
    plan = tmp_path / "plan.json"
    distill(model, (torch.randn(64, 32),), layer_start=1, layer_end=1, block_size=16, k=2, steps=2, plan_path=plan,
            show_progress=False)
    options = dict(plan=str(plan), force=True, error_budget={"fft_linear": 10.0})
    x = torch.randn(3, 32)
    with torch.no_grad():
        _, _, fitted = _rewritten(model, x, **options)  # the torch path on the CPU
        _forcing(monkeypatch, "dft2")
        gm, decisions, out = _rewritten(model, x, **options)
    (tables,) = _table_args(gm).values()
    assert set(tables) == {"dft_forward", "dft_inverse", "source_index", "coeff_operand"}
    assert [d.location for d in decisions if d.applied] == ["layers.1"] and "as constants" in decisions[-1].reason
    torch.testing.assert_close(out, fitted)
