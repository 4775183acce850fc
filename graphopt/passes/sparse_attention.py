"""The `sparse_attention` pass (lossy, opt-in): re-lowers `graphopt::attention` nodes to
`graphopt::sparse_attention` (SpargeAttn-style predicted block sparsity, graphopt/kernels/sparse_attention/).

It runs after the `attention` pass and rewrites the `graphopt::attention` nodes that pass emitted;
when the attention pass is disabled it runs that pass's matcher itself (`find_attention` +
`rewrite_attention`) to get them.

Thresholds, per layer and head, come from the plan's "sparse_attention" section written by
`graphopt tune` (layers keyed by the attention's module path, or "#i" for the i-th attention of a
graph without module paths). Heads the tuner left dense get cdfthreshd=1, simthreshd1=-1 and no PV
skipping; a layer whose heads are all dense is declined. Without a plan (or for a layer the plan
does not name) the documented defaults apply: simthreshd1=0.6, cdfthreshd=0.98, PV skipping off;
their error was not measured on this model, which the decision says.

The predictor's block statistics (pooled Q and K blocks and their self-similarity) are either
emitted as aten ops right after q and k are produced (`emit_block_statistics`), where the
downstream compiler can fuse them with the kernels that produce q and k, the op's predictor then
reading only those pooled rows; or computed by the op, which pools q and k itself. The cost model
picks (`estimate_block_statistics`); `force` takes the graph. Under Inductor (its Triton schedule
for a LLaMA block) the per-token norms fuse into the RoPE kernel that writes q and k, and the
block sums are one reduction kernel that reads q or k once more.

The cost model decides: dense time (the backend the attention pass chose, on the target GPU)
against the predictor plus the block-sparse kernel at the plan's measured sparsity
(without a plan: an assumed ASSUMED_SPARSITY_WITHOUT_PLAN, recorded as such). Both estimates are
rooflines fitted to the H200 timings (bench/results/sparse_attention_h200.json; see
the constants in graphopt/cost/sparse_attention.py). Where the kernel wins, by sequence length
and share of blocks skipped, is in bench/RESULTS.md section 6: from long sequences at half the
blocks skipped, at shorter ones only at high sparsity, never at density 1. Short sequences and
low sparsity are declined with the reason. Unless the step replays from a CUDA graph
(`cuda_graphs` / `graph_replay`), each side is priced at least at its op's host launch path
(`priced_host_launches`), which moves the flip to longer sequences.

Symbolic sequence lengths (torch.compile(dynamic=True), the automatic dynamic shapes Dynamo
turns on after a second length, or an ONNX export with dynamic axes): one graph then serves every
length, so the pass finds the cost model's break-even length (`break_even_length`, Lq = Lk, at the
example's batch, heads and head dim) and passes it as the op's `dense_below`. The op runs dense
attention, on the backend the dense decision named, where min(Lq, Lk) is below it, or under
causality where Lq != Lk. Static lengths keep `dense_below=0`: the decision is made once.

Declined, with the reason recorded: a bias or mask other than causal (the kernel applies none);
Lq != Lk under causality (at the example's sizes); v's head dim differing from q's or above 256; a plan layer whose head
count does not match; a plan tuned under a larger L1 budget than the config's error_budget;
non-GPU targets unless `force` (the CPU op runs the slow torch reference).

ONNX: `graphopt::sparse_attention` exports as the standard `Attention` (opset 23) with the
predicted block mask, computed in-graph from the pooled Q/K blocks with standard ops, expanded to a boolean
attn_mask (and the token-level causal mask). It is exact when PV skipping is off; PV skipping is
not expressible in `Attention` and is dropped (the exported model is then the mask-only variant).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.cost.sparse_attention import (
    BREAK_EVEN_SEARCH_LIMIT,
    break_even_length,
    estimate_dense,
    estimate_sparse_attention,
    priced_host_launches,
)
from graphopt.cost_model import Estimate
from graphopt.kernels.sparse_attention import (BLOCK_M, BLOCK_N, DEFAULT_CDFTHRESHD, DEFAULT_SIMTHRESHD1,
                                               block_statistics)
from graphopt.onnx_registry import register_onnx_translation
from graphopt.ops import DENSE_ATTENTION_TARGETS
from graphopt.passes.base import GraphPass, PassContext, module_path
from graphopt.passes.fx_utils import (device, dtype, fake, fix_symbolic_sizes, replace_with_call, size_hints,
                                     symbolic_size)
from graphopt.passes.tensor_parallel import head_shard

log = logging.getLogger("graphopt")

ASSUMED_SPARSITY_WITHOUT_PLAN = 0.5  # fraction of QK blocks skipped, for the cost model only

# ---------------------------------------------------------------------------------------------
# Plan lookup
# ---------------------------------------------------------------------------------------------
def attention_key(node, index: int) -> str:
    """How plans name an attention: its module path, else its position among the graph's attentions."""
    return module_path(node) or f"#{index}"


