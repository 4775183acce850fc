"""The walks of a hand-written attention, from its softmax: UP the scores to the QK^T matmul
(collecting the scale and the mask terms), DOWN the probabilities to the PV matmul (through
casts, copies, views and dropout). Functions here fill any match object with the fields of
match.AttentionMatch, and set its `reason` where the form is not one the fused op reproduces."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.passes.attention.masks import (
    MASKED_FILL_THRESHOLD,
    SCALED_FILL_THRESHOLD,
    MaskTerm,
    _masks,
    _scalar,
)
from graphopt.passes.attention.operands import match_qk, ndim
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import arg, canonical, dtype, fake, size_hint

# Casts that keep a floating value (`.to(dtype)`, `.float()`, ...), and copies that keep the value.
_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as"}
_COPIES = {"contiguous", "clone"}
_VIEWS = {"view", "reshape", "unflatten", "flatten"}
# Shape readers: users of the scores that read only their shape (`mask.expand_as(scores)`).
_SHAPE_READERS = {"expand_as", "view_as", "reshape_as"}
_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv)
_MASKING_HINT = (f"(<= {MASKED_FILL_THRESHOLD:g}, and <= {SCALED_FILL_THRESHOLD:g} after scaling, or -inf)")


def is_matmul(node: Any) -> bool:
    return isinstance(node, fx.Node) and canonical(node) in ("matmul", "bmm")


def _is_qk_product(node: Any) -> bool:
    """A matmul, or baddbmm(bias, q, k^T) (BLOOM's ALiBi, nn.MultiheadAttention with a mask)."""
    return is_matmul(node) or (isinstance(node, fx.Node) and canonical(node) == "baddbmm")


def in_place(node: fx.Node) -> bool:
    """An op that writes into its first argument (`scores += mask`, `scores.masked_fill_(...)`)."""
    if node.op == "call_function":
        return node.target in _IN_PLACE_OPERATORS
    return node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")


def value_users(node: fx.Node) -> list[fx.Node]:
    """Users that read the value of `node`: not `x.type_as(node)` (its dtype) nor
    `x.expand_as(node)` / `.size()` (its shape)."""
    out = []
    for u in node.users:
        kind = canonical(u)
        reads_other = len(u.args) == 2 and u.args[1] is node and u.args[0] is not node
        if kind == "type_as" and reads_other or kind in _SHAPE_READERS and reads_other:
            continue
        if kind in ("size", "dim") and u.args and u.args[0] is node:
            continue
        out.append(u)
    return out


def _is_float_cast(node: fx.Node) -> bool:
    value = fake(node)
    return canonical(node) in _CASTS and isinstance(value, torch.Tensor) and value.is_floating_point()


def _passes_value(node: fx.Node) -> bool:
    """A cast or copy whose value is its first argument's (in a floating dtype)."""
    return _is_float_cast(node) or (canonical(node) in _COPIES and bool(node.args) and isinstance(node.args[0], fx.Node))


def _same(a: Any, b: Any) -> bool:
    """Sizes provably equal (symbolic ones included, without adding a guard)."""
    return statically_known_true(a == b)


def heads_view(node: fx.Node) -> tuple[fx.Node, int] | None:
    """A view of attention scores or probabilities that keeps their shape, or that merges or splits
    the heads between (B, H, Lq, Lk) and (B*H, Lq, Lk): (its input, H), H = 0 for a no-op view.
    None for any other node."""
    if canonical(node) not in _VIEWS or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    a, b = fake(src), fake(node)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if a.dim() == b.dim() and all(_same(x, y) for x, y in zip(a.shape, b.shape)):
        return src, 0
    if a.dim() == 4 and b.dim() == 3:
        four, three = a.shape, b.shape
    elif a.dim() == 3 and b.dim() == 4:
        four, three = b.shape, a.shape
    else:
        return None
    if not (_same(four[2], three[1]) and _same(four[3], three[2]) and _same(four[0] * four[1], three[0])):
        return None
    heads = four[1]
    hint = size_hint(heads)
    return (src, hint) if hint else None


def _note_heads(match: Any, heads: int, four_dim: fx.Node) -> bool:
    if match.heads and match.heads != heads:
        match.reason = f"the scores are viewed with {match.heads} and with {heads} heads"
        return False
    match.heads, match.heads_node = heads, four_dim
    return True


def _unwrap_expand(node: Any, match: Any) -> Any:
    """`m.expand_as(scores)` as a mask term is `m` (it broadcasts the same way); the expand node is
    erased with the match, which drops its read of the scores."""
    if isinstance(node, fx.Node) and canonical(node) == "expand_as" and len(node.args) == 2 and on_scores_path(node.args[1]):
        match.nodes.append(node)
        return node.args[0]
    return node


# ---------------------------------------------------------------------------------------------
# Down: softmax -> PV matmul
# ---------------------------------------------------------------------------------------------
def dropout_state(ctx: PassContext, node: fx.Node) -> tuple[float | None, str]:
    """(p of an active dropout, or 0.0 when it is inactive; None with the reason when it cannot be told)."""
    if node.op == "call_module":
        module = ctx.gm.get_submodule(node.target)
        return (float(module.p) if module.training else 0.0), ""
    if node.target is torch.dropout:  # torch.dropout(input, p, train)
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return None, "attention dropout with a non-constant p or training flag"
    return (float(p) if training else 0.0), ""


def is_dropout(node: fx.Node, ctx: PassContext) -> bool:
    if canonical(node) == "dropout":
        return True
    if node.op == "call_module":
        try:
            return isinstance(ctx.gm.get_submodule(node.target), torch.nn.Dropout)
        except AttributeError:
            return False
    return False


DROPOUT_OFF_REASON = ("attention dropout active in training (p={p:g}); the fused op would draw another random mask: "
                      "attention_dropout=True rewrites it to SDPA with dropout_p (the same distribution)")


def walk_down(ctx: PassContext, match: Any, allow_dropout: bool) -> None:
    """softmax -> casts / copies / head views / dropout -> PV matmul."""
    node = match.softmax
    chain: list[fx.Node] = []
    while True:
        users = list(node.users)
        if len(users) != 1:
            if any(is_matmul(u) and u.args[0] is node for u in users) or chain:
                match.reason = (f"attention probabilities have {len(users)} users (e.g. output_attentions=True): "
                                "the fused kernel never materializes them")
            else:
                match.reason = "softmax output is not consumed by a single PV matmul"
            # Still locate the PV matmul so the decline is attributed to the attention module.
            match.output = next((u for u in users if is_matmul(u)), None)
            return
        user = users[0]
        if _passes_value(user) and user.args[0] is node:
            chain.append(user)
            node = user
            continue
        view = heads_view(user)
        if view is not None and view[0] is node:
            if view[1] and not _note_heads(match, view[1], node if ndim(node) == 4 else user):
                return
            chain.append(user)
            node = user
            continue
        if is_dropout(user, ctx):
            p, why = dropout_state(ctx, user)
            if p is None:
                match.reason = why
                return
            if p > 0:
                if not allow_dropout:
                    match.reason = DROPOUT_OFF_REASON.format(p=p)
                    return
                if p >= 1 or match.dropout_p:
                    match.reason = f"attention dropout p={p:g} after p={match.dropout_p:g}" if match.dropout_p else \
                        "attention dropout with p=1 drops every probability"
                    return
                match.dropout_p = p
            chain.append(user)
            node = user
            continue
        if is_matmul(user) and user.args[0] is node and len(user.args) >= 2:
            if match.heads and ndim(node) != ndim(user.args[1]):  # viewed to other dims than v's
                match.reason = f"probabilities of {ndim(node)} dims times values of {ndim(user.args[1])} dims"
                return
            match.output = user
            match.v = user.args[1]
            match.nodes.extend(chain)
            return
        match.reason = f"softmax output flows into {user.format_node() if hasattr(user, 'format_node') else user}, not a PV matmul"
        return


def reaches_pv(node: fx.Node, ctx: PassContext, depth: int = 0) -> bool:
    """Whether `node`'s value flows (through casts, copies, views, dropout) into a matmul."""
    if depth > 8:
        return False
    for user in node.users:
        if is_matmul(user) and user.args[0] is node:
            return True
        if (_passes_value(user) or heads_view(user) is not None or is_dropout(user, ctx)) and user.args[0] is node:
            if reaches_pv(user, ctx, depth + 1):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Up: softmax input -> QK^T matmul
# ---------------------------------------------------------------------------------------------
def walk_up(ctx: PassContext, match: Any) -> None:
    """softmax input -> casts / copies / head views / scale / masks -> QK^T matmul."""
    node = match.softmax.args[0] if match.softmax.args else match.softmax.kwargs.get("input")
    multiplier = 1.0  # product of the scales applied between this point and the softmax
    chain: list[fx.Node] = []
    capped_terms = 0  # terms found before (above) a soft-capping tanh
    while isinstance(node, fx.Node):
        kind = canonical(node)
        space = ndim(node)
        if len(value_users(node)) != 1:
            match.reason = f"the attention scores are used elsewhere too ({node.name} has {len(node.users)} users)"
            return
        if in_place(node) and not on_scores_path(node.args[0] if node.args else None):
            match.reason = f"{node.name} writes the scores into another tensor in place"
            return
        if _passes_value(node):
            chain.append(node)
            node = node.args[0]
            continue
        view = heads_view(node)
        if view is not None:
            src, heads = view
            if heads and not _note_heads(match, heads, node if ndim(node) == 4 else src):
                return
            chain.append(node)
            node = src
            continue
        if kind in ("mul", "div") and len(node.args) == 2 and node.kwargs.get("rounding_mode") is None:
            a, b = node.args
            tensor_side, const = (a, b) if on_scores_path(a) else (b, a)
            value = _scalar(ctx, const, match.size_guards) if not on_scores_path(const) else None
            if kind == "div" and tensor_side is not a:
                value = None  # c / scores is not a scale
            if value is not None and value != 0 and isinstance(tensor_side, fx.Node):
                factor = 1.0 / value if kind == "div" else value
                if factor <= 0:
                    match.reason = f"scores scaled by a non-positive factor {factor}"
                    return
                multiplier *= factor
                match.scale *= factor
                chain.append(node)
                node = tensor_side
                continue
            match.reason = f"scores multiplied by a non-constant ({node.name})"
            return
        if kind == "add" and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
            a, b = node.args
            if on_scores_path(a) and not on_scores_path(b):
                scores, other = a, b
            elif on_scores_path(b) and not on_scores_path(a):
                scores, other = b, a
            else:
                match.reason = f"cannot tell scores from bias in {node.name}"
                return
            if not isinstance(other, fx.Node):
                if isinstance(other, (int, float)):  # adding a constant does not change softmax
                    chain.append(node)
                    node = scores
                    continue
                match.reason = f"unsupported addend {other!r}"
                return
            match.terms.append(MaskTerm("add", _unwrap_expand(other, match), multiplier, space=space))
            chain.append(node)
            node = scores
            continue
        if kind == "sub" and len(node.args) == 2 and on_scores_path(node.args[0]) and not on_scores_path(node.args[1]):
            other = node.args[1]
            if isinstance(other, (int, float)):
                chain.append(node)
                node = node.args[0]
                continue
        if kind == "masked_fill":
            scores, mask, fill = arg(node, 0, "input"), arg(node, 1, "mask"), arg(node, 2, "value")
            fill_value = _scalar(ctx, fill)
            if not _masks(fill_value, multiplier):
                match.reason = (f"masked_fill with fill {fill!r} (times the later scale {multiplier:g}) is not a masking "
                                f"value {_MASKING_HINT}")
                return
            match.terms.append(MaskTerm("drop", _unwrap_expand(mask, match), multiplier, fill_value, space=space))
            chain.append(node)
            node = scores
            continue
        if kind == "where" and len(node.args) == 3:
            cond, x, y = node.args
            if on_scores_path(x) and not on_scores_path(y):
                keep, scores, fill = True, x, y
            elif on_scores_path(y) and not on_scores_path(x):
                keep, scores, fill = False, y, x
            else:
                match.reason = f"cannot tell scores from fill in {node.name}"
                return
            fill_value = _scalar(ctx, fill)
            if not _masks(fill_value, multiplier):
                match.reason = (f"torch.where with fill {fill!r} (times the later scale {multiplier:g}) is not a masking "
                                f"value {_MASKING_HINT}")
                return
            match.terms.append(MaskTerm("keep" if keep else "drop", _unwrap_expand(cond, match), multiplier,
                                        fill_value, space=space))
            chain.append(node)
            node = scores
            continue
        if match.softcap and len(match.terms) != capped_terms:
            match.reason = "a mask or bias added to the scores before their soft-capping (tanh)"
            return
        if is_matmul(node):
            chain.append(node)
            match.nodes.extend(chain)
            match_qk(ctx, match, node, node.args[0], node.args[1])
            return
        if kind == "baddbmm":  # beta * bias + alpha * (q @ k^T)
            bias, q, kt = arg(node, 0, "input"), arg(node, 1, "batch1"), arg(node, 2, "batch2")
            beta, alpha = _scalar(ctx, node.kwargs.get("beta", 1.0)), _scalar(ctx, node.kwargs.get("alpha", 1.0))
            if beta is None or alpha is None or alpha <= 0:
                match.reason = f"baddbmm with beta={node.kwargs.get('beta')!r}, alpha={node.kwargs.get('alpha')!r}: " \
                               "not constants (alpha > 0)"
                return
            if not isinstance(bias, fx.Node):
                match.reason = f"baddbmm onto {bias!r}, not a tensor"
                return
            if beta != 0:
                if match.softcap:
                    match.reason = "a bias added to the scores (baddbmm) before their soft-capping (tanh)"
                    return
                match.terms.append(MaskTerm("add", bias, multiplier * beta, space=space))
            match.scale *= alpha
            chain.append(node)
            match.nodes.extend(chain)
            match_qk(ctx, match, node, q, kt)
            return
        if kind == "tanh":  # soft-capping: cap * tanh(s / cap), cap = the scales applied after it (Gemma 2)
            if match.softcap:
                match.reason = "the scores pass through tanh twice"
                return
            match.softcap = multiplier
            capped_terms = len(match.terms)
            chain.append(node)
            node = node.args[0]
            continue
        match.reason = f"scores come from {node.name} ({kind}), not a QK^T matmul"
        return
    match.reason = "softmax input is not a graph value"


def on_scores_path(node: Any, depth: int = 0) -> bool:
    """Whether `node` leads (through ops the walk can pass) to a q @ k^T matmul."""
    if not isinstance(node, fx.Node) or depth > 24:
        return False
    if _is_qk_product(node):
        return True
    kind = canonical(node)
    if kind == "tanh" or kind in _COPIES or kind in _VIEWS:  # tanh: soft-capped scores (declined with the reason)
        return bool(node.args) and on_scores_path(node.args[0], depth + 1)
    if kind in _CASTS or kind in ("mul", "div", "add", "sub", "masked_fill"):
        return on_scores_path(node.args[0], depth + 1) or (
            kind in ("mul", "add") and len(node.args) > 1 and on_scores_path(node.args[1], depth + 1))
    if kind == "where" and len(node.args) == 3:
        return on_scores_path(node.args[1], depth + 1) or on_scores_path(node.args[2], depth + 1)
    return False




# ---------------------------------------------------------------------------------------------
# In-place updates of the scores through tensor methods
# ---------------------------------------------------------------------------------------------
_IN_PLACE_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill"}
# Ops whose result is a tensor of its own (no view, no alias of an input: `.to()` / `.float()` may return self).
_FRESH = {"matmul", "bmm", "baddbmm", "add", "sub", "mul", "div", "masked_fill", "where"}
# Readers of the scores that an in-place update after them cannot reach: their result is a tensor of its own.
_FRESH_READERS = _FRESH | {"softmax", "log_softmax", "exp", "tanh", "sum", "amax", "mean"}


def functionalize_score_updates(graph: fx.Graph) -> None:
    """`scores.add_(mask)` (also sub_, mul_, div_, masked_fill_) on attention scores: Dynamo records
    the call, and the later ops read the mutated `scores` node itself. Each such call on a tensor of
    its own (a matmul's or an arithmetic op's result, read before the call only by ops whose result
    is a tensor of their own: a view or alias taken before it would see the update) becomes its
    out-of-place op, read by the ops after it: the same values, in the form the walks follow. An
    update whose other operand would promote the scores' dtype stays: the in-place op keeps the
    scores' dtype, its out-of-place form would not."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _IN_PLACE_METHODS or not node.args:
            continue
        target = node.args[0]
        if not isinstance(target, fx.Node) or canonical(target) not in _FRESH or in_place(target) or not on_scores_path(target):
            continue
        earlier = [u for u in target.users if u is not node and order[u] < order[node]]
        if any(canonical(u) not in _FRESH_READERS or in_place(u) for u in earlier):
            continue  # a view or alias taken before the update would see it: leave the graph as it is
        other = node.args[1] if len(node.args) > 1 else None
        target_dtype, other_dtype = dtype(target), dtype(other) if isinstance(other, fx.Node) else None
        if (node.target != "masked_fill_" and target_dtype is not None and other_dtype is not None
                and torch.promote_types(target_dtype, other_dtype) != target_dtype):
            continue
        with graph.inserting_after(node):
            out = graph.call_method(_IN_PLACE_METHODS[node.target], node.args, node.kwargs)
        out.meta.update(node.meta)
        later = [u for u in target.users if u is not node and u is not out and order[u] > order[node]]
        for user in later:
            user.replace_input_with(target, out)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
