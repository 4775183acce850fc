"""Decode fusion for the weight passes: the neighbours of a one-token quantized linear go into its op.

At one token a decoder layer's RMSNorms, SiLU gate and residual adds each cost Inductor a kernel
launch for a few kilobytes of work, as much GPU time as a small GEMV (graphopt.kernels.linear_fusion).
After fp4_linear rewrote the linears, `fuse_decode_neighbours` hands them to its op (q4_linear's
one-token kernel does not take them):
  - RMSNorm before it, LLaMA's form (`w * (h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(dt)`
    with h32 = h.to(float32), the mul in either order, through a no-op full slice as before lm_head):
    the op reads h, `norm_weight` and `norm_eps`;
  - a SiLU gate after it (`silu(gate) * up`, gate and up the two halves of the call's output split in
    that order, as fuse_sibling_linears writes gate_proj and up_proj): the weight pass interleaves the
    call's gate and up rows (`interleave`) and the op computes the gate, `gated=True`;
  - a residual add after it (`r + y` or `y + r`, r of y's shape and dtype, computed before the op):
    the op reads r, `residual`.
A node of a matched chain that is read outside the chain stops the match (a norm read by several
fused calls is computed in each of them). The op reads h, r or the gate/up output where it runs, not
where the model read them, so a match is also stopped by any in-place operation in between. Forms not
listed (Gemma's 1 + w, LayerNorm, GELU gates) are left as they are. Only calls of one token (a static
count) are fused; on a GPU only under CUDA graphs and in bf16 / fp16 (where the one-token kernel that
takes them in, an opaque Gluon op, may run); never for export (the ONNX forms are the plain op's);
option `fuse_decode_neighbours=False` turns it off, a list of FUSIONS names keeps only those. The op
runs the neighbours in its one-token kernel and in torch on every other path, so a fused graph
computes what the original did.

`mark_dependent_calls` then marks the one-token GPU calls that read another one's output: their
kernel may start while the one before it finishes (graphopt.kernels.dependent_launch).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt.kernels.linear_fusion import FUSIONS
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import canonical, device, dtype, erase_unused, shape, tokens, writes_in_place

_SILU = (F.silu, torch.nn.functional.silu)
_SPLIT = (torch.split, torch.functional.split, torch.Tensor.split)
_RSQRT = (torch.rsqrt,)
_POW = (torch.pow, operator.pow)
_MEAN = (torch.mean,)


def fuse_decode_neighbours(ctx: PassContext, target: Any, in_features_index: int,
                           interleave: Callable[[fx.Node], bool] | None = None) -> dict[fx.Node, list[str]]:
    """Fuse into every one-token call of `target` (an op with the norm_weight / norm_eps / gated /
    residual keyword arguments, x its first argument, in_features its argument `in_features_index`).
    `interleave(call)`: the weight pass's rewrite of a call's weight rows into gate / up pairs
    (linear_fusion.interleave_gate_up), False where it cannot (a call with a bias, say); without it no
    gate is fused.
    Returns {call: the neighbours it took in, e.g. ["rms_norm", "silu_gate"]}."""
    option = ctx.config.fuse_decode_neighbours
    allowed = set(FUSIONS) if option is True else set(option or ())
    if not allowed or ctx.for_export:
        return {}
    graph = ctx.gm.graph
    calls = [n for n in graph.find_nodes(op="call_function", target=target) if _eligible(ctx, n)]
    order = {node: i for i, node in enumerate(graph.nodes)}  # stays monotonic as matched nodes are erased
    done: dict[fx.Node, list[str]] = {}
    for call in calls:
        in_features = call.args[in_features_index]
        taken = []
        if call.kwargs.get("norm_weight") is None and "rms_norm" in allowed:
            norm = _rms_norm(ctx, call.args[0], in_features, calls)
            if norm is not None and not _mutation_between(norm[2][-1], call):
                source, kwargs, chain = norm
                call.update_arg(0, source)
                call.kwargs = {**call.kwargs, **kwargs}
                erase_unused(chain, graph)
                taken.append("rms_norm")
        gate = None
        if "silu_gate" in allowed and interleave is not None and not call.kwargs.get("gated"):
            gate = _silu_gate(call)
        if gate is not None and call.kwargs.get("residual") is None and interleave(call):
            product, chain = gate
            call.kwargs = {**call.kwargs, "gated": True}
            if "example_value" in product.meta:  # the call's output is now the product's (half as wide)
                call.meta["example_value"] = product.meta["example_value"]
            product.replace_all_uses_with(call)
            erase_unused(chain, graph)
            taken.append("silu_gate")
        residual = _residual(call, order) if "residual" in allowed and call.kwargs.get("residual") is None else None
        if residual is not None:
            add, value = residual
            call.kwargs = {**call.kwargs, "residual": value}
            add.replace_all_uses_with(call)
            graph.erase_node(add)
            taken.append("residual")
        if taken:
            done[call] = taken
    return done


def mark_dependent_calls(ctx: PassContext, target: Any) -> list[fx.Node]:
    """Give `dependent=True` to the one-token GPU calls of `target` whose x is another such call's
    output (directly, or through a full slice): by data flow, so their kernel usually follows that
    call's on the stream and may start as its dependent (graphopt.kernels.dependent_launch); where the
    call before runs another path or its neighbours in torch, the launch is still correct, only not
    faster. Returns the calls marked."""
    if ctx.for_export:
        return []
    graph = ctx.gm.graph
    calls = {n for n in graph.find_nodes(op="call_function", target=target)
             if _eligible(ctx, n) and getattr(device(n.args[0]), "type", None) == "cuda"}
    marked = []
    for call in calls:
        x = call.args[0]
        if isinstance(x, fx.Node) and _full_slice(x):
            x = x.args[0]
        if x in calls and not call.kwargs.get("dependent"):
            call.kwargs = {**call.kwargs, "dependent": True}
            marked.append(call)
    return marked


def _eligible(ctx: PassContext, call: fx.Node) -> bool:
    """A call of one token, on the CPU (the op's torch form) or, under CUDA graphs, in bf16 / fp16 on a
    GPU (where the one-token kernel may run; an fp32 call never reaches it)."""
    x = call.args[0]
    if tokens(x) != 1:
        return False
    where = getattr(device(x), "type", None)
    return where == "cpu" or (where == "cuda" and ctx.config.cuda_graphs
                              and dtype(x) in (torch.bfloat16, torch.float16))


def _mutates(node: fx.Node) -> bool:
    """Whether a node may write a tensor in place (conservatively: any module call)."""
    return node.op == "call_module" or writes_in_place(node)


def _mutation_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after `first` and before `last`, in graph order, may write a tensor in place."""
    node = first.next
    while node is not last and node.op != "root":
        if _mutates(node):
            return True
        node = node.next
    return False


def _read_only_by(node: fx.Node, readers: set[fx.Node]) -> bool:
    return bool(node.users) and all(user in readers for user in node.users)


def _cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a plain dtype cast (`x.to(dt)`, `x.to(dtype=dt)`, `x.type(dt)`, `x.float()`), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_method":
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return torch.float32
    if node.target not in ("to", "type"):
        return None
    rest, kwargs = node.args[1:], dict(node.kwargs)
    if len(rest) == 1 and not kwargs and isinstance(rest[0], torch.dtype):
        return rest[0]
    if not rest and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    return None


def _operands(node: fx.Node) -> tuple[Any, Any] | None:
    """(a, b) of a binary op call without extra arguments."""
    if node.kwargs or len(node.args) != 2:
        return None
    return node.args[0], node.args[1]


def _full_slice(node: fx.Node) -> bool:
    """x[:, 0:, :], x[:, -1:, :] of one token and the like: a getitem of slices that select all of
    x (HF's logits_to_keep)."""
    if canonical(node) != "getitem" or not isinstance(node.args[1], tuple):
        return False
    sizes = shape(node.args[0])
    if sizes is None or len(node.args[1]) > len(sizes):
        return False
    return all(isinstance(s, slice) and s.stop is None and s.step is None
               and (s.start in (None, 0) or (isinstance(s.start, int) and s.start <= -size))
               for s, size in zip(node.args[1], sizes))


def _rms_norm(ctx: PassContext, x: Any, in_features: int, calls: list[fx.Node]):
    """(h, {norm_weight, norm_eps}, chain) where x is LLaMA's RMSNorm of h with a (K,) model
    parameter as its weight, else None; the chain ends with the node that reads h."""
    if not isinstance(x, fx.Node):
        return None
    readers, out = set(calls), x
    chain = [x]
    if _full_slice(x):
        if not _read_only_by(x, readers):
            return None
        readers, x = {x}, x.args[0]
        chain.append(x)
    if canonical(x) != "mul" or x.op != "call_function" or (ops := _operands(x)) is None or not _read_only_by(x, readers):
        return None
    out_dtype = dtype(out)
    weight, cast = ops if _cast_dtype(ops[1]) is not None else ops[::-1]
    if not (isinstance(weight, fx.Node) and weight.op == "placeholder" and ctx.is_model_state(weight)
            and not ctx.is_lifted_scalar(weight) and shape(weight) == (in_features,)):
        return None
    if dtype(weight) != out_dtype or _cast_dtype(cast) != out_dtype or len(cast.users) != 1:
        return None
    scaled = cast.args[0]
    if canonical(scaled) != "mul" or (ops := _operands(scaled)) is None or len(scaled.users) != 1:
        return None
    for h32, inv in (ops, ops[::-1]):
        if not (isinstance(inv, fx.Node) and (inv.target in _RSQRT or (inv.op == "call_method" and inv.target == "rsqrt"))):
            continue
        eps_add = inv.args[0]
        if len(inv.users) != 1 or canonical(eps_add) != "add" or (terms := _operands(eps_add)) is None:
            return None
        variance, eps = terms if isinstance(terms[1], (float, int)) else terms[::-1]
        if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps > 0 or len(eps_add.users) != 1:
            return None
        squares = _mean_of_last_dim(variance)
        if squares is None or not _square_of(squares, h32):
            return None
        if _cast_dtype(h32) != torch.float32 or set(h32.users) != {squares, scaled}:
            return None
        h = h32.args[0]
        if not isinstance(h, fx.Node) or dtype(h) != out_dtype:
            return None
        chain += [cast, scaled, inv, eps_add, variance, squares, h32]
        return h, {"norm_weight": weight, "norm_eps": float(eps)}, chain
    return None


def _mean_of_last_dim(node: Any) -> fx.Node | None:
    """p where node is p.mean(-1, keepdim=True) (or the last dim by index), read once."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    if not (node.target in _MEAN or (node.op == "call_method" and node.target == "mean")):
        return None
    if set(node.kwargs) - {"dim", "keepdim"}:  # a dtype= mean is not LLaMA's fp32 one
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    rank = len(shape(node.args[0]) or ())
    if isinstance(dims, (list, tuple)) and len(dims) == 1:
        dims = dims[0]
    if dims not in (-1, rank - 1) or node.kwargs.get("keepdim") is not True or len(node.args) > 2:
        return None
    return node.args[0]


def _square_of(node: Any, base: fx.Node) -> bool:
    """node is base ** 2 (pow) or base * base, read once."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if node.target in _POW or (node.op == "call_method" and node.target == "pow"):
        return tuple(node.args) == (base, 2) and not node.kwargs
    return canonical(node) == "mul" and not _mutates(node) and _operands(node) == (base, base)


def _silu_gate(call: fx.Node):
    """(the product node, chain) where the call's output is read only by `gate, up = y.split([n, n], -1)`
    and the two halves only by silu(gate) * up; else None. The chain (product, silu, halves, split) is
    erased once the product reads the gated call."""
    split = next(iter(call.users)) if len(call.users) == 1 else None
    if split is None or not (split.target in _SPLIT or (split.op == "call_method" and split.target == "split")):
        return None
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    out_shape = shape(call)
    if split.args[0] is not call or out_shape is None or dim not in (-1, len(out_shape) - 1) or out_shape[-1] % 2:
        return None
    half = out_shape[-1] // 2
    if (list(sizes) if isinstance(sizes, (list, tuple)) else [sizes, sizes]) != [half, half] or len(split.users) != 2:
        return None
    halves = {user.args[1]: user for user in split.users if canonical(user) == "getitem" and len(user.users) == 1}
    if set(halves) != {0, 1}:
        return None
    gate, up = halves[0], halves[1]
    silu = next(iter(gate.users))
    product = next(iter(up.users))
    if not _is_silu(silu) or len(silu.users) != 1 or next(iter(silu.users)) is not product:
        return None
    if canonical(product) != "mul" or _mutates(product) or sorted(map(id, _operands(product) or ())) != sorted(
            map(id, (silu, up))):
        return None
    if dtype(product) != dtype(call) or shape(product) != (*out_shape[:-1], half):
        return None
    return product, [product, silu, gate, up, split]


def _is_silu(node: Any) -> bool:
    return (isinstance(node, fx.Node) and not node.kwargs.get("inplace", False) and len(node.args) == 1
            and (node.target in _SILU or (node.op == "call_method" and node.target == "silu")))


def _residual(call: fx.Node, order: dict[fx.Node, int]):
    """(the add, r) where the call's one reader is r + call or call + r, r of the call's shape and
    dtype and computed before it; else None."""
    if len(call.users) != 1:
        return None
    add = next(iter(call.users))
    if canonical(add) != "add" or _mutates(add) or (ops := _operands(add)) is None:
        return None
    if add.op == "call_method" and add.target != "add":
        return None
    other = ops[1] if ops[0] is call else ops[0]
    if other is call or not isinstance(other, fx.Node) or call not in ops:
        return None
    if shape(other) is None or shape(other) != shape(call) or dtype(other) != dtype(call) or dtype(add) != dtype(call):
        return None
    if order[other] > order[call] or _mutation_between(call, add):
        return None
    return add, other
