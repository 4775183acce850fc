"""Mask terms of a matched attention: compile-time evaluation of constant mask subgraphs and
scales (`evaluate_constant`, `_scalar`), the checks every term must pass (`_check_terms`), and the
causal proof (`_prove_causal`): a constant term that is exactly the top-left causal pattern is
dropped and the match becomes `is_causal`; a constant all-zero bias is dropped."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import canonical, dtype, fake, size_hints, writes_in_place

# A mask entry at or below this (or -inf) contributes exp(fill - max) == 0 to softmax in any float
# dtype we run, so such a fill counts as "masked out".
MASKED_FILL_THRESHOLD = -1e4
# ... and what it must still be after the scales applied between it and the softmax: exp(-1e3)
# is 0 in float32, so such entries weigh nothing beside any score within 1e2 of 0.
SCALED_FILL_THRESHOLD = -1e3
# Compile-time evaluation of mask subgraphs: at most this many nodes, and this much memory per
# intermediate (expanded views are free; a (1, 1, 8192, 8192) fp32 mask is 256 MiB).
_MAX_EVAL_NODES = 64
_MAX_EVAL_BYTES = 512 << 20

_RANDOM_HINTS = ("rand", "dropout", "normal", "bernoulli", "multinomial", "uniform", "exponential")


@dataclass
class MaskTerm:
    """One term of the bias, as found on the scores chain.

    kind: "add"   additive tensor `node` (times `multiplier`, the scale applied after it);
          "keep"  bool tensor, True = attend (from `where(mask, scores, fill)`);
          "drop"  bool tensor, True = masked out (from `masked_fill(mask, fill)`, `where(mask, fill, scores)`).
    For keep/drop, `fill` is the value masked entries take (times `multiplier`).
    `space`: the dims of the scores where the term applies; `merged_heads`: it applies to scores
    viewed as (B*H, Lq, Lk) in a match whose fused op works on (B, H, Lq, Lk).
    """

    kind: str
    node: Any
    multiplier: float = 1.0
    fill: float = float("-inf")
    space: int | None = None
    merged_heads: bool = False


# ---------------------------------------------------------------------------------------------
# Constant evaluation (masks built from arange/tril/buffers, scale tensors)
# ---------------------------------------------------------------------------------------------
class _NotConstant(Exception):
    pass


# Why a mask built from symbolic sizes stays a bias: its value at the example sizes would prove
# nothing about the others (a sliding window, for one, is plain causal below its width).
SYMBOLIC_MASK_NOTE = ("the mask is built from symbolic sizes (dynamic shapes) and cannot be proven causal at "
                      "compile time; it stays a bias (static shapes, or SDPA's is_causal, avoid this)")


def _masks(fill: float | None, multiplier: float) -> bool:
    """Whether a masked_fill / where fill, times the scales applied after it, masks its entries."""
    if fill is None:
        return False
    if fill == float("-inf"):
        return multiplier > 0
    return fill <= MASKED_FILL_THRESHOLD and fill * multiplier <= SCALED_FILL_THRESHOLD


# Functions and methods that write into their first argument: a mask subgraph touched by one is
# not the value its inputs compute (evaluate_constant would miss the edit).
_VIEW_METHODS = {"view", "reshape", "expand", "expand_as", "transpose", "permute", "unsqueeze", "squeeze", "t",
                 "narrow", "select", "as_strided", "view_as", "unflatten", "flatten", "contiguous", "__getitem__",
                 "diagonal", "unfold", "split", "chunk", "T", "mT"}


def _written_in_place(node: fx.Node, seen: set | None = None) -> bool:
    """Whether `node`'s tensor, or a view of it, is written in place anywhere in the graph."""
    seen = set() if seen is None else seen
    if node in seen:
        return False
    seen.add(node)
    for user in node.users:
        if user.kwargs.get("out") is node:
            return True
        if not user.args or user.args[0] is not node:
            continue
        if writes_in_place(user):
            return True
        if user.op == "call_function":
            name = getattr(user.target, "__name__", "")
            if user.target is operator.getitem or user.target is getattr or name in _VIEW_METHODS:
                if _written_in_place(user, seen):
                    return True
        elif user.op == "call_method" and user.target in _VIEW_METHODS and _written_in_place(user, seen):
            return True
    return False


