"""nn.MultiheadAttention: Dynamo keeps its F.multi_head_attention_forward call as one node. Where its
attention weights are not read (SigLIP's pooling head asks for them and drops them), the call is
written out as the torch ops it runs (in-projection, softmax(q k^T / sqrt(d) + masks) v, output
projection), with the attention in the form the matcher rewrites. The call stays in the graph until
the pass has decided: where its attention is not rewritten, the written-out ops go again and the
call is used as before. A call that cannot be written out keeps its node, and the pass records why."""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher

from graphopt.passes.attention.masks import _scalar
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import dtype, fake, size_hints

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def is_multi_head_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.multi_head_attention_forward


@dataclass
class Expansion:
    """One call written out: the call, its output's getitem, and the nodes emitted for it."""

    call: fx.Node
    output: fx.Node  # getitem(call, 0), whose users now read `written`
    written: fx.Node
    softmax: fx.Node
    emitted: list[fx.Node]


def expand_multi_head_attention(ctx: PassContext, record: Callable[[fx.Node, str], None]) -> list[Expansion]:
    """Write out every F.multi_head_attention_forward call of ctx.gm that can be; `record(node, why)`
    for those that cannot. finish_multi_head_attention settles each once the pass has decided."""
    expansions = []
    for node in [n for n in ctx.gm.graph.nodes if is_multi_head_attention(n)]:
        try:
            bound = _SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError as exc:
            record(node, f"nn.MultiheadAttention call with unexpected arguments ({exc})")
            continue
        bound.apply_defaults()
        arguments = bound.arguments
        if arguments["training"] is False:
            arguments["dropout_p"] = 0.0  # inactive (under dynamic=True the module's float arrives as an input)
        elif isinstance(arguments["dropout_p"], fx.Node):
            arguments["dropout_p"] = _scalar(ctx, arguments["dropout_p"])
        why = _why_not(node, arguments)
        if why is not None:
            record(node, f"nn.MultiheadAttention left as a call: {why}")
            continue
        expansions.append(_write_out(ctx.gm.graph, node, arguments))
    return expansions


def finish_multi_head_attention(graph: fx.Graph, expansions: list[Expansion]) -> None:
    """Where the written-out attention was rewritten (its softmax is gone), the call goes; elsewhere
    its written-out ops go and the call's output is used again."""
    for e in expansions:
        if getattr(e.softmax, "_erased", False):
            for user in list(e.call.users):
                graph.erase_node(user)
            graph.erase_node(e.call)
        else:
            e.written.replace_all_uses_with(e.output)
            for node in reversed(e.emitted):
                if not getattr(node, "_erased", False) and not node.users:
                    graph.erase_node(node)


def _why_not(node: fx.Node, a: dict[str, Any]) -> str | None:
    readers = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in readers):
        return "its result is used other than as (output, weights)"
    if not any(u.args[1] == 0 for u in readers):
        return "its output is not read"
    if any(u.args[1] == 1 and u.users for u in readers):
        return "its attention weights are read (need_weights=True); the fused kernel never materializes them"
    if not all(isinstance(a[n], fx.Node) for n in ("query", "key", "value")) or size_hints(a["query"]) is None:
        return "query, key or value is not a tensor of known rank"
    if len(size_hints(a["query"])) != 3:
        return "unbatched (2-D) inputs"
    if a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]:
        return "bias_k / bias_v / add_zero_attn (extra key positions)"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "static_k / static_v"
    if not isinstance(a["num_heads"], int) or not isinstance(a["dropout_p"], (int, float)) or not isinstance(a["training"], bool):
        return "non-constant num_heads, dropout_p or training"
    embed = size_hints(a["query"])[-1]
    if embed % a["num_heads"]:
        return f"embed dim {embed} is not a multiple of {a['num_heads']} heads"
    weights = ("q_proj_weight", "k_proj_weight", "v_proj_weight") if a["use_separate_proj_weight"] else ("in_proj_weight",)
    if any(not isinstance(a[w], fx.Node) for w in weights) or not isinstance(a["out_proj_weight"], fx.Node):
        return "projection weights that are not tensors"
    for name in ("attn_mask", "key_padding_mask"):
        mask = a[name]
        if mask is not None and (not isinstance(mask, fx.Node) or dtype(mask) is None
                                 or not (dtype(mask) == torch.bool or dtype(mask).is_floating_point)):
            return f"{name} of dtype {dtype(mask)} (bool or floating point expected)"
    if a["attn_mask"] is not None and len(size_hints(a["attn_mask"]) or ()) not in (2, 3):
        return "attn_mask of other than 2 or 3 dims"
    return None


