import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.compiler import recording_decisions
from graphopt.passes import register_extra_pass, unregister_extra_pass
from graphopt.passes.base import GraphPass
from graphopt.passes.fx_utils import find_linears, replace_with_call


@pytest.mark.slow
def test_entry_point_works_in_a_fresh_interpreter_without_importing_graphopt():
    code = ("import torch, sys; m = torch.nn.Linear(4, 4); "
            "print(torch.compile(m, backend='graphopt')(torch.randn(2, 4)).shape); "
            "print('graphopt' in sys.modules or 'graphopt.compiler' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "torch.Size([2, 4])"
    # Dynamo loaded graphopt through the entry point; a second lookup must not re-register it.
    code2 = ("import torch; from torch._dynamo import lookup_backend; "
             "a = lookup_backend('graphopt'); b = lookup_backend('graphopt'); print(a is b)")
    out2 = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, timeout=300)
    assert out2.returncode == 0 and out2.stdout.strip() == "True", out2.stderr


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_outputs_and_gradients_match_eager(downstream):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(5, 16)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, backend="graphopt", options={"downstream": downstream})(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for g, r in zip([p.grad for p in model.parameters()], ref_grads):
        torch.testing.assert_close(g, r)


def test_llama_gradients_match_eager():
    from graphopt.models import LLAMA_SHAPES, llama

    model, (ids,) = llama(LLAMA_SHAPES["tiny-llama"], seq_len=8)
    model.train()  # dropout is 0 in LLaMA configs; train mode exercises the training graph
    loss = model(ids, labels=ids).loss
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="graphopt", options={"downstream": "eager"})
    loss2 = compiled(ids, labels=ids).loss
    loss2.backward()
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-5, msg=n)


class _BrokenPass(GraphPass):
    """Mutates the graph half-way, then raises: the framework must restore the graph."""

    name = "broken_for_test"

    def run(self, ctx):
        for node in list(ctx.gm.graph.nodes):
            if node.op == "call_function":
                with ctx.gm.graph.inserting_before(node):
                    ctx.gm.graph.call_function(torch.neg, (node.args[0],))
                node.args = (node.args[0],) + tuple(node.args[1:])
                break
        raise RuntimeError("deliberately broken pass")


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_a_pass_that_raises_is_logged_and_skipped(caplog, downstream):
    """Also under Inductor: the restored graph keeps what Dynamo set on its placeholders
    (AOTAutograd needs their _dynamo_source; a plain deepcopy dropped it and the compile died)."""
    register_extra_pass(_BrokenPass())
    try:
        torch.manual_seed(0)
        model, x = MLP(), torch.randn(3, 16)
        with caplog.at_level("WARNING", logger="graphopt"):
            report = graphopt.explain(model, x, downstream=downstream)
        torch.testing.assert_close(report.output, model(x))
        failed = [d for d in report.decisions if d.pass_name == "broken_for_test"]
        assert failed and not failed[0].applied and "deliberately broken pass" in failed[0].reason
        assert "broken_for_test failed and was skipped" in caplog.text
    finally:
        unregister_extra_pass("broken_for_test")


class _FrozenLinearPass(GraphPass):
    """A stand-in weight-rewriting pass: bakes each linear weight (scaled by 1) into the graph."""

    name = "frozen_linear_for_test"

    def run(self, ctx):
        for match in find_linears(ctx):
            ok, why = ctx.can_freeze(match.weight_node)
            if not ok:
                ctx.record(self.name, False, why, node=match.node)
                continue
            const = ctx.add_constant(match.weight(ctx).clone(), "w")
            bias = match.bias_node
            ctx.record(self.name, True, "test", node=match.node)
            replace_with_call(ctx, match.node, F.linear, (match.input, const, bias))


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_frozen_weights_are_guarded_against_later_updates(downstream):
    register_extra_pass(_FrozenLinearPass())
    try:
        torch.manual_seed(0)
        model, x = MLP().eval(), torch.randn(3, 16)
        compiled = torch.compile(model, backend="graphopt", options={"downstream": downstream})
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
            model.fc1.weight.mul_(2.0)  # in-place update after compile
            torch.testing.assert_close(compiled(x), model(x))
    finally:
        unregister_extra_pass("frozen_linear_for_test")


@pytest.mark.parametrize("dynamic", [True, None])  # None: Dynamo's automatic dynamic shapes, from the second length
def test_a_frozen_weight_change_in_a_graph_with_symbolic_sizes_keeps_every_size_running(dynamic):
    """A compile outside Dynamo would see one call's sizes: after the change the unrewritten graph
    runs op by op, at every length, with the new weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).eval()
    compiled = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}, force=True), dynamic=dynamic)
    with torch.no_grad():
        for tokens in (3, 5):
            assert (compiled(torch.randn(tokens, 64)) - model(torch.randn(1, 64))).shape == (tokens, 32)
        model[0].weight.mul_(0.5)
        for tokens in (5, 7, 2):
            x = torch.randn(tokens, 64)
            torch.testing.assert_close(compiled(x), model(x))


def test_weights_made_under_inference_mode_are_rewritten():
    """Inference tensors keep no version counter: the guard watches their identity."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).eval()
        x = torch.randn(3, 64)
        with recording_decisions() as decisions:
            out = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}, force=True))(x)
        assert [d.applied for d in decisions if d.pass_name == "fp4_linear"] == [True, True], [d.reason for d in decisions]
        assert 0 < (out - model(x)).abs().max() < 0.2