def plan_layer(layers: dict, key: str) -> tuple[str | None, dict | None]:
    """(plan key, layer entry) for the attention at module path `key`: the same path, else the one
    plan key that ends the path or that the path ends (the same model compiled inside a wrapper,
    or a submodule of the tuned one). None when there is none or more than one."""
    if key in layers:
        return key, layers[key]
    hits = [k for k in layers if key.endswith("." + k) or k.endswith("." + key)]
    return (hits[0], layers[hits[0]]) if len(hits) == 1 else (None, None)


def layer_thresholds(section: dict | None, key: str, heads: int, *, head_dim: int | None = None,
                     is_causal: bool | None = None, head_shard: tuple[int, int] | None = None):
    """(simthreshd1, cdfthreshd, pvthreshd or None, measured sparsity or None, layer dict or None, note).
    A plan layer tuned on another head count, head dim or causality is declined: its errors were
    measured on another attention. head_shard: (mesh index, mesh size) where the attention holds a
    tensor-parallel rank's contiguous share of the heads; a plan tuned on the whole model then
    gives this rank its heads' thresholds."""
    plan_key, layer = plan_layer((section or {}).get("layers", {}), key)
    if layer is None:
        note = "no plan" if section is None else f"plan has no layer {key!r}"
        return ([DEFAULT_SIMTHRESHD1] * heads, [DEFAULT_CDFTHRESHD] * heads, None, None, None,
                f"{note}: untuned defaults simthreshd1={DEFAULT_SIMTHRESHD1}, cdfthreshd={DEFAULT_CDFTHRESHD} (error not measured)")
    shard_note = ""
    if head_shard is not None and layer.get("heads") == heads * head_shard[1]:
        first, total = head_shard[0] * heads, heads * head_shard[1]
        layer = {**layer, "heads": heads, **{field: values[first:first + heads] for field, values in layer.items()
                                             if isinstance(values, list) and len(values) == total}}  # per-head lists
        shard_note = f", heads {first}-{first + heads - 1} of {total}: this tensor-parallel rank's"
    if layer.get("heads") != heads or len(layer.get("cdfthreshd", [])) != heads:
        raise _Decline(f"plan layer {plan_key!r} has {layer.get('heads')} heads, the attention has {heads}")
    if head_dim is not None and layer.get("head_dim") not in (None, head_dim):
        raise _Decline(f"plan layer {plan_key!r} was tuned on head dim {layer['head_dim']}, the attention has "
                       f"{head_dim}: tune again for this model")
    if is_causal is not None and layer.get("is_causal") not in (None, is_causal):
        raise _Decline(f"plan layer {plan_key!r} was tuned on {'causal' if layer['is_causal'] else 'non-causal'} "
                       f"attention, this one is {'causal' if is_causal else 'non-causal'}: tune again for it")
    dense = layer.get("dense", [False] * heads)
    sim = [-1.0 if dense[i] else float(layer["simthreshd1"][i]) for i in range(heads)]
    cdf = [1.0 if dense[i] else float(layer["cdfthreshd"][i]) for i in range(heads)]
    pv_list = [math.inf if dense[i] or layer["pvthreshd"][i] is None else float(layer["pvthreshd"][i]) for i in range(heads)]
    pv = None if all(math.isinf(x) for x in pv_list) else pv_list
    sparsity = [0.0 if dense[i] else float(layer["sparsity"][i] or 0.0) for i in range(heads)]
    matched = "" if plan_key == key else f", plan layer {plan_key!r}"
    return (sim, cdf, pv, sum(sparsity) / heads, layer,
            f"tuned plan ({sum(not x for x in dense)}/{heads} heads sparse{matched}{shard_note})")


