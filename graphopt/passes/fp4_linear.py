"""The `fp4_linear` pass: weights to MXFP4 / NVFP4 at compile time (lossy, opt-in).

For every linear whose weight is a 2-D model parameter (F.linear, nn.Linear, addmm as in GPT-2's
Conv1D, x @ W, x @ W.T; graphopt.passes.fx_utils.find_linears) in an inference graph:
  1. the weight must be freezable (a parameter that does not require grad under grad mode);
  2. the cost model must predict a win: graphopt::fp4_linear (graphopt.cost.fp4
     .estimate_fp4_linear, families fp4_gemv / fp4_gemm) against the dense linear
     (graphopt.cost_model.linear), by at least MIN_PREDICTED_SPEEDUP (a lossy rewrite must buy
     a real gain). Tiny layers (launch-bound) and the CPU target are declined, unless `force=True`;
  3. the weight is quantized once (option `fp4_format`, scale search on), and its SQNR in dB
     against the original weight must reach `error_budget["fp4_linear"]`;
  4. the linear becomes one `graphopt::fp4_linear` node reading the kernel-layout constants.
Where it wins (bench/RESULTS.md): decode, a few tokens per call; prefill sizes stay dense. The
decode constants of the cost model (graphopt/cost/fp4.py) are fitted to measured decode rows.
`force=True` rewrites anyway (memory savings, 3.6x smaller weights, are then the gain).
The op is a torch.library.triton_op: Inductor launches its Triton kernels from its own generated
code (and inside its CUDA graphs), so no Python launch path is paid per call. Its kernel path and
tile are chosen here, at compile time, and passed in its `kernel` string: the path by the cost
model on the GPU the weights are on (graphopt.cost.fp4.device_path), the tile by timing
(fp4.tune_fp4_linear, for a static token count, kept in the tuning file); for a token count not
known here, the cost model's path for every token range (graphopt.cost.fp4.path_ranges) with
default tiles. fp4_tma's Gluon decode, an opaque op with a Python launch, is a candidate only
under CUDA graphs.
Plans (options={"plan": path}; graphopt.plan): a "fp4_linear" section may supply pre-quantized
weights per module path, e.g. GPTQ-style ones from graphopt.kernels.fp4.calibrate_fp4, written by
`save_fp4_plan(path, {module_path: Fp4Tensor})`:
    "fp4_linear": {"file": "<plan stem>.fp4.safetensors",
                   "layers": {"<module path>": {"format": "nvfp4", "out_features": N, "in_features": K}}}
Tensors in the file: "<module path>.codes" (uint8, standard packing), "<module path>.scales" (uint8
bytes; e4m3 bit patterns for NVFP4), "<module path>.global_scale" (fp32 scalar). A layer with an
entry uses those codes instead of quantizing its weight; the entry's format must equal
`fp4_format` and its shape the layer's, else the layer is declined with the reason. The SQNR budget
is checked against the layer's actual weight (which also catches a plan made for other weights).
Layers without an entry are quantized at compile time as without a plan.
Each match records one Decision; applied ones carry `memory_saved_bytes` (dense weight bytes
minus packed codes + scales), the weight SQNR, the format and the kernel path for this token count.
Output shape and dtype are unchanged. Inference only (the op has no autograd formula).
Tensor-parallel linears (DTensor weights; graphopt.passes.tensor_parallel): each rank quantizes its
shard, NVFP4 with the whole weight's global scale (one all-reduce per layer or sibling group, made
in the same order on every rank), and the op runs on the local tensors.

ONNX (graphopt.export_onnx, onnx_forms={"graphopt::fp4_linear": "standard" | "runnable"}):
  standard: DequantizeLinear(FLOAT4E2M1 codes, fp32 block scales, axis=1, block_size=32|16)
            -> undo the kernel layout's within-block order (Reshape/Transpose/Reshape) -> MatMul.
            MXFP4 block scales are 2^(byte - 127) computed with Pow; NVFP4 block scales are
            DequantizeLinear(e4m3 scales, global scale), the usual two-level NVFP4 form.
  runnable: uint8 codes -> low/high nibbles -> Gather from the 16-value e2m1 table -> times the
            block scales -> same reorder -> MatMul. onnxruntime 1.31's CPU provider implements
            neither FLOAT4E2M1 DequantizeLinear nor Cast, so this is the form it can run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from graphopt import cost_model
from graphopt.cost import fp4 as fp4_cost
from graphopt.kernels import fp4 as fp4k
from graphopt.kernels.linear_fusion import interleave_gate_up
import graphopt.ops  # noqa: F401  (registers the graphopt::* ops this module names)
from graphopt.onnx_registry import register_onnx_translation
from graphopt.passes.base import GraphPass, PassContext, log
from graphopt.passes.fx_utils import (LinearMatch, arg, bias_problem, dtype, find_linears, model_state_input,
                                      replace_linear, replace_siblings_with_call, sibling_groups)
from graphopt.passes.tensor_parallel import all_ranks_agree, all_ranks_amax
from graphopt.passes.fx_utils import tokens as token_count
from graphopt.passes.linear_fusion import fuse_decode_neighbours, mark_dependent_calls
from graphopt.plan import plan_section, save_plan
from graphopt.quant.linear import FP4_SCALE_SEARCH

# Compile-time quantization uses the per-block MSE scale search (one-time cost; lowers weight
# error, see tests/kernels/test_fp4.py::test_scale_search_lowers_error), as graphopt.quantize_ does.
SCALE_SEARCH = FP4_SCALE_SEARCH
# A lossy rewrite must buy a real speedup: launch-bound layers predicted within 5% are declined.
MIN_PREDICTED_SPEEDUP = 1.05


def predict(hw, tokens: int, in_features: int, out_features: int, fmt: str, *, act_dtype: torch.dtype = torch.bfloat16,
            bias: bool = False) -> tuple[cost_model.Estimate, cost_model.Estimate]:
    """(dense linear, graphopt::fp4_linear) predicted on `hw` for activations of `act_dtype`: what the
    pass compares."""
    dtype_bytes = act_dtype.itemsize
    before = cost_model.linear(hw, tokens, in_features, out_features, dtype_bytes=dtype_bytes, bias=bias)
    after = fp4_cost.estimate_fp4_linear(hw, tokens, in_features, out_features, fmt, dtype_bytes=dtype_bytes, bias=bias,
                                     act_dtype=act_dtype)
    return before, after


def worth_rewriting(before: cost_model.Estimate, after: cost_model.Estimate) -> bool:
    """The unforced rule: predicted faster by at least MIN_PREDICTED_SPEEDUP."""
    return before.ms >= MIN_PREDICTED_SPEEDUP * after.ms


class Fp4LinearPass(GraphPass):
    name = "fp4_linear"
    lossless = False

    def run(self, ctx: PassContext) -> None:
        if (why := ctx.differentiated_reason()) is not None:
            ctx.record(self.name, False, why)
            return
        pending: dict = {}  # kernel placeholder -> what _choose_kernels needs
        self._quantized_in_place(ctx, pending)
        fmt = ctx.config.fp4_format
        budget_db = ctx.config.error_budget["fp4_linear"]
        plan = PlanWeights(plan_section(ctx, self.name))
        replaced: dict = {}  # erased linear node -> the node now computing it (later matches read it)
        tied: dict = {}  # (weight node, transposed) -> the quantized weight its first linear made
        matches = find_linears(ctx)
        if ctx.config.fuse_sibling_linears:
            for group in sibling_groups(matches):
                if any(plan.has(m.location) for m in group):
                    continue  # plan weights carry their own global scales
                outs = self._siblings(ctx, group, fmt, budget_db, replaced, pending)
                for m, out in zip(group, outs or ()):
                    replaced[m.node] = out
        for m in matches:
            if m.node not in replaced:
                new = self._one(ctx, m, fmt, budget_db, replaced, plan, tied, pending)
                if new is not None:
                    replaced[m.node] = new
        fused = fuse_decode_neighbours(ctx, torch.ops.graphopt.fp4_linear.default, 7,
                                       interleave=lambda call: _interleave_gate_up(ctx, call, pending))
        mark_dependent_calls(ctx, torch.ops.graphopt.fp4_linear.default)
        self._choose_kernels(ctx, pending, fused)

    @staticmethod
    def _choose_kernels(ctx: PassContext, pending: dict, fused: dict) -> None:
        """The kernel string of every call this pass wrote, chosen now that the calls have taken in
        their neighbours (a fused call's tiles are timed with them)."""
        for node in ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.graphopt.fp4_linear.default):
            entry = pending.get(arg(node, 9, "kernel", ""))
            if entry is None:
                continue
            info, kw, has_bias, path, decisions = entry
            taken = fused.get(node, [])
            kernel, tuned = _op_kernel(ctx, info, kw, has_bias, tuple(taken))
            _set_arg(node, 9, "kernel", kernel)
            for decision in decisions:
                decision.details["kernel"] = kernel
                if decision.applied:
                    decision.implementation = _implementation(path, tuned)
                if taken:
                    decision.details["fused"] = taken

    def _quantized_in_place(self, ctx: PassContext, pending: dict) -> None:
        """graphopt::fp4_linear calls that read their packed weights from the model's buffers (layers
        that graphopt.quantize_ or graphopt.load_quantized made): the weights stay as they are (no
        second quantization, whatever fp4_format says); on a GPU the op gets the cost model's path
        and tile for its token count here, as the pass's own rewrites do. One Decision each, not
        applied (nothing is rewritten)."""
        for node in ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.graphopt.fp4_linear.default):
            codes = model_state_input(ctx, arg(node, 1, "codes"))
            if codes is None:
                continue
            x, bias = arg(node, 0, "x"), arg(node, 5, "bias")
            scales, global_scale = (ctx.example_value(arg(node, i, name)) for i, name in ((3, "scales"), (4, "global_scale")))
            out_f, in_f, fmt = arg(node, 6, "out_features"), arg(node, 7, "in_features"), arg(node, 8, "format")
            static = token_count(x)
            kw = fp4k.Fp4KernelWeight(codes, scales, global_scale, out_f, in_f, fmt)
            info = dict(tokens=static or 1, static_tokens=static is not None, act_dtype=dtype(x) or torch.bfloat16)
            kernel = arg(node, 9, "kernel", "")
            decision = ctx.record(self.name, False, f"already quantized to {fmt} in the model (graphopt.quantize_): "
                                  f"weights kept as they are, not quantized again", node=node, implementation=None,
                                  quantized_in_place=True, format=fmt, kernel=kernel,
                                  fp4_weight_bytes=int(kw.nbytes) if isinstance(scales, torch.Tensor) else None)
            if not kernel and isinstance(scales, torch.Tensor) and isinstance(global_scale, torch.Tensor):
                _set_arg(node, 9, "kernel", _pending(pending, info, kw, bias is not None, "", [decision]))

    def _decide(self, ctx: PassContext, m: LinearMatch, fmt: str) -> tuple[str | None, dict]:
        """(why not, {}) or (None, the estimates): every check that needs no quantized weight."""
        if m.problem is not None:
            return m.problem, {}
        ok, why = ctx.can_freeze(m.weight_node)
        if not ok:
            return why, {}
        x_dtype, out_dtype = dtype(m.input), dtype(m.node)
        if x_dtype is None or out_dtype is None or not x_dtype.is_floating_point:
            return "input/output dtype unknown or not floating point", {}
        if x_dtype != out_dtype:
            return f"mixed dtypes (input {x_dtype}, output {out_dtype}); the op returns the input's dtype", {}
        if (why := bias_problem(m)) is not None:
            return why, {}
        tokens = m.tokens()
        tokens_note = ""
        if tokens is None:
            tokens, tokens_note = 1, " (dynamic token count: costed at 1 token)"
        before, after = predict(ctx.hardware, tokens, m.in_features, m.out_features, fmt, act_dtype=x_dtype,
                                bias=m.bias_node is not None)
        info = dict(before=before, after=after, tokens=tokens, note=tokens_note, act_dtype=x_dtype,
                    static_tokens=not tokens_note)
        accepted, reason = self.accept(ctx, before, after)
        if accepted and not ctx.config.force and not worth_rewriting(before, after):
            accepted, reason = False, (f"predicted gain {before.ms / after.ms:.2f}x is below {MIN_PREDICTED_SPEEDUP:.2f}x, "
                                       f"not worth a lossy rewrite ({before.ms:.4f} -> {after.ms:.4f} ms)")
        return (None if accepted else reason + tokens_note), {**info, "reason": reason}

    def _one(self, ctx: PassContext, m: LinearMatch, fmt: str, budget_db: float, replaced: dict, plan: "PlanWeights",
             tied: dict, pending: dict):
        """One linear. A weight that an earlier linear of this graph already quantized (tied
        weights) reuses that linear's constants: one FP4 copy, its memory saving counted once."""
        node = m.node
        why, info = self._decide(ctx, m, fmt)
        if why is not None:
            ctx.record(self.name, False, why, node=node, before=info.get("before"), after=info.get("after"))
            return
        before, after, tokens = info["before"], info["after"], info["tokens"]
        in_f, out_f = m.in_features, m.out_features

        # Measure before freezing: a declined layer must not pin the parameter.
        weight = m.value(ctx)  # (N, K); a tensor-parallel linear: this rank's shard
        source = "compile-time quantization"
        tie_key = (m.weight_node, m.weight_transposed)
        first_use = None if plan.has(m.location) else tied.get(tie_key)
        if first_use is not None:
            q, source = first_use["q"], f"the FP4 weight of {first_use['location']} (tied)"
        elif plan.has(m.location):
            q, problem = plan.get(m.location, fmt, (out_f, in_f))
            if q is None:
                ctx.record(self.name, False, f"plan weights for {m.location!r}: {problem}", node=node, before=before, after=after)
                return
            source = f"plan weights ({plan.file})"
            q = dataclasses.replace(q, codes=q.codes.to(weight.device), scales=q.scales.to(weight.device),
                                    global_scale=q.global_scale.to(weight.device))
        else:
            q = fp4k.quantize_fp4(weight, fmt, scale_search=SCALE_SEARCH, tensor_amax=_tensor_amax([m], [weight], fmt))
        sqnr = first_use["sqnr"] if first_use is not None else fp4k.weight_sqnr_db(weight, q)
        if not sqnr >= budget_db:  # NaN (a weight fp4 cannot hold) fails too
            ctx.record(self.name, False, f"weight SQNR {sqnr:.2f} dB below the budget of {budget_db:.2f} dB "
                       f"(error_budget['fp4_linear']; {source})", node=node, before=before, after=after, sqnr_db=sqnr, format=fmt)
            return

        m.weight(ctx)  # freeze: the compiled graph now depends on this parameter's value
        kw = fp4k.to_kernel_layout(q)
        path = (fp4_cost.choose_fp4_path(ctx.hardware, tokens, in_f, out_f, fmt, info["act_dtype"])
                if ctx.hardware.is_gpu else "reference")
        dense_bytes = weight.numel() * weight.element_size()
        if first_use is not None:
            constants, saved, fp4_bytes = first_use["constants"], 0, 0
        else:
            constants, saved, fp4_bytes = self._constants(ctx, kw), dense_bytes - kw.nbytes, kw.nbytes
            if not plan.has(m.location):
                tied[tie_key] = dict(q=q, sqnr=sqnr, constants=constants, location=m.location or node.name)
        decision = ctx.record(
            self.name, True, info["reason"] + info["note"] + m.shard_note, node=node, before=before, after=after,
            implementation=_implementation(path, ""),
            memory_saved_bytes=int(saved), dense_weight_bytes=int(dense_bytes),
            fp4_weight_bytes=int(fp4_bytes), sqnr_db=sqnr, format=fmt, tokens=tokens, weights_from=source,
            **m.shard_details,
        )
        kernel = _pending(pending, info, kw, m.bias_node is not None, path, [decision])
        x_node = replaced.get(m.input, m.input)
        bias_node = replaced.get(m.bias_node, m.bias_node)
        return replace_linear(ctx, m, torch.ops.graphopt.fp4_linear.default,
                              (x_node, *constants, bias_node, out_f, in_f, fmt, kernel))

    def _siblings(self, ctx: PassContext, group: list[LinearMatch], fmt: str, budget_db: float, replaced: dict,
                  pending: dict):
        """Quantize a sibling group's weights as one (concatenated along the output features; for
        NVFP4 that means one global scale) and run a single fp4_linear for all of them: one launch
        and one weight stream instead of several. Every member must pass on its own (cost model
        and weight SQNR); otherwise None, nothing changed or recorded, and the members go through
        _one."""
        infos = []
        for m in group:
            why, info = self._decide(ctx, m, fmt)
            if why is not None:
                return None
            infos.append(info)
        weights = [m.value(ctx) for m in group]
        q = fp4k.quantize_fp4(torch.cat(weights), fmt, scale_search=SCALE_SEARCH,
                              tensor_amax=_tensor_amax(group, weights, fmt))
        restored = fp4k.dequantize_fp4(q).split([w.shape[0] for w in weights])
        sqnrs = [fp4k.sqnr_db(w, r) for w, r in zip(weights, restored)]
        ok = all(sqnr >= budget_db for sqnr in sqnrs)  # NaN fails too
        if group[0].shard is not None and group[0].shard.style != "replicated":
            ok = all_ranks_agree(group[0].shard, ok)  # else ranks would reach _one's all-reduces unevenly
        if not ok:
            return None
        for m in group:
            m.weight(ctx)  # freeze
        kw = fp4k.to_kernel_layout(q)
        in_f, out_total, tokens = group[0].in_features, sum(w.shape[0] for w in weights), infos[0]["tokens"]
        path = (fp4_cost.choose_fp4_path(ctx.hardware, tokens, in_f, out_total, fmt, infos[0]["act_dtype"])
                if ctx.hardware.is_gpu else "reference")
        _, fused_after = predict(ctx.hardware, tokens, in_f, out_total, fmt, act_dtype=infos[0]["act_dtype"])
        names = ", ".join(m.location or m.node.name for m in group)
        decisions = []
        for m, info, w, sqnr in zip(group, infos, weights, sqnrs):
            dense_bytes = w.numel() * w.element_size()
            share = kw.nbytes * w.shape[0] // out_total
            decisions.append(ctx.record(
                self.name, True, f"{info['reason']}{info['note']}; run as one {out_total}x{in_f} FP4 GEMM with its "
                f"siblings ({names}), predicted {fused_after.ms:.4f} ms for all{m.shard_note}", node=m.node, before=info["before"],
                after=info["after"], implementation=_implementation(path, ""),
                memory_saved_bytes=int(dense_bytes - share), dense_weight_bytes=int(dense_bytes), fp4_weight_bytes=int(share),
                sqnr_db=sqnr, format=fmt, tokens=tokens, weights_from="compile-time quantization (with its siblings)",
                **m.shard_details,
            ))
        kernel = _pending(pending, infos[0], kw, False, path, decisions)
        x_node = replaced.get(group[0].input, group[0].input)
        return replace_siblings_with_call(ctx, group, torch.ops.graphopt.fp4_linear.default,
                                          (x_node, *self._constants(ctx, kw), None, out_total, in_f, fmt, kernel))

    @staticmethod
    def _constants(ctx: PassContext, kw) -> tuple:
        """The op's weight arguments: codes, the same bytes as float4_e2m1fn_x2 (read by the ONNX form
        only; a compiled graph gets codes there again: two graph inputs that are views of one storage
        in different dtypes stop AOTAutograd when the graph also mutates an input, as a KV cache
        update does), scales, global scale."""
        codes = ctx.add_constant(kw.codes, "fp4_codes")
        codes_fp4 = ctx.add_constant(kw.codes.view(torch.float4_e2m1fn_x2), "fp4_codes_e2m1") if ctx.for_export else codes
        return (codes, codes_fp4, ctx.add_constant(kw.scales, "fp4_scales"),
                ctx.add_constant(kw.global_scale, "fp4_global_scale"))