def test_weight_passes_decline_training_graphs():
    register_extra_pass(_FrozenLinearPass())
    try:
        model, x = MLP(), torch.randn(3, 16)
        torch._dynamo.reset()
        from graphopt import compiler as backend

        with backend.recording_decisions() as sink:
            torch.compile(model, backend="graphopt", options={"downstream": "eager"})(x)  # grad enabled
        decisions = [d for d in sink if d.pass_name == "frozen_linear_for_test"]
        assert decisions and not any(d.applied for d in decisions)
        assert "requires grad" in decisions[0].reason
    finally:
        unregister_extra_pass("frozen_linear_for_test")


@pytest.mark.parametrize("options,fragment", [
    ({"fp4": True}, "unknown graphopt option 'fp4'; valid choices: passes, target"),
    ({"target": "h300"}, "target='h300' is not valid (did you mean 'h200'?); valid choices: auto, h100"),
    ({"passes": {"fp4linear": True}}, "fp4linear"),
])
def test_a_bad_option_reaches_the_caller_as_a_value_error_not_a_compiler_failure(options, fragment):
    """torch.compile(backend="graphopt", options=...) hands the options over at the first call;
    the error then is graphopt's ValueError, not Dynamo's BackendCompilerFailed around it."""
    compiled = torch.compile(nn.Linear(2, 2), backend="graphopt", options=options)
    with pytest.raises(ValueError, match=re.escape(fragment)) as info:
        compiled(torch.randn(1, 2))
    assert not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    with pytest.raises(ValueError, match=re.escape(fragment)):  # graphopt.backend checks them where it is built
        graphopt.backend(**options)


def test_graphopt_log_turns_on_decision_logging(monkeypatch, caplog):
    import logging

    from graphopt import logging_setup

    level = logging.getLogger("graphopt").level
    monkeypatch.setenv("GRAPHOPT_LOG", "info")
    logging_setup.configure_logging()
    assert logging.getLogger("graphopt").level == logging.INFO
    monkeypatch.setenv("GRAPHOPT_LOG", "loud")
    with pytest.raises(ValueError, match="GRAPHOPT_LOG='loud'.*valid choices: info, debug, warning"):
        logging_setup.configure_logging()
    # explain checks it before compiling: the error is the ValueError itself, not Dynamo's wrapper
    with pytest.raises(ValueError, match="GRAPHOPT_LOG='loud'"):
        graphopt.explain(nn.Linear(2, 2), torch.randn(1, 2))
    monkeypatch.setenv("GRAPHOPT_LOG", "")
    logging_setup.configure_logging()
    logger = logging.getLogger("graphopt")
    assert logger.level == level
    # off again, graphopt's warnings go through the application's handlers, at its levels, as before
    assert logger.propagate and not any(getattr(h, "_graphopt", False) for h in logger.handlers)


