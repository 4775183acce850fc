"""Tensor parallelism (torch.distributed.tensor, "DTensor"): rewriting a rank's local shard.

A model split with `parallelize_module` (ColwiseParallel / RowwiseParallel on q/k/v/o and
gate/up/down, as gpt-fast and torchtitan do) reaches the backend as a torch-level graph that keeps
DTensor at each parallelized linear and computes on local tensors everywhere else:

    x_dt = DTensor.from_local(x, mesh, (Replicate(),))     # the module's input hook
    y_dt = linear(x_dt, W)                                  # W: a DTensor parameter, global shape
    y = y_dt.redistribute((Shard(-1),)).to_local()          # its output hook

Attention between the projections sees each rank's local heads as plain tensors, so the attention
passes need nothing from here. A weight pass rewrites the linear on the rank's shard instead:
op(x, packed local shard), wrapped back with `from_local` and the placement the DTensor linear
had: Shard(last) for a column-parallel weight (Shard(0) with a replicated input), Partial() for a
row-parallel one (Shard(1) with an input sharded on its last dim; its bias is added on mesh index 0
only, so the partial sums add up to one bias). The `redistribute` after it stays, so the
collectives DTensor inserted (the all-reduce of the partial sums) run unchanged, unless the
all_reduce pass (graphopt.passes.all_reduce) replaces that all-reduce.
transformers' own tensor parallelism (`tp_plan`) keeps DTensor parameters but multiplies plain local
tensors by `weight.to_local()`, its hooks doing the collectives; such a linear is rewritten in place
on the same shard, with nothing to wrap. Every other DTensor linear is left alone, with the reason
(`LinearShard.problem`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx


def _dtensor_api():
    """(DTensor, Shard, Replicate, Partial), or None where torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor, Shard, Replicate, Partial


def is_dtensor(value: Any) -> bool:
    api = _dtensor_api()
    return api is not None and isinstance(value, api[0])


def rank_and_world() -> tuple[int, int] | None:
    """(rank, world size) of this process where torch.distributed runs with more than one process."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


@dataclass
class LinearShard:
    """How a linear against a DTensor weight runs on this rank. `problem` says why it cannot be
    rewritten per rank (then nothing else need be set)."""

    problem: str | None = None
    style: str = ""  # "column-parallel" | "row-parallel" | "replicated"
    local_input: fx.Node | None = None  # x, the local tensor the input hook wrapped
    mesh: Any = None  # the DeviceMesh of the linear's input, reused for the output
    out_placements: tuple = ()
    weight: torch.Tensor | None = None  # the DTensor parameter
    coordinate: int = 0  # this rank's index along the mesh
    mesh_size: int = 1
    local_form: bool = False  # the graph already multiplies local tensors by weight.to_local()

    @property
    def local_weight(self) -> torch.Tensor:
        return self.weight.to_local()

    def describe(self) -> str:
        """E.g. "column-parallel shard 32x64 of 64x64 (mesh index 1 of 2)"."""
        local, full = tuple(self.local_weight.shape), tuple(self.weight.shape)
        return (f"{self.style} shard {local[0]}x{local[1]} of {full[0]}x{full[1]} "
                f"(mesh index {self.coordinate} of {self.mesh_size})")


def _is_prim(node: Any, name: str) -> bool:
    """A call of the closure older Dynamo (torch before 2.13) records for DTensor's `name`, its
    arguments inside it: named "prim <name>" or "prim_<name>" (both spellings occur)."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and getattr(node.target, "__name__", "") in (f"prim {name}", f"prim_{name}"))


def _is_from_local(node: Any) -> bool:
    """DTensor.from_local in a Dynamo graph: the function itself, or (torch before 2.13) the
    closure Dynamo wraps it in, named "prim from_local", with the mesh and placements inside it
    (the node's recorded DTensor value carries them in both forms)."""
    api = _dtensor_api()
    return api is not None and isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is api[0].from_local) or _is_prim(node, "from_local"))