def _tensor_amax(group: list[LinearMatch], weights: list[torch.Tensor], fmt: str) -> torch.Tensor | None:
    """For NVFP4 weights sharded over tensor-parallel ranks, the largest |value| of the whole weights
    (one all-reduce), so each rank's blocks get the scales they have in the single-device model;
    None otherwise (the weights' own amax)."""
    shard = group[0].shard
    if fmt != "nvfp4" or shard is None or shard.style == "replicated":
        return None
    return all_ranks_amax(shard, torch.stack([w.abs().amax() for w in weights]).amax())


def _interleave_gate_up(ctx: PassContext, call, pending: dict) -> bool:
    """Put the rows of a call's [gate | up] weight in the gated epilogue's order (gate j, up j, ...),
    in place: only a call without bias whose codes and scales are this pass's own constants, read by
    no other node, and whose kernel is still to be chosen (`pending`, which then tunes the new order)."""
    if arg(call, 5, "bias") is not None or arg(call, 9, "kernel", "") not in pending:
        return False
    nodes = {arg(call, i, name) for i, name in ((1, "codes"), (2, "codes_fp4"), (3, "scales"))}
    if any(getattr(n, "op", None) != "get_attr" or set(n.users) != {call} for n in nodes):
        return False
    for node in nodes:
        rows = getattr(ctx.gm, node.target).view(torch.uint8)  # codes and scale bytes, moved as bytes
        rows.copy_(interleave_gate_up(rows))
    return True


