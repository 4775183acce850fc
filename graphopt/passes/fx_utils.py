"""FX helpers shared by the passes: canonical op names, argument access, shapes, replacement,
and the linear-layer matcher used by every weight-rewriting pass.

Dynamo's torch-level graphs spell one operation many ways: `x @ y`, `torch.matmul(x, y)`,
`x.matmul(y)`; `x.softmax(-1)`, `F.softmax(x, dim=-1)`, `torch.softmax(x, -1)`. `canonical(node)`
folds each family into one name so matchers are written once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt.passes.base import PassContext, module_path
from graphopt.passes.tensor_parallel import (LinearShard, linear_shard, local_bias_node, local_example,
                                             local_shard_parameter, wrap_local)

# Python operators that write their first operand in place (`x += y`, `x[i] = v`, ...).
IN_PLACE_FUNCTIONS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift})


def writes_in_place(node: fx.Node) -> bool:
    """Whether a call may write a tensor it is given in place: a method or function named with a
    trailing underscore (not the operator module's and_, or_...), the in-place operators, an op with
    a mutable overload, a higher-order op, an `inplace=True` or `out=` argument. Module calls are
    left to the caller."""
    if node.op not in ("call_method", "call_function"):
        return False
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    target = node.target
    if target in IN_PLACE_FUNCTIONS or isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):  # torch.ops.ns.op(...): any of its overloads
        return any(getattr(target, overload)._schema.is_mutable for overload in target.overloads())
    name = getattr(target, "__name__", "")
    operator_module = getattr(target, "__module__", None) in ("_operator", "operator")
    return name.endswith("_") and not name.endswith("__") and not operator_module


_FUNCTIONS: dict[Any, str] = {
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm", torch.baddbmm: "baddbmm",
    torch.softmax: "softmax", F.softmax: "softmax", torch.nn.functional.log_softmax: "log_softmax",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub", operator.neg: "neg",
    torch.transpose: "transpose", torch.permute: "permute", torch.reshape: "reshape",
    torch.where: "where", torch.masked_fill: "masked_fill",
    F.dropout: "dropout", torch.dropout: "dropout", torch.nn.functional.linear: "linear",
    torch._C._nn.linear: "linear", torch.addmm: "addmm", torch.unsqueeze: "unsqueeze",
    torch.repeat_interleave: "repeat_interleave", F.scaled_dot_product_attention: "sdpa",
    operator.getitem: "getitem", torch.flatten: "flatten", torch.cat: "cat", torch.tanh: "tanh",
    # in-place operators (`scores += mask`): the same operation, written into the first operand
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    torch.clone: "clone",
}
# Method names that are already canonical, or map to a canonical name.
_METHODS: dict[str, str] = {
    "matmul": "matmul", "bmm": "bmm", "softmax": "softmax", "mul": "mul", "div": "div", "add": "add",
    "sub": "sub", "transpose": "transpose", "permute": "permute", "view": "view", "reshape": "reshape",
    "expand": "expand", "contiguous": "contiguous", "to": "to", "float": "float", "half": "half",
    "bfloat16": "bfloat16", "type_as": "type_as", "type": "to", "masked_fill": "masked_fill",
    "masked_fill_": "masked_fill", "unsqueeze": "unsqueeze", "t": "t", "mT": "mT",
    "repeat_interleave": "repeat_interleave", "size": "size", "flatten": "flatten", "__getitem__": "getitem",
    "neg": "neg", "mul_": "mul", "div_": "div", "add_": "add", "tanh": "tanh",
}


def canonical(node: Any) -> str | None:
    """A canonical op name for a call node ("matmul", "softmax", ...), or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        if node.target is getattr and len(node.args) == 2 and node.args[1] in ("T", "mT"):
            return node.args[1]  # x.T / x.mT: Dynamo records the attribute read
        name = _FUNCTIONS.get(node.target)
        if name is None and isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return f"aten.{node.target.__name__.split('.')[0]}"
        return name
    if node.op == "call_method":
        return _METHODS.get(node.target, node.target)
    if node.op == "call_module":
        return None
    return None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def fake(node: Any) -> Any:
    """The FakeTensor (or value) Dynamo recorded for a node, if any."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def shape(node: Any) -> tuple[int, ...] | None:
    """A node's static shape, or None where a size is symbolic (a dynamic capture): int() of a
    SymInt would not fail but install a guard that fixes the size, undoing the dynamic dim."""
    value = fake(node)
    if not isinstance(value, torch.Tensor):
        return None
    sizes = []
    for size in value.shape:
        if isinstance(size, torch.SymInt):
            size = size.node.maybe_as_int()  # a symbol Dynamo already fixed reads as its value
            if size is None:
                return None
        sizes.append(int(size))
    return tuple(sizes)


def size_hints(node: Any) -> tuple[int, ...] | None:
    """A node's shape with each symbolic size read as its hint (the size of the example Dynamo
    traced), for cost estimates only: reading the hint installs no guard. None where a symbol has
    no hint."""
    value = fake(node)
    if not isinstance(value, torch.Tensor):
        return None
    hints = [size_hint(s) for s in value.shape]
    return None if None in hints else tuple(hints)


def size_hint(size: Any) -> int | None:
    """An int, or a symbolic size (a SymInt, or the graph node computing one) read as its hint; None
    for a symbol with no hint or anything else."""
    value = fake(size) if isinstance(size, fx.Node) else size
    if isinstance(value, torch.SymInt):
        hint = getattr(value.node, "hint", None)
        return None if hint is None else int(hint)
    return value if isinstance(value, int) else None


def symbolic_size(node: Any, dim: int) -> Any:
    """The SymInt of a node's dim `dim` where that size is symbolic (not fixed by Dynamo), else None."""
    value = fake(node)
    if not isinstance(value, torch.Tensor):
        return None
    size = value.shape[dim]
    if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
        return size
    return None