def _is_to_local(node: Any) -> bool:
    """`t.to_local()` in a Dynamo graph: a method call, or (torch before 2.13) a call of Dynamo's
    closure named "prim to_local"."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == "to_local") or _is_prim(node, "to_local"))


def wrapped_local(node: Any) -> fx.Node | None:
    """The local tensor a DTensor.from_local node wraps (either graph form), else None."""
    return _node_arg(node, 0, "local_tensor") if _is_from_local(node) else None


def is_redistribute(node: Any) -> bool:
    """`t.redistribute(...)` in a Dynamo graph: a method call (torch 2.13), or a call of the closure
    older Dynamo records, named "prim_redistribute", with the arguments inside it."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == "redistribute") or _is_prim(node, "redistribute"))


def redistribute_arguments(node: fx.Node) -> tuple[tuple, dict] | None:
    """The arguments of a redistribute after the DTensor itself, (args, kwargs): the node's own, or
    those the closure form captured (its `args_as_value` and `kwargs_as_value`). None where they
    cannot be read."""
    if node.op == "call_method":
        return tuple(node.args[1:]), dict(node.kwargs)
    if len(node.args) != 1 or node.kwargs:
        return None
    try:
        captured = inspect.getclosurevars(node.target).nonlocals
    except TypeError:
        return None
    args, kwargs = captured.get("args_as_value", ()), captured.get("kwargs_as_value", {})
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        return None
    return tuple(args), dict(kwargs)


def _node_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def local_shard_parameter(ctx, weight: Any) -> fx.Node | None:
    """The DTensor parameter behind a linear's weight `W.to_local()` (transformers' tensor
    parallelism multiplies by the rank's shard that way), else None."""
    if not _is_to_local(weight):
        return None
    param = weight.args[0]
    value = ctx.example_value(param) if isinstance(param, fx.Node) and param.op == "placeholder" else None
    return param if is_dtensor(value) and isinstance(value, torch.nn.Parameter) and value.dim() == 2 else None


def linear_shard(ctx, node: fx.Node, x: Any, weight_node: fx.Node, bias_node: fx.Node | None,
                 kind: str, *, local_form: bool = False) -> LinearShard | None:
    """The per-rank form of a linear whose weight is a DTensor parameter, or None for a plain weight.
    local_form: the linear multiplies plain local tensors by `weight_node.to_local()`."""
    weight = ctx.example_value(weight_node)
    if not is_dtensor(weight):
        return None
    _, Shard, Replicate, Partial = _dtensor_api()
    if kind != "linear":
        return LinearShard(f"DTensor weight used through {kind}: only F.linear of a parallelized nn.Linear is "
                           "rewritten per rank")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        return LinearShard(f"DTensor weight on a {mesh.ndim}-D device mesh: only 1-D (tensor-parallel) meshes are "
                           "rewritten per rank")
    w_placements = tuple(weight.placements)
    coordinate = mesh.get_coordinate()
    index = coordinate[0] if coordinate else 0
    if local_form:  # plain tensors in and out (the shard's own shape, even or not); the model's hooks communicate
        styles = {(Shard(0),): "column-parallel", (Shard(1),): "row-parallel", (Replicate(),): "replicated"}
        if w_placements not in styles:
            return LinearShard(f"local shard of a DTensor weight placed {w_placements}: only Shard(0), Shard(1) and "
                               "Replicate() weights are rewritten per rank")
        return LinearShard(None, styles[w_placements], x, None, (), weight, index, mesh.size(0), local_form=True)
    for dim, placement in enumerate(w_placements):  # from_local below assumes even shards
        if isinstance(placement, Shard) and weight.shape[placement.dim] % mesh.size(dim):
            return LinearShard(f"uneven shards: weight dim {placement.dim} of size {weight.shape[placement.dim]} does not "
                               f"split evenly over {mesh.size(dim)} ranks")
    if not _is_from_local(x):
        return LinearShard("the DTensor linear's input is not a local tensor wrapped by DTensor.from_local "
                           "(the input hook of ColwiseParallel / RowwiseParallel)")
    local_x = _node_arg(x, 0, "local_tensor")
    x_dims = len(getattr(_fake(local_x), "shape", ()))
    wrapped = _fake(x)
    if not x_dims or not is_dtensor(wrapped):
        return LinearShard("the local input's shape or its DTensor placements are unknown")
    last = Shard(x_dims - 1)
    in_placements = _normalized(tuple(wrapped.placements), x_dims)
    if w_placements == (Shard(0),) and in_placements == (Replicate(),):
        style, out = "column-parallel", (last,)
    elif w_placements == (Shard(1),) and in_placements == (last,):
        style, out = "row-parallel", (Partial(),)
    elif w_placements == (Replicate(),) and in_placements == (Replicate(),):
        style, out = "replicated", (Replicate(),)
    else:
        return LinearShard(f"DTensor placements input {in_placements}, weight {w_placements}: only column-parallel "
                           "(replicated input, Shard(0) weight) and row-parallel (input sharded on its last dim, "
                           "Shard(1) weight) linears are rewritten per rank")
    recorded = getattr(_fake(node), "placements", None)
    if recorded is not None and _normalized(tuple(recorded), x_dims) != out:
        return LinearShard(f"DTensor gives this linear's output the placements {tuple(recorded)}, not the {out} of a "
                           f"{style} linear")
    if bias_node is not None:
        bias = ctx.example_value(bias_node)
        wanted = (Shard(0),) if style == "column-parallel" else (Replicate(),)
        if not is_dtensor(bias) or tuple(bias.placements) != wanted:
            return LinearShard(f"{style} linear whose bias is not a DTensor parameter placed {wanted}")
    return LinearShard(None, style, local_x, wrapped.device_mesh, out, weight, index, mesh.size(0))