class _Decline(Exception):
    """A recorded decline: the reason, and the estimates when the cost model made the call."""

    def __init__(self, reason: str, before: Estimate | None = None, after: Estimate | None = None):
        super().__init__(reason)
        self.before, self.after = before, after


# ---------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------
@dataclass
class _Site:
    """One attention the pass may re-lower: a `graphopt::attention` node, or an SDPA call that the
    attention pass left as it is (`match`; it becomes a graphopt::attention node only once the
    sparse rewrite is accepted, so a decline leaves the call untouched)."""

    node: fx.Node
    match: Any = None

    def describe(self, ctx: PassContext) -> tuple:
        """(q, k, v shapes as (B, H, L, D) tuples, symbolic sizes read as their hints, or None; has
        bias; scale; is_causal; dense backend; dtype; device; (Lq, Lk), each a SymInt where symbolic)."""
        if self.match is None:
            q, k, v, bias, scale, is_causal, _, backend = self.node.args
            return ((size_hints(q), size_hints(k), size_hints(v)), bias is not None, scale, is_causal, backend,
                    dtype(q), device(q) or torch.device("cpu"), _symbolic_lengths(q, k))
        from graphopt.passes.attention import dispatched_sdpa_backend

        match, dims = self.match, self.match.dims()
        shapes = (None, None, None)
        if dims is not None:
            b, h, hkv, lq, lk, d, dv = dims
            shapes = ((b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv))
        backend = dispatched_sdpa_backend(ctx, match)
        return (shapes, bool(match.terms), match.scale, match.is_causal, backend, dtype(match.q),
                device(match.q) or torch.device("cpu"), _symbolic_lengths(match.q, match.k))

    def query(self) -> fx.Node:
        return self.node.args[0] if self.match is None else self.match.q

    def attention_node(self, ctx: PassContext) -> fx.Node:
        """The graphopt::attention node to replace (rewriting the SDPA call into one first)."""
        if self.match is None:
            return self.node
        from graphopt.passes.attention import dispatched_sdpa_backend, rewrite_attention

        return rewrite_attention(ctx, self.match, backend=dispatched_sdpa_backend(ctx, self.match))


def _attention_sites(ctx: PassContext, pass_name: str) -> list[_Site]:
    """graphopt::attention nodes and untouched SDPA calls, in graph order. When the attention pass
    is disabled, hand-written attentions are matched (and rewritten) here."""
    from graphopt.passes.attention import find_attention, rewrite_attention

    attention_on = ctx.config.enabled("attention")
    sites = []
    for n in ctx.gm.graph.nodes:
        if n.op != "call_function" or n.target not in DENSE_ATTENTION_TARGETS:
            continue
        if len(n.args) > 8 and (n.args[8] or (len(n.args) > 9 and n.args[9] is not None)):
            ctx.record(pass_name, False, "soft-capped or ALiBi scores: the block-sparse kernel takes neither", node=n)
            continue
        sites.append(_Site(n))
    replaced: dict = {}  # outputs of attentions rewritten here -> their replacements
    for match in find_attention(ctx):
        if match.reason is None and not match.follow(replaced):
            match.reason = "overlaps an attention rewritten before it"
        if match.reason is None and match.softcap:
            match.reason = "soft-capped scores: the block-sparse kernel takes no soft-capping"
        if attention_on and not match.from_sdpa:
            # still hand-written after the attention pass: it declined this one (its reason is on
            # record there); the block-sparse op replaces only what that pass lowered
            ctx.record(pass_name, False, "the attention pass kept this hand-written attention"
                       f"{': ' + match.reason if match.reason else ''}; sparse attention replaces only the attention "
                       "it lowers (graphopt::attention) and SDPA calls",
                       node=match.output if match.output is not None else match.softmax)
            continue
        if match.reason is not None:
            if not attention_on or match.from_sdpa:  # (a hand-written one kept is recorded above)
                ctx.record(pass_name, False, f"attention not matched: {match.reason}",
                           node=match.output if match.output is not None else match.softmax)
            continue
        if match.from_sdpa:
            sites.append(_Site(match.output, match))
        else:
            sites.append(_Site(rewrite_attention(ctx, match)))
            replaced[match.output] = match.replaced_by
    position = {node: i for i, node in enumerate(ctx.gm.graph.nodes)}
    return sorted(sites, key=lambda site: position[site.node])


