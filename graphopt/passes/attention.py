"""The `attention` pass: hand-written scaled-dot-product attention -> one `graphopt::attention`.

Lossless and on by default. It anchors on every softmax node and walks
- UP the scores through ops that do not change what softmax sees beyond what the fused kernel
  reproduces: casts (`.float()`, `.to(dtype)`, `.type(...)`, `.type_as(...)`), `contiguous`,
  multiplication/division by a constant scalar (a Python number or a constant 0-d/1-element tensor
  such as GPT-2's `torch.full([], sqrt(d))`), additive masks and biases (`scores + mask`, summed when
  there are several, as in T5), `masked_fill(mask, fill)` and `torch.where(mask, scores, fill)` with a
  very negative fill, down to the QK^T matmul (`matmul`/`@`/`bmm`). The scale may also sit on q or k
  before the matmul. K^T may be `k.transpose(-2, -1)`/`transpose(2, 3)`/`.mT`/`permute(0, 1, 3, 2)`
  or any other tensor (then the pass transposes it back). GQA's `repeat_kv` (expand + reshape, or
  `repeat_interleave` over the head dim) is undone: the kernel reads the un-repeated K/V.
- DOWN the probabilities through casts and inactive dropout (`training=False` or `p=0`) to the PV
  matmul.

It also takes `F.scaled_dot_product_attention` calls (HF's default "sdpa" attention): their
`attn_mask` becomes a mask term (bool = attend, float = additive), `is_causal`, `scale` (default
1/sqrt(D)) and `enable_gqa` carry over, and `dropout_p` must be 0. Such a call is rewritten only
when the cost model prefers another implementation than the one PyTorch's SDPA dispatcher would
pick by itself (its priority order among the enabled backends): that default is the "before".

Masks. A bool mask with fill -inf stays a bool mask (True = attend). A finite fill (HF's
finfo.min, -1e9, -1e4) must be <= -1e4, and still <= -1e3 once multiplied by any scale applied
after it; it becomes the additive bias `where(mask, fill, 0)`. Rows with at least one visible key are exact. A row whose keys are all
masked (padding, which models ignore) can differ from eager:
- with a finite fill eager gives the mean of V (equal scores). The bias gives the same only where it
  swallows the scores, as finfo(float32).min does on the SDPA paths; with -1e4 the row becomes
  softmax(scores), and our Triton kernel gives 0 (see kernels/flash_attention.py);
- with -inf eager gives NaN, the rewrite 0 (SDPA's safe softmax).
A mask term whose value depends only on constants, parameters and buffers, and that nothing
writes in place (a prefix-LM mask edited with `m[:, :p] = True` is not the value its inputs
compute), is evaluated at compile time; when it is
exactly the top-left causal pattern (query i sees keys j <= i; masked entries <= -1e4 or -inf) it
is dropped and the node gets `is_causal=True`, so kernels skip the upper triangle. Buffers read
this way are registered as frozen: an in-place change of the buffer triggers a recompile. An
all-zero constant bias (T5's cross-attention position bias) is dropped.

Declined, with a recorded reason: probabilities used elsewhere (`output_attentions=True`), dropout
active in training, a bias that broadcasts the scores to a larger shape or has more than 4 dims,
mixed q/k/v dtypes, an output dtype differing from v's, a softmax over another dim.

The implementation is chosen at compile time: on CPU, SDPA's CPU kernel ("sdpa_cpu"); on CUDA the
fastest applicable of our Triton kernel and SDPA's cuDNN / flash / memory-efficient backends, by
the roofline cost model or, where `graphopt calibrate` measured the shape, by the measured table
(`calibrate_attention_table`). `attention_backend` in the config forces one.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt import cost_model
from graphopt.cost_model import Estimate
from graphopt.onnx_registry import register_onnx_translation
from graphopt.passes.base import GraphPass, PassContext, module_path
from graphopt.passes.fx_utils import arg, canonical, device, dtype, erase_unused, fake, fix_symbolic_sizes, size_hints

log = logging.getLogger("graphopt")

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

_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as", "contiguous"}
_RANDOM_HINTS = ("rand", "dropout", "normal", "bernoulli", "multinomial", "uniform", "exponential")
_SDPA_CANDIDATES = ("cudnn", "flash", "efficient")


# ---------------------------------------------------------------------------------------------
# The match
# ---------------------------------------------------------------------------------------------
@dataclass
class MaskTerm:
    """One term of the bias, as found on the scores chain.

    kind: "add"   additive tensor `node` (times `multiplier`, the scale applied after it);
          "keep"  bool tensor, True = attend (from `where(mask, scores, fill)`);
          "drop"  bool tensor, True = masked out (from `masked_fill(mask, fill)`, `where(mask, fill, scores)`).
    For keep/drop, `fill` is the value masked entries take (times `multiplier`).
    """

    kind: str
    node: Any
    multiplier: float = 1.0
    fill: float = float("-inf")


@dataclass
class AttentionMatch:
    """One softmax-anchored attention: out = softmax(scale * q @ k^T + bias) @ v.

    `reason` is None when the match can be rewritten, else why not (the pass records it).
    q, k, v are the tensors the fused op reads: (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv),
    except that `k_transposed` says the graph only holds k^T (the rewrite transposes it back) and
    `batched_3d` says the graph works on (B*H, L, D) tensors (the rewrite adds a leading dim).
    """

    softmax: fx.Node
    output: fx.Node | None  # the PV matmul whose value the fused op replaces
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    scale: float = 1.0
    is_causal: bool = False
    num_kv_groups: int = 1
    terms: list[MaskTerm] = field(default_factory=list)
    k_transposed: bool = False
    batched_3d: bool = False
    nodes: list[fx.Node] = field(default_factory=list)  # matched nodes, erased when unused
    softmax_fp32: bool = False
    scores_shape: tuple[int, ...] | None = None  # of the QK^T matmul
    dropped: list[fx.Node] = field(default_factory=list)  # mask terms proven causal / zero (dead after rewrite)
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    from_sdpa: bool = False  # an F.scaled_dot_product_attention call (softmax and output are that node)
    call_has_mask: bool = False  # that call as written (before a constant mask is proven causal)
    call_is_causal: bool = False
    replaced_by: fx.Node | None = None  # after rewrite_attention: the node now computing `output`

    def follow(self, replaced: dict[fx.Node, fx.Node]) -> bool:
        """Point q, k, v and the mask terms at the nodes that replaced earlier rewrites' outputs
        (one attention's output feeding the next directly). False when the match still reads a
        node an earlier rewrite erased."""
        self.q, self.k, self.v = (replaced.get(n, n) for n in (self.q, self.k, self.v))
        for term in self.terms:
            term.node = replaced.get(term.node, term.node)
        live = [self.q, self.k, self.v, self.output, self.softmax, *self.nodes, *(t.node for t in self.terms)]
        return not any(isinstance(n, fx.Node) and getattr(n, "_erased", False) for n in live)

    @property
    def location(self) -> str:
        return module_path(self.output if self.output is not None else self.softmax)

    # shapes (from the recorded fake tensors)
    def dims(self) -> tuple[int, int, int, int, int, int, int] | None:
        """(B, H, Hkv, Lq, Lk, D, Dv), or None when sizes are symbolic and have no hint."""
        qs, ks, vs = size_hints(self.q), size_hints(self.k), size_hints(self.v)
        if qs is None or ks is None or vs is None:
            return None
        if self.k_transposed:
            ks = (*ks[:-2], ks[-1], ks[-2])
        if self.batched_3d:
            qs, ks, vs = (1, *qs), (1, *ks), (1, *vs)
        b, hq, lq, d = qs
        hkv, lk, dv = ks[1], ks[2], vs[3]
        return b, hq, hkv, lq, lk, d, dv

    @property
    def has_bias(self) -> bool:
        return bool(self.terms)


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
_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
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
        if not user.args or user.args[0] is not node:
            continue
        if user.op == "call_function":
            name = getattr(user.target, "__name__", "")
            operator_module = getattr(user.target, "__module__", None) in ("_operator", "operator")  # and_, or_ ...
            if user.target in _INPLACE_FUNCTIONS or (name.endswith("_") and not name.endswith("__") and not operator_module):
                return True
            if user.target is operator.getitem or user.target is getattr or name in _VIEW_METHODS:
                if _written_in_place(user, seen):
                    return True
        elif user.op == "call_method":
            if user.target.endswith("_") and not user.target.endswith("__"):
                return True
            if user.target in _VIEW_METHODS and _written_in_place(user, seen):
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


def _scalar(ctx: PassContext, node: Any) -> float | None:
    """A Python number, or a constant one-element tensor, as a float; else None. A value read
    from a parameter or buffer (a learned temperature, a scale buffer) is guarded: the graph is
    recompiled if it changes in place, as for a frozen mask."""
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
            return None
        _guard_state(ctx, used_state)
        if isinstance(real, torch.Tensor) and real.numel() == 1:
            return float(real.item())
        if isinstance(real, (int, float)) and not isinstance(real, bool):
            return float(real)
    return None


# ---------------------------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------------------------
def _value_users(node: fx.Node) -> list[fx.Node]:
    """Users that read the value of `node` (not `x.type_as(node)`, which only reads its dtype)."""
    return [u for u in node.users if not (canonical(u) == "type_as" and len(u.args) == 2 and u.args[1] is node and u.args[0] is not node)]


def _is_float_cast(node: fx.Node) -> bool:
    value = fake(node)
    return canonical(node) in _CASTS and isinstance(value, torch.Tensor) and value.is_floating_point()


def _dropout_inactive(ctx: PassContext, node: fx.Node) -> tuple[bool, str]:
    """(is inactive dropout, reason if it is an active one)."""
    if node.op == "call_module":
        module = ctx.gm.get_submodule(node.target)
        if isinstance(module, torch.nn.Dropout):
            return (not module.training or module.p == 0), f"attention dropout active in training (p={module.p})"
        return False, ""
    if node.target is torch.dropout:  # torch.dropout(input, p, train)
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return False, "attention dropout with a non-constant p or training flag"
    if p == 0 or not training:
        return True, ""
    return False, f"attention dropout active in training (p={p}); the fused kernels cannot reproduce its random mask"


def _is_dropout(node: fx.Node, ctx: PassContext) -> bool:
    if canonical(node) == "dropout":
        return True
    if node.op == "call_module":
        try:
            return isinstance(ctx.gm.get_submodule(node.target), torch.nn.Dropout)
        except AttributeError:
            return False
    return False


def _last_dim(node: fx.Node, dim: Any) -> bool:
    value = fake(node)
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int):
        return False
    return dim == -1 or dim == value.dim() - 1


def _is_matmul(node: Any) -> bool:
    return isinstance(node, fx.Node) and canonical(node) in ("matmul", "bmm")


def _ndim(node: Any) -> int | None:
    value = fake(node)
    return value.dim() if isinstance(value, torch.Tensor) else None


def _walk_down(ctx: PassContext, match: AttentionMatch) -> None:
    """softmax -> casts / inactive dropout -> PV matmul."""
    node = match.softmax
    chain: list[fx.Node] = []
    while True:
        users = list(node.users)
        if len(users) != 1:
            if any(_is_matmul(u) and u.args[0] is node for u in users) or chain:
                match.reason = (f"attention probabilities have {len(users)} users (e.g. output_attentions=True): "
                                "the fused kernel never materializes them")
            else:
                match.reason = "softmax output is not consumed by a single PV matmul"
            # Still locate the PV matmul so the decline is attributed to the attention module.
            match.output = next((u for u in users if _is_matmul(u)), None)
            return
        user = users[0]
        if _is_float_cast(user):
            chain.append(user)
            node = user
            continue
        if _is_dropout(user, ctx):
            inactive, why = _dropout_inactive(ctx, user)
            if not inactive:
                match.reason = why
                return
            chain.append(user)
            node = user
            continue
        if _is_matmul(user) and user.args[0] is node and len(user.args) >= 2:
            match.output = user
            match.v = user.args[1]
            match.nodes.extend(chain)
            return
        match.reason = f"softmax output flows into {user.format_node() if hasattr(user, 'format_node') else user}, not a PV matmul"
        return


def _walk_up(ctx: PassContext, match: AttentionMatch) -> None:
    """softmax input -> casts / scale / masks -> QK^T matmul."""
    node = match.softmax.args[0] if match.softmax.args else match.softmax.kwargs.get("input")
    multiplier = 1.0  # product of the scales applied between this point and the softmax
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node):
        kind = canonical(node)
        if len(_value_users(node)) != 1:
            match.reason = f"the attention scores are used elsewhere too ({node.name} has {len(node.users)} users)"
            return
        if _is_float_cast(node) and node.args and isinstance(node.args[0], fx.Node):
            chain.append(node)
            node = node.args[0]
            continue
        if kind in ("mul", "div") and len(node.args) == 2:
            a, b = node.args
            tensor_side, const = (a, b) if _on_scores_path(a) else (b, a)
            value = _scalar(ctx, const) if not _on_scores_path(const) else None
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
        if kind == "add" and len(node.args) == 2 and not node.kwargs.get("alpha"):
            a, b = node.args
            if _on_scores_path(a) and not _on_scores_path(b):
                scores, other = a, b
            elif _on_scores_path(b) and not _on_scores_path(a):
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
            match.terms.append(MaskTerm("add", other, multiplier))
            chain.append(node)
            node = scores
            continue
        if kind == "sub" and len(node.args) == 2 and _on_scores_path(node.args[0]) and not _on_scores_path(node.args[1]):
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
                                f"value (<= {MASKED_FILL_THRESHOLD:g}, and <= {SCALED_FILL_THRESHOLD:g} after scaling, or -inf)")
                return
            match.terms.append(MaskTerm("drop", mask, multiplier, fill_value))
            chain.append(node)
            node = scores
            continue
        if kind == "where" and len(node.args) == 3:
            cond, x, y = node.args
            if _on_scores_path(x) and not _on_scores_path(y):
                keep, scores, fill = True, x, y
            elif _on_scores_path(y) and not _on_scores_path(x):
                keep, scores, fill = False, y, x
            else:
                match.reason = f"cannot tell scores from fill in {node.name}"
                return
            fill_value = _scalar(ctx, fill)
            if not _masks(fill_value, multiplier):
                match.reason = (f"torch.where with fill {fill!r} (times the later scale {multiplier:g}) is not a masking "
                                f"value (<= {MASKED_FILL_THRESHOLD:g}, and <= {SCALED_FILL_THRESHOLD:g} after scaling, or -inf)")
                return
            match.terms.append(MaskTerm("keep" if keep else "drop", cond, multiplier, fill_value))
            chain.append(node)
            node = scores
            continue
        if _is_matmul(node):
            chain.append(node)
            match.nodes.extend(chain)
            _match_qk(ctx, match, node)
            return
        if kind == "tanh":
            match.reason = ("logit soft-capping (cap * tanh(scores / cap) between QK^T and softmax, as in Gemma 2): "
                            "no attention kernel here takes it (SDPA has no soft-capping); left as is")
            return
        match.reason = f"scores come from {node.name} ({kind}), not a QK^T matmul"
        return
    match.reason = "softmax input is not a graph value"


_SCORES_CACHE: dict[int, bool] = {}


def _on_scores_path(node: Any, depth: int = 0) -> bool:
    """Whether `node` leads (through ops the walk can pass) to a q @ k^T matmul."""
    if not isinstance(node, fx.Node) or depth > 24:
        return False
    if _is_matmul(node):
        return True
    kind = canonical(node)
    if kind == "tanh":  # soft-capped scores (recognized as attention, then declined with the reason)
        return bool(node.args) and _on_scores_path(node.args[0], depth + 1)
    if kind in _CASTS or kind in ("mul", "div", "add", "sub", "masked_fill"):
        return _on_scores_path(node.args[0], depth + 1) or (
            kind in ("mul", "add") and len(node.args) > 1 and _on_scores_path(node.args[1], depth + 1))
    if kind == "where" and len(node.args) == 3:
        return _on_scores_path(node.args[1], depth + 1) or _on_scores_path(node.args[2], depth + 1)
    return False


def _match_qk(ctx: PassContext, match: AttentionMatch, qk: fx.Node) -> None:
    q, kt = qk.args[0], qk.args[1]
    match.scores_shape = size_hints(qk)
    if not isinstance(q, fx.Node) or not isinstance(kt, fx.Node):
        match.reason = "QK^T matmul of a non-tensor"
        return
    nq, nk, nv = _ndim(q), _ndim(kt), _ndim(match.v)
    if nq not in (3, 4) or nq != nk or nq != nv:
        match.reason = f"q, k^T, v have {nq}, {nk}, {nv} dims; the kernel takes (B, H, L, D) or (B*H, L, D)"
        return
    match.batched_3d = nq == 3
    # Scale on q or k before the matmul.
    q = _strip_scale(ctx, match, q)
    kt = _strip_scale(ctx, match, kt)
    # k^T -> k
    kind = canonical(kt)
    k = None
    if kind == "transpose" and len(kt.args) == 3 and sorted(_norm_dims(kt.args[1:3], nk)) == [nk - 2, nk - 1]:
        k = kt.args[0]
    elif kind == "mT":
        k = kt.args[0]
    elif kind == "permute":
        dims = list(kt.args[1]) if len(kt.args) == 2 and isinstance(kt.args[1], (list, tuple)) else list(kt.args[1:])
        if _norm_dims(dims, nk) == [*range(nk - 2), nk - 1, nk - 2]:
            k = kt.args[0]
    if k is not None and len(kt.users) == 1:
        match.nodes.append(kt)
    if k is not None:
        k = _strip_scale(ctx, match, k)
    if k is None:
        k, match.k_transposed = kt, True
    match.q, match.k = q, k
    # GQA: undo repeat_kv on k and v (4-D only)
    if not match.batched_3d and not match.k_transposed:
        k_src, gk, k_nodes = _unrepeat_kv(k)
        v_src, gv, v_nodes = _unrepeat_kv(match.v)
        if gk > 1 and gk == gv:
            match.k, match.v, match.num_kv_groups = k_src, v_src, gk
            match.nodes.extend(k_nodes + v_nodes)
        elif gk > 1 or gv > 1:
            match.notes.append("k and v repeated differently; kept the repeated tensors")
    _check_heads(match)
    if match.reason is None:
        _check_dtypes(match)


def _check_heads(match: AttentionMatch) -> None:
    """K/V heads that broadcast over q's (multi-query attention written as a (B, 1, L, D) key) become
    K/V grouping; any other head mismatch is declined (the op takes H = Hkv * groups exactly)."""
    if match.batched_3d:
        return
    qs, ks, vs = size_hints(match.q), size_hints(match.k), size_hints(match.v)
    if qs is None or ks is None or vs is None or len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return
    hq, hk, hv = qs[1], ks[1], vs[1]  # k^T (B, H, D, L) keeps its heads at dim 1 too
    if hk == hv == 1 and hq > 1 and match.num_kv_groups == 1:
        match.num_kv_groups = hq
        match.notes.append(f"k and v broadcast one head over {hq}: K/V grouping {hq}")
    elif hk != hv or hq != hk * match.num_kv_groups:
        match.reason = (f"q has {hq} heads, k {hk} and v {hv} (K/V grouping {match.num_kv_groups}): heads that "
                        "broadcast other than one K/V head for all are not supported")


def _check_dtypes(match: AttentionMatch) -> None:
    dq, dk_, dv = dtype(match.q), dtype(match.k), dtype(match.v)
    if dq is None or dq != dk_ or dq != dv or not dq.is_floating_point:
        match.reason = f"q, k, v dtypes differ or are not floating point ({dq}, {dk_}, {dv})"
        return
    if dtype(match.output) != dq:
        match.reason = f"attention output dtype {dtype(match.output)} differs from q/k/v dtype {dq}"


def _match_sdpa(ctx: PassContext, node: fx.Node) -> AttentionMatch:
    """F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False) as an AttentionMatch."""
    match = AttentionMatch(softmax=node, output=node, from_sdpa=True)
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    mask, dropout_p = arg(node, 3, "attn_mask"), arg(node, 4, "dropout_p", 0.0)
    is_causal, scale, enable_gqa = arg(node, 5, "is_causal", False), arg(node, 6, "scale"), arg(node, 7, "enable_gqa", False)
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        match.reason = "SDPA on non-tensor query/key/value"
        return match
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        match.reason = f"SDPA with dropout_p={dropout_p!r}: the fused kernels cannot reproduce its random mask"
        return match
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        match.reason = "SDPA with a non-constant is_causal or enable_gqa"
        return match
    if is_causal and mask is not None:
        match.reason = "SDPA with both attn_mask and is_causal (PyTorch rejects this call)"
        return match
    nq, nk, nv = _ndim(q), _ndim(k), _ndim(v)
    if nq not in (3, 4) or nq != nk or nq != nv:
        match.reason = f"SDPA on q, k, v of {nq}, {nk}, {nv} dims; the kernel takes (B, H, L, D) or (B*H, L, D)"
        return match
    qs, ks = size_hints(q), size_hints(k)
    if qs is None or ks is None:
        match.reason = "SDPA with symbolic shapes (no size hints)"
        return match
    match.batched_3d = nq == 3
    match.q, match.k, match.v, match.is_causal = q, k, v, is_causal
    match.call_has_mask, match.call_is_causal = mask is not None, is_causal
    match.scores_shape = (*qs[:-1], ks[-2])
    if scale is None:
        match.scale = qs[-1] ** -0.5
    else:
        value = _scalar(ctx, scale)
        if value is None or value <= 0:
            match.reason = f"SDPA with scale {scale!r}: not a positive constant"
            return match
        match.scale = value
    if nq == 4 and qs[1] != ks[1]:
        if not enable_gqa or ks[1] == 0 or qs[1] % ks[1]:
            match.reason = f"SDPA with {qs[1]} query heads and {ks[1]} key heads (enable_gqa={enable_gqa})"
            return match
        match.num_kv_groups = qs[1] // ks[1]
    elif nq == 4:  # k and v repeated by hand before the call (older repeat_kv)
        k_src, gk, k_nodes = _unrepeat_kv(k)
        v_src, gv, v_nodes = _unrepeat_kv(v)
        if gk > 1 and gk == gv:
            match.k, match.v, match.num_kv_groups = k_src, v_src, gk
            match.nodes.extend(k_nodes + v_nodes)
    if isinstance(mask, fx.Node):
        bool_mask = dtype(mask) == torch.bool
        match.terms.append(MaskTerm("keep" if bool_mask else "add", mask))  # bool: True = attend
    elif mask is not None:
        match.reason = f"SDPA attn_mask {mask!r} is not a tensor"
        return match
    _check_dtypes(match)
    return match


def _norm_dims(dims, ndim: int | None) -> list[int]:
    if ndim is None:
        return []
    return [d % ndim if isinstance(d, int) else -99 for d in dims]


def _strip_scale(ctx: PassContext, match: AttentionMatch, node: fx.Node) -> fx.Node:
    """Fold `x * c` / `x / c` (c a positive constant) on q or k^T into the scale."""
    while canonical(node) in ("mul", "div") and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and _ndim(a) == _ndim(node):
            tensor_side, const = a, b
        elif canonical(node) == "mul" and isinstance(b, fx.Node) and _ndim(b) == _ndim(node):
            tensor_side, const = b, a
        else:
            return node
        value = _scalar(ctx, const)
        if value is None or value <= 0:
            return node
        match.scale *= 1.0 / value if canonical(node) == "div" else value
        if len(node.users) == 1:
            match.nodes.append(node)
        node = tensor_side
    return node


def _unrepeat_kv(node: fx.Node) -> tuple[fx.Node, int, list[fx.Node]]:
    """(un-repeated tensor, groups, nodes of the repeat) for HF's repeat_kv or repeat_interleave."""
    value = fake(node)
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return node, 1, []
    kind = canonical(node)
    # repeat_interleave(x, n, dim=1)
    if kind == "repeat_interleave":
        src, repeats, dim = arg(node, 0, "input"), arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(src, fx.Node) and isinstance(repeats, int) and dim in (1, -3) and _ndim(src) == 4:
            return src, repeats, [node]
        return node, 1, []
    # x[:, :, None, :, :].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)
    if kind in ("reshape", "view"):
        expanded = node.args[0]
        if canonical(expanded) != "expand" or _ndim(expanded) != 5:
            return node, 1, []
        unsq = expanded.args[0]
        unsq_shape = size_hints(unsq)
        exp_shape = size_hints(expanded)
        if unsq_shape is None or exp_shape is None or len(unsq_shape) != 5 or unsq_shape[2] != 1:
            return node, 1, []
        if canonical(unsq) == "getitem":
            src = unsq.args[0]
        elif canonical(unsq) == "unsqueeze" and arg(unsq, 1, "dim") in (2, -3):
            src = unsq.args[0]
        else:
            return node, 1, []
        src_shape = size_hints(src)
        if src_shape is None or len(src_shape) != 4 or (src_shape[0], src_shape[1], 1, *src_shape[2:]) != unsq_shape:
            return node, 1, []
        groups = exp_shape[2]
        if exp_shape != (src_shape[0], src_shape[1], groups, *src_shape[2:]):
            return node, 1, []
        nodes = [n for n in (node, expanded, unsq) if len(n.users) <= 1]
        return src, groups, nodes
    return node, 1, []