def fix_symbolic_sizes(node: Any, dims: tuple[int, ...]) -> None:
    """Guard the given dims of a node's value to their example sizes where they are symbolic. For
    a rewrite that bakes a size into the graph (a scale from the head dim, a head count): Dynamo
    then recompiles for another size instead of reusing the rewritten graph. (int() of a SymInt
    installs the guard; Dynamo collects guards added while the backend compiles.)"""
    value = fake(node)
    if not isinstance(value, torch.Tensor):
        return
    for dim in dims:
        size = value.shape[dim]
        if isinstance(size, torch.SymInt):
            int(size)


def dtype(node: Any) -> torch.dtype | None:
    value = fake(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def device(node: Any) -> torch.device | None:
    value = fake(node)
    return value.device if isinstance(value, torch.Tensor) else None


def tokens(node: Any) -> int | None:
    """Rows of a (..., features) activation: the product of all but the last dimension."""
    s = shape(node)
    if s is None:
        return None
    n = 1
    for d in s[:-1]:
        n *= d
    return n


def single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def replace_with_call(
    ctx: PassContext,
    root: fx.Node,
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    matched: list[fx.Node] | None = None,
) -> fx.Node:
    """Replace the value of `root` by `target(*args, **kwargs)` and erase matched nodes left unused.

    The new node is inserted just before `root` (every argument of a matched subgraph is defined
    before its last node), inherits `root`'s recorded value and module stack, and the matched
    nodes that no longer have users are erased.
    """
    graph = ctx.gm.graph
    with graph.inserting_before(root):
        new = graph.call_function(target, tuple(args), kwargs or {})
    for key in ("example_value", "val", "nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in root.meta:
            new.meta[key] = root.meta[key]
    root.replace_all_uses_with(new)
    erase_unused([root, *(matched or [])], graph)
    return new


def erase_unused(nodes: list[fx.Node], graph: fx.Graph) -> None:
    """Erase nodes (among `nodes`) that have no users, repeating until nothing changes."""
    pending = list(dict.fromkeys(n for n in nodes if n.graph is graph))  # each once
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if node.op in ("placeholder", "output"):
                pending.remove(node)
                continue
            if not node.users:
                graph.erase_node(node)
                pending.remove(node)
                changed = True


# ---------------------------------------------------------------------------------------------
# Linear layers against a frozen weight (shared by fp4_linear, q4_linear, fft_linear)
# ---------------------------------------------------------------------------------------------
@dataclass
class LinearMatch:
    """y = x @ weight.T + bias, with `weight` an [out_features, in_features] view of a parameter.
    With a DTensor weight (tensor parallelism), `shard` says how the linear runs on this rank;
    `input`, `in_features`, `out_features` and `value` are then the rank's local ones."""

    node: fx.Node  # computes y
    input: fx.Node  # x (..., in_features)
    weight_node: fx.Node  # the parameter placeholder
    weight_transposed: bool  # parameter is stored [in, out] (GPT-2 Conv1D, x @ W)
    bias_node: fx.Node | None
    kind: str  # "linear" | "addmm" | "matmul"
    extra_nodes: tuple[fx.Node, ...] = ()  # e.g. the W.T node of `x @ W.T`, erased with the match
    shard: LinearShard | None = None

    @property
    def location(self) -> str:
        return module_path(self.node)

    @property
    def problem(self) -> str | None:
        """Why this linear cannot be rewritten at all (a DTensor form no pass handles, an empty
        weight), or None."""
        if self.shard is not None and self.shard.problem is not None:
            return self.shard.problem
        if not (self.in_features and self.out_features):
            return f"empty weight ({self.out_features} x {self.in_features}): nothing to rewrite"
        return None

    @property
    def shard_note(self) -> str:
        """"; <the rank's shard>" for a tensor-parallel linear, else "": for decision reasons."""
        return f"; {self.shard.describe()}" if self.shard is not None and self.shard.problem is None else ""

    @property
    def shard_details(self) -> dict:
        """Decision details naming a tensor-parallel linear's shard on this rank ({} otherwise)."""
        return {"shard": self.shard.describe()} if self.shard is not None and self.shard.problem is None else {}

    def value(self, ctx: PassContext) -> torch.Tensor:
        """The [out, in] weight this rank multiplies by (not frozen: measure before deciding)."""
        w = self.shard.local_weight if self.shard is not None else ctx.example_value(self.weight_node)
        w = w.detach()
        return w.t() if self.weight_transposed else w

    def weight(self, ctx: PassContext) -> torch.Tensor:
        """The frozen [out, in] weight (registers the parameter as frozen)."""
        ctx.freeze(self.weight_node)
        return self.value(ctx)

    def bias(self, ctx: PassContext) -> torch.Tensor | None:
        if self.bias_node is None:
            return None
        if ctx.is_parameter(self.bias_node):
            return ctx.freeze(self.bias_node)
        return None

    @property
    def in_features(self) -> int:
        if self.shard is not None and self.shard.problem is None:
            return self.shard.local_weight.shape[1]
        s = shape(self.weight_node)
        return s[0] if self.weight_transposed else s[1]

    @property
    def out_features(self) -> int:
        if self.shard is not None and self.shard.problem is None:
            return self.shard.local_weight.shape[0]
        s = shape(self.weight_node)
        return s[1] if self.weight_transposed else s[0]

    def tokens(self) -> int | None:
        return tokens(self.input)


def bias_problem(m: LinearMatch) -> str | None:
    """Why a linear's bias cannot be the rewritten op's (out_features,) vector, or None. A bias
    that only broadcasts, such as (1,), would make the op's launcher refuse the call at run time."""
    if m.bias_node is None:
        return None
    bias_shape = shape(m.bias_node)  # a DTensor bias: its global shape
    out_features = m.shard.weight.shape[0] if m.shard is not None and not m.shard.local_form else m.out_features
    if bias_shape != (out_features,):
        what = "of unknown or symbolic shape" if bias_shape is None else f"of shape {bias_shape}"
        return f"bias {what} is not a ({out_features},) vector, one value per output feature"
    return None


def model_state_input(ctx: PassContext, node: Any) -> torch.Tensor | None:
    """The tensor behind a graph input that holds model state (a parameter or buffer, such as the
    packed weight of a graphopt.quantize_ layer), else None (a computed value, a user input, a
    constant a pass added)."""
    if not isinstance(node, fx.Node) or node.op != "placeholder" or not ctx.is_model_state(node):
        return None
    value = ctx.example_value(node)
    return value if isinstance(value, torch.Tensor) else None


def _param_2d(ctx: PassContext, node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and ctx.is_parameter(node) and len(shape(node) or ()) == 2


def find_linears(ctx: PassContext) -> list[LinearMatch]:
    """Every linear whose weight is a 2-D model parameter: F.linear, addmm (Conv1D), x @ W, x @ W.T.
    A DTensor weight's match carries its shard (graphopt.passes.tensor_parallel)."""
    matches = []
    for node in list(ctx.gm.graph.nodes):
        kind = canonical(node)
        if kind == "linear":
            x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
            bias = b if isinstance(b, fx.Node) else None
            if _param_2d(ctx, w):
                matches.append(_match(ctx, LinearMatch(node, x, w, False, bias, "linear")))
            elif (param := local_shard_parameter(ctx, w)) is not None:  # transformers' tensor parallelism
                m = LinearMatch(node, x, param, False, bias, "linear", (w,))
                m.shard = linear_shard(ctx, node, x, param, bias, "linear", local_form=True)
                matches.append(m)
        elif kind == "addmm":
            b, x, w = arg(node, 0, "input"), arg(node, 1, "mat1"), arg(node, 2, "mat2")
            if _param_2d(ctx, w) and arg(node, 3, "beta", 1) == 1 and arg(node, 4, "alpha", 1) == 1:
                matches.append(_match(ctx, LinearMatch(node, x, w, True, b if isinstance(b, fx.Node) else None, "addmm")))
        elif kind == "matmul":
            x, w = node.args[0], node.args[1]
            if _param_2d(ctx, w):
                matches.append(_match(ctx, LinearMatch(node, x, w, True, None, "matmul")))
            elif canonical(w) in ("t", "T", "mT") or (canonical(w) == "transpose" and sorted(w.args[1:3]) in ([-2, -1], [0, 1])):
                if _param_2d(ctx, w.args[0]):
                    matches.append(_match(ctx, LinearMatch(node, x, w.args[0], False, None, "matmul", (w,))))
    return matches


def _match(ctx: PassContext, m: LinearMatch) -> LinearMatch:
    """`m` with its tensor-parallel shard, if its weight is a DTensor: the input becomes the local one."""
    m.shard = linear_shard(ctx, m.node, m.input, m.weight_node, m.bias_node, m.kind)
    if m.shard is not None and m.shard.problem is None and not m.shard.local_form:
        m.extra_nodes = (*m.extra_nodes, m.input)  # the input hook's from_local, erased once unused
        m.input = m.shard.local_input
    return m


def replace_linear(ctx: PassContext, m: LinearMatch, target: Any, args: tuple, matched: list[fx.Node] | None = None) -> fx.Node:
    """replace_with_call for a linear match. A tensor-parallel linear is replaced by target(*args) on
    the rank's local tensors (a DTensor bias in `args` read as its local shard), wrapped back into the
    DTensor the linear produced, so the redistribute after it runs its collective as before."""
    matched = [*(matched or []), *m.extra_nodes]
    if m.shard is None or m.shard.local_form:
        return replace_with_call(ctx, m.node, target, args, matched=matched)
    graph = ctx.gm.graph
    if m.bias_node is not None:
        local_bias = local_bias_node(graph, m.shard, m.bias_node, m.node)
        args = tuple(local_bias if a is m.bias_node else a for a in args)
    with graph.inserting_before(m.node):
        local = graph.call_function(target, tuple(args))
    _local_meta(local, m, m.out_features)
    wrapped = wrap_local(graph, m.shard, local, m.node)
    m.node.replace_all_uses_with(wrapped)
    erase_unused([m.node, *matched], graph)
    return wrapped


def _local_meta(node: fx.Node, m: LinearMatch, features: int) -> None:
    """Meta of a node computing (part of) a tensor-parallel linear on local tensors."""
    example = local_example(fake(m.input), features)
    if example is not None:
        node.meta["example_value"] = example
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in m.node.meta:
            node.meta[key] = m.node.meta[key]


def sibling_groups(matches: list[LinearMatch]) -> list[list[LinearMatch]]:
    """Linears that read the same input tensor, two or more per group in graph order: a
    transformer block's q/k/v projections, or its MLP's gate and up projections. Only plain
    bias-free `F.linear` calls against [out, in] weights of one dtype qualify, so the group is one
    linear against the weights concatenated along the output features. A weight appears once per
    group (a layer called twice on one input is one member; the other call is rewritten alone)."""
    by_input: dict[tuple, list[LinearMatch]] = {}
    for m in matches:
        if m.problem is not None:
            continue
        # a tensor-parallel member's extra node is its input hook's from_local; the local inputs group
        shard = None if m.shard is None else (m.shard.style, m.shard.mesh, repr(m.shard.out_placements))
        plain = not m.extra_nodes or (m.shard is not None and len(m.extra_nodes) == 1)
        if m.kind == "linear" and m.bias_node is None and not m.weight_transposed and plain:
            group = by_input.setdefault((m.input, dtype(m.weight_node), shard), [])
            if all(other.weight_node is not m.weight_node for other in group):
                group.append(m)
    groups = []
    for group in by_input.values():
        width = sum(m.out_features for m in group)
        group = [m for m in group if not _viewed_across_rows(m.node, width)]
        if len(group) >= 2:
            groups.append(group)
    return groups


def _viewed_across_rows(node: fx.Node, fused_width: int) -> bool:
    """Whether a reader views a linear's output with a shape that a column slice of a fused output
    `fused_width` wide cannot take (a .view merging the features with another dim). Symbolic sizes
    are read as their hints (Dynamo fixes sizes 0 and 1, so a merge that fails for one size >= 2
    fails for all); a size with no hint counts as such a view."""
    sizes = size_hints(node)
    viewers = [u for u in node.users if u.op == "call_method" and u.target == "view" and u.args[0] is node]
    if not viewers:
        return False
    if sizes is None:
        return True
    column_slice = torch.empty((*sizes[:-1], fused_width), device="meta")[..., :sizes[-1]]
    for user in viewers:
        target = user.args[1] if len(user.args) == 2 and isinstance(user.args[1], (tuple, list)) else user.args[1:]
        target = [size_hint(d) for d in target]
        if None in target:
            return True
        try:
            column_slice.view(target)
        except RuntimeError:
            return True
    return False


def replace_siblings_with_call(ctx: PassContext, group: list[LinearMatch], target: Any, args: tuple) -> list[fx.Node]:
    """Replace the linears of a sibling group by one call of `target(*args)`, whose last dimension
    holds their outputs side by side, and a split. Returns each member's new value node."""
    graph = ctx.gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min((m.node for m in group), key=order.__getitem__)
    sizes = [m.out_features for m in group]
    with graph.inserting_before(first):  # the shared input is defined before every member
        fused = graph.call_function(target, tuple(args))
        parts = graph.call_function(torch.split, (fused, sizes, -1))
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(group))]
    sharded = group[0].shard is not None and not group[0].shard.local_form
    value = fake(first)
    if sharded:
        _local_meta(fused, group[0], sum(sizes))
    elif isinstance(value, torch.Tensor):
        try:  # metadata for later passes; never fail the rewrite for it
            fused.meta["example_value"] = value.new_empty((*value.shape[:-1], sum(sizes)))
        except Exception:
            pass
    values = []
    for m, out in zip(group, outs):
        if sharded:  # each member's local part, wrapped back into its DTensor
            _local_meta(out, m, m.out_features)
            out = wrap_local(graph, m.shard, out, m.node)
        else:
            for key in ("example_value", "val", "nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in m.node.meta:
                    out.meta[key] = m.node.meta[key]
            if any(user.op == "output" for user in m.node.users):
                # returned to the caller, who gets a linear's contiguous output from eager, not a column slice
                with graph.inserting_after(out):
                    contiguous = graph.call_method("contiguous", (out,))
                contiguous.meta.update(out.meta)
                out = contiguous
        m.node.replace_all_uses_with(out)
        values.append(out)
    erase_unused([n for m in group for n in (m.node, *m.extra_nodes)], graph)
    return values