def evaluate_constant(ctx: PassContext, node: Any, used_state: list[fx.Node] | None = None) -> Any:
    """The value of `node` if it depends only on constants, parameters and buffers, else raises
    _NotConstant. Placeholders read are appended to `used_state` (to be guarded by the caller)."""
    cache: dict[fx.Node, Any] = {}
    count = [0]

    def value_of(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            if isinstance(n, (list, tuple)):
                return type(n)(value_of(x) for x in n)
            if isinstance(n, dict):
                return {key: value_of(x) for key, x in n.items()}
            return n
        if n in cache:
            return cache[n]
        count[0] += 1
        if count[0] > _MAX_EVAL_NODES:
            raise _NotConstant("subgraph too large")
        if _written_in_place(n):
            raise _NotConstant(f"{n.name} is written in place")
        if n.op == "get_attr":
            result = _get_attr(ctx.gm, n.target)
        elif n.op == "placeholder":
            value = ctx.example_value(n)
            if isinstance(value, torch.SymInt | int) and not isinstance(value, bool):
                raise _NotConstant(SYMBOLIC_MASK_NOTE)
            if not isinstance(value, torch.Tensor) or not ctx.is_model_state(n):
                raise _NotConstant("depends on an input")
            if ctx.grad_enabled and value.requires_grad:  # a trainable bias must keep its gradient
                raise _NotConstant("depends on a parameter being trained")
            if used_state is not None and n not in used_state:
                used_state.append(n)
            result = value.detach()
        elif n.op in ("call_function", "call_method"):
            name = str(n.target if n.op == "call_method" else getattr(n.target, "__name__", n.target)).lower()
            if any(h in name for h in _RANDOM_HINTS) or (n.op == "call_method" and name.endswith("_") and not name.endswith("__")):
                raise _NotConstant(f"{name} is random or in-place")
            args, kwargs = value_of(n.args), value_of(n.kwargs)
            with torch.no_grad():
                if n.op == "call_method":
                    result = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    result = n.target(*args, **kwargs)
        else:
            raise _NotConstant(n.op)
        if isinstance(result, torch.Tensor) and result.untyped_storage().nbytes() > _MAX_EVAL_BYTES:
            raise _NotConstant("too large")
        cache[n] = result
        return result

    return value_of(node)


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _scalar(ctx: PassContext, node: Any, sizes: list | None = None) -> float | None:
    """A Python number, or a constant one-element tensor, as a float; else None. A value read
    from a parameter or buffer (a learned temperature, a scale buffer) is guarded: the graph is
    recompiled if it changes in place, as for a frozen mask. With `sizes`, also a number computed
    from symbolic sizes (`1 / math.sqrt(q.size(-1))` under dynamic shapes), at the traced example;
    the symbolic sizes it reads are appended to `sizes`, for the rewrite to guard."""
    if isinstance(node, bool):
        return None
    if isinstance(node, (int, float)):
        return float(node)
    if isinstance(node, fx.Node):
        value = fake(node)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return None
        used_state: list[fx.Node] = []
        try:
            real = evaluate_constant(ctx, node, used_state)
        except Exception:
            if isinstance(value, (torch.SymInt, torch.SymFloat)) and sizes is not None:
                return _size_expression(node, value, sizes)
            return None
        _guard_state(ctx, used_state)
        if isinstance(real, torch.Tensor) and real.numel() == 1:
            return float(real.item())
        if isinstance(real, (int, float)) and not isinstance(real, bool):
            return float(real)
    return None


def _size_expression(node: fx.Node, value: Any, sizes: list) -> float | None:
    """The example value of a number computed from symbolic sizes only, with those sizes appended to
    `sizes`; None for one that reads anything else (a tensor's item)."""
    hint = getattr(value.node, "hint", None)
    if hint is None:
        return None
    found, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = fake(n)
        if isinstance(v, torch.SymInt) and (n.op == "placeholder" or canonical(n) == "size"):
            found.append(v)  # a size Dynamo passes in, or reads off a tensor
            continue
        if not isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) or n.op != "call_function":
            return None
        stack.extend(n.all_input_nodes)
    sizes.extend(found)
    return float(hint)


def guard_sizes(sizes: list) -> None:
    """Fix symbolic sizes to their example values (Dynamo recompiles for others): for a rewrite that
    bakes a number computed from them."""
    for size in sizes:
        int(size)


def _check_terms(ctx: PassContext, match: Any) -> None:
    """Every mask/bias term of `match` (an AttentionMatch) must broadcast to the scores without
    enlarging them, in <= 4 dims."""
    scores = match.scores_shape
    if scores is None:
        return  # symbolic: the op's own checks run at run time
    merged = (scores[0] * scores[1], *scores[2:]) if len(scores) == 4 else tuple(scores)
    softmax_shape = size_hints(match.softmax)
    if not match.from_sdpa and softmax_shape not in (tuple(scores), merged):
        match.reason = (f"the mask/bias broadcasts the scores {tuple(scores)} up to {softmax_shape}: "
                        "not broadcastable as the kernel needs (B, H, Lq, Lk)")
        return
    for term in match.terms:
        shape_ = size_hints(term.node)
        if shape_ is None:
            continue
        scores = merged if term.merged_heads else match.scores_shape
        if len(shape_) > len(scores):
            match.reason = (f"mask/bias of shape {tuple(shape_)} has more dims than the scores {tuple(scores)}: "
                            "not broadcastable as the kernel needs (B, H, Lq, Lk)")
            return
        try:
            out = torch.broadcast_shapes(tuple(shape_), tuple(scores))
        except RuntimeError:
            out = None
        if out != tuple(scores):
            match.reason = f"mask/bias of shape {tuple(shape_)} does not broadcast to the scores {tuple(scores)}"
            return
        if term.kind in ("keep", "drop") and dtype(term.node) != torch.bool:
            match.reason = f"mask of dtype {dtype(term.node)} in masked_fill/where (expected bool)"
            return