def find_attention(ctx: PassContext) -> list[AttentionMatch]:
    """Every softmax that is the middle of a hand-written attention, and every SDPA call, rewritable
    or not (see AttentionMatch.reason). A softmax unrelated to any matmul (a classifier head) is
    not listed."""
    matches = []
    constant_cache: dict = {}
    for node in list(ctx.gm.graph.nodes):
        if canonical(node) == "sdpa":
            match = _match_sdpa(ctx, node)
            if match.reason is None:
                _check_terms(ctx, match)
            if match.reason is None:
                _prove_causal(ctx, match, constant_cache)
            matches.append(match)
            continue
        if canonical(node) != "softmax":
            continue
        match = AttentionMatch(softmax=node, output=None)
        dim = arg(node, 1, "dim")
        source = node.args[0] if node.args else node.kwargs.get("input")
        looks_like_attention = _on_scores_path(source) or any(_is_matmul(u) for u in node.users)
        if not looks_like_attention:
            continue
        if not _last_dim(node, dim):
            match.reason = f"softmax over dim {dim}, not the key dimension"
            matches.append(match)
            continue
        _walk_down(ctx, match)
        if match.reason is None:
            _walk_up(ctx, match)
        if match.reason is None:
            _check_terms(ctx, match)
        if match.reason is None:
            _prove_causal(ctx, match, constant_cache)
            match.softmax_fp32 = dtype(match.softmax) == torch.float32 and dtype(match.q) != torch.float32
        matches.append(match)
    return matches


