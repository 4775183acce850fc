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
(graphopt.calibrate.calibrate_attention_table). `attention_backend` in the config forces one.

Modules: `match` (the matcher), `masks` (constant evaluation, term checks, the causal proof),
`choose` (candidates, their estimates, the emulation of SDPA's dispatch), `rewrite`, `onnx` (the
ONNX translation). The measured table is written by graphopt.calibrate (`graphopt calibrate`).
"""

from __future__ import annotations

import torch.fx as fx

from graphopt.cost.attention import attention_key
from graphopt.passes.attention import choose as _choose
from graphopt.passes.attention import onnx as _onnx
from graphopt.passes.attention.choose import (
    _bias_kind,
    choose_implementation,
    default_sdpa_backend,
    dispatched_sdpa_backend,
    native_sdpa_backend,
    sdpa_applicable,
)
from graphopt.passes.attention.masks import MaskTerm, evaluate_constant
from graphopt.passes.attention.match import AttentionMatch, find_attention
from graphopt.passes.attention.rewrite import in_graph_sdpa, rewrite_attention
from graphopt.passes.base import GraphPass, PassContext


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
                                    "graphopt::decode_attention" if choice == "triton_decode" else
                                    f"aten SDPA ({choice})" if in_graph_sdpa(ctx, match, choice) else "graphopt::attention"),
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


_onnx.register()

# internals the tests read through the pass's path (they patch them in graphopt.passes.attention.choose)
_device_name = _choose._device_name
_dispatcher_choice = _choose._dispatcher_choice
_triton_applicable = _choose._triton_applicable

__all__ = ["AttentionMatch", "MaskTerm", "find_attention", "rewrite_attention", "AttentionPass", "PASS",
           "attention_key", "choose_implementation", "default_sdpa_backend", "dispatched_sdpa_backend",
           "evaluate_constant", "native_sdpa_backend", "sdpa_applicable"]