def _symbolic_lengths(q: fx.Node, k: fx.Node) -> tuple[Any, Any]:
    """(Lq, Lk) of (B, H, L, D) q and k: each a SymInt where Dynamo left it symbolic, else None."""
    return symbolic_size(q, -2), symbolic_size(k, -2)


def _dtype_bytes(dt) -> int:
    return torch.finfo(dt).bits // 8 if dt is not None and dt.is_floating_point else 2


class SparseAttentionPass(GraphPass):
    name = "sparse_attention"
    lossless = False

    def run(self, ctx: PassContext) -> None:
        from graphopt.plan import plan_section

        if (why := ctx.differentiated_reason()) is not None:
            ctx.record(self.name, False, why)
            return
        section = plan_section(ctx, self.name)
        budget = ctx.config.error_budget.get(self.name, 0.06)
        sites = _attention_sites(ctx, self.name)
        keys = [attention_key(site.node, index) for index, site in enumerate(sites)]
        plan_layers = (section or {}).get("layers", {})
        if plan_layers and keys and all(plan_layer(plan_layers, key)[1] is None for key in keys):
            log.warning("sparse_attention: the plan's layers (%s) match none of this graph's attentions (%s); "
                        "untuned defaults apply", ", ".join(sorted(plan_layers)[:3]), ", ".join(keys[:3]))
        replaced: dict = {}  # nodes rewritten here -> their replacements (one attention feeding the next)
        for site, key in zip(sites, keys):
            if site.match is not None and not site.match.follow(replaced):
                ctx.record(self.name, False, "overlaps an attention rewritten before it", node=site.node)
                continue
            try:
                replaced[site.node] = self._rewrite(ctx, site, key, section, budget)
            except _Decline as why:
                ctx.record(self.name, False, str(why), node=site.node, before=why.before, after=why.after)

    def _rewrite(self, ctx: PassContext, site: _Site, key: str, section, budget: float) -> fx.Node:
        (qs, ks, vs), has_bias, scale, is_causal, backend, dt, dev, symbols = site.describe(ctx)
        if has_bias:
            why = site.node.meta.get("graphopt_mask_note")
            raise _Decline("attention has a bias or mask other than causal (padding mask, position bias)"
                           f"{': ' + why if why else ''}; the block-sparse kernel applies only the causal mask")
        if qs is None or ks is None or vs is None:
            raise _Decline("symbolic shapes without size hints: the cost model needs example sizes")
        symbolic = any(size is not None for size in symbols)
        b, h, lq, d = qs
        hkv, lk, dv = ks[1], ks[2], vs[3]
        if not qs[0] == ks[0] == vs[0] or ks[1] != vs[1]:
            raise _Decline(f"q, k, v of shapes {tuple(qs)}, {tuple(ks)}, {tuple(vs)}: the kernel takes one batch size "
                           "and as many value heads as key heads (no broadcast)")
        if dv != d or d > 256:
            raise _Decline(f"head dims q {d} / v {dv}: the kernel needs equal head dims up to 256")
        if is_causal and lq != lk:
            raise _Decline(f"causal attention with Lq {lq} != Lk {lk} (cached decoding): not supported")
        if dt not in (torch.float16, torch.bfloat16, torch.float32):
            raise _Decline(f"dtype {dt}: the kernel takes float16, bfloat16 or float32")
        if not ctx.hardware.is_gpu and not ctx.config.force:
            raise _Decline(f"target {ctx.hardware.name} is not a GPU: the CPU op runs the slow torch reference "
                           "(force=True applies it anyway)")
        sim, cdf, pv, sparsity, layer, source = layer_thresholds(section, key, h, head_dim=d, is_causal=is_causal,
                                                                 head_shard=head_shard(site.query()))
        if layer is not None:
            if all(layer.get("dense", [])):
                raise _Decline(f"the tuned plan marks every head of {key!r} dense (no head reached useful sparsity "
                               "within the L1 budget)")
            blocks = (section.get("block_m", BLOCK_M), section.get("block_n", BLOCK_N))
            if blocks != (BLOCK_M, BLOCK_N):
                raise _Decline(f"plan tuned on {blocks[0]}x{blocks[1]} blocks, the kernel predicts {BLOCK_M}x{BLOCK_N} "
                               "blocks: tune again")
            if float(section.get("l1") or 0.0) > budget + 1e-12:
                raise _Decline(f"plan tuned for L1 < {section.get('l1')}, over this config's error_budget {budget}")
        assumed = sparsity is None
        if assumed:
            sparsity = ASSUMED_SPARSITY_WITHOUT_PLAN
        nbytes = _dtype_bytes(dt)
        host = priced_host_launches(ctx, backend, dense_is_op=site.match is None)
        before = estimate_dense(ctx.hardware, backend, b, h, hkv, lq, lk, d, causal=bool(is_causal), dtype_bytes=nbytes,
                                host_launches=host[1])
        # where the predictor's block statistics are computed: in the graph, or by the op pooling q and k
        after, in_op = (estimate_sparse_attention(ctx.hardware, b, h, hkv, lq, lk, d, causal=bool(is_causal),
                                                  sparsity=sparsity, dtype_bytes=nbytes, host_launches=host[0],
                                                  statistics_in_graph=in_graph) for in_graph in (True, False))
        in_graph = ctx.config.force or after.ms <= in_op.ms
        pooling = (f"predictor's block statistics in the graph ({'forced' if ctx.config.force else 'estimated'} "
                   f"{after.ms:.4f} ms against {in_op.ms:.4f} ms pooled in the op)")
        if not in_graph:
            after, pooling = in_op, (f"Q and K pooled in the op (estimated {in_op.ms:.4f} ms against {after.ms:.4f} ms "
                                     "with the block statistics in the graph)")
        ok, why = self.accept(ctx, before, after)
        at = f"{sparsity:.0%} sparsity ({'assumed, no measurement' if assumed else 'measured by the tuner'})"
        # static lengths: the decision above is the one for every call. Forced with a symbolic
        # length: sparse at every length, dense only where causal Lq != Lk (the kernel's limit).
        dense_below = 1 if symbolic else 0
        if symbolic and not ctx.config.force:
            # One graph serves every length: sparse from the cost model's break-even length on,
            # the dense backend below it (the op compares at run time).
            dense_below = break_even_length(ctx.hardware, backend, b, h, hkv, d, causal=bool(is_causal),
                                            sparsity=sparsity, dtype_bytes=nbytes, host_launches=host,
                                            statistics_in_graph=in_graph)
            if dense_below is None:
                raise _Decline(f"symbolic sequence length: the cost model predicts no win at any L up to "
                               f"{BREAK_EVEN_SEARCH_LIMIT} at {at}", before, after)
            ok, why = True, (f"symbolic sequence length: sparse for L >= {dense_below} (the cost model's break-even "
                             f"at Lq = Lk), dense {backend} below; at the example L={lq}: {why}")
        if not ok:
            raise _Decline(f"{why} at {at}, L={lq}", before, after)
        node = site.attention_node(ctx)
        q, k = node.args[:2]
        fix_symbolic_sizes(q, (-3, -1))  # the thresholds hold one entry per query head
        fix_symbolic_sizes(k, (-3,))
        consts = [ctx.add_constant(torch.tensor(x, dtype=torch.float32, device=dev), name)
                  for x, name in ((sim, "sparse_sim1"), (cdf, "sparse_cdf"))]
        pv_tensor = torch.tensor(pv, dtype=torch.float32, device=dev) if pv is not None else torch.empty(0, device=dev)
        consts.append(ctx.add_constant(pv_tensor, "sparse_pv"))
        statistics = emit_block_statistics(ctx.gm.graph, q, k) if in_graph else ()
        if in_graph and not statistics:
            pooling = "Q and K pooled in the op (q or k carries no recorded value to trace the statistics on)"
        ctx.record(self.name, True, f"{why} at {at}; thresholds: {source}; {pooling}", node=node, before=before,
                   after=after, implementation="triton_sparse", layer=key, sparsity=sparsity, sparsity_assumed=assumed,
                   simthreshd1=sim, cdfthreshd=cdf, pvthreshd=pv, dense_backend=backend,
                   l1=None if layer is None else layer.get("l1"), heldout_l1=None if layer is None else layer.get("heldout_l1"),
                   location_key=module_path(node), dense_below=dense_below, host_launches=host,
                   statistics_in_graph=bool(statistics))
        v = node.args[2]
        return replace_with_call(ctx, node, torch.ops.graphopt.sparse_attention.default,
                                 (q, k, v, float(scale), bool(is_causal), *consts, dense_below, backend, *statistics))


