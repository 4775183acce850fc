"""The fp4_linear pass: what it rewrites, what it declines and why, numerics, ONNX forms.

The LLaMA test compiles with the default downstream (Inductor); the decision-only tests use
downstream="eager" to stay fast (the passes and the rewritten graph are the same).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.kernels import fp4
from graphopt.passes.fp4_linear import SCALE_SEARCH
from tests.passes.sibling_models import SiblingsOnALinear


def _llama_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # per decoder layer: they read one input


def _quantized_reference(model, fmt: str, fuse: bool):
    """The model with every linear's weight replaced by its FP4 round trip; with `fuse`, each
    layer's q/k/v and gate/up weights are quantized as one concatenated matrix, as the pass does."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer in reference.model.layers:
            groups = [[getattr(layer.self_attn, n) for n in SIBLINGS[0]], [getattr(layer.mlp, n) for n in SIBLINGS[1]]]
            others = [layer.self_attn.o_proj, layer.mlp.down_proj]
            for mods in (groups if fuse else []) + [[m] for m in others + (sum(groups, []) if not fuse else [])]:
                weight = torch.cat([m.weight for m in mods])
                restored = fp4.dequantize_fp4(fp4.quantize_fp4(weight, fmt, scale_search=SCALE_SEARCH))
                for m, part in zip(mods, restored.split([m.weight.shape[0] for m in mods])):
                    m.weight.copy_(part)
        head = reference.lm_head
        head.weight.copy_(fp4.dequantize_fp4(fp4.quantize_fp4(head.weight, fmt, scale_search=SCALE_SEARCH)))
    return reference


