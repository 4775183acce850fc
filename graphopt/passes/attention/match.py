"""The matcher: every softmax in the middle of a hand-written attention, and every
F.scaled_dot_product_attention call, as an `AttentionMatch` (rewritable, or the reason why not).
walk.py walks up the scores to the QK^T matmul and down the probabilities to the PV matmul;
operands.py reads q, k, v; masks.py checks and classifies the mask terms found on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.attention.masks import MaskTerm, _check_terms, _prove_causal, _scalar
from graphopt.passes.attention.operands import check_batches, check_dtypes, ndim, unrepeat_kv
from graphopt.passes.attention.walk import on_scores_path, reaches_pv, walk_down, walk_up
from graphopt.passes.base import PassContext, module_path
from graphopt.passes.fx_utils import arg, canonical, dtype, fake, size_hints, writes_in_place


@dataclass
class AttentionMatch:
    """One softmax-anchored attention: out = softmax(scale * q @ k^T + bias) @ v.

    `reason` is None when the match can be rewritten, else why not (the pass records it).
    q, k, v are the tensors the fused op reads: (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv),
    except that `k_transposed` says the graph only holds k^T (the rewrite transposes it back) and
    `batched_3d` says the graph works on (B*H, L, D) tensors: the rewrite adds a leading dim, or
    splits the first into (B, `heads`) where the scores were viewed as (B, H, Lq, Lk) on the way.
    `dropout_p` > 0: dropout active on the probabilities (rewritten only with attention_dropout).
    `softcap` > 0: the scores are softcap * tanh(scale * q.k / softcap) before the mask terms.
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
    heads: int = 0  # H of a (B*H, ...) <-> (B, H, ...) view of the scores or probabilities
    heads_node: fx.Node | None = None  # the 4-D side of that view (its H is guarded by the rewrite)
    dropout_p: float = 0.0
    softcap: float = 0.0  # > 0: the scores are soft-capped, softcap * tanh(scale * q.k / softcap)
    alibi: fx.Node | None = None  # per-head ALiBi slopes (H,) for the Triton kernel, from a constant bias term
    size_guards: list = field(default_factory=list)  # symbolic sizes a baked scale was computed from

    def bias_dtype(self) -> torch.dtype | None:
        """The dtype eager adds the additive mask terms to the scores in: q's, or a wider float dtype a
        term brings by type promotion (a float32 bias on bfloat16 scores is added, and the softmax
        taken, in float32); an integer term counts as the softmax's input dtype. None without
        additive terms (a fill from masked_fill / where takes the scores' dtype)."""
        q_dtype = dtype(self.q)
        if q_dtype is None or not any(t.kind == "add" for t in self.terms):
            return None
        result = q_dtype
        for term in self.terms:
            term_dtype = dtype(term.node) if term.kind == "add" else None
            if term_dtype is not None:
                if not term_dtype.is_floating_point:
                    term_dtype = torch.float32 if self.softmax_fp32 else q_dtype
                result = torch.promote_types(result, term_dtype)
        return result

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
            b = qs[0] // self.heads if self.heads else 1
            h = self.heads or qs[0]
            qs, ks, vs = (b, h, *qs[1:]), (b, h, *ks[1:]), (b, h, *vs[1:])
        b, hq, lq, d = qs
        hkv, lk, dv = ks[1], ks[2], vs[3]
        return b, hq, hkv, lq, lk, d, dv

    @property
    def has_bias(self) -> bool:
        return bool(self.terms)


def _last_dim(node: fx.Node, dim: Any) -> bool:
    value = fake(node)
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int):
        return False
    return dim == -1 or dim == value.dim() - 1