def _check_terms(ctx: PassContext, match: AttentionMatch) -> None:
    """Every mask/bias term must broadcast to the scores without enlarging them, in <= 4 dims."""
    scores = match.scores_shape
    if scores is None:
        return  # symbolic: the op's own checks run at run time
    if not match.from_sdpa and size_hints(match.softmax) != scores:
        match.reason = (f"the mask/bias broadcasts the scores {tuple(scores)} up to {size_hints(match.softmax)}: "
                        "not broadcastable as the kernel needs (B, H, Lq, Lk)")
        return
    for term in match.terms:
        shape_ = size_hints(term.node)
        if shape_ is None:
            continue
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
        if term.kind == "add" and dtype(term.node) == torch.bool:
            match.reason = "bool tensor added to the scores"
            return


def _prove_causal(ctx: PassContext, match: AttentionMatch, cache: dict | None = None) -> None:
    """Drop constant mask terms that are exactly the top-left causal mask (-> is_causal), and
    constant all-zero biases. Terms that depend on inputs stay."""
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


# ---------------------------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------------------------
def rewrite_attention(ctx: PassContext, match: AttentionMatch, backend: str | None = None, *,
                      native: bool = False) -> fx.Node:
    """Replace the matched subgraph by one graphopt::attention node and return it.

    `backend` is the op's backend argument ("triton", "flash", "cudnn", "efficient", "math",
    "sdpa_cpu"), or "triton_decode" for a graphopt::decode_attention node; None picks "sdpa_cpu" for CPU tensors and "efficient" otherwise. `native`: emit a
    plain F.scaled_dot_product_attention call instead (see native_sdpa_backend); the match must then
    carry no mask term and no K/V head grouping."""
    if match.reason is not None or match.output is None:
        raise ValueError(f"cannot rewrite this attention: {match.reason}")
    # The scale (from the head dim when the call gives none) and the K/V head grouping are baked
    # in at their example sizes: another head count or head dim must recompile.
    heads = () if match.batched_3d else (-3,)
    fix_symbolic_sizes(match.q, (*heads, -1))
    fix_symbolic_sizes(match.k, heads)
    fix_symbolic_sizes(match.v, (-1,))
    graph = ctx.gm.graph
    root = match.output
    if backend is None:
        dev = device(match.q) or torch.device("cpu")
        backend = "sdpa_cpu" if dev.type == "cpu" else "efficient"
    with graph.inserting_before(root):
        q, k, v = match.q, match.k, match.v
        if match.k_transposed:
            k = _with_value(graph.call_method("transpose", (k, -2, -1)), k, lambda t: t.transpose(-2, -1))
        if match.batched_3d:
            q, k, v = (_with_value(graph.call_method("unsqueeze", (t, 0)), t, lambda x: x.unsqueeze(0)) for t in (q, k, v))
        bias = _build_bias(graph, match)
        if bias is not None:  # left-pad the bias's shape with ones to 4-D (views)
            for _ in range(4 - max(_ndim(t.node) or 4 for t in match.terms)):
                bias = graph.call_method("unsqueeze", (bias, 0))
        if native:
            if bias is not None or match.num_kv_groups != 1:
                raise ValueError("a native SDPA rewrite takes no mask and no K/V head grouping")
            new = graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                      {"is_causal": bool(match.is_causal), "scale": float(match.scale)})
        elif backend == "triton_decode":
            b, _, hkv, _, lk, _, _ = match.dims()
            splits = cost_model.decode_attention_splits(ctx.hardware, b, hkv, lk)
            new = graph.call_function(torch.ops.graphopt.decode_attention.default,
                                      (q, k, v, bias, float(match.scale), splits))
        else:
            new = graph.call_function(
                torch.ops.graphopt.attention.default,
                (q, k, v, bias, float(match.scale), bool(match.is_causal), int(match.num_kv_groups), backend),
            )
        out = graph.call_method("squeeze", (new, 0)) if match.batched_3d else new
    for key in ("example_value", "val"):
        if key in root.meta:
            new.meta[key] = root.meta[key].unsqueeze(0) if match.batched_3d else root.meta[key]
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in root.meta:
            new.meta[key] = root.meta[key]
    if SYMBOLIC_MASK_NOTE in match.notes:
        new.meta["graphopt_mask_note"] = SYMBOLIC_MASK_NOTE  # for the sparse pass's decline reason
    root.replace_all_uses_with(out)
    match.replaced_by = out
    erase_unused([root, match.softmax, *match.nodes, *_ancestors(match.dropped)], graph)
    return new