def emit_block_statistics(graph: fx.Graph, q: fx.Node, k: fx.Node) -> tuple[fx.Node, ...]:
    """The predictor's block statistics of q and k (`block_statistics`: pooled blocks and their
    self-similarity) as aten ops in the graph, right after q and k are produced, for the downstream
    compiler to fuse with the kernels that produce q and k (their projection and RoPE). Under
    Inductor the per-token norms fuse into the RoPE kernel; the block sums are a reduction kernel
    that reads q or k once more. Traced on the recorded values
    (symbolic sizes stay symbolic). Returns the nodes (pooled_q, sim_q, pooled_k, sim_k), or ()
    where q or k has no recorded value (the op then pools them itself)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    values = fake(q), fake(k)
    mode = getattr(values[0], "fake_mode", None)
    if mode is None or not all(isinstance(value, torch.Tensor) for value in values):
        return ()
    with mode, enable_python_dispatcher():
        # fresh values in one mode (a rewrite before this one may have recorded k in another)
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
        traced = make_fx(lambda q, k: block_statistics(q, k), tracing_mode="real")(*inputs)
    existing = set(graph.nodes)
    position = {node: i for i, node in enumerate(graph.nodes)}
    after = max((q, k), key=position.__getitem__)
    if after.op == "placeholder":  # graph inputs stay first
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(after.next):
        outputs = graph.graph_copy(traced.graph, dict(zip(inputs, (q, k))))
    for node in graph.nodes:
        if node not in existing:  # later passes read the recorded value Dynamo's nodes carry
            node.meta.setdefault("example_value", node.meta.get("val"))
    return tuple(outputs)


PASS = SparseAttentionPass()


# ---------------------------------------------------------------------------------------------
# ONNX: standard Attention with the predicted block mask as attn_mask
# ---------------------------------------------------------------------------------------------
def _onnx_sparse_attention():
    from onnxscript import opset23 as op

    def pool(x, block: int):
        """x (B, H, L, D) -> pooled (B, H, n, D), self-similarity (B, H, n), n = ceil(L / block)."""
        zero = op.Constant(value_ints=[0])
        one = op.Constant(value_ints=[1])
        shape_x = op.Shape(x)
        length = op.Slice(shape_x, op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))  # (1,)
        blk = op.Constant(value_ints=[block])
        n = op.Div(op.Sub(op.Add(length, blk), one), blk)
        pad_len = op.Sub(op.Mul(n, blk), length)
        xf = op.Cast(x, to=1)
        pads = op.Concat(zero, zero, zero, zero, zero, zero, pad_len, zero, axis=0)
        xp = op.Pad(xf, pads)
        b_h = op.Slice(shape_x, zero, op.Constant(value_ints=[2]))
        d = op.Slice(shape_x, op.Constant(value_ints=[3]), op.Constant(value_ints=[4]))
        xb = op.Reshape(xp, op.Concat(b_h, n, blk, d, axis=0))  # (B, H, n, block, D)
        pos = op.Range(op.Constant(value_int=0), op.Squeeze(n, zero), op.Constant(value_int=1))
        counts = op.Cast(op.Min(op.Sub(length, op.Mul(pos, op.Constant(value_int=block))), blk), to=1)  # (n,)
        pooled = op.Div(op.ReduceSum(xb, op.Constant(value_ints=[3]), keepdims=0), op.Unsqueeze(counts, one))
        norm = op.Max(op.Sqrt(op.ReduceSum(op.Mul(xb, xb), op.Constant(value_ints=[-1]), keepdims=1)),
                      op.Constant(value_float=1e-12))
        unit_sum = op.ReduceSum(op.Div(xb, norm), op.Constant(value_ints=[3]), keepdims=0)  # (B, H, n, D)
        sim = op.Div(op.ReduceSum(op.Mul(unit_sum, unit_sum), op.Constant(value_ints=[-1]), keepdims=0),
                     op.Mul(counts, counts))
        return pooled, sim, n

    def sparse_attention(q, k, v, scale: float, is_causal: bool, simthreshd1, cdfthreshd, pvthreshd,
                         dense_below: int, dense_backend: str, pooled_q=None, sim_q=None, pooled_k=None, sim_k=None):
        # PV skipping (pvthreshd) is dropped: Attention has no equivalent; exact when it is off.
        # dense_backend has no meaning in ONNX: below dense_below the mask keeps every block.
        # The block statistics come from the graph (the pass emits them) or are pooled here.
        zero = op.Constant(value_ints=[0])
        one = op.Constant(value_ints=[1])
        neg_inf = op.Constant(value_float=-math.inf)
        if pooled_q is None:
            pooled_q, sim_q, n_q = pool(q, BLOCK_M)
            pooled_k, sim_k, n_k = pool(k, BLOCK_N)
        else:
            n_q = op.Slice(op.Shape(pooled_q), op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
            n_k = op.Slice(op.Shape(pooled_k), op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
        shape_q = op.Shape(q)
        heads = op.Slice(shape_q, one, op.Constant(value_ints=[2]))
        kv_heads = op.Slice(op.Shape(k), one, op.Constant(value_ints=[2]))
        group = op.Div(heads, kv_heads)
        # GQA: repeat pooled K per query head (kv head h // group)
        pooled_k = op.Reshape(op.Tile(op.Unsqueeze(pooled_k, op.Constant(value_ints=[2])),
                                      op.Concat(one, one, group, one, one, axis=0)),
                              op.Concat(op.Slice(op.Shape(pooled_k), zero, one), heads, n_k,
                                        op.Slice(op.Shape(pooled_k), op.Constant(value_ints=[3]), op.Constant(value_ints=[4])), axis=0))
        sim_k = op.Reshape(op.Tile(op.Unsqueeze(sim_k, op.Constant(value_ints=[2])), op.Concat(one, one, group, one, axis=0)),
                           op.Concat(op.Slice(op.Shape(sim_k), zero, one), heads, n_k, axis=0))
        sim1 = op.Reshape(simthreshd1, op.Constant(value_ints=[1, -1, 1]))
        cdf = op.Reshape(cdfthreshd, op.Constant(value_ints=[1, -1, 1, 1]))
        q_similar = op.Unsqueeze(op.Greater(sim_q, sim1), op.Constant(value_ints=[3]))  # (B, H, nQ, 1)
        k_similar = op.Unsqueeze(op.Greater(sim_k, sim1), op.Constant(value_ints=[2]))  # (B, H, 1, nK)
        scores = op.Mul(op.MatMul(pooled_q, op.Transpose(pooled_k, perm=[0, 1, 3, 2])), op.Constant(value_float=scale))
        lq = op.Slice(shape_q, op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
        lk = op.Slice(op.Shape(k), op.Constant(value_ints=[2]), op.Constant(value_ints=[3]))
        i = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(n_q, zero), op.Constant(value_int=1)), one)  # (nQ, 1)
        j = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(n_k, zero), op.Constant(value_int=1)), zero)  # (1, nK)
        if is_causal:
            last_query = op.Sub(op.Min(op.Mul(op.Add(i, op.Constant(value_int=1)), op.Constant(value_int=BLOCK_M)), lq),
                                op.Constant(value_int=1))
            last_key = op.Sub(op.Min(op.Mul(op.Add(j, op.Constant(value_int=1)), op.Constant(value_int=BLOCK_N)), lk),
                              op.Constant(value_int=1))
            allowed = op.LessOrEqual(op.Mul(j, op.Constant(value_int=BLOCK_N)), last_query)  # (nQ, nK)
            diagonal = op.And(allowed, op.Greater(last_key, op.Mul(i, op.Constant(value_int=BLOCK_M))))
        else:
            allowed = op.Expand(op.Cast(op.Constant(value_ints=[1]), to=9), op.Concat(n_q, n_k, axis=0))  # all True
            diagonal = op.Not(allowed)
        candidates = op.And(k_similar, allowed)
        logits = op.Where(candidates, scores, neg_inf)
        row_max = op.ReduceMax(logits, op.Constant(value_ints=[-1]), keepdims=1)
        row_max = op.Where(op.Equal(row_max, neg_inf), op.Constant(value_float=0.0), row_max)
        weights = op.Where(candidates, op.Exp(op.Sub(logits, row_max)), op.Constant(value_float=0.0))
        probs = op.Div(weights, op.Max(op.ReduceSum(weights, op.Constant(value_ints=[-1]), keepdims=1),
                                       op.Constant(value_float=1e-30)))
        sorted_p, _ = op.TopK(probs, n_k, axis=-1, largest=1, sorted=1)
        mass_before = op.Sub(op.CumSum(sorted_p, op.Constant(value_int=-1)), sorted_p)
        inf = op.Constant(value_float=math.inf)
        smallest = op.ReduceMin(op.Where(op.Less(mass_before, cdf), sorted_p, inf), op.Constant(value_ints=[-1]), keepdims=1)
        keep = op.And(op.GreaterOrEqual(probs, smallest), candidates)
        whole = op.Or(op.Or(op.Not(q_similar), op.Not(k_similar)), op.GreaterOrEqual(cdf, op.Constant(value_float=1.0)))
        keep = op.And(op.Or(op.Or(keep, whole), diagonal), allowed)
        best = op.ArgMax(op.Where(allowed, scores, neg_inf), axis=-1, keepdims=1)  # (B, H, nQ, 1)
        kept_count = op.ReduceSum(op.Cast(keep, to=7), op.Constant(value_ints=[-1]), keepdims=1)  # int64
        none_kept = op.Equal(kept_count, op.Constant(value_int=0))
        keep = op.Or(keep, op.And(none_kept, op.Equal(j, best)))  # (B, H, nQ, nK)
        if dense_below > 0:  # where the op runs dense (graphopt.ops.sparse_attention_runs_dense): every block kept
            runs_dense = op.Less(op.Squeeze(op.Min(lq, lk), zero), op.Constant(value_int=dense_below))
            if is_causal:
                runs_dense = op.Or(runs_dense, op.Squeeze(op.Not(op.Equal(lq, lk)), zero))
            keep = op.Or(keep, runs_dense)
        # block mask -> token mask (B, H, Lq, Lk)
        shape_keep = op.Shape(keep)
        b_h = op.Slice(shape_keep, zero, op.Constant(value_ints=[2]))
        blk_m = op.Constant(value_ints=[BLOCK_M])
        blk_n = op.Constant(value_ints=[BLOCK_N])
        tiled = op.Expand(op.Unsqueeze(keep, op.Constant(value_ints=[3, 5])), op.Concat(b_h, n_q, blk_m, n_k, blk_n, axis=0))
        token_mask = op.Reshape(tiled, op.Concat(b_h, op.Mul(n_q, blk_m), op.Mul(n_k, blk_n), axis=0))
        token_mask = op.Slice(token_mask, op.Constant(value_ints=[0, 0]), op.Concat(lq, lk, axis=0), op.Constant(value_ints=[2, 3]))
        if is_causal:
            qi = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(lq, zero), op.Constant(value_int=1)), one)
            kj = op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(lk, zero), op.Constant(value_int=1)), zero)
            token_mask = op.And(token_mask, op.LessOrEqual(kj, qi))
        y, _, _, _ = op.Attention(q, k, v, token_mask, scale=float(scale))
        return y

    return sparse_attention


try:  # registration needs onnxscript; the pass itself does not
    register_onnx_translation(torch.ops.graphopt.sparse_attention.default, form="standard")(_onnx_sparse_attention())
except Exception:  # pragma: no cover - onnxscript missing or too old
    pass