def _set_arg(node, index: int, name: str, value) -> None:
    """Set a call node's argument, positional or keyword."""
    if len(node.args) > index:
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _pending(pending: dict, info: dict, kw, has_bias: bool, path: str, decisions: list) -> str:
    """A placeholder kernel string for a call whose kernel _choose_kernels picks after the fusion;
    `pending` maps it to what the choice needs."""
    key = f"pending:{len(pending)}"
    pending[key] = (info, kw, has_bias, path, decisions)
    return key


def _op_kernel(ctx: PassContext, info: dict, kw, has_bias: bool, fused: tuple[str, ...] = ()) -> tuple[str, str]:
    """(the op's kernel string, its tuned part): the tuned path and tile where _tuned_kernel times one;
    else, for weights on a GPU, the cost model's path on that GPU for every token range, each with its
    default tile (graphopt.cost.fp4.path_ranges); else "" (a CPU graph: the op runs its reference)."""
    tuned = _tuned_kernel(ctx, info, kw, has_bias, fused)
    if tuned or not kw.codes.is_cuda:
        return tuned, tuned
    ranges = fp4_cost.path_ranges(kw.codes.device.index, kw.in_features, kw.out_features, kw.format, info["act_dtype"])
    return fp4k.kernel_string([(lo, hi, path, None) for lo, hi, path in ranges]), ""