def _with_value(new: fx.Node, source: fx.Node, fn) -> fx.Node:
    """Give a helper node the recorded (fake) value later passes read, e.g. sparse_attention."""
    value = fake(source)
    if isinstance(value, torch.Tensor):
        try:
            new.meta["example_value"] = fn(value)
        except Exception:  # metadata only: never fail the rewrite for it
            pass
    return new


def _ancestors(nodes: list[fx.Node], limit: int = 256) -> list[fx.Node]:
    """`nodes` and what they are computed from (to erase a dropped mask's now-dead subgraph)."""
    seen: dict[fx.Node, None] = {}
    stack = list(nodes)
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen or node.op in ("placeholder", "output"):
            continue
        seen[node] = None
        stack.extend(node.all_input_nodes)
    return list(seen)


def _build_bias(graph: fx.Graph, match: AttentionMatch) -> fx.Node | None:
    """One bias node from the remaining terms: a bool mask when that is all there is and its fill
    is -inf, else an additive float bias (bool terms become where(mask, fill, 0))."""
    terms = match.terms
    if not terms:
        return None
    if len(terms) == 1 and terms[0].kind in ("keep", "drop") and terms[0].fill == float("-inf"):
        t = terms[0]
        return t.node if t.kind == "keep" else graph.call_function(torch.logical_not, (t.node,))
    total = None
    for t in terms:
        if t.kind == "add":
            part = t.node if t.multiplier == 1.0 else graph.call_function(operator.mul, (t.node, t.multiplier))
        else:
            fill = t.fill * t.multiplier if math.isfinite(t.fill) else t.fill
            masked = t.node if t.kind == "drop" else graph.call_function(torch.logical_not, (t.node,))
            part = graph.call_function(torch.where, (masked, fill, 0.0))
        total = part if total is None else graph.call_function(operator.add, (total, part))
    return total