class _Emitter:
    """Emits nodes before `anchor`, each with the value fake tensor propagation gives it."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_inputs: list):
        self.graph, self.anchor = graph, anchor
        self.mode = next(t.fake_mode for t in fake_inputs)  # the mode of the graph's recorded values
        self.emitted: list[fx.Node] = []

    def __call__(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = (self.graph.call_method if kind == "method" else self.graph.call_function)(target, args, kwargs)
        for key in _META:
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        values = fx.node.map_arg((args, kwargs), fake)
        # Python decompositions keep symbolic sizes symbolic (as in Dynamo's own fake propagation);
        # without them torch 2.11's C++ kernels read concrete sizes and specialize the graph.
        with self.mode, enable_python_dispatcher():
            value = getattr(values[0][0], target)(*values[0][1:], **values[1]) if kind == "method" else target(*values[0], **values[1])
        node.meta["example_value"] = value
        self.emitted.append(node)
        return node


def _write_out(graph: fx.Graph, node: fx.Node, a: dict[str, Any]) -> Expansion:
    """The computation of F.multi_head_attention_forward (inputs (L, N, E), batch second), with
    the attention as softmax((q / sqrt(d)) @ k^T + masks) @ v on (N, H, L, d) tensors."""
    query, key, value, heads = a["query"], a["key"], a["value"], a["num_heads"]
    embed = size_hints(query)[-1]
    head_dim = embed // heads
    emit = _Emitter(graph, node, [fake(query)])
    fn, method = (lambda t, *x, **k: emit("function", t, *x, **k)), (lambda t, *x, **k: emit("method", t, *x, **k))
    bias = a["in_proj_bias"]
    biases = [fn(operator.getitem, fn(torch.chunk, bias, 3), i) for i in range(3)] if bias is not None else [None] * 3
    if a["use_separate_proj_weight"]:
        weights = [a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]]
    elif query is key and key is value:  # self-attention: one projection, then split
        packed = fn(F.linear, query, a["in_proj_weight"], bias)
        weights = None
        q, k, v = (fn(operator.getitem, fn(torch.chunk, packed, 3, -1), i) for i in range(3))
    else:
        weights = [fn(operator.getitem, fn(torch.chunk, a["in_proj_weight"], 3), i) for i in range(3)]
    if weights is not None:
        q, k, v = (fn(F.linear, x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    # (L, N, E) -> (N, H, L, d)
    q, k, v = (method("permute", method("unflatten", t, -1, (heads, head_dim)), 1, 2, 0, 3) for t in (q, k, v))
    scores = fn(torch.matmul, fn(operator.mul, q, 1.0 / math.sqrt(head_dim)), method("transpose", k, -2, -1))
    mask = a["attn_mask"]
    if mask is not None:
        if len(size_hints(mask)) == 3:  # (N*H, L, S)
            mask = method("unflatten", mask, 0, (-1, heads))
        scores = _apply_mask(fn, method, scores, mask)
    padding = a["key_padding_mask"]
    if padding is not None:  # (N, S) -> (N, 1, 1, S)
        scores = _apply_mask(fn, method, scores, method("unsqueeze", method("unsqueeze", padding, 1), 2))
    probs = probs_softmax = fn(torch.softmax, scores, -1)
    if a["training"] and a["dropout_p"] > 0:
        probs = fn(F.dropout, probs, a["dropout_p"], True)
    out = method("flatten", method("permute", fn(torch.matmul, probs, v), 2, 0, 1, 3), -2)  # (L, N, E)
    out = fn(F.linear, out, a["out_proj_weight"], a["out_proj_bias"])
    output = next(u for u in node.users if u.args[1] == 0)
    output.replace_all_uses_with(out)
    return Expansion(node, output, out, probs_softmax, emit.emitted)


def _apply_mask(fn, method, scores: fx.Node, mask: fx.Node) -> fx.Node:
    """F.multi_head_attention_forward's masks: a bool one hides where True, a float one is added."""
    if dtype(mask) == torch.bool:
        return method("masked_fill", scores, mask, float("-inf"))
    return fn(operator.add, scores, mask)
