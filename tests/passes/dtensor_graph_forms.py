"""The two forms in which Dynamo records DTensor's boundary calls:

- "calls" (torch 2.13): `DTensor.from_local(t, mesh, placements, ...)` with the mesh a graph value,
  and the method calls `t.redistribute(...)` and `t.to_local()`. Earlier FX cannot write these as
  code that runs (`calls_form_runs`), so earlier Dynamo records only the other form.
- "prim" (earlier torch, e.g. 2.11): a call of a one-argument closure named "prim from_local",
  "prim_redistribute" or "prim_to_local" that holds the other arguments (as `args_as_value` and
  `kwargs_as_value`). Made here from the calls form where Dynamo records that one.
"""

from __future__ import annotations

import functools
import importlib

import torch.fx as fx

FORMS = ("calls", "prim")
_PRIM_NAMES = {"prim from_local": "from_local", "prim_redistribute": "redistribute", "prim_to_local": "to_local"}


def in_graph_form(gm: fx.GraphModule, form: str) -> dict[str, int]:
    """Put every from_local / redistribute / to_local of a Dynamo graph in `form`: "prim" rewrites
    the calls form into closures, "calls" leaves the graph as Dynamo recorded it. Returns how many
    calls of each kind the graph then holds in that form."""
    if form not in FORMS:
        raise ValueError(f"unknown graph form {form!r}; valid choices: {', '.join(FORMS)}")
    if form == "prim":
        for node in list(gm.graph.nodes):
            if (kind := _call_kind(node)) is not None:
                _to_prim(node, kind)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    counts = dict.fromkeys(_PRIM_NAMES.values(), 0)
    for node in gm.graph.nodes:
        kind = _call_kind(node) if form == "calls" else _PRIM_NAMES.get(_prim_name(node))
        if kind is not None:
            counts[kind] += 1
    return counts


@functools.cache
def calls_form_runs() -> bool:
    """Whether this torch's FX writes the calls form as code that runs: DTensor.from_local under a
    name that imports, and placements as literals (torch 2.13)."""
    from torch.distributed.tensor import Shard

    module, _, name = fx.node._get_qualified_name(_dtensor().from_local).rpartition(".")
    try:
        if getattr(importlib.import_module(module), name) is not _dtensor().from_local:
            return False
    except (ImportError, AttributeError):
        return False
    graph = fx.Graph()
    graph.output(graph.call_method("redistribute", (graph.placeholder("x"),), {"placements": (Shard(0),)}))

    class Probe:
        def redistribute(self, placements):
            return placements

    try:
        return fx.GraphModule({}, graph)(Probe()) == (Shard(0),)
    except NameError:
        return False


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _prim_name(node: fx.Node) -> str | None:
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name if name in _PRIM_NAMES else None


def _call_kind(node: fx.Node) -> str | None:
    """The kind of a boundary call in the calls form, else None."""
    if node.op == "call_function" and node.target is _dtensor().from_local:
        return "from_local"
    if node.op == "call_method" and node.target in ("redistribute", "to_local"):
        return node.target
    return None


def _to_prim(node: fx.Node, kind: str) -> None:
    args_as_value, kwargs_as_value = list(node.args[1:]), dict(node.kwargs)  # the names Dynamo's closures use
    if kind == "from_local":  # the mesh and placements as values, from the recorded DTensor
        value = node.meta["example_value"]
        args_as_value = [value.device_mesh, tuple(value.placements)]
    DTensor = _dtensor()

    def fn_with_prim_types(x):
        if kind == "from_local":
            return DTensor.from_local(x, *args_as_value, **kwargs_as_value)
        return getattr(x, kind)(*args_as_value, **kwargs_as_value)

    fn_with_prim_types.__name__ = "prim from_local" if kind == "from_local" else f"prim_{kind}"
    node.op, node.target, node.args, node.kwargs = "call_function", fn_with_prim_types, (node.args[0],), {}
