"""The all_reduce pass: the Partial() -> Replicate() redistribute after a row-parallel linear
becomes graphopt::all_reduce on the local partial tensor, wrapped back as a replicated DTensor.

One gloo process (a mesh of one rank: the graph, the placements and the rewrite are those of any
tensor-parallel size; tests/test_tensor_parallel.py runs two ranks). Both graph forms Dynamo
records are read: the `redistribute` method call (torch 2.13) and the closure named
"prim_redistribute" earlier torch records, each made from whichever form the installed torch
records (tests/passes/dtensor_graph_forms.py). The GPU test at the end runs the one-shot kernel on
two GPUs under CUDA graphs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import free_port
from tests.passes.dtensor_graph_forms import calls_form_runs, in_graph_form

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

H100 = dict(target="h100")
OP = "graphopt.all_reduce.default"


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


class TwoBlocks(nn.Module):
    """Two MLP blocks, each a column-parallel then a row-parallel linear: two all-reduces."""

    def __init__(self, width=48, hidden=80, blocks=2):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(hidden, width, bias=False) for _ in range(blocks))

    def forward(self, x):
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.relu(up(x)))
        return x


def _split(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.ups)):
        plan[f"ups.{i}"], plan[f"downs.{i}"] = ColwiseParallel(), RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _float64(model, x):
    reference = type(model)(blocks=len(model.ups)).double()
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.full_tensor() if hasattr(q, "full_tensor") else q)
        return reference(x.double())


def _compile(model, x, graph_form: str | None = None, **options):
    """The model compiled by graphopt (eager downstream unless given) under no_grad, its graph first
    put in `graph_form` where one is given: its output, the decisions of the all_reduce pass, the
    rewritten graph's all-reduce nodes and the boundary calls the graph held in that form."""
    import graphopt
    from graphopt.compiler import recording_decisions

    inner = graphopt.backend(**{"passes": {"all_reduce": True}, "downstream": "eager", **options})
    seen = {}

    def backend(gm, example_inputs):
        seen["form"] = in_graph_form(gm, graph_form) if graph_form else {}
        compiled = inner(gm, example_inputs)
        seen["ops"] = [n.args for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == OP]
        return compiled

    with recording_decisions() as decisions, torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return out, [d for d in decisions if d.pass_name == "all_reduce"], seen


@pytest.mark.parametrize("graph_form", ["calls", "prim"], ids=["redistribute", "prim_redistribute"])
def test_row_parallel_all_reduces_are_rewritten_in_either_graph_form(mesh, graph_form):
    if graph_form == "calls" and not calls_form_runs():
        pytest.skip("this torch's FX cannot write DTensor.from_local and placements as code; its Dynamo records the prim form only")
    torch.manual_seed(0)
    model = _split(TwoBlocks(), mesh).eval()
    x = torch.randn(3, 5, 48)
    out, decisions, seen = _compile(model, x, graph_form=graph_form, force=True, **H100)
    # every hook's boundary calls, the column-parallel ones too, all in the form under test
    assert seen["form"] == {"from_local": 4, "redistribute": 4, "to_local": 4}
    assert [(d.applied, d.location, d.details["slot"]) for d in decisions] == [(True, "downs.0", 0), (True, "downs.1", 1)]
    assert all(d.implementation.startswith("functional") and "tensors are on cpu" in d.reason for d in decisions)
    assert all(d.details["bytes"] == 3 * 5 * 48 * 4 and d.details["ranks"] == 1 for d in decisions)
    # one op per all-reduce, on the group of the mesh, alternating buffers
    group = mesh.get_group(0).group_name
    assert [tuple(args[1:]) for args in seen["ops"]] == [(group, 0), (group, 1)]
    torch.testing.assert_close(out.double(), _float64(model, x), rtol=1e-5, atol=1e-5)