# ---------------------------------------------------------------------------------------------
# Decision: which implementation
# ---------------------------------------------------------------------------------------------
def _dtype_bytes(dt: torch.dtype | None) -> int:
    return torch.finfo(dt).bits // 8 if dt is not None and dt.is_floating_point else 2


def attention_key(b, h, hkv, lq, lk, d, dt, is_causal: bool, bias_kind: str) -> str:
    """Key of the measured table (`graphopt calibrate`)."""
    return cost_model.shape_key(b, h, hkv, lq, lk, d, str(dt).replace("torch.", ""), "causal" if is_causal else "full", bias_kind)


def _bias_kind(match: AttentionMatch) -> str:
    if not match.terms:
        return "none"
    if len(match.terms) == 1 and match.terms[0].kind in ("keep", "drop") and match.terms[0].fill == float("-inf"):
        return "bool"
    return "float"


def sdpa_applicable(backend: str, dt: torch.dtype, d: int, dv: int, has_bias: bool, lk: int | None = None) -> tuple[bool, str]:
    """Conservative summary of PyTorch's sdp_utils checks (torch 2.5 .. 2.13) for one backend
    (`lk`: the key length, where known)."""
    half = dt in (torch.float16, torch.bfloat16)
    if backend == "flash":
        if not half:
            return False, "SDPA flash needs fp16/bf16"
        if has_bias:
            return False, "SDPA flash takes no attention mask"
        if d != dv or d > 256 or d % 8:
            return False, f"SDPA flash needs equal q/v head dims, a multiple of 8, <= 256 (got {d}, {dv})"
        return True, ""
    if backend == "cudnn":
        if not half:
            return False, "SDPA cuDNN needs fp16/bf16"
        if d != dv or d > 128 or d % 8:
            return False, f"SDPA cuDNN needs equal q/v head dims, a multiple of 8, <= 128 (got {d}, {dv})"
        if lk == 1:  # torch 2.11, H100: "No available kernel" with cuDNN forced; the dispatcher skips it
            return False, "SDPA cuDNN takes no single-key attention"
        return True, ""
    if backend == "efficient":
        align = 8 if half else 4
        if dt not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"SDPA memory-efficient does not take {dt}"
        if d % align or dv % align:
            return False, f"SDPA memory-efficient needs head dims that are multiples of {align} (got {d}, {dv})"
        return True, ""
    if backend == "math":
        return True, ""
    return False, f"unknown SDPA backend {backend}"