@pytest.mark.parametrize("fuse", [True, False], ids=["siblings-fused", "one-by-one"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_llama_tiny_every_linear_rewritten_logits_match_dequantized_reference(fmt, fuse):
    """Every linear is rewritten (forced on CPU). With fuse_sibling_linears (the default) each
    layer's q/k/v and gate/up projections share one quantized weight and one fp4_linear, and the
    logits match a reference quantized the same way; without it, a per-layer reference."""
    model = _llama_tiny()
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    report = graphopt.explain(model, ids, passes={"fp4_linear": True}, force=True, fp4_format=fmt,
                              fuse_sibling_linears=fuse)
    decisions = [d for d in report.decisions if d.pass_name == "fp4_linear"]
    linears = [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    assert len(decisions) == len(linears) == 15
    for d in decisions:
        assert d.applied or d.reason, d
    applied = [d for d in decisions if d.applied]
    assert {d.location for d in applied} == set(linears)  # nothing declined on this model
    for d in applied:
        assert d.details["format"] == fmt and d.details["sqnr_db"] >= 15.0
        assert d.details["memory_saved_bytes"] == d.details["dense_weight_bytes"] - d.details["fp4_weight_bytes"]
    grouped = sorted(d.location for d in applied if "siblings" in d.details["weights_from"])
    expected_grouped = sorted(f"model.layers.{i}.{kind}.{n}" for i in range(2) for kind, names in
                              (("self_attn", SIBLINGS[0]), ("mlp", SIBLINGS[1])) for n in names)
    assert grouped == (expected_grouped if fuse else [])

    expected = _quantized_reference(model, fmt, fuse)(ids).logits.detach()
    with torch.no_grad():
        original = model(ids).logits
    got = report.output.logits
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert (got - original).abs().max() > 1e-4  # the weights really changed


def test_cpu_target_declines_without_force():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    report = graphopt.explain(model, torch.randn(3, 64), passes={"fp4_linear": True}, downstream="eager")
    (d,) = report.decisions
    assert not d.applied and "cost model predicts no win" in d.reason


@pytest.mark.slow
def test_gpu_target_rewrites_large_decode_layers_and_declines_tiny_ones_unless_forced():
    """H100 target, one token: a 4096x4096 layer was measured 1.85x faster than cuBLAS bf16 cold
    (bench/results/fp4_linear_mma_decode_h100.json), so the cost model rewrites it to the CUDA-core
    gemv; a 16-output layer is launch-bound either way and is declined, unless forced.
    """
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Linear(4096, 4096, bias=False)
            self.tiny = torch.nn.Linear(4096, 16)  # 16 outputs: launch-bound either way

        def forward(self, x):
            return self.tiny(self.big(x))

    model = Two().eval().to(torch.bfloat16)
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    report = graphopt.explain(model, x, passes={"fp4_linear": True}, target="h100", downstream="eager")
    by_location = {d.location: d for d in report.decisions}
    big, tiny = by_location["big"], by_location["tiny"]
    assert big.applied and big.implementation == "fp4_gemv", big.reason
    assert big.details["memory_saved_bytes"] == 4096 * 4096 * 2 - (4096 * 2048 + 4096 * 256 + 4)
    assert not tiny.applied and ("below 1.05x" in tiny.reason or "no win" in tiny.reason), tiny.reason
    forced = graphopt.explain(model, x, passes={"fp4_linear": True}, target="h100", downstream="eager",
                              force=True)
    tiny = {d.location: d for d in forced.decisions}["tiny"]
    assert tiny.applied and tiny.implementation == "fp4_gemv" and "forced" in tiny.reason
    assert forced.output.dtype == torch.bfloat16 and forced.output.shape == (1, 16)


def test_sqnr_budget_declines_with_reason():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    report = graphopt.explain(model, torch.randn(2, 64), passes={"fp4_linear": True}, force=True,
                              error_budget={"fp4_linear": 40.0}, downstream="eager")
    (d,) = report.decisions
    assert not d.applied and "SQNR" in d.reason and "below the budget of 40.00 dB" in d.reason


def test_weight_that_is_not_a_parameter_is_not_rewritten():
    def f(x, w):
        return F.linear(x, w)

    x, w = torch.randn(2, 64), torch.randn(32, 64)
    report = graphopt.explain(_Wrap(f), x, w, passes={"fp4_linear": True}, force=True, downstream="eager")
    assert report.counts.get("fp4_linear", 0) == 0
    assert torch.equal(report.output, f(x, w))


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_training_graph_is_not_rewritten():
    model = torch.nn.Linear(64, 32)
    from graphopt import compiler as backend

    with backend.recording_decisions() as decisions:
        compiled = torch.compile(model, backend="graphopt",
                                 options={"passes": {"fp4_linear": True}, "force": True, "downstream": "eager"})
        x = torch.randn(2, 64)
        y = compiled(x)  # grad mode on, weight requires grad
        y.sum().backward()
    (d,) = [d for d in decisions if d.pass_name == "fp4_linear"]
    assert not d.applied and "requires grad" in d.reason
    assert torch.allclose(y, model(x)) and model.weight.grad is not None


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 96)  # codes (96, 128): over onnxscript's constant-folding limit
        self.down = torch.nn.Linear(96, 40, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_onnx_runnable_form_matches_pytorch_in_onnxruntime(fmt, tmp_path):
    import onnx

    from graphopt.onnx_export import capture_rewritten, run_onnxruntime

    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 256)
    options = dict(passes={"fp4_linear": True}, force=True, fp4_format=fmt)
    path = graphopt.export_onnx(model, (x,), tmp_path / "fp4.onnx", onnx_forms={"graphopt::fp4_linear": "runnable"}, **options)
    proto = onnx.load(str(path))
    assert "Gather" in [n.op_type for n in proto.graph.node]
    assert not any(i.data_type == onnx.TensorProto.FLOAT and list(i.dims) in ([96, 256], [256, 96]) for i in proto.graph.initializer)
    (y,) = run_onnxruntime(path, x)
    rewritten, decisions = capture_rewritten(model, (x,), **options)
    assert sum(d.applied for d in decisions) == 2
    with torch.no_grad():
        expected = rewritten(x).numpy()
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_onnx_standard_form_is_float4_dequantize_linear(fmt, tmp_path):
    import onnx

    model, x = _Mlp().eval(), torch.randn(2, 256)
    path = graphopt.export_onnx(model, (x,), tmp_path / "fp4_std.onnx", passes={"fp4_linear": True}, force=True,
                                fp4_format=fmt)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    kinds = [n.op_type for n in proto.graph.node]
    assert "DequantizeLinear" in kinds and "MatMul" in kinds and "Gather" not in kinds
    fp4_inits = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT4E2M1]
    assert sorted(list(i.dims) for i in fp4_inits) == [[40, 128], [96, 256]]  # (N, K padded to 64)
    fp4_names = {i.name for i in fp4_inits}
    dequant = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp4_names]
    assert len(dequant) == 2
    for n in dequant:
        attrs = {a.name: a.i for a in n.attribute}
        assert attrs["block_size"] == fp4.BLOCK_SIZES[fmt] and attrs["axis"] == 1


