"""The matcher: every softmax in the middle of a hand-written attention, and every
F.scaled_dot_product_attention call, as an `AttentionMatch` (rewritable, or the reason why not).
The walks go up the scores to the QK^T matmul and down the probabilities to the PV matmul;
masks.py checks and classifies the mask terms found on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.attention.masks import (
    MASKED_FILL_THRESHOLD,
    SCALED_FILL_THRESHOLD,
    MaskTerm,
    _check_terms,
    _masks,
    _prove_causal,
    _scalar,
)
from graphopt.passes.base import PassContext, module_path
from graphopt.passes.fx_utils import arg, canonical, dtype, fake, size_hints

_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as", "contiguous"}


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