def _tuned_kernel(ctx: PassContext, info: dict, kw, has_bias: bool, fused: tuple[str, ...] = ()) -> str:
    """The op's compile-time kernel choice: the cost model's path on the GPU the weights live on
    (graphopt.cost.fp4.device_path) with its tiles timed now, for a static token count in a graph
    that goes to a compiler ("" otherwise). The Gluon decodes (fp4_tma's, decode_persistent's) are
    candidates only under CUDA graphs, where their opaque op's Python launch is not paid per call. A
    failed timing costs speed, never the rewrite."""
    if not (ctx.hardware.is_gpu and info["static_tokens"] and kw.codes.is_cuda) or ctx.for_export:
        return ""
    bias = torch.randn(kw.out_features, device=kw.codes.device, dtype=info["act_dtype"]) if has_bias else None
    try:
        path = fp4_cost.device_path(kw.codes.device.index, info["tokens"], kw.in_features, kw.out_features, kw.format,
                                    info["act_dtype"])
        return fp4k.tune_fp4_linear(info["tokens"], kw.codes, kw.scales, kw.global_scale, bias, kw.out_features,
                                    kw.in_features, kw.format, info["act_dtype"], allow_gluon=ctx.config.cuda_graphs,
                                    path=path, fused=fused)
    except fp4k.NoCorrectTile as exc:  # the path's tiles are wrong on this GPU: dequantize + cuBLAS instead
        log.warning("graphopt fp4_linear: %s; the op dequantizes the weight and runs cuBLAS", exc)
        return fp4k.kernel_string([(0, None, "dequant", None)])
    except Exception as exc:  # noqa: BLE001
        log.warning("graphopt fp4_linear: tuning failed (%s: %s); the op runs its untuned default tile",
                    type(exc).__name__, exc)
        return ""