def test_the_all_reduce_of_a_rewritten_linear_reads_its_local_result(mesh):
    """With fp4_linear on, the row-parallel linear is an op on local tensors wrapped as a Partial
    DTensor: the all-reduce takes the op's output directly, with no DTensor between them."""
    torch.manual_seed(0)
    model = _split(TwoBlocks(), mesh).eval()
    x = torch.randn(2, 48)
    out, decisions, seen = _compile(model, x, passes={"all_reduce": True, "fp4_linear": True}, force=True, **H100)
    assert [d.applied for d in decisions] == [True, True]
    assert all(str(args[0].target) == "graphopt.fp4_linear.default" for args in seen["ops"])
    reference, _, _ = _compile(model, x, passes={"fp4_linear": True}, force=True, **H100)
    torch.testing.assert_close(out, reference)


def test_an_odd_all_reduce_stays_dtensors(mesh):
    """The one-shot calls of a graph come in pairs (two alternating buffers): a graph with three
    rewrites the first two and keeps the third as DTensor's, also when forced."""
    torch.manual_seed(0)
    model = _split(TwoBlocks(blocks=3), mesh).eval()
    x = torch.randn(4, 48)
    out, decisions, seen = _compile(model, x, force=True, **H100)
    assert [(d.applied, d.details["slot"]) for d in decisions] == [(True, 0), (True, 1), (False, -1)]
    assert "come in pairs" in decisions[2].reason and "this graph has 3" in decisions[2].reason
    assert len(seen["ops"]) == 2
    torch.testing.assert_close(out.double(), _float64(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, applied, reason", [
    (dict(target="cpu"), False, "symmetric memory needs CUDA GPUs (target: generic CPU)"),
    (dict(target="cpu", force=True), True, "forced: the op runs the functional all-reduce (symmetric memory needs"),
    (dict(target="h100"), False, "the tensors are on cpu: symmetric memory needs CUDA GPUs"),
])
def test_without_cuda_the_pass_declines_unless_forced(mesh, options, applied, reason):
    torch.manual_seed(0)
    model = _split(TwoBlocks(), mesh).eval()
    x = torch.randn(3, 48)
    out, decisions, seen = _compile(model, x, **options)
    assert [d.applied for d in decisions] == [applied, applied]
    assert all(d.reason.startswith(reason) for d in decisions), decisions[0].reason
    assert len(seen["ops"]) == (2 if applied else 0)
    if applied:  # nothing to alternate: the functional all-reduce has no buffer
        assert [args[2] for args in seen["ops"]] == [-1, -1]
    torch.testing.assert_close(out.double(), _float64(model, x), rtol=1e-5, atol=1e-5)


def _partial_program(kind: str, mesh):
    """A function of one local tensor whose redistribute the pass must decline, and the reason."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if kind == "max":
        return (lambda t: DTensor.from_local(t, mesh, [Partial("max")]).redistribute(mesh, [Replicate()]).to_local() * 2,
                "a Partial('max') reduction: only sums are rewritten")
    if kind == "reduce-scatter":
        return (lambda t: DTensor.from_local(t, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local() * 2,
                "redistribute to (Shard(dim=0),): only Partial() -> Replicate()")
    if kind == "cast":
        return (lambda t: DTensor.from_local(t, mesh, [Partial()]).redistribute(
            mesh, [Replicate()], forward_dtype=torch.float64).to_local() * 2, "the redistribute casts its tensor")
    mesh2 = init_device_mesh("cpu", (1, 1))
    return (lambda t: DTensor.from_local(t, mesh2, [Partial(), Replicate()]).redistribute(
        mesh2, [Replicate(), Replicate()]).to_local() * 2, "a 2-D device mesh: only 1-D")


@pytest.mark.parametrize("kind", ["max", "reduce-scatter", "cast", "2-D mesh"])
def test_other_redistributes_of_partial_tensors_are_declined_with_the_reason(mesh, kind):
    fn, reason = _partial_program(kind, mesh)
    t = torch.randn(4, 6)
    out, decisions, seen = _compile(fn, t, force=True, **H100)
    assert len(decisions) == 1 and not decisions[0].applied
    assert decisions[0].reason.startswith(reason), decisions[0].reason
    assert not seen["ops"]
    torch.testing.assert_close(out, fn(t))


def test_a_row_parallel_embeddings_masked_partial_is_declined(mesh):
    """A row-parallel embedding's output is a masked partial: its all-reduce applies the lookup's
    mask, so it stays DTensor's."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    embedding = parallelize_module(nn.Embedding(32, 16), mesh, RowwiseParallel(input_layouts=Replicate()))
    ids = torch.randint(0, 32, (2, 5))
    out, decisions, seen = _compile(embedding, ids, force=True, **H100)
    assert len(decisions) == 1 and not decisions[0].applied
    assert "masked partial" in decisions[0].reason
    torch.testing.assert_close(out, embedding.weight.full_tensor()[ids].detach())