# ---------------------------------------------------------------------------------------------
# Plans: pre-quantized (GPTQ-calibrated) weights
# ---------------------------------------------------------------------------------------------
class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 48, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _calibration(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    return torch.randn(5, 16, generator=g) @ mixing + 0.2 * torch.randn(5, 64, generator=g)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_plan_weights_are_used_instead_of_compile_time_quantization(fmt, tmp_path):
    from graphopt.passes.fp4_linear import save_fp4_plan

    torch.manual_seed(0)
    model = _TwoLinears().eval()
    quantized = fp4.calibrate_fp4(model, [_calibration(s) for s in range(8)], fmt)
    plan = save_fp4_plan(tmp_path / "plan.json", quantized)
    x = _calibration(100)
    report = graphopt.explain(model, x, passes={"fp4_linear": True}, force=True, fp4_format=fmt, plan=str(plan),
                              downstream="eager")
    decisions = {d.location: d for d in report.decisions if d.pass_name == "fp4_linear"}
    assert set(decisions) == {"up", "down"} and all(d.applied for d in decisions.values())
    assert all("plan weights" in d.details["weights_from"] for d in decisions.values())

    def built_from(weights):
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for name in ("up", "down"):
                getattr(reference, name).weight.copy_(fp4.dequantize_fp4(weights[name]))
            return reference(x)

    torch.testing.assert_close(report.output, built_from(quantized), atol=1e-5, rtol=1e-4)
    plain = {n: fp4.quantize_fp4(getattr(model, n).weight, fmt, scale_search=SCALE_SEARCH) for n in ("up", "down")}
    assert not torch.equal(quantized["up"].codes, plain["up"].codes)  # GPTQ picked other codes
    assert (report.output - built_from(plain)).abs().max() > 1e-4


def test_plan_with_wrong_format_or_shape_declines_and_other_layers_fall_back(tmp_path):
    from graphopt.passes.fp4_linear import save_fp4_plan

    torch.manual_seed(0)
    model = _TwoLinears().eval()
    wrong_shape = fp4.quantize_fp4(torch.randn(96, 32), "nvfp4")
    plan = save_fp4_plan(tmp_path / "plan.json", {"up": wrong_shape})
    report = graphopt.explain(model, _calibration(1), passes={"fp4_linear": True}, force=True, fp4_format="nvfp4",
                              plan=str(plan), downstream="eager")
    decisions = {d.location: d for d in report.decisions if d.pass_name == "fp4_linear"}
    assert not decisions["up"].applied and "does not match the layer's 96x64" in decisions["up"].reason
    assert decisions["down"].applied and decisions["down"].details["weights_from"] == "compile-time quantization"

    plan = save_fp4_plan(tmp_path / "plan2.json", {"up": fp4.quantize_fp4(model.up.weight, "mxfp4")})
    report = graphopt.explain(model, _calibration(1), passes={"fp4_linear": True}, force=True, fp4_format="nvfp4",
                              plan=str(plan), downstream="eager")
    up = next(d for d in report.decisions if d.pass_name == "fp4_linear" and d.location == "up")
    assert not up.applied and "format 'mxfp4' does not match fp4_format='nvfp4'" in up.reason


@pytest.mark.parametrize("bad, fragment", [
    ("scales", "must be bytes"), ("codes", "must be bytes"), ("global_scale", "expected one float"),
    ("file", "cannot be read as safetensors")])
def test_plan_tensors_of_the_wrong_kind_decline_that_layer_only(tmp_path, bad, fragment):
    """Stored tensors of other dtypes (which a byte view would reshape), a global scale of several
    values, or a file that is not safetensors: the planned layer is declined with the reason, the
    other layer is quantized at compile time."""
    from safetensors.torch import load_file, save_file

    from graphopt.passes.fp4_linear import save_fp4_plan

    torch.manual_seed(0)
    model = _TwoLinears().eval()
    plan = save_fp4_plan(tmp_path / "plan.json", {"up": fp4.quantize_fp4(model.up.weight.detach(), "nvfp4")})
    file = tmp_path / "plan.fp4.safetensors"
    tensors = load_file(str(file))
    if bad == "file":
        file.write_bytes(b"not a safetensors file")
    else:
        name = f"up.{bad}"
        tensors[name] = (torch.ones(2) if bad == "global_scale" else
                         tensors[name].to(torch.float32 if bad == "scales" else torch.int16))
        save_file(tensors, str(file))
    report = graphopt.explain(model, _calibration(1), passes={"fp4_linear": True}, force=True, fp4_format="nvfp4",
                              plan=str(plan), downstream="eager")
    decisions = {d.location: d for d in report.decisions if d.pass_name == "fp4_linear"}
    assert not decisions["up"].applied and fragment in decisions["up"].reason, decisions["up"].reason
    assert decisions["down"].applied and decisions["down"].details["weights_from"] == "compile-time quantization"


class _Gated(torch.nn.Module):
    """Two linears reading one input (a gated MLP's gate and up projections)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(128, 64, bias=False)
        self.up = torch.nn.Linear(128, 32, bias=False)

    def forward(self, x):
        return F.silu(self.gate(x))[..., :32] * self.up(x)


def test_sibling_linears_export_as_one_fp4_weight_and_a_split(tmp_path):
    """The standard ONNX form of a fused sibling group: one FLOAT4E2M1 initializer of the
    concatenated weight (96 x 128), one DequantizeLinear -> MatMul, then a Split; onnxruntime's
    runnable form matches the rewritten PyTorch graph."""
    import onnx

    from graphopt.onnx_export import capture_rewritten, run_onnxruntime

    torch.manual_seed(0)
    model, x = _Gated().eval(), torch.randn(2, 5, 128)
    options = dict(passes={"fp4_linear": True}, force=True, fp4_format="nvfp4")
    proto = onnx.load(str(graphopt.export_onnx(model, (x,), tmp_path / "std.onnx", **options)))
    fp4_inits = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT4E2M1]
    assert [list(i.dims) for i in fp4_inits] == [[96, 128]]
    assert "Split" in [n.op_type for n in proto.graph.node]
    path = graphopt.export_onnx(model, (x,), tmp_path / "run.onnx", onnx_forms={"graphopt::fp4_linear": "runnable"},
                                **options)
    (y,) = run_onnxruntime(path, x)
    rewritten, decisions = capture_rewritten(model, (x,), **options)
    assert [d.applied for d in decisions] == [True, True]
    assert all("siblings" in d.reason for d in decisions)
    with torch.no_grad():
        np.testing.assert_allclose(y, rewritten(x).numpy(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fuse", [True, False])
def test_linears_reading_a_rewritten_linear_read_its_replacement(fuse):
    """a and b (siblings) read proj's output: after proj is rewritten they read the new node.
    MXFP4 (no global scale), so grouped and one-by-one give the same weights."""
    from graphopt.onnx_export import capture_rewritten

    torch.manual_seed(5)
    model, x = SiblingsOnALinear(128).eval(), torch.randn(3, 128)
    rewritten, decisions = capture_rewritten(model, (x,), passes={"fp4_linear": True}, force=True, fp4_format="mxfp4",
                                             fuse_sibling_linears=fuse)
    assert [d.applied for d in decisions] == [True] * 3
    assert sum("siblings" in d.reason for d in decisions) == (2 if fuse else 0)

    def roundtrip(w):
        return fp4.dequantize_fp4(fp4.quantize_fp4(w, "mxfp4", scale_search=SCALE_SEARCH))

    with torch.no_grad():
        h = F.linear(x, roundtrip(model.proj.weight))
        expected = F.linear(h, roundtrip(model.a.weight)) * F.linear(h, roundtrip(model.b.weight))
        torch.testing.assert_close(rewritten(x), expected, rtol=1e-4, atol=1e-5)


def test_dynamic_token_count_compiles_once_and_keeps_the_rewrite():
    # dynamic=True: the token count is a symbol. The pass must not read it as an int (that would
    # install a guard and recompile per length); it costs the layer at one token instead.
    from graphopt import compiler as backend_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).eval()
    compiled = torch.compile(model, backend="graphopt", dynamic=True,
                             options={"passes": {"fp4_linear": True}, "force": True, "downstream": "eager"})
    xs = [torch.randn(n, 64) for n in (5, 9, 17)]
    with backend_module.recording_decisions(reset=True) as sink, torch.no_grad():
        outs = [compiled(x) for x in xs]
        refs = [model(x) for x in xs]
    fp4 = [d for d in sink if d.pass_name == "fp4_linear"]
    assert len(fp4) == 2 and all(d.applied for d in fp4), [d.reason for d in fp4]  # one compile, both layers
    assert all("costed at 1 token" in d.reason for d in fp4)
    for out, ref in zip(outs, refs):  # FP4 weights: close to the float model, not equal
        assert out.shape == ref.shape
        assert (out - ref).norm() < 0.25 * ref.norm()


def test_onnx_runnable_form_with_a_dynamic_token_count(tmp_path):
    from graphopt.onnx_export import capture_rewritten, run_onnxruntime

    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 256)
    options = dict(passes={"fp4_linear": True}, force=True, dynamic_axes={0: {0: "batch", 1: "seq"}})
    path = graphopt.export_onnx(model, (x,), tmp_path / "fp4_dyn.onnx", onnx_forms={"graphopt::fp4_linear": "runnable"},
                                **options)
    rewritten, decisions = capture_rewritten(model, (x,), **options)  # the same rewrite, run by PyTorch
    assert sum(d.applied for d in decisions) == 2
    for shape in ((3, 5, 256), (1, 2, 256)):  # shapes other than the example's
        y = torch.randn(*shape)
        (out,) = run_onnxruntime(path, y)
        with torch.no_grad():
            expected = rewritten(y).numpy()
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-4)


def test_a_path_with_no_correct_tile_falls_back_to_dequantize_and_cublas(monkeypatch):
    """When the tuner finds no tile of the cost model's path that computes the product on this GPU,
    the op must not run that path's untuned default (wrong too): it dequantizes and runs cuBLAS."""
    from types import SimpleNamespace

    from graphopt.passes import fp4_linear as pass_module

    def no_tile(*args, **kwargs):
        raise fp4.NoCorrectTile("no FP4 gemv kernel configuration computed the product")

    monkeypatch.setattr(pass_module.fp4k, "tune_fp4_linear", no_tile)
    monkeypatch.setattr(pass_module.fp4_cost, "device_path", lambda *args: "gemv")
    ctx = SimpleNamespace(hardware=SimpleNamespace(is_gpu=True), for_export=False, config=SimpleNamespace(cuda_graphs=True))
    kw = SimpleNamespace(codes=SimpleNamespace(is_cuda=True, device=torch.device("cpu")), scales=None, global_scale=None,
                         out_features=64, in_features=64, format="nvfp4")
    info = {"static_tokens": True, "tokens": 1, "act_dtype": torch.bfloat16}
    kernel = pass_module._tuned_kernel(ctx, info, kw, has_bias=False)
    assert fp4.kernel_choice(kernel, 1) == ("dequant", None)
    assert fp4.kernel_choice(kernel, 4096) == ("dequant", None)