def test_cuda_graphs_option_asks_inductor_for_cuda_graph_trees(monkeypatch):
    """options={"cuda_graphs": True} is mode="reduce-overhead" for graphopt (torch.compile takes
    one of mode= and options=): the downstream Inductor compile gets triton.cudagraphs. On a CPU
    graph Inductor skips the recording, and the results are unchanged."""
    from torch._inductor import compile_fx as inductor_compile_fx

    seen = []
    real = inductor_compile_fx.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return real(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(3, 16)
    with torch.no_grad():
        out = torch.compile(model, backend="graphopt", options={"cuda_graphs": True})(x)
        torch.testing.assert_close(out, model(x))
    from torch._inductor import config as inductor_config

    # graphopt's Triton kernels go through Inductor's static launcher wherever this torch has it
    static = ({"static_launch_user_defined_triton_kernels": True}
              if hasattr(inductor_config, "static_launch_user_defined_triton_kernels") else {})
    assert seen and seen[0] == {"triton.cudagraphs": True, **static}
    torch._dynamo.reset()
    seen.clear()
    with torch.no_grad():
        torch.compile(model, backend="graphopt")(x)
    assert seen[0] == (static or None)  # Inductor calls itself again inside the patches


def test_inductor_compile_workers_are_told_to_launch_statically(monkeypatch):
    """Inductor's compile workers take the static-launch switch from the environment they start
    with: graphopt sets it for its downstream compile only, and leaves a value the user set alone."""
    from torch._inductor import compile_fx as inductor_compile_fx
    from torch._inductor import config as inductor_config

    from graphopt import compiler

    if not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):
        pytest.skip("this torch has no static launch of user-defined Triton kernels")
    seen = []

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(os.environ.get(compiler.STATIC_LAUNCH_ENV))
        return gm.forward

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", spy)
    monkeypatch.setenv(compiler.STATIC_LAUNCH_ENV, "")  # so that teardown restores the value from before
    model, x = MLP().eval(), torch.randn(3, 16)
    for preset, inside in ((None, "1"), ("0", "0")):
        if preset is None:
            monkeypatch.delenv(compiler.STATIC_LAUNCH_ENV)
        else:
            monkeypatch.setenv(compiler.STATIC_LAUNCH_ENV, preset)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="graphopt")(x), model(x))
        assert seen[-1] == inside
        assert os.environ.get(compiler.STATIC_LAUNCH_ENV) == preset  # nothing left behind
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_cpp_wrapper_compiles_graphs_with_the_4bit_ops():
    """Inductor's C++ wrapper (the README's recipe for one-launch host costs without CUDA graphs)
    compiles graphs holding graphopt's FP4 and Q4 ops (on the CPU their torch references, called
    from the C++ through the dispatcher) with the Python wrapper's results."""
    from torch._inductor import config as inductor_config

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).eval(), torch.randn(3, 64)
    for options in ({"passes": {"fp4_linear": True}, "force": True}, {"passes": {"q4_linear": True}, "force": True}):
        results = []
        for cpp in (False, True):
            torch._dynamo.reset()
            with torch.no_grad(), inductor_config.patch(cpp_wrapper=cpp), \
                    recording_decisions() as decisions:
                results.append(torch.compile(model, backend=graphopt.backend(**options))(x))
            assert sum(d.applied for d in decisions) == 2, [d.reason for d in decisions]
        torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)
        assert (results[1] - model(x)).abs().max() < 0.2  # 4-bit weights, not the dense ones
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph trees record only on a GPU")
def test_cuda_graphs_replays_graphopt_kernels_with_fresh_inputs():
    """On a GPU the step is recorded once and replayed: the FP4 kernels (tuned on the warm-up call)
    run inside the recording, and each new input gives the same result as without CUDA graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).cuda().to(torch.bfloat16).eval()
    options = {"passes": {"fp4_linear": True}, "force": True}
    with torch.no_grad():
        plain = torch.compile(model, backend="graphopt", options=options)
        inputs = [torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        expected = [plain(x).clone() for x in inputs]
        torch._dynamo.reset()
        graphed = torch.compile(model, backend="graphopt", options={**options, "cuda_graphs": True})
        for x, want in zip(inputs, expected):
            torch.compiler.cudagraph_mark_step_begin()
            # bf16 tolerance: a split-K tile may sum its fp32 partials in another order
            torch.testing.assert_close(graphed(x).clone(), want)
        assert not torch.allclose(expected[0], expected[1])  # the inputs differ, so must the outputs
    torch._dynamo.reset()


def _rejecting_rewritten_graphs(monkeypatch, armed=lambda: True):
    """compiler._downstream raising on graphs that hold a graphopt op (while `armed()`)."""
    from graphopt import compiler

    real = compiler._downstream

    def rejecting(gm, example_inputs, config, mode):
        if armed() and any("graphopt" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("downstream cannot take this op")
        return real(gm, example_inputs, config, mode)

    monkeypatch.setattr(compiler, "_downstream", rejecting)


def test_a_rewritten_graph_the_downstream_compiler_rejects_runs_unrewritten(monkeypatch, caplog):
    """A rewrite never turns a program that runs into one that fails: when the downstream compiler
    raises on the rewritten graph, the graph is compiled without graphopt's rewrites, with a warning,
    and the recorded decisions say the rewrites were dropped."""
    from graphopt import compiler

    _rejecting_rewritten_graphs(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    x = torch.randn(2, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}, force=True,
                                                             downstream="eager"))
    with torch.no_grad(), caplog.at_level("WARNING", logger="graphopt"), compiler.recording_decisions() as decisions:
        got = compiled(x)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))  # the unrewritten (exact) linear ran
    assert any("downstream compiler failed on the rewritten graph" in r.getMessage() for r in caplog.records)
    fp4 = [d for d in decisions if d.pass_name == "fp4_linear"]
    assert fp4 and not any(d.applied for d in fp4) and all(d.reason.startswith("dropped") for d in fp4)


def test_a_recompile_the_downstream_compiler_rejects_runs_unrewritten(monkeypatch):
    """The recompile after a frozen weight changed falls back as the first compile does."""
    failing = [False]
    _rejecting_rewritten_graphs(monkeypatch, armed=lambda: failing[0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}, force=True,
                                                             downstream="eager"))
    with torch.no_grad():
        assert not torch.equal(compiled(x), model(x))  # FP4 weights ran
        failing[0] = True
        model[0].weight.mul_(1.01)  # the frozen weight changes: the graph is compiled again
        with pytest.warns(RuntimeWarning, match="downstream compiler failed"):
            got = compiled(x)
        torch.testing.assert_close(got, model(x))  # the new weights, unrewritten
        model[0].weight.mul_(1.01)  # the unrewritten graph reads the weights as they are
        torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()