def _implementation(path: str, kernel: str) -> str:
    """The decision's implementation: the path, and the tuned tile where one was chosen."""
    if path == "reference":
        return "fp4_reference"
    return f"fp4_{path}" + (f" ({kernel.split('=', 2)[2]})" if kernel else "")


PASS = Fp4LinearPass()


# =============================================================================================
# Plans: pre-quantized (e.g. GPTQ-calibrated) weights per module path
# =============================================================================================
class PlanWeights:
    """The plan's "fp4_linear" section; its safetensors file is read on first use."""

    def __init__(self, section: dict | None):
        self.layers = (section or {}).get("layers", {})
        self.file = (section or {}).get("file")
        self._dir = (section or {}).get("_dir", ".")
        self._tensors = None
        self._unreadable = None  # why the file could not be read, once tried

    def has(self, location: str) -> bool:
        return bool(location) and location in self.layers

    def get(self, location: str, fmt: str, shape: tuple[int, int]):
        """(Fp4Tensor, None) or (None, why it cannot be used)."""
        entry = self.layers[location]
        if entry.get("format") != fmt:
            return None, f"format {entry.get('format')!r} does not match fp4_format={fmt!r}"
        planned = (entry.get("out_features"), entry.get("in_features"))
        if planned != shape:
            return None, f"shape {planned[0]}x{planned[1]} (out x in) does not match the layer's {shape[0]}x{shape[1]}"
        if self._tensors is None:
            from safetensors.torch import load_file

            path = Path(self._dir) / str(self.file)
            if not path.exists():
                return None, f"plan tensor file {str(path)!r} does not exist"
            try:
                self._tensors = load_file(str(path))
            except Exception as exc:  # safetensors raises its own error type for a malformed file
                self._tensors = {}
                self._unreadable = f"plan tensor file {str(path)!r} cannot be read as safetensors ({exc})"
        if self._unreadable:
            return None, self._unreadable
        try:
            codes = self._tensors[f"{location}.codes"]
            scales = self._tensors[f"{location}.scales"]
            global_scale = self._tensors[f"{location}.global_scale"]
        except KeyError as exc:
            return None, f"tensor {exc.args[0]!r} missing from {self.file!r}"
        one_byte = (torch.uint8, torch.int8, torch.float8_e4m3fn)
        if codes.dtype not in one_byte[:2] or scales.dtype not in one_byte:
            return None, (f"stored codes ({codes.dtype}) and scales ({scales.dtype}) must be bytes: uint8 codes, uint8 "
                          "scales (e4m3 bit patterns for NVFP4), as save_fp4_plan writes them")
        if global_scale.numel() != 1 or not global_scale.is_floating_point():
            return None, (f"stored global_scale of shape {tuple(global_scale.shape)} and dtype {global_scale.dtype}: "
                          "expected one float")
        bs = fp4k.BLOCK_SIZES[fmt]
        blocks = -(-shape[1] // bs)
        if tuple(codes.shape) != (shape[0], blocks * bs // 2) or tuple(scales.shape) != (shape[0], blocks):
            return None, (f"stored codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit a "
                          f"{shape[0]}x{shape[1]} {fmt} weight")
        scales = scales.view(torch.uint8)
        if fmt == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        return fp4k.Fp4Tensor(codes.view(torch.uint8), scales, global_scale.reshape(()).to(torch.float32), shape, fmt), None


def save_fp4_plan(path, quantized: dict, *, merge: bool = True) -> Path:
    """Write {module path: Fp4Tensor} (e.g. from graphopt.kernels.fp4.calibrate_fp4) as the plan's
    "fp4_linear" section plus "<plan stem>.fp4.safetensors" beside it (merging into an existing plan
    file's other sections unless merge=False). Compile with options={"plan": path}."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    file = f"{path.stem}.fp4.safetensors"
    tensors, layers = {}, {}
    for location, q in quantized.items():
        if not isinstance(q, fp4k.Fp4Tensor):
            raise ValueError(f"save_fp4_plan: {location!r} is a {type(q).__name__}, expected graphopt.kernels.fp4.Fp4Tensor")
        tensors[f"{location}.codes"] = q.codes.detach().cpu().view(torch.uint8).contiguous()
        tensors[f"{location}.scales"] = q.scales.detach().cpu().view(torch.uint8).contiguous()
        tensors[f"{location}.global_scale"] = q.global_scale.detach().cpu().to(torch.float32).reshape(()).contiguous()
        layers[location] = {"format": q.format, "out_features": int(q.shape[0]), "in_features": int(q.shape[1])}
    save_file(tensors, str(path.parent / file))
    return save_plan(path, {"fp4_linear": {"file": file, "layers": layers}}, merge=merge)


# =============================================================================================
# ONNX translations of graphopt::fp4_linear
# =============================================================================================
def _i64(values):
    import numpy as np
    import onnx

    return onnx.numpy_helper.from_array(np.array(values, dtype=np.int64))


def _block_scales_onnx(op, scales, global_scale, format: str):
    """fp32 decode scale per block, (N, Kp/bs)."""
    import onnx

    if format == "mxfp4":
        exponent = op.Sub(op.Cast(scales, to=onnx.TensorProto.FLOAT), op.Constant(value_float=127.0))
        return op.Pow(op.Constant(value_float=2.0), exponent)
    # NVFP4: e4m3 block scales times the fp32 global scale (DequantizeLinear of an fp8 tensor).
    return op.DequantizeLinear(scales, op.Reshape(global_scale, op.Constant(value=_i64([]))))


def _kernel_order_to_natural(op, w_blocks, out_features: int, in_features: int, block_size: int):
    """(N, Kp) in the kernel layout's within-block order [e0, e_h, e1, e_{h+1}, ...] (h = bs/2,
    as read through FLOAT4E2M1 or as nibble pairs) -> (N, K) natural order."""
    w = op.Reshape(w_blocks, op.Constant(value=_i64([out_features, -1, block_size // 2, 2])))
    w = op.Transpose(w, perm=[0, 1, 3, 2])
    w = op.Reshape(w, op.Constant(value=_i64([out_features, -1])))
    return op.Slice(w, op.Constant(value=_i64([0])), op.Constant(value=_i64([in_features])), op.Constant(value=_i64([1])))


def _matmul_bias(op, x, w, bias):
    y = op.MatMul(x, op.Transpose(op.CastLike(w, x), perm=[1, 0]))
    return y if bias is None else op.Add(y, op.CastLike(bias, y))


@register_onnx_translation(torch.ops.graphopt.fp4_linear.default, form="standard")
def _fp4_linear_onnx_standard(x, codes, codes_fp4, scales, global_scale, bias=None, out_features: int = 0,
                              in_features: int = 0, format: str = "nvfp4", kernel: str = ""):
    """DequantizeLinear(FLOAT4E2M1, block scales, axis=1, block_size) -> reorder -> MatMul (+ Add)."""
    from onnxscript import opset23 as op

    bs = fp4k.BLOCK_SIZES[format]
    block_scale = _block_scales_onnx(op, scales, global_scale, format)  # (N, Kp/bs) fp32
    w = op.DequantizeLinear(codes_fp4, block_scale, axis=1, block_size=bs)  # (N, Kp), kernel order
    return _matmul_bias(op, x, _kernel_order_to_natural(op, w, out_features, in_features, bs), bias)


@register_onnx_translation(torch.ops.graphopt.fp4_linear.default, form="runnable")
def _fp4_linear_onnx_runnable(x, codes, codes_fp4, scales, global_scale, bias=None, out_features: int = 0,
                              in_features: int = 0, format: str = "nvfp4", kernel: str = ""):
    """uint8 codes -> nibbles -> Gather(16-value table) -> x block scale -> reorder -> MatMul (+ Add)."""
    import numpy as np
    import onnx
    from onnxscript import opset23 as op

    bs = fp4k.BLOCK_SIZES[format]
    u8 = lambda v: onnx.numpy_helper.from_array(np.array(v, dtype=np.uint8))  # noqa: E731
    low = op.BitwiseAnd(codes, op.Constant(value=u8(15)))
    high = op.BitShift(codes, op.Constant(value=u8(4)), direction="RIGHT")
    pairs = op.Concat(op.Unsqueeze(low, op.Constant(value=_i64([2]))), op.Unsqueeze(high, op.Constant(value=_i64([2]))), axis=2)
    nibbles = op.Cast(op.Reshape(pairs, op.Constant(value=_i64([out_features, -1]))), to=onnx.TensorProto.INT64)  # (N, Kp)
    table = op.Constant(value=onnx.numpy_helper.from_array(np.array(fp4k.E2M1_VALUES, dtype=np.float32)))
    values = op.Gather(table, nibbles, axis=0)  # (N, Kp) fp32, kernel order
    block_scale = _block_scales_onnx(op, scales, global_scale, format)  # (N, Kp/bs)
    values = op.Reshape(values, op.Constant(value=_i64([out_features, -1, bs])))
    w = op.Mul(values, op.Unsqueeze(block_scale, op.Constant(value=_i64([2]))))
    return _matmul_bias(op, x, _kernel_order_to_natural(op, w, out_features, in_features, bs), bias)


__all__ = ["PASS", "Fp4LinearPass", "SCALE_SEARCH", "MIN_PREDICTED_SPEEDUP", "predict", "worth_rewriting", "save_fp4_plan"]