def _triton_applicable(match: AttentionMatch) -> tuple[bool, str]:
    try:
        from graphopt.kernels import flash_attention
    except Exception as exc:  # the kernel module is optional at import time
        return False, f"Triton kernel unavailable ({type(exc).__name__}: {exc})"
    q, k, v = fake(match.q), fake(match.k), fake(match.v)
    if match.k_transposed:
        k = k.transpose(-2, -1)
    if match.batched_3d:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q.dtype == torch.float32 and not _tf32_allowed():
        return False, ("fp32 inputs: the Triton kernel computes in TF32 (~1e-3 relative error), which this "
                       "lossless pass uses only when torch.backends.cuda.matmul.allow_tf32 is on")
    bias = None
    if match.terms and match.scores_shape:
        bias_dtype = torch.bool if _bias_kind(match) == "bool" else q.dtype
        bias = torch.empty((), dtype=bias_dtype, device=q.device).expand(match.scores_shape)  # no memory
    try:
        ok, why = flash_attention.supports(q, k, v, bias)
    except Exception as exc:
        return False, f"Triton kernel supports() failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(why)


def _decode_applicable(match: AttentionMatch) -> tuple[bool, str]:
    """Whether the split-key decode kernel takes this call (few query rows, no causal flag)."""
    try:
        from graphopt.kernels import decode_attention
    except Exception as exc:  # the kernel module is optional at import time
        return False, f"Triton decode kernel unavailable ({type(exc).__name__}: {exc})"
    if match.is_causal:
        return False, "the decode kernel takes a mask, not a causal flag"
    q, k, v = fake(match.q), fake(match.k), fake(match.v)
    if match.k_transposed:
        k = k.transpose(-2, -1)
    if match.batched_3d:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    bias = None
    if match.terms and match.scores_shape:
        bias_dtype = torch.bool if _bias_kind(match) == "bool" else q.dtype
        bias = torch.empty((), dtype=bias_dtype, device=q.device).expand(match.scores_shape)  # no memory
    try:
        ok, why = decode_attention.supports(q, k, v, bias)
    except Exception as exc:
        return False, f"Triton decode kernel supports() failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(why)


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _device_name(hw) -> str:
    try:
        if hw.is_gpu and torch.cuda.is_available():
            from graphopt.hardware import spec_for_device_name

            name = torch.cuda.get_device_name()
            if spec_for_device_name(name) is not None and spec_for_device_name(name).name == hw.name:
                return name
    except Exception:
        pass
    return hw.name


def choose_implementation(ctx: PassContext, match: AttentionMatch) -> tuple[Estimate | None, dict[str, Estimate], dict[str, str], str | None]:
    """(before, {candidate: estimate}, {candidate: why not applicable}, measured-table note)."""
    hw = ctx.hardware
    dims = match.dims()
    dt = dtype(match.q)
    if dims is None:
        return None, {}, {}, None
    b, h, hkv, lq, lk, d, dv = dims
    nbytes = _dtype_bytes(dt)
    has_mask = bool(match.terms)
    default = dispatched_sdpa_backend(ctx, match)
    if default is not None:  # the SDPA call as written, as PyTorch would run it (an explicit causal
        # mask is read, and its upper triangle computed). "sdpa_cpu": priced like the CPU candidate below.
        kv = hkv if default in ("flash", "math", "sdpa_cpu") else h
        backend = {} if default == "sdpa_cpu" else {"backend": default}
        now = cost_model.sdpa(hw, b, h, lq, lk, d, **backend, causal=match.call_is_causal, dtype_bytes=nbytes,
                              has_mask=match.call_has_mask, kv_heads=kv)
        before = Estimate(f"SDPA as dispatched ({default})", now.ms, now.flops, now.bytes, now.launches, now.bound)
    else:
        before = cost_model.naive_attention(
            hw, b, h, lq, lk, d, dtype_bytes=nbytes, has_mask=has_mask, softmax_fp32=match.softmax_fp32,
            fused_pointwise=ctx.config.downstream == "inductor", kv_heads=h,
        )
    candidates: dict[str, Estimate] = {}
    rejected: dict[str, str] = {}
    if not hw.is_gpu:
        candidates["sdpa_cpu"] = cost_model.sdpa(hw, b, h, lq, lk, d, causal=match.is_causal, dtype_bytes=nbytes,
                                                 has_mask=has_mask, kv_heads=hkv)
        return before, candidates, rejected, None
    ok, why = _triton_applicable(match)
    if ok:
        candidates["triton"] = cost_model.fused_attention(hw, b, h, lq, lk, d, family="triton_flash", causal=match.is_causal,
                                                          dtype_bytes=nbytes, has_mask=has_mask, kv_heads=hkv, name="Triton flash")
    else:
        rejected["triton"] = why
    ok, why = _decode_applicable(match)
    if ok:
        candidates["triton_decode"] = cost_model.decode_attention(hw, b, h, lq, lk, d, kv_heads=hkv, dtype_bytes=nbytes,
                                                                  has_mask=has_mask)
    else:
        rejected["triton_decode"] = why
    for backend in (*_SDPA_CANDIDATES, "math"):  # math: only when forced (never the fastest)
        ok, why = sdpa_applicable(backend, dt, d, dv, has_mask, lk)
        if not ok:
            rejected[backend] = why
            continue
        kv = hkv if backend in ("flash", "math") else h  # others get K/V repeated for GQA
        candidates[backend] = cost_model.sdpa(hw, b, h, lq, lk, d, backend=backend, causal=match.is_causal,
                                              dtype_bytes=nbytes, has_mask=has_mask, kv_heads=kv)
    note = None
    measured = cost_model.lookup_measured("attention", _device_name(hw), attention_key(b, h, hkv, lq, lk, d, dt, match.is_causal, _bias_kind(match)))
    if measured and any(name in measured for name in candidates):
        # Measured and modelled times are not comparable: choose among the measured ones only.
        note = "measured table"
        for name in list(candidates):
            e = candidates.pop(name)
            if name in measured:
                candidates[name] = Estimate(f"{e.name} (measured)", measured[name], e.flops, e.bytes, e.launches, "measured")
        measured_before = default if default is not None else "naive"
        if measured_before in measured:
            before = Estimate(f"{before.name} (measured)", measured[measured_before], before.flops, before.bytes,
                              before.launches, "measured")
    if ctx.config.prices_host_path:
        native = native_sdpa_backend(ctx, match)
        for name, e in candidates.items():
            # graphopt::decode_attention is a triton_op: Inductor launches its kernels itself
            if name != native and not (name == "triton_decode" and ctx.config.downstream == "inductor"):
                candidates[name] = cost_model.host_paced(hw, e, cost_model.attention_op_host_launches(name),
                                                         "graphopt::attention host path")
    return before, candidates, rejected, note


