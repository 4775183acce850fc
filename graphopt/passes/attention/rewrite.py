"""The rewrite: a matched attention becomes one graphopt::attention node (or
graphopt::decode_attention, the SDPA backend's call through ops.attention_in_graph, or a plain SDPA
call), its mask terms one bias."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt import cost_model
from graphopt.passes.attention.masks import SYMBOLIC_MASK_NOTE, guard_sizes
from graphopt.passes.attention.match import AttentionMatch
from graphopt.passes.attention.operands import ndim
from graphopt.ops import ATTENTION_GRAPH_BACKENDS, attention_in_graph, attention_with_dropout
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import device, dtype, erase_unused, fake, fix_symbolic_sizes

# ---------------------------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------------------------
def rewrite_attention(ctx: PassContext, match: AttentionMatch, backend: str | None = None, *,
                      native: bool = False) -> fx.Node:
    """Replace the matched subgraph by one graphopt::attention node and return it.

    `backend` is the op's backend argument ("triton", "flash", "cudnn", "efficient", "math",
    "sdpa_cpu"), or "triton_decode" for a graphopt::decode_attention node; None picks "sdpa_cpu" for CPU tensors and "efficient" otherwise. `native`: emit a
    plain F.scaled_dot_product_attention call instead (see native_sdpa_backend); the match must then
    carry no mask term and no K/V head grouping. A match with dropout (match.dropout_p) becomes
    ops.attention_with_dropout, SDPA with dropout_p, whatever `backend` says."""
    if match.reason is not None or match.output is None:
        raise ValueError(f"cannot rewrite this attention: {match.reason}")
    # The scale (from the head dim when the call gives none) and the K/V head grouping are baked
    # in at their example sizes: another head count or head dim must recompile.
    heads = () if match.batched_3d else (-3,)
    fix_symbolic_sizes(match.q, (*heads, -1))
    fix_symbolic_sizes(match.k, heads)
    fix_symbolic_sizes(match.v, (-1,))
    if match.heads_node is not None:
        fix_symbolic_sizes(match.heads_node, (1,))
    guard_sizes(match.size_guards)
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
            q, k, v = (_to_4d(graph, t, match.heads) for t in (q, k, v))
        bias = _build_bias(graph, match)
        if bias is not None:  # left-pad the bias's shape with ones to 4-D (views)
            for _ in range(4 - max(_term_ndim(t) for t in match.terms)):
                bias = graph.call_method("unsqueeze", (bias, 0))
        if match.dropout_p:
            new = graph.call_function(attention_with_dropout, (q, k, v, bias, float(match.scale), bool(match.is_causal),
                                                               int(match.num_kv_groups), float(match.dropout_p)))
        elif native:
            if bias is not None or match.num_kv_groups != 1 or match.softcap:
                raise ValueError("a native SDPA rewrite takes no mask and no K/V head grouping")
            new = graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                      {"is_causal": bool(match.is_causal), "scale": float(match.scale)})
        elif backend == "triton_decode":
            b, _, hkv, _, lk, _, _ = match.dims()
            splits = cost_model.decode_attention_splits(ctx.hardware, b, hkv, lk)
            new = graph.call_function(torch.ops.graphopt.decode_attention.default,
                                      (q, k, v, bias, float(match.scale), splits))
        else:
            variants = ()  # the op's defaults: no soft-capping, no ALiBi
            if match.softcap or match.alibi is not None:
                variants = (float(match.softcap),) + ((match.alibi,) if match.alibi is not None else ())
            target = torch.ops.graphopt.attention.default
            if in_graph_sdpa(ctx, match, backend) and not variants:  # (SDPA takes neither variant)
                target = attention_in_graph
            new = graph.call_function(
                target,
                (q, k, v, bias, float(match.scale), bool(match.is_causal), int(match.num_kv_groups), backend, *variants),
            )
        out = new
        if match.batched_3d:
            out = graph.call_method("flatten", (new, 0, 1)) if match.heads else graph.call_method("squeeze", (new, 0))
    for key in ("example_value", "val"):
        if key in root.meta:
            new.meta[key] = _4d_value(root.meta[key], match.heads) if match.batched_3d else root.meta[key]
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in root.meta:
            new.meta[key] = root.meta[key]
    if SYMBOLIC_MASK_NOTE in match.notes:
        new.meta["graphopt_mask_note"] = SYMBOLIC_MASK_NOTE  # for the sparse pass's decline reason
    root.replace_all_uses_with(out)
    match.replaced_by = out
    erase_unused([root, match.softmax, *match.nodes, *_ancestors(match.dropped)], graph)
    return new


def in_graph_sdpa(ctx: PassContext, match: AttentionMatch, backend: str) -> bool:
    """Whether a rewrite onto SDPA `backend` is emitted as ops.attention_in_graph (the backend's aten
    call, launched by the compiler with no Python op between) rather than graphopt::attention: for
    CUDA tensors going to a compiler. The ONNX exporter keeps graphopt::attention (its translation
    names it); the CPU keeps it too, where its body is the plain SDPA call."""
    dev = device(match.q)
    return backend in ATTENTION_GRAPH_BACKENDS and dev is not None and dev.type == "cuda" and not ctx.for_export


def _with_value(new: fx.Node, source: fx.Node, fn) -> fx.Node:
    """Give a helper node the recorded (fake) value later passes read, e.g. sparse_attention."""
    value = fake(source)
    if isinstance(value, torch.Tensor):
        try:
            new.meta["example_value"] = fn(value)
        except Exception:  # metadata only: never fail the rewrite for it
            pass
    return new


def _4d_value(value, heads: int):
    return value.unflatten(0, (-1, heads)) if heads else value.unsqueeze(0)


def _to_4d(graph: fx.Graph, node: fx.Node, heads: int) -> fx.Node:
    """(B*H, L, D) -> (B, H, L, D) where the match saw the heads, else (1, B*H, L, D)."""
    new = graph.call_method("unflatten", (node, 0, (-1, heads))) if heads else graph.call_method("unsqueeze", (node, 0))
    return _with_value(new, node, lambda x: _4d_value(x, heads))


def _splits_heads(term) -> bool:
    """A term added to the (B*H, Lq, Lk) view of the scores, whose first dim is B*H (not a broadcast 1):
    the bias takes its (B, H, Lq, Lk) form."""
    value = fake(term.node)
    return bool(term.merged_heads and ndim(term.node) == 3 and not (isinstance(value.shape[0], int) and value.shape[0] == 1))


def _term_ndim(term) -> int:
    return 4 if _splits_heads(term) else (ndim(term.node) or 4)


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
    if len(terms) == 1 and terms[0].kind in ("keep", "drop") and terms[0].fill == float("-inf") and not _splits_heads(terms[0]):
        t = terms[0]
        return t.node if t.kind == "keep" else graph.call_function(torch.logical_not, (t.node,))
    total = None
    for t in terms:
        node = t.node
        if _splits_heads(t):
            node = graph.call_method("unflatten", (node, 0, (-1, match.heads)))
        if t.kind == "add":
            part = node
            term_dtype = dtype(t.node)
            if term_dtype is not None and not term_dtype.is_floating_point:
                # an integer mask added to float scores: SDPA and the kernels take float or bool masks
                part = graph.call_method("to", (part, match.bias_dtype() or torch.float32))
            if t.multiplier != 1.0:
                part = graph.call_function(operator.mul, (part, t.multiplier))
        else:
            fill = t.fill * t.multiplier if math.isfinite(t.fill) else t.fill
            masked = node if t.kind == "drop" else graph.call_function(torch.logical_not, (node,))
            if dtype(match.q) == torch.float64:  # a float64 fill (finfo(float64).min) overflows where's float32
                fill = graph.call_function(torch.scalar_tensor, (fill,), {"dtype": torch.float64})
            part = graph.call_function(torch.where, (masked, fill, 0.0))
        total = part if total is None else graph.call_function(operator.add, (total, part))
    return total