def _prove_causal(ctx: PassContext, match: Any, cache: dict | None = None) -> None:
    """Drop the constant mask terms of `match` (an AttentionMatch) that are exactly the top-left
    causal mask (-> is_causal), and constant all-zero biases. Terms that depend on inputs stay."""
    scores = match.scores_shape
    if scores is None:
        return
    lq, lk = scores[-2], scores[-1]
    causal = torch.ones(lq, lk, dtype=torch.bool).tril()  # True = attend
    kept: list[MaskTerm] = []
    cache = {} if cache is None else cache
    for term in match.terms:
        key = (term.node, term.kind, term.multiplier, lq, lk)
        if key not in cache:
            cache[key] = _classify_constant_term(ctx, term, causal)
        what, used = cache[key]
        if what not in ("causal", "zero"):
            kept.append(term)
            if what is not None and what not in match.notes:
                match.notes.append(what)
            continue
        match.dropped.append(term.node)
        if what == "causal":
            match.is_causal = True
            match.notes.append("constant mask proven top-left causal -> is_causal")
        else:
            match.notes.append("dropped an all-zero constant bias")
        _guard_state(ctx, used)
    match.terms = kept


def _classify_constant_term(ctx: PassContext, term: MaskTerm, causal: torch.Tensor) -> tuple[str | None, list[fx.Node]]:
    """("causal" | "zero" | None, buffers read) for one mask term; SYMBOLIC_MASK_NOTE instead of
    None where the term could not be evaluated because it reads symbolic sizes."""
    used: list[fx.Node] = []
    try:
        value = evaluate_constant(ctx, term.node, used)
    except _NotConstant as exc:
        return (SYMBOLIC_MASK_NOTE if str(exc) == SYMBOLIC_MASK_NOTE else None), []
    except Exception:
        return None, []
    if not isinstance(value, torch.Tensor):
        return None, []
    value = value.detach()
    causal = causal.to(value.device)
    if term.kind == "add":
        full = value.float() * term.multiplier
        if bool((full == 0).all()):
            return "zero", used
        attend = full == 0
        masked = (full <= MASKED_FILL_THRESHOLD) | (full == float("-inf"))
        if bool((attend | masked).all()) and bool((attend == causal).all()):
            return "causal", used
    elif value.dtype == torch.bool:
        attend = value if term.kind == "keep" else ~value
        if bool((attend == causal).all()):
            return "causal", used
    return None, []


def _guard_state(ctx: PassContext, nodes: list[fx.Node]) -> None:
    """Buffers whose compile-time value we relied on: recompile if they change in place."""
    for node in nodes:
        ctx.guard_tensor(node)


def alibi_slopes(ctx: PassContext, term: MaskTerm, heads: int, len_q: int, len_k: int) -> torch.Tensor | None:
    """Per-head slopes (H,) float32 when `term` is a constant ALiBi bias: on every query row of
    head h, slope_h * j plus a constant (BLOOM's slope * j, MPT's slope * (j - Lk + 1), or slope *
    (j - i)), broadcast over the batch. None for any other term. The buffers read are guarded."""
    if term.kind != "add" or term.merged_heads or len_k < 2:
        return None
    used: list[fx.Node] = []
    try:
        value = evaluate_constant(ctx, term.node, used)
    except Exception:
        return None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() > 4:
        return None
    value = value.detach().double() * term.multiplier
    value = value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))
    if value.shape[0] != 1 or value.shape[1] not in (1, heads) or value.shape[2] not in (1, len_q) or value.shape[3] != len_k:
        return None
    value = value[0]  # (H or 1, Lq or 1, Lk)
    if not torch.isfinite(value).all():
        return None
    slopes = ((value[..., -1] - value[..., 0]) / (len_k - 1)).mean(-1)  # (H or 1,)
    j = torch.arange(len_k, dtype=torch.float64, device=value.device)
    fitted = slopes[:, None, None] * j + value[..., :1]
    # the ALiBi the kernel computes differs from the stored bias by its float32 rounding only
    if (slopes == 0).all() or float((value - fitted).abs().max()) > 4 * 2.0 ** -24 * float(value.abs().max()):
        return None
    _guard_state(ctx, used)
    return slopes.expand(heads).float().contiguous()
