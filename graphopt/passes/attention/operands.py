"""The operands of a matched attention: q and k from the QK^T matmul (a scale on either folded into
the match's scale, k^T transposed back), v from the PV matmul, GQA's repeat_kv undone, and the
head and dtype checks the fused op needs. Functions here take any match object with the fields of
match.AttentionMatch."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.attention.masks import _scalar
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import arg, canonical, dtype, fake, size_hints


def ndim(node: Any) -> int | None:
    value = fake(node)
    return value.dim() if isinstance(value, torch.Tensor) else None


def match_qk(ctx: PassContext, match: Any, qk: fx.Node, q: Any, kt: Any) -> None:
    """Fill match.q / match.k (and the K/V grouping) from the QK^T product `qk` = q @ kt."""
    match.scores_shape = size_hints(qk)
    if not isinstance(q, fx.Node) or not isinstance(kt, fx.Node):
        match.reason = "QK^T matmul of a non-tensor"
        return
    nq, nk, nv = ndim(q), ndim(kt), ndim(match.v)
    if nq not in (3, 4) or nq != nk or nq != nv:
        match.reason = f"q, k^T, v have {nq}, {nk}, {nv} dims; the kernel takes (B, H, L, D) or (B*H, L, D)"
        return
    match.batched_3d = nq == 3
    if not _canonical_scores(match, nq):
        return
    # Scale on q or k before the matmul.
    q = strip_scale(ctx, match, q)
    kt = strip_scale(ctx, match, kt)
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
        k = strip_scale(ctx, match, k)
    if k is None:
        k, match.k_transposed = kt, True
    match.q, match.k = q, k
    # GQA: undo repeat_kv on k and v (4-D only)
    if not match.batched_3d and not match.k_transposed:
        k_src, gk, k_nodes = unrepeat_kv(k)
        v_src, gv, v_nodes = unrepeat_kv(match.v)
        if gk > 1 and gk == gv:
            match.k, match.v, match.num_kv_groups = k_src, v_src, gk
            match.nodes.extend(k_nodes + v_nodes)
        elif gk > 1 or gv > 1:
            match.notes.append("k and v repeated differently; kept the repeated tensors")
    check_heads(match)
    if match.reason is None:
        check_dtypes(match)


def _canonical_scores(match: Any, nq: int) -> bool:
    """Settle the (B, H, Lq, Lk) scores shape the mask terms are checked against. Where the scores
    were viewed between (B*H, Lq, Lk) and (B, H, Lq, Lk) on the way (match.heads), the fused op
    works on the 4-D form; terms found on the 3-D side are marked merged_heads."""
    if not match.heads:
        return True
    scores = match.scores_shape
    if scores is None:
        return True
    if nq == 3:
        n, lq, lk = scores
        if n % match.heads:
            match.reason = f"scores of {n} rows viewed as {match.heads} heads"
            return False
        match.scores_shape = (n // match.heads, match.heads, lq, lk)
    elif scores[1] != match.heads:
        match.reason = f"scores with {scores[1]} heads viewed as {match.heads} heads"
        return False
    for term in match.terms:
        term.merged_heads = term.space == 3
    return True


def check_heads(match: Any) -> None:
    """K/V heads that broadcast over q's (multi-query attention written as a (B, 1, L, D) key) become
    K/V grouping; any other head mismatch is declined (the op takes H = Hkv * groups exactly)."""
    if match.batched_3d:
        return
    qs, ks, vs = size_hints(match.q), size_hints(match.k), size_hints(match.v)
    if qs is None or ks is None or vs is None or len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return
    if not check_batches(match, qs, ks, vs):
        return
    hq, hk, hv = qs[1], ks[1], vs[1]  # k^T (B, H, D, L) keeps its heads at dim 1 too
    if hk == hv == 1 and hq > 1 and match.num_kv_groups == 1:
        match.num_kv_groups = hq
        match.notes.append(f"k and v broadcast one head over {hq}: K/V grouping {hq}")
    elif hk != hv or hq != hk * match.num_kv_groups:
        match.reason = (f"q has {hq} heads, k {hk} and v {hv} (K/V grouping {match.num_kv_groups}): heads that "
                        "broadcast other than one K/V head for all are not supported")


def check_batches(match: Any, qs, ks, vs) -> bool:
    """q, k and v of one batch size (the op takes no batch broadcast); False, with the reason, if not."""
    if qs[0] == ks[0] == vs[0]:
        return True
    match.reason = (f"q, k and v have batch sizes {qs[0]}, {ks[0]} and {vs[0]}: the op takes one batch (no "
                    "broadcast over it)")
    return False


def check_dtypes(match: Any) -> None:
    dq, dk_, dv = dtype(match.q), dtype(match.k), dtype(match.v)
    if dq is None or dq != dk_ or dq != dv or not dq.is_floating_point:
        match.reason = f"q, k, v dtypes differ or are not floating point ({dq}, {dk_}, {dv})"
        return
    if dtype(match.output) != dq:
        match.reason = f"attention output dtype {dtype(match.output)} differs from q/k/v dtype {dq}"


def _norm_dims(dims, n: int | None) -> list[int]:
    if n is None:
        return []
    return [d % n if isinstance(d, int) else -99 for d in dims]


def strip_scale(ctx: PassContext, match: Any, node: fx.Node) -> fx.Node:
    """Fold `x * c` / `x / c` (c a positive constant) on q or k^T into the scale."""
    while canonical(node) in ("mul", "div") and len(node.args) == 2 and node.kwargs.get("rounding_mode") is None:
        a, b = node.args
        if isinstance(a, fx.Node) and ndim(a) == ndim(node):
            tensor_side, const = a, b
        elif canonical(node) == "mul" and isinstance(b, fx.Node) and ndim(b) == ndim(node):
            tensor_side, const = b, a
        else:
            return node
        value = _scalar(ctx, const, match.size_guards)
        if value is None or value <= 0:
            return node
        match.scale *= 1.0 / value if canonical(node) == "div" else value
        if len(node.users) == 1:
            match.nodes.append(node)
        node = tensor_side
    return node


def unrepeat_kv(node: fx.Node) -> tuple[fx.Node, int, list[fx.Node]]:
    """(un-repeated tensor, groups, nodes of the repeat) for HF's repeat_kv or repeat_interleave."""
    value = fake(node)
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return node, 1, []
    kind = canonical(node)
    # repeat_interleave(x, n, dim=1)
    if kind == "repeat_interleave":
        src, repeats, dim = arg(node, 0, "input"), arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(src, fx.Node) and isinstance(repeats, int) and dim in (1, -3) and ndim(src) == 4:
            return src, repeats, [node]
        return node, 1, []
    # x[:, :, None, :, :].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)
    if kind in ("reshape", "view"):
        expanded = node.args[0]
        if canonical(expanded) != "expand" or ndim(expanded) != 5:
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