def test_graphs_that_need_gradients_are_declined(mesh):
    import graphopt
    from graphopt.compiler import recording_decisions

    torch.manual_seed(0)
    model = _split(TwoBlocks(), mesh)
    x = torch.randn(3, 48)
    with recording_decisions() as decisions:
        out = torch.compile(model, backend=graphopt.backend(passes={"all_reduce": True}, force=True, downstream="eager",
                                                             **H100))(x)
    declined = [d for d in decisions if d.pass_name == "all_reduce"]
    assert len(declined) == 2 and not any(d.applied for d in declined)
    assert all("requires grad" in d.reason for d in declined)
    out.sum().backward()  # the program still trains
    assert model.ups[0].weight.grad is not None


# ---- the choice: cost model, buffer bound, slots ------------------------------------------------


def _site(nbytes: int, ranks: int = 2, group: str = "tp", dtype=torch.bfloat16, device="cuda"):
    from graphopt.passes.all_reduce import Site

    return Site(node=None, group_name=group, ranks=ranks, dtype=dtype, device=torch.device(device),
                numel=nbytes // dtype.itemsize)


@pytest.fixture
def symmetric_memory(monkeypatch):
    """As on a GPU host whose torch has symmetric memory."""
    from graphopt.ops import all_reduce as ops

    monkeypatch.setattr(ops, "symmetric_memory_problem", lambda device: None)


@pytest.mark.parametrize("nbytes, ranks, rewrite, reason", [
    (8192, 2, True, "one-shot all-reduce of 8192 bytes over 2 ranks through symmetric memory: predicted 2."),
    (2 * 2**20, 2, True, "one-shot all-reduce of 2097152 bytes over 2 ranks"),
    (4 * 2**20, 8, False, "cost model predicts NCCL faster for 4194304 bytes over 8 ranks ("),
    (8 * 2**20, 2, False, "8388608 bytes: larger than the 4 MiB symmetric buffers"),
    (8190, 2, False, "8190 bytes: the one-shot kernel moves multiples of 16 bytes"),
])
def test_the_cost_model_and_the_buffer_decide(symmetric_memory, nbytes, ranks, rewrite, reason):
    from graphopt.hardware import SPECS
    from graphopt.passes.all_reduce import decide

    site = _site(nbytes, ranks)
    decide(site, SPECS["h200"], force=False, graph_replay=True)
    assert site.rewrite is rewrite
    assert site.reason.startswith(reason), site.reason
    if site.before is not None:  # the decision carries both predicted times
        assert f"{site.before.ms:.4f} -> {site.after.ms:.4f} ms" in site.reason
        assert (site.after.ms < site.before.ms) is rewrite


def test_the_one_shot_kernel_is_priced_inside_cuda_graphs_only(symmetric_memory):
    from graphopt.hardware import SPECS
    from graphopt.passes.all_reduce import decide

    site = _site(8192)
    decide(site, SPECS["h200"], force=False, graph_replay=False)
    assert not site.rewrite and "measured inside CUDA graphs only" in site.reason
    decide(site, SPECS["h200"], force=True, graph_replay=False)
    assert site.rewrite and site.slot == 0 and site.reason.startswith("forced: one-shot all-reduce")


def test_slots_alternate_per_group_and_come_in_pairs():
    from graphopt.passes.all_reduce import assign_slots

    sites = [_site(8192, group=g) for g in ("a", "a", "b", "a", "a", "a", "b", "a")]
    for site in sites:
        site.rewrite, site.slot = True, 0
    sites[3].slot = -1  # forced onto the functional all-reduce: no buffer, not counted
    assign_slots(sites)
    assert [(s.group_name, s.rewrite, s.slot) for s in sites] == [
        ("a", True, 0), ("a", True, 1), ("b", True, 0), ("a", True, -1), ("a", True, 0), ("a", True, 1),
        ("b", True, 1), ("a", False, -1)]
    assert "come in pairs" in sites[7].reason and "this graph has 5" in sites[7].reason


# ---- two GPUs: the one-shot kernel under CUDA graphs --------------------------------------------


def _gpu_worker(rank: int, port: int, out: str) -> None:
    import graphopt
    from graphopt.compiler import recording_decisions
    from graphopt.ops import all_reduce as ops
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cuda", (2,))
        group = mesh.get_group(0).group_name
        results: dict = {}
        # the op itself, against NCCL: eagerly, then four calls recorded in one CUDA graph and replayed
        sizes = (4096, 65536, 3 * 2**20)  # bf16 elements; the last is larger than the buffers
        ops.prepare_buffers(group, torch.bfloat16, 65536, torch.device("cuda", rank))
        direct = []
        for numel in sizes:
            x = torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=_cuda_gen(rank * 10 + numel % 7))
            expected = x.clone()
            dist.all_reduce(expected)
            direct.append((numel, [ops.buffer_for(x, group, s) is not None for s in (0, 1)],
                           [(torch.ops.graphopt.all_reduce(x, group, s) - expected).abs().max().item() for s in (0, 1)]))
        static = [torch.zeros(8192, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            [torch.ops.graphopt.all_reduce(t, group, i % 2) for i, t in enumerate(static)]  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = [torch.ops.graphopt.all_reduce(t, group, i % 2) for i, t in enumerate(static)]
        replay_errors = []
        for seed in (1, 2):
            for i, t in enumerate(static):
                t.copy_(torch.randn(8192, device="cuda", dtype=torch.bfloat16, generator=_cuda_gen(100 * seed + 10 * i + rank)))
            expected = [t.clone() for t in static]
            for e in expected:
                dist.all_reduce(e)
            graph.replay()
            torch.cuda.synchronize()
            replay_errors.append(max((g - e).abs().max().item() for g, e in zip(graphed, expected)))
        results["direct"], results["replay_errors"] = direct, replay_errors
        # a split MLP under mode="reduce-overhead", the pass off and on
        torch.manual_seed(0)  # every rank builds the same weights and keeps its shards
        model = _split(TwoBlocks(width=1024, hidden=2816).cuda().to(torch.bfloat16), mesh).eval()
        for name, passes in (("off", {}), ("on", {"all_reduce": True})):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=graphopt.backend(passes=passes), mode="reduce-overhead")
            outputs = []
            with torch.no_grad(), recording_decisions() as decisions:
                for seed in (1, 2, 3):
                    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, generator=_cuda_gen(seed))
                    torch.compiler.cudagraph_mark_step_begin()
                    outputs.append(compiled(x).clone())  # a replay overwrites the last output
            results[name] = dict(outputs=[o.cpu() for o in outputs],
                                 decisions=[(d.applied, d.implementation, d.reason) for d in decisions
                                            if d.pass_name == "all_reduce"])
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_one_shot_all_reduce_under_cuda_graphs_equals_nccl(tmp_path, monkeypatch):
    """Two GPUs, NCCL: graphopt::all_reduce through the one-shot kernel equals NCCL's sum eagerly
    and replayed from a CUDA graph that alternates the two buffers (larger than the buffers: the
    functional all-reduce); a split MLP compiled with mode="reduce-overhead" and the pass on gives
    the outputs of the pass off, its two all-reduces run by the one-shot kernel."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_gpu_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for numel, buffered, errors in results["direct"]:
            assert buffered == [numel <= 65536] * 2, numel
            assert max(errors) < 0.05, (numel, errors)  # bf16 sums of N(0, 1) pairs: NCCL's to the last bit or so
        assert max(results["replay_errors"]) < 0.05, results["replay_errors"]
        assert [(applied, implementation) for applied, implementation, _ in results["on"]["decisions"]] == [
            (True, "one_shot (slot 0)"), (True, "one_shot (slot 1)")], results["on"]["decisions"]
        for on, off in zip(results["on"]["outputs"], results["off"]["outputs"]):
            torch.testing.assert_close(on, off)
        assert not torch.allclose(results["on"]["outputs"][0], results["on"]["outputs"][1])