def _normalized(placements: tuple, ndim: int) -> tuple:
    """Placements with Shard(-1) and the like written as Shard(ndim - 1)."""
    Shard = _dtensor_api()[1]
    return tuple(Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)


def _fake(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def head_shard(query: fx.Node, max_depth: int = 32) -> tuple[int, int] | None:
    """(mesh index, mesh size) where `query`, a (B, H, L, D) attention query, holds this rank's
    contiguous share of the heads: its nearest ancestor that leaves DTensor (`to_local`) reads the
    output of a column-parallel projection, sharded on its last dim over a 1-D mesh, or the
    projection's Shard(0) weight itself (transformers' tensor parallelism). Else None."""
    api = _dtensor_api()
    if api is None:
        return None
    Shard = api[1]
    frontier, seen = [query], {query}
    for _ in range(max_depth):
        nearest = [n for n in frontier if _is_to_local(n)]
        if nearest:
            value = _fake(nearest[0].args[0])
            if not is_dtensor(value) or value.device_mesh.ndim != 1 or len(value.placements) != 1:
                return None
            placement = value.placements[0]
            weight = nearest[0].args[0].op == "placeholder" and value.dim() == 2
            if not isinstance(placement, Shard) or placement.dim not in ((0,) if weight else (-1, value.dim() - 1)):
                return None
            coordinate = value.device_mesh.get_coordinate()
            return (coordinate[0] if coordinate else 0), value.device_mesh.size(0)
        frontier = [p for n in frontier for p in n.all_input_nodes if p not in seen]
        seen.update(frontier)
        if not frontier:
            return None
    return None


def local_bias_node(graph: fx.Graph, shard: LinearShard, bias_node: fx.Node, before: fx.Node) -> fx.Node | None:
    """What this rank adds as the bias of a rewritten linear, inserted before `before`: the local
    shard of a column-parallel bias; a row-parallel linear's whole bias on mesh index 0 and none
    elsewhere, since its outputs are partial sums that the all-reduce adds up."""
    if shard.style == "row-parallel" and shard.coordinate != 0:
        return None
    with graph.inserting_before(before):
        return graph.call_method("to_local", (bias_node,))


def wrap_local(graph: fx.Graph, shard: LinearShard, local: fx.Node, like: fx.Node | None) -> fx.Node:
    """DTensor.from_local(local, mesh, shard.out_placements) inserted after `local`: the value the
    DTensor linear had, for the redistribute that follows it. `like`: the replaced node, whose
    recorded value and module stack the wrapper takes."""
    return from_local_node(graph, local, shard.mesh, shard.out_placements, like)


def from_local_node(graph: fx.Graph, local: fx.Node, mesh: Any, placements: tuple, like: fx.Node | None,
                    shape: tuple | None = None, stride: tuple | None = None) -> fx.Node:
    """DTensor.from_local(local, mesh, placements[, shape, stride]) inserted after `local`, taking
    the recorded value and module stack of `like` (the node whose DTensor value it stands for)."""
    with graph.inserting_after(local):
        wrapped = graph.call_function(_from_local_on(mesh, placements, shape, stride), (local,))
    if like is not None:
        for key in ("example_value", "val", "nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                wrapped.meta[key] = like.meta[key]
    return wrapped


def _from_local_on(mesh: Any, placements: tuple, shape: tuple | None = None, stride: tuple | None = None):
    """A function of one tensor: DTensor.from_local on `mesh` with `placements` (and the global
    `shape` and `stride`, where shards may be uneven). They live in the closure, not in the graph's
    arguments, which FX can only hold as values it knows how to print (as Dynamo does for the
    same call)."""
    DTensor = _dtensor_api()[0]

    def from_local(local: torch.Tensor):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    from_local.__name__ = "prim from_local"
    return from_local


def localize_dtensor_inputs(gm: fx.GraphModule, example_inputs: list) -> tuple[list[int], list]:
    """Make the graph take the local shard of each DTensor input (the parallelized parameters)
    and wrap it back with `from_local` inside the graph. Returns the input positions changed and
    the example inputs to compile with.

    Why: a compiled graph whose inputs are DTensors unwraps every one of them in Python at every
    call (AOTAutograd's subclass runtime wrapper), which at batch-1 decode costs more host time
    than the GPU spends on the step. Handing over `_local_tensor` (the caller does it, see
    graphopt.compiler) is an attribute read. Done only with grad mode off, where no gradient has
    to reach the DTensor parameter; Dynamo guards on grad mode, so a call with grad on compiles
    again without this. Inputs with symbolic shapes are left as they are."""
    if _dtensor_api() is None or torch.is_grad_enabled():
        return [], example_inputs
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return [], example_inputs
    positions, examples = [], list(example_inputs)
    for position, (node, example) in enumerate(zip(placeholders, example_inputs)):
        fake = _fake(node)
        if not (is_dtensor(example) and is_dtensor(fake) and node.users):
            continue
        if not all(isinstance(d, int) for d in (*fake.shape, *fake.stride())):
            continue
        wrapped = from_local_node(gm.graph, node, fake.device_mesh, tuple(fake.placements), node,
                                  tuple(fake.shape), tuple(fake.stride()))
        node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)
        for key in ("example_value", "val"):  # the placeholder now holds the local shard
            if key in node.meta:
                node.meta[key] = node.meta[key]._local_tensor
        examples[position] = example._local_tensor
        positions.append(position)
    if positions:
        gm.recompile()
    return positions, examples


def local_example(value: Any, features: int) -> Any:
    """A local (..., features) example like `value` (the local input), for the meta of a rewritten
    node: later passes read shapes and dtypes from it."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.new_empty((*value.shape[:-1], features))
    except Exception:  # noqa: BLE001 - metadata only
        return None


def all_ranks_amax(shard: LinearShard, local_amax: torch.Tensor) -> torch.Tensor:
    """The largest |value| over every rank's shard (one all-reduce over the weight's mesh), so that a
    per-tensor scale (NVFP4's global scale) is the one the whole weight would get. Every rank
    compiles the same graph and reaches this call for the same layers, in the same order."""
    amax = local_amax.detach().to(device=shard.local_weight.device, dtype=torch.float32).reshape(1).clone()
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=shard.weight.device_mesh.get_group(0))
    return amax.to(local_amax.device).reshape(())



def all_ranks_agree(shard: LinearShard, ok: bool) -> bool:
    """Whether `ok` holds on every rank of the weight's mesh (one all-reduce): for a choice that
    decides which collectives follow (a sibling group quantized as one, or member by member), so
    that every rank makes the same calls."""
    flag = torch.tensor([1.0 if ok else 0.0], device=shard.local_weight.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=shard.weight.device_mesh.get_group(0))
    return bool(flag.item() > 0)


def same_on_all_ranks(group: Any, device: torch.device, value: int) -> bool:
    """Whether every rank of `group` holds the same integer `value` (two all-reduces on `device`,
    the group's device): for a compile-time plan whose collectives must match rank for rank."""
    bounds = torch.tensor([value, -value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(bounds[0]) == -int(bounds[1])


__all__ = ["LinearShard", "linear_shard", "local_shard_parameter", "head_shard", "is_dtensor", "rank_and_world", "local_bias_node", "wrap_local",
           "from_local_node", "is_redistribute", "redistribute_arguments", "wrapped_local", "local_example", "localize_dtensor_inputs",
           "all_ranks_amax", "all_ranks_agree", "same_on_all_ranks"]