def dispatched_sdpa_backend(ctx: PassContext, match: AttentionMatch) -> str | None:
    """For an SDPA call with static shapes: the backend it runs as it stands; else None."""
    dims = match.dims()
    if not match.from_sdpa or dims is None:
        return None
    return default_sdpa_backend(ctx.hardware, dtype(match.q), dims[5], dims[6], match.call_has_mask, dims[4],
                                lq=dims[3], is_causal=match.call_is_causal)


# PyTorch's SDPA dispatch order on CUDA when torch cannot tell us (torch 2.5-2.13 default).
_DEFAULT_SDPA_ORDER = ("flash", "efficient", "math", "cudnn")
_SDPA_BACKEND_IDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def _sdpa_flags() -> tuple[bool, ...]:
    """PyTorch's SDPA backend switches (torch.backends.cuda.*_sdp_enabled): part of a dispatcher
    choice's cache key, since turning a backend off changes the pick."""
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
            cuda.math_sdp_enabled())


def _dispatcher_choice(hw_name: str, dt: torch.dtype, d: int, dv: int, has_mask: bool, lq: int | None,
                       lk: int | None, is_causal: bool) -> str | None:
    """_cached_dispatcher_choice under the backend switches in force now."""
    return _cached_dispatcher_choice(hw_name, dt, d, dv, has_mask, lq, lk, is_causal, _sdpa_flags())


@functools.lru_cache(maxsize=256)
def _cached_dispatcher_choice(hw_name: str, dt: torch.dtype, d: int, dv: int, has_mask: bool, lq: int | None,
                              lk: int | None, is_causal: bool, flags: tuple[bool, ...]) -> str | None:
    """PyTorch's own pick for such a call (torch._fused_sdp_choice, on small CUDA tensors of the
    call's dtype and head dims) when the target is the GPU present; None elsewhere. It applies
    rules the priority order does not show: torch 2.11 on an H100 lists flash first
    (torch._C._get_sdp_priority_order() == [1, 2, 0, 3, 4]) and runs cuDNN, for causal and
    non-causal prefill and for one-token decode alike."""
    if not torch.cuda.is_available() or dt not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    try:
        from graphopt.hardware import device_spec

        if device_spec(torch.cuda.current_device()).name != hw_name:
            return None
        rows = 1 if lq == 1 else 64  # one-token decode has its own rules (cuDNN takes no single key)
        keys = 1 if lk == 1 else 64
        q = torch.zeros(1, 1, rows, d, device="cuda", dtype=dt)
        k = torch.zeros(1, 1, keys, d, device="cuda", dtype=dt)
        v = torch.zeros(1, 1, keys, dv, device="cuda", dtype=dt)
        mask = torch.ones(1, 1, rows, keys, device="cuda", dtype=torch.bool) if has_mask else None
        choice = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal and not has_mask))
    except Exception:  # an older torch, or no usable device: the priority order below decides
        return None
    return _SDPA_BACKEND_IDS.get(choice)


def default_sdpa_backend(hw, dt: torch.dtype | None, d: int, dv: int, has_mask: bool, lk: int | None = None, *,
                         lq: int | None = None, is_causal: bool = False) -> str:
    """The backend PyTorch's SDPA dispatcher would run for such a call: "sdpa_cpu" on a CPU target;
    on the GPU present, the dispatcher's own pick (_dispatcher_choice); else the first enabled
    backend of its priority order that sdpa_applicable admits."""
    if not hw.is_gpu:
        return "sdpa_cpu"
    if dt is not None:
        choice = _dispatcher_choice(hw.name, dt, d, dv, has_mask, lq, lk, is_causal)
        if choice is not None:
            return choice
    try:
        order = tuple(_SDPA_BACKEND_IDS[i] for i in torch._C._get_sdp_priority_order() if i in _SDPA_BACKEND_IDS)
    except Exception:  # older or trimmed builds
        order = _DEFAULT_SDPA_ORDER
    enabled = dict(zip(("flash", "efficient", "cudnn", "math"), _sdpa_flags()))
    for backend in order:
        if enabled.get(backend) and dt is not None and sdpa_applicable(backend, dt, d, dv, has_mask, lk)[0]:
            return backend
    return "math"


def native_sdpa_backend(ctx: PassContext, match: AttentionMatch) -> str | None:
    """The backend PyTorch dispatches a plain F.scaled_dot_product_attention call of the rewritten
    form (no mask, no K/V head grouping) to, when that call can be emitted; else None. A candidate
    equal to it is emitted as that call: Inductor launches it from its own wrapper, without
    graphopt::attention's Python path (cost_model.ATTENTION_OP_HOST_LAUNCHES). Not for a forced
    backend or `force` (the tuner records graphopt::attention nodes), nor on CPU."""
    if not ctx.hardware.is_gpu or ctx.config.force:
        return None
    dims = match.dims()
    if ctx.config.attention_backend != "auto" or match.terms or match.num_kv_groups != 1 or dims is None:
        return None
    backend = default_sdpa_backend(ctx.hardware, dtype(match.q), dims[5], dims[6], False, dims[4], lq=dims[3],
                                   is_causal=match.is_causal)
    return backend if backend in ("flash", "cudnn", "efficient") else None


