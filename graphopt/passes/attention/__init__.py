"""The `attention` pass: hand-written scaled-dot-product attention -> one `graphopt::attention`.

Lossless and on by default. It anchors on every softmax node and walks
- UP the scores through ops that do not change what softmax sees beyond what the fused kernel
  reproduces: casts (`.float()`, `.to(dtype)`, `.type(...)`, `.type_as(...)`), copies (`contiguous`,
  `clone`), views between (B*H, Lq, Lk) and (B, H, Lq, Lk) (the op then works on the 4-D form),
  multiplication/division by a constant scalar (a Python number, a constant 0-d/1-element tensor
  such as GPT-2's `torch.full([], sqrt(d))`, or a number computed from symbolic sizes, guarded),
  additive masks and biases (`scores + mask` or in place `scores += mask`, summed when there are
  several, as in T5; a mask read through `m.expand_as(scores)` is `m`), `masked_fill(mask, fill)` and
  `torch.where(mask, scores, fill)` with a very negative fill, soft-capping `cap * tanh(s / cap)`
  (Gemma 2), down to the QK^T matmul (`matmul`/`@`/`bmm`, or `baddbmm(bias, q, k^T)`, whose bias is a
  term: BLOOM's ALiBi). The scale may also sit on q or k before the matmul. K^T may be
  `k.transpose(-2, -1)`/`transpose(2, 3)`/`.mT`/`permute(0, 1, 3, 2)` or any other tensor (then the
  pass transposes it back). GQA's `repeat_kv` (expand + reshape, or `repeat_interleave` over the head
  dim) is undone: the kernel reads the un-repeated K/V; one K/V head broadcast over the query heads
  is K/V grouping too.
- DOWN the probabilities through casts, copies, the same views and dropout to the PV matmul.
  Inactive dropout (`training=False` or `p=0`) is dropped; active dropout is rewritten to SDPA with
  `dropout_p` (ops.attention_with_dropout: another random mask, the same distribution) when the
  config's `attention_dropout` is on, and declined otherwise.

nn.MultiheadAttention's F.multi_head_attention_forward call is written out as the torch ops it runs
where its attention weights are not read (mha.py), and then matched like the rest. Attention inside
activation-checkpointed regions (the body of Dynamo's tag_activation_checkpoint call) is rewritten
in that body; attention in other higher-order ops' bodies is declined with the reason.

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
  softmax(scores), and our Triton kernel gives 0 (see kernels/flash_attention/);
- with -inf eager gives NaN, the rewrite 0 (SDPA's safe softmax).
A mask term whose value depends only on constants, parameters and buffers, and that nothing
writes in place (a prefix-LM mask edited with `m[:, :p] = True` is not the value its inputs
compute), is evaluated at compile time; when it is
exactly the top-left causal pattern (query i sees keys j <= i; masked entries <= -1e4 or -inf) it
is dropped and the node gets `is_causal=True`, so kernels skip the upper triangle. Buffers read
this way are registered as frozen: an in-place change of the buffer triggers a recompile. An
all-zero constant bias (T5's cross-attention position bias) is dropped.

Declined, with a recorded reason: probabilities used elsewhere (`output_attentions=True`), dropout
active in training with `attention_dropout=False`, a bias that broadcasts the scores to a larger
shape or has more than 4 dims, a mask added before the soft-capping, mixed q/k/v dtypes, an output
dtype differing from v's, a softmax over another dim; soft-capped scores on the CPU (SDPA has no
soft-capping; graphopt's Triton kernel, which has, runs on a GPU).

The implementation is chosen at compile time: on CPU, SDPA's CPU kernel ("sdpa_cpu"); on CUDA the
fastest applicable of our Triton kernel and SDPA's cuDNN / flash / memory-efficient backends, by
the roofline cost model or, where `graphopt calibrate` measured the shape, by the measured table
(graphopt.calibrate.calibrate_attention_table). `attention_backend` in the config forces one. When
the Triton kernel is chosen, a constant ALiBi bias (per head, slope * key position plus a constant
per row) becomes the kernel's ALiBi: slopes it turns into slope * (j - i) itself.

Tensor parallelism (torch.distributed.tensor): the q/k/v the matcher sees are the local tensors of
column-parallel projections, so each rank rewrites the attention of its own heads, GQA groups
whole (a rank holds its query heads' KV heads).

Modules: `match` (the matcher), `walk` (the walks up the scores and down the probabilities),
`operands` (q, k, v and their checks), `masks` (constant evaluation, term checks, the causal proof,
ALiBi recognition), `mha` (nn.MultiheadAttention written out), `choose` (candidates, their
estimates, the emulation of SDPA's dispatch), `rewrite`, `onnx` (the ONNX translation). The
measured table is written by graphopt.calibrate (`graphopt calibrate`).
"""

