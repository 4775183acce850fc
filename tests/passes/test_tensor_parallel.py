"""The tensor-parallel helpers of the linear passes read both forms in which Dynamo records
DTensor's boundary calls: `DTensor.from_local` itself (torch 2.13) and the closure named
"prim from_local" that holds the mesh and placements (earlier torch, e.g. the GPU machines'
2.11). Each form is made from whichever one the installed torch records
(tests/passes/dtensor_graph_forms.py), in one gloo process (a mesh of one rank: the placements,
and so the per-rank rewrite, are those of any tensor-parallel size)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.passes.dtensor_graph_forms import calls_form_runs, in_graph_form

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512, bias=False)
        self.down = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("graph_form", ["calls", "prim"], ids=["from_local", "prim from_local"])
def test_column_and_row_parallel_linears_are_rewritten_in_either_graph_form(mesh, graph_form):
    if graph_form == "calls" and not calls_form_runs():
        pytest.skip("this torch's FX cannot write DTensor.from_local and placements as code; its Dynamo records the prim form only")
    import graphopt
    from graphopt.compiler import recording_decisions
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = MLP().eval()
    reference = MLP().eval()
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    options = dict(passes={"fp4_linear": True}, force=True, target="h100", downstream="eager")
    inner = graphopt.backend(**options)
    forms = []

    def backend(gm, example_inputs):
        forms.append(in_graph_form(gm, graph_form))
        return inner(gm, example_inputs)

    x = torch.randn(3, 256)
    with recording_decisions() as decisions, torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        expected = torch.compile(reference, backend=graphopt.backend(**options), fullgraph=True)(x)
    applied = [d for d in decisions if d.pass_name == "fp4_linear" and d.applied]
    assert forms[0]["from_local"] == 2  # both input hooks, in the form under test
    assert [("column-parallel" in d.reason, "row-parallel" in d.reason) for d in applied[:2]] == [(True, False), (False, True)]
    # one rank holds the whole weight: its blocks are the single-process model's blocks
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_dtensor_parameters_reach_inductor_as_local_shards_only_without_grad(mesh):
    """Under no_grad the compiled graph takes the DTensor parameters as local shards (one
    tensor_parallel Decision) and computes what the split model computes eagerly. With grad on the
    inputs stay DTensors, so the parameters' gradients still arrive, equal to eager's."""
    import graphopt
    from graphopt.compiler import recording_decisions
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = model(x)
    torch._dynamo.reset()
    with recording_decisions() as decisions, torch.no_grad():
        out = torch.compile(model, backend=graphopt.backend(target="h100"))(x)
    local = [d for d in decisions if d.pass_name == "tensor_parallel"]
    assert len(local) == 1 and local[0].applied and local[0].details["local_inputs"] == 2
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()
    model(x).sum().backward()
    eager_grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    model.zero_grad()
    with recording_decisions() as decisions:
        torch.compile(model, backend=graphopt.backend(target="h100"))(x).sum().backward()
    assert not [d for d in decisions if d.pass_name == "tensor_parallel"]
    for p, eager in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad.full_tensor(), eager, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_a_failed_compile_of_the_local_shard_graph_compiles_the_graph_as_it_came(mesh, monkeypatch, caplog):
    """If the downstream compile of the graph with local-shard inputs fails, the graph with its
    DTensor inputs is restored and compiled instead: the same outputs, no tensor_parallel
    Decision, and a warning that says so."""
    import graphopt
    from graphopt import compiler
    from graphopt.compiler import recording_decisions
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    real, calls = compiler._downstream, []

    def failing_once(gm, example_inputs, config, mode):
        calls.append([type(x).__name__ for x in example_inputs])
        if len(calls) == 1:
            raise RuntimeError("downstream refuses the local-shard graph")
        return real(gm, example_inputs, config, mode)

    monkeypatch.setattr(compiler, "_downstream", failing_once)
    torch.manual_seed(1)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(3, 256)
    torch._dynamo.reset()
    with recording_decisions() as decisions, torch.no_grad(), caplog.at_level("WARNING", logger="graphopt"):
        out = torch.compile(model, backend=graphopt.backend(target="h100"))(x)
        expected = model(x)
    torch._dynamo.reset()
    assert calls[0].count("DTensor") == 0 and calls[1].count("DTensor") == 2  # local shards, then the DTensors
    assert not [d for d in decisions if d.pass_name == "tensor_parallel"]
    assert "compiling the graph with its DTensor inputs" in caplog.text
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