class AttentionPass(GraphPass):
    name = "attention"
    lossless = True

    def run(self, ctx: PassContext) -> None:
        replaced: dict[fx.Node, fx.Node] = {}  # rewritten attention outputs -> their replacements
        for match in find_attention(ctx):
            node = match.output if match.output is not None else match.softmax
            if match.reason is not None:
                ctx.record(self.name, False, match.reason, node=node)
                continue
            if not match.follow(replaced):
                ctx.record(self.name, False, "overlaps an attention rewritten before it", node=node)
                continue
            before, candidates, rejected, note = choose_implementation(ctx, match)
            forced = ctx.config.attention_backend
            on_cpu = not ctx.hardware.is_gpu
            if forced != "auto" and not on_cpu:
                if forced not in candidates:
                    ctx.record(self.name, False, f"attention_backend={forced!r} is not applicable here: "
                               f"{rejected.get(forced, 'not a candidate')}", node=node, before=before)
                    continue
                choice = forced
            elif any(name != "math" for name in candidates):
                # a tie goes to PyTorch's own SDPA kernels (on pre-Hopper GPUs the cost model
                # prices our Triton kernel at SDPA flash's efficiency: cost_model.family_efficiency)
                choice = min((n for n in candidates if n != "math"), key=lambda name: (candidates[name].ms, name == "triton"))
            else:
                choice = "sdpa_cpu" if on_cpu else "efficient"
            after = candidates.get(choice)
            host_note = (f"; {choice} through graphopt::attention is priced at its host launch path, longer than its "
                         "GPU work (graph_replay=True prices GPU time only)"
                         if after is not None and after.bound == "host" else "")
            default = dispatched_sdpa_backend(ctx, match)
            # The same backend on the same call (no mask proven causal) would change nothing.
            unchanged = (default == choice and match.call_has_mask == bool(match.terms)
                         and match.call_is_causal == match.is_causal)
            if default is not None and unchanged and not ctx.config.force:
                ctx.record(self.name, False, f"SDPA call left as it is: the backend PyTorch dispatches it to ({default}) "
                           "is already the fastest candidate", node=node, before=before, after=after)
                continue
            if forced != "auto" and not on_cpu and before is not None and after is not None:
                ok, why = True, f"predicted {before.ms:.4f} -> {after.ms:.4f} ms"  # the user's pick, not the model's
            elif before is not None and after is not None:
                ok, why = self.accept(ctx, before, after)
            else:
                ok, why = True, "symbolic shapes: fused attention assumed faster (it reads Q, K, V once)"
            if not ok:
                ctx.record(self.name, False, why + host_note, node=node, before=before, after=after)
                continue
            why += host_note
            if forced != "auto" and not on_cpu:
                why = f"attention_backend={forced!r} forced; {why}"
            if note:
                why = f"{why}; {note}"
            native = native_sdpa_backend(ctx, match) == choice
            details = dict(source="sdpa" if match.from_sdpa else "hand-written",
                           emitted=("F.scaled_dot_product_attention" if native else
                                    "graphopt::decode_attention" if choice == "triton_decode" else "graphopt::attention"),
                           is_causal=match.is_causal, num_kv_groups=match.num_kv_groups, scale=match.scale,
                           bias=_bias_kind(match), candidates={k: round(v.ms, 6) for k, v in candidates.items()},
                           rejected=rejected, notes=list(match.notes))
            decision = ctx.record(self.name, True, why, node=node, before=before, after=after,
                                  implementation=choice, **details)
            try:
                rewrite_attention(ctx, match, backend=choice, native=native)
            except Exception:
                ctx.decisions.remove(decision)
                raise
            replaced[match.output] = match.replaced_by


PASS = AttentionPass()


# ---------------------------------------------------------------------------------------------
# Measured table (wired into `graphopt calibrate` by the CLI)
# ---------------------------------------------------------------------------------------------
DEFAULT_CALIBRATION_SHAPES: tuple[tuple[int, int, int, int, int, bool, str], ...] = (
    # (B, H, Hkv, L, D, causal, dtype)
    (1, 32, 32, 1024, 128, True, "bfloat16"),
    (1, 32, 32, 4096, 128, True, "bfloat16"),
    (1, 32, 8, 4096, 128, True, "bfloat16"),
    (2, 32, 32, 4096, 128, False, "bfloat16"),
    (1, 32, 32, 8192, 128, True, "bfloat16"),
    (4, 12, 12, 512, 64, False, "bfloat16"),
)


def _time_ms(fn) -> float:
    try:
        from graphopt.timing import median_ms

        return float(median_ms(fn))
    except ImportError:
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))


def calibrate_attention_table(shapes=None) -> dict:
    """Time every candidate (naive, triton, SDPA cudnn/flash/efficient) on the present GPU for
    `shapes` ((B, H, Hkv, L, D, causal, dtype) tuples; default DEFAULT_CALIBRATION_SHAPES, no bias)
    and store them with cost_model.record_measured; returns {key: {implementation: ms}}."""
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate_attention_table needs a CUDA device")
    device_name = torch.cuda.get_device_name()
    results: dict[str, dict[str, float]] = {}
    for b, h, hkv, length, d, causal, dtype_name in shapes or DEFAULT_CALIBRATION_SHAPES:
        dt = getattr(torch, dtype_name) if isinstance(dtype_name, str) else dtype_name
        q = torch.randn(b, h, length, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, length, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, length, d, device="cuda", dtype=dt)
        groups = h // hkv
        scale = d ** -0.5
        timings: dict[str, float] = {}

        def naive():
            kk = k.repeat_interleave(groups, 1) if groups > 1 else k
            vv = v.repeat_interleave(groups, 1) if groups > 1 else v
            s = (q @ kk.transpose(-2, -1)) * scale
            if causal:
                s = s.masked_fill(~torch.ones(length, length, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            return s.float().softmax(-1).to(dt) @ vv

        candidates = {"naive": naive}
        for backend in ("triton", *_SDPA_CANDIDATES):
            if backend != "triton" and not sdpa_applicable(backend, dt, d, d, False)[0]:
                continue
            candidates[backend] = (lambda be=backend: torch.ops.graphopt.attention(q, k, v, None, scale, causal, groups, be))
        for name, fn in candidates.items():
            try:
                fn()
                torch.cuda.synchronize()
                timings[name] = _time_ms(fn)
            except Exception as exc:  # one failing candidate must not stop the table
                log.warning("calibrate attention %s at %s failed: %s", name, (b, h, hkv, length, d, causal), exc)
        key = attention_key(b, h, hkv, length, length, d, dt, causal, "none")
        cost_model.record_measured("attention", device_name, key, timings)
        results[key] = timings
    return results


# ---------------------------------------------------------------------------------------------
# ONNX: the standard opset-23 Attention operator
# ---------------------------------------------------------------------------------------------
# One known difference: a query row whose every key is masked by a large negative additive bias
# (HF's finfo.min padding mask on a left-padded row) gets the mean of V from PyTorch (a softmax of
# equal scores) and zeros from onnxruntime's Attention (1.32). Such rows are padding, which
# models ignore; every row with at least one visible key matches.
def _register_onnx() -> None:
    try:
        from onnxscript import opset23 as op
    except Exception:  # onnxscript missing or too old: export of this op reports it
        return

    @register_onnx_translation(torch.ops.graphopt.attention.default, form="standard")
    def attention_to_onnx(q, k, v, bias=None, scale: float = 1.0, is_causal: bool = False, num_kv_groups: int = 1, backend: str = ""):
        # 4-D inputs (B, H, L, D): ONNX reads the head counts from the shapes (q_num_heads /
        # kv_num_heads are only for 3-D inputs); GQA follows from K having fewer heads.
        # Attention has four outputs (Y, present_key, present_value, qk_matmul_output); Y is ours.
        if bias is None:
            y, _, _, _ = op.Attention(q, k, v, is_causal=int(is_causal), scale=float(scale))
        else:
            y, _, _, _ = op.Attention(q, k, v, bias, is_causal=int(is_causal), scale=float(scale))
        return y


import graphopt.ops  # noqa: E402,F401  (registers graphopt::attention before the translation refers to it)

_register_onnx()

__all__ = ["AttentionMatch", "MaskTerm", "find_attention", "rewrite_attention", "AttentionPass", "PASS",
           "calibrate_attention_table", "choose_implementation", "default_sdpa_backend", "dispatched_sdpa_backend",
           "evaluate_constant", "sdpa_applicable"]