def match_sdpa(ctx: PassContext, node: fx.Node) -> AttentionMatch:
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
    nq, nk, nv = ndim(q), ndim(k), ndim(v)
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
    vs = size_hints(v)
    if vs is None or vs[0] != ks[0] or (nq == 4 and vs[1] != ks[1]):
        match.reason = f"SDPA with key {tuple(ks)} and value {vs and tuple(vs)}: their batch and heads must match"
        return match
    if nq == 4 and not check_batches(match, qs, ks, vs):
        return match
    if nq == 4 and qs[1] != ks[1]:
        # one K/V head broadcast over every query head (multi-query attention written without
        # enable_gqa, as Falcon does) is K/V grouping too
        broadcast = ks[1] == 1 and vs is not None and vs[1] == 1
        if not (enable_gqa or broadcast) or ks[1] == 0 or qs[1] % ks[1]:
            match.reason = f"SDPA with {qs[1]} query heads and {ks[1]} key heads (enable_gqa={enable_gqa})"
            return match
        match.num_kv_groups = qs[1] // ks[1]
    elif nq == 4:  # k and v repeated by hand before the call (older repeat_kv)
        k_src, gk, k_nodes = unrepeat_kv(k)
        v_src, gv, v_nodes = unrepeat_kv(v)
        if gk > 1 and gk == gv:
            match.k, match.v, match.num_kv_groups = k_src, v_src, gk
            match.nodes.extend(k_nodes + v_nodes)
    if isinstance(mask, fx.Node):
        bool_mask = dtype(mask) == torch.bool
        match.terms.append(MaskTerm("keep" if bool_mask else "add", mask))  # bool: True = attend
    elif mask is not None:
        match.reason = f"SDPA attn_mask {mask!r} is not a tensor"
        return match
    check_dtypes(match)
    return match


def _check_no_write_inside(match: AttentionMatch) -> None:
    """The fused op runs where the PV matmul was and reads q, k, v and the mask terms there: a tensor
    written in place between the scores (the first matched node that reads q or k) and that matmul
    would be read after the write, where the model read it before. Writes into tensors made inside
    that span (the scores themselves: `scores += mask`) are the attention's own."""
    matched = {node for node in (*match.nodes, match.softmax) if isinstance(node, fx.Node)}
    order = {node: i for i, node in enumerate(match.output.graph.nodes)}
    reads_qk = [node for node in matched if match.q in node.all_input_nodes or match.k in node.all_input_nodes]
    start = min(reads_qk or [match.softmax], key=order.__getitem__)
    node = start
    while (node := node.next) is not match.output and node.op != "root":
        if node in matched or not (node.op == "call_module" or writes_in_place(node)):
            continue
        if isinstance(node.kwargs.get("out"), fx.Node):
            written = [node.kwargs["out"]]
        elif node.op == "call_module" or isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                                                 torch._ops.HigherOrderOperator)):
            written = node.all_input_nodes  # which of them it writes is the op's schema's business
        else:  # x.add_(...), x += ..., relu(x, inplace=True): the first operand
            written = node.args[:1] if node.args and isinstance(node.args[0], fx.Node) else node.all_input_nodes
        if all(order[w] >= order[start] for w in written):
            continue
        match.reason = (f"{node.name} writes a tensor in place inside the attention (between its scores and its "
                        "output): the fused op would read it after the write")
        return


def find_attention(ctx: PassContext, *, allow_dropout: bool = False) -> list[AttentionMatch]:
    """Every softmax that is the middle of a hand-written attention, and every SDPA call, rewritable
    or not (see AttentionMatch.reason). A softmax unrelated to any matmul (a classifier head) is
    not listed. allow_dropout: match attention with active dropout (match.dropout_p), else decline it."""
    matches = []
    constant_cache: dict = {}
    for node in list(ctx.gm.graph.nodes):
        if canonical(node) == "sdpa":
            match = match_sdpa(ctx, node)
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
        looks_like_attention = on_scores_path(source) or reaches_pv(node, ctx)
        if not looks_like_attention:
            continue
        if not _last_dim(node, dim):
            match.reason = f"softmax over dim {dim}, not the key dimension"
            matches.append(match)
            continue
        walk_down(ctx, match, allow_dropout)
        if match.reason is None:
            walk_up(ctx, match)
        if match.reason is None:
            _check_no_write_inside(match)
        if match.reason is None:
            _check_terms(ctx, match)
        if match.reason is None:
            _prove_causal(ctx, match, constant_cache)
            match.softmax_fp32 = dtype(match.softmax) == torch.float32 and dtype(match.q) != torch.float32
        matches.append(match)
    return matches