from __future__ import annotations

import copy

import torch.fx as fx

from graphopt.cost.attention import attention_key
from graphopt.passes.attention import choose as _choose
from graphopt.passes.attention import onnx as _onnx
from graphopt.passes.attention.choose import (
    _bias_kind,
    bias_rounding,
    choose_implementation,
    default_sdpa_backend,
    dispatched_sdpa_backend,
    native_sdpa_backend,
    sdpa_applicable,
)
from graphopt.passes.attention.masks import MaskTerm, alibi_slopes, evaluate_constant
from graphopt.passes.attention.match import AttentionMatch, find_attention
from graphopt.passes.attention.mha import expand_multi_head_attention, finish_multi_head_attention
from graphopt.passes.attention.rewrite import in_graph_sdpa, rewrite_attention
from graphopt.passes.attention.walk import functionalize_score_updates
from graphopt.passes.base import GraphPass, PassContext
from graphopt.passes.fx_utils import dtype, fake
from graphopt.passes.subgraphs import BodyContext, higher_order_bodies, is_checkpoint, op_name


class AttentionPass(GraphPass):
    name = "attention"
    lossless = True

    def run(self, ctx: PassContext) -> None:
        self._run_graph(ctx)
        self._run_bodies(ctx)

    def _run_bodies(self, ctx: PassContext) -> None:
        """Attention inside activation-checkpointed regions: Dynamo puts each region's code in a body
        GraphModule called through tag_activation_checkpoint, rewritten here like the graph itself
        (the checkpoint recomputes the rewritten body in the backward). Other higher-order ops'
        bodies are left alone, and each attention found in one is declined with the reason."""
        for call, body in higher_order_bodies(ctx.gm):
            sub = BodyContext(ctx, call, body)
            if not is_checkpoint(call):
                for match in find_attention(sub):
                    node = match.output if match.output is not None else match.softmax
                    ctx.record(self.name, False, f"attention inside the body of the higher-order op {op_name(call)}: "
                               "graphopt rewrites inside activation-checkpointed regions only; call the attention "
                               "outside that op to have it rewritten", node=node)
                continue
            snapshot = copy.deepcopy(body.graph)
            try:
                self.run(sub)
                body.graph.lint()
                body.recompile()
            except Exception:
                body.graph = snapshot
                body.recompile()
                raise

    def _run_graph(self, ctx: PassContext) -> None:
        functionalize_score_updates(ctx.gm.graph)
        expansions = expand_multi_head_attention(ctx, lambda node, why: ctx.record(self.name, False, why, node=node))
        try:
            self._rewrite_matches(ctx)
        finally:
            finish_multi_head_attention(ctx.gm.graph, expansions)

    def _rewrite_matches(self, ctx: PassContext) -> None:
        replaced: dict[fx.Node, fx.Node] = {}  # rewritten attention outputs -> their replacements
        for match in find_attention(ctx, allow_dropout=ctx.config.attention_dropout and not ctx.for_export):
            node = match.output if match.output is not None else match.softmax
            if match.reason is not None:
                ctx.record(self.name, False, match.reason, node=node)
                continue
            if not match.follow(replaced):
                ctx.record(self.name, False, "overlaps an attention rewritten before it", node=node)
                continue
            if match.dropout_p:
                self._rewrite_with_dropout(ctx, match, node)
                replaced[match.output] = match.replaced_by
                continue
            before, candidates, rejected, note = choose_implementation(ctx, match)
            if not candidates and match.softcap:
                ctx.record(self.name, False, "soft-capped scores (Gemma 2): " + "; ".join(
                    f"{name}: {why}" for name, why in rejected.items() if name in ("triton", "sdpa_cpu", "cudnn")),
                    node=node, before=before)
                continue
            rounding = bias_rounding(match, dtype(match.q))[0]
            if rounding and not any(name != "math" for name in candidates):
                ctx.record(self.name, False, f"left as written: {rounding}", node=node, before=before, rejected=rejected)
                continue
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
            if choice == "triton" and not ctx.for_export:
                self._alibi_to_kernel(ctx, match)
            native = native_sdpa_backend(ctx, match) == choice
            details = dict(source="sdpa" if match.from_sdpa else "hand-written",
                           emitted=("F.scaled_dot_product_attention" if native else
                                    "graphopt::decode_attention" if choice == "triton_decode" else
                                    f"aten SDPA ({choice})" if in_graph_sdpa(ctx, match, choice) else "graphopt::attention"),
                           is_causal=match.is_causal, num_kv_groups=match.num_kv_groups, scale=match.scale,
                           bias=_bias_kind(match), softcap=match.softcap, alibi=match.alibi is not None,
                           candidates={k: round(v.ms, 6) for k, v in candidates.items()},
                           rejected=rejected, notes=list(match.notes))
            decision = ctx.record(self.name, True, why, node=node, before=before, after=after,
                                  implementation=choice, **details)
            try:
                rewrite_attention(ctx, match, backend=choice, native=native)
            except Exception:
                ctx.decisions.remove(decision)
                raise
            replaced[match.output] = match.replaced_by


    @staticmethod
    def _alibi_to_kernel(ctx: PassContext, match: AttentionMatch) -> None:
        """A constant ALiBi bias term becomes the Triton kernel's ALiBi: per-head slopes it turns into
        slope * (j - i) itself, reading no bias."""
        dims = match.dims()
        if dims is None:
            return
        _, heads, _, len_q, len_k, _, _ = dims
        for term in match.terms:
            slopes = alibi_slopes(ctx, term, heads, len_q, len_k)
            if slopes is None:
                continue
            try:
                match.alibi = ctx.add_constant(slopes.to(fake(match.q).device), "alibi_slopes")
            except NotImplementedError:  # no constants in a higher-order op's body: it stays a bias
                return
            match.terms.remove(term)
            match.dropped.append(term.node)
            match.notes.append("constant ALiBi bias -> the Triton kernel's ALiBi (per-head slopes)")
            return

    def _rewrite_with_dropout(self, ctx: PassContext, match: AttentionMatch, node: fx.Node) -> None:
        """Attention with dropout active on its probabilities -> SDPA with dropout_p, which PyTorch
        dispatches itself (our kernels take no dropout): another random mask, the same distribution."""
        if match.softcap:
            ctx.record(self.name, False, f"soft-capped scores with dropout p={match.dropout_p:g}: SDPA, which draws "
                       "the dropout, has no soft-capping", node=node)
            return
        before, candidates, rejected, _ = choose_implementation(ctx, match)
        sdpa = {name: e for name, e in candidates.items() if name in ("sdpa_cpu", "flash", "cudnn", "efficient")}
        dims = match.dims()
        choice = None
        if dims is not None:
            choice = default_sdpa_backend(ctx.hardware, dtype(match.q), dims[5], dims[6], bool(match.terms), dims[4],
                                          lq=dims[3], is_causal=match.is_causal)
        if choice not in sdpa:
            choice = min(sdpa, key=lambda name: sdpa[name].ms) if sdpa else None
        after = sdpa.get(choice)
        if before is not None and after is not None:
            ok, why = self.accept(ctx, before, after)
        else:
            ok, why = True, "symbolic shapes: fused attention assumed faster (it reads Q, K, V once)"
        if not ok:
            ctx.record(self.name, False, why, node=node, before=before, after=after)
            return
        why = f"{why}; dropout p={match.dropout_p:g} through SDPA's dropout_p (another random mask than eager's, " \
              "the same distribution)"
        decision = ctx.record(self.name, True, why, node=node, before=before, after=after, implementation=choice,
                              source="hand-written", emitted="F.scaled_dot_product_attention (dropout_p)",
                              dropout_p=match.dropout_p, is_causal=match.is_causal, num_kv_groups=match.num_kv_groups,
                              scale=match.scale, bias=_bias_kind(match), rejected=rejected, notes=list(match.notes))
        try:
            rewrite_attention(ctx, match, backend=choice)
        except Exception:
            ctx.decisions.remove(decision)
            raise


PASS = AttentionPass()


_onnx.register()

# internals the tests read through the pass's path (they patch them in graphopt.passes.attention.choose)
_device_name = _choose._device_name
_dispatcher_choice = _choose._dispatcher_choice
_triton_applicable = _choose._triton_applicable

__all__ = ["AttentionMatch", "MaskTerm", "find_attention", "rewrite_attention", "AttentionPass", "PASS",
           "attention_key", "choose_implementation", "default_sdpa_backend", "dispatched_sdpa_backend",
           "evaluate_constant", "native_sdpa_backend", "sdpa_applicable"]
