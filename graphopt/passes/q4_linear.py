"""The `q4_linear` pass: Q4_0 weights x Q8_1 activations, and quantize->GEMM fusion (lossy, opt-in).

Three rewrites, run in this order over the graph:
1. `graphopt::quantize_q8_1(x)` feeding `graphopt::q4_q8_gemm` -> one `graphopt::q4_linear(...,
   "fused")` node: the activation quantization moves inside the GEMM. Same numbers: both paths
   quantize with the same Q8_1 rule and compute the same integer formula (kernels/q4/).
2. The fake-quant idiom of quantization-aware models, `(round(x / s).clamp(qmin, qmax) * s)` fed to a
   linear / matmul whose weight is a parameter lying exactly on a Q4_0 grid (dequantize(quantize(W))
   == W in float32), with s a number or a per-tensor / per-row tensor -> one
   `graphopt::q4_linear_static` node. "Same numbers" here means: the same integers q (the quotient
   rounded to the promoted dtype, round half to even, the same clamp), the same weight values, and
   the dot products summed in fp32 -- equal to the idiom up to fp32 rounding and summation order.
   Only float32 idioms are fused: in bf16/fp16 the idiom rounds q*s to the half type before its
   matmul, which the integer kernel does not reproduce, so those are declined with that reason.
3. Every remaining linear against a frozen 2-D parameter: quantize the weight to Q4_0 once (ggml
   rule), check its SQNR against error_budget["q4_linear"] (dB), and emit `graphopt::q4_linear`
   with the mode the cost model picks (option q4_mode: auto | fused | separate), or keep the
   dense layer where dense bf16 is predicted faster (large token counts).

The tile: where the target GPU is the one the weights live on and the token count is static, the
pass times the chosen mode's tiles now (kernels/q4.tune_q4_linear, cached on disk) and hands the
fastest to the op as its `kernel` string; elsewhere "" (the untuned default). Nothing is tuned in a
user's forward. The tuner checks every tile, the default among them, against the float64 product;
where none of the mode computes it on this GPU, the layer is not rewritten (a sibling group stays
dense as a whole), with the reason, and a layer held only as Q4_0 (graphopt.quantize_) runs
q4.dequantized_q4_linear, a dense GEMM on its dequantized weight, instead of a tile known wrong.
The Gluon decodes are candidates only under CUDA graphs (cuda_graphs=True, mode="reduce-overhead"):
q4_tma's in the separate mode, and for 1-4 tokens, in either mode, decode_persistent's (it quantizes
the activations itself). They run as an opaque op whose Python launch path costs more host time per
call than the layer's GPU work, while Inductor launches the Triton kernels from its generated code.

Tensor-parallel linears (DTensor weights; graphopt.passes.tensor_parallel): each rank quantizes its
shard (Q4_0 blocks run along the input features, inside a shard whose width is a multiple of 32)
and the op runs on the local tensors, the collectives after it unchanged. Whether a layer is
rewritten (its shard's SQNR, a tile that computes the product) is agreed by all ranks, so every
rank rewrites the same layers.

Activation range: Q8_1 stores each 32-value block's step d = amax / 127 in fp16, byte-for-byte as
ggml does. A block whose largest magnitude is below about 8e-3 gets a subnormal step (fewer
significant bits), below about 8e-6 a zero step (the block then contributes nothing), and above
about 8.3e6 an infinite one (NaN outputs). The error budget checks the weights only, which the pass
sees at compile time; activations outside that range need a rescaled model or another pass.

Where it wins (bench/RESULTS.md sections 3 and 4): decode, at 1-16 tokens, on the fused dp4a kernel,
q4_tma's Gluon decode (the separate path, which the cost model picks at 4-16 tokens) or the
persistent decode; from 64 tokens on the int8 GEMM is slower than cuBLAS bf16. The cost model
(tests/cost/test_fit_regression.py) therefore rewrites decode linears and declines prefill unless
force=True. The estimates and the mode choice are graphopt.cost.q4's (estimate_q4_fused,
estimate_q4_separate, predict_linear).

ONNX: `q4_linear` exports the Q8_1 rounding of its activations as plain ONNX ops (so the exported
model computes what the op computes), then DequantizeLinear(INT4 weight = nibble - 8, scale d, axis 1,
block_size 32) -> MatMul ("standard"), or as com.microsoft.MatMulNBits ("matmulnbits": onnxruntime's fast
kernel; its 4-bit blobs pack element 2i in the low and 2i+1 in the high nibble of byte i, and with
no zero_points input the zero point is 8, which is exactly Q4_0's offset). The nibble plane is
unpacked with ONNX ops on the stored initializers; onnxruntime folds that at session start.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.fx as fx

from graphopt import cost_model
from graphopt.cost.q4 import estimate_q4_fused, estimate_q4_separate, predict_linear
from graphopt.cost_model import roofline
from graphopt.kernels import q4 as q4k
from graphopt.kernels.tuning import NoCorrectTile
import graphopt.ops  # noqa: F401  (registers the graphopt::* ops this module names)
from graphopt.onnx_registry import register_onnx_translation
from graphopt.passes.base import GraphPass, PassContext, log
from graphopt.passes.fx_utils import (LinearMatch, arg, bias_problem, canonical, dtype, fake, find_linears, model_state_input,
                                      replace_linear, replace_siblings_with_call, replace_with_call, shape,
                                      sibling_groups)
from graphopt.passes.fx_utils import tokens as token_count
from graphopt.passes.tensor_parallel import all_ranks_agree


def _dtype_bytes(dt: torch.dtype | None) -> int:
    return 4 if dt == torch.float32 else 2


def _is_op(node, packet) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (packet, packet.default)


def _name(node) -> str | None:
    """canonical() plus the ops the fake-quant idiom uses (round, clamp)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        if node.target in (torch.round,):
            return "round"
        if node.target in (torch.clamp, torch.clip):
            return "clamp"
    if node.op == "call_method" and node.target in ("round", "clamp", "clip"):
        return "clamp" if node.target in ("clamp", "clip") else "round"
    return canonical(node)


class Q4LinearPass(GraphPass):
    name = "q4_linear"
    lossless = False

    def run(self, ctx: PassContext) -> None:
        if (why := ctx.differentiated_reason()) is not None:
            ctx.record(self.name, False, why)
            return
        self._quantized_in_place(ctx)
        self._fuse_prequantized(ctx)
        self._fuse_fake_quant(ctx)
        self._quantize_linears(ctx)

    # -- 0. layers quantized in the model (graphopt.quantize_) ------------------------------------
    def _quantized_in_place(self, ctx: PassContext) -> None:
        """graphopt::q4_linear calls that read their Q4_0 weights from the model's buffers (layers
        that graphopt.quantize_ or graphopt.load_quantized made): the weights stay as they are; the
        op gets the cost model's mode (q4_mode) and, on a GPU, its tile for the token count here,
        as the pass's own rewrites do (modes and tiles give the same numbers up to fp32 summation
        order). One Decision each, not applied. Where no tile of either mode computes the product
        on this GPU, the call becomes q4.dequantized_q4_linear (a dense GEMM on the dequantized
        weight): there is no dense weight to keep."""
        for node in ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.graphopt.q4_linear.default):
            qweight = model_state_input(ctx, arg(node, 1, "qweight"))
            if qweight is None:
                continue
            x, scales, bias = arg(node, 0, "x"), ctx.example_value(arg(node, 2, "scales")), arg(node, 3, "bias")
            act_dtype, xs = dtype(x), shape(x)
            static = token_count(x)
            k, n = (xs[-1] if xs else 2 * qweight.shape[1]), qweight.shape[0]
            reason = "already quantized to q4_0 in the model (graphopt.quantize_): weights kept as they are"
            if arg(node, 5, "kernel", "") or act_dtype not in q4k.SUPPORTED_ACT_DTYPES:
                ctx.record(self.name, False, reason, node=node, quantized_in_place=True)
                continue
            before, after, mode, _, _ = predict_linear(ctx.hardware, static or 1, k, n, act_bytes=_dtype_bytes(act_dtype),
                                                       bias=bias is not None, mode=ctx.config.q4_mode,
                                                       tma=ctx.config.cuda_graphs)
            mode = _op_mode(mode)
            layer = dict(tokens=static, mode=mode, in_features=k, act_dtype=act_dtype)
            kernel = _tuned_kernel(ctx, layer, qweight, scales, bias is not None)
            if kernel is None:  # the weights exist only as Q4_0: the other kernel mode, if one of its tiles is right
                mode = layer["mode"] = "separate" if mode == "fused" else "fused"
                kernel = _tuned_kernel(ctx, layer, qweight, scales, bias is not None)
            if kernel is None:  # no dense weight to go back to: the Q4 product through a dense GEMM
                ctx.record(self.name, False, f"{reason}; no Q4 tile of either kernel mode, the defaults included, computed "
                           f"the product at {static}x{n}x{k} on this GPU: the layer dequantizes its weight and runs a "
                           "dense fp32 GEMM (kernels/q4 dequantized_q4_linear) instead", node=node, before=before,
                           quantized_in_place=True, implementation="q4 dequantize + dense GEMM")
                replace_with_call(ctx, node, q4k.dequantized_q4_linear, (x, arg(node, 1, "qweight"),
                                                                         arg(node, 2, "scales"), bias))
                continue
            for index, name, value in ((4, "mode", mode), (5, "kernel", kernel)):
                if len(node.args) > index:
                    node.update_arg(index, value)
                else:
                    node.update_kwarg(name, value)
            ctx.record(self.name, False, f"{reason}; mode {mode}, tile {_tile_name(kernel)} chosen at compile time",
                       node=node, before=before, after=after, quantized_in_place=True, mode=mode, tile=_tile_name(kernel))

    # -- 1. graphopt::quantize_q8_1 -> graphopt::q4_q8_gemm --------------------------------------
    def _fuse_prequantized(self, ctx: PassContext) -> None:
        ops = torch.ops.graphopt
        for node in list(ctx.gm.graph.nodes):
            if not _is_op(node, ops.q4_q8_gemm):
                continue
            xq = arg(node, 0, "xq")
            if not _is_op(xq, ops.quantize_q8_1):
                ctx.record(self.name, False, "q4_q8_gemm input is not produced by graphopt::quantize_q8_1 in this graph",
                           node=node, implementation=None)
                continue
            x = arg(xq, 0, "x")
            qweight, scales = arg(node, 1, "qweight"), arg(node, 2, "scales")
            bias, out_dtype = arg(node, 3, "bias"), arg(node, 4, "out_dtype")
            if dtype(x) is not None and out_dtype != dtype(x):
                ctx.record(self.name, False, f"GEMM output dtype {out_dtype} differs from the activation dtype {dtype(x)}; "
                           "the fused op returns the activation dtype", node=node)
                continue
            xs, ws = shape(x), shape(qweight)
            tokens = (math.prod(xs[:-1]) or 1) if xs else 1  # an empty batch is costed as one token
            k = xs[-1] if xs else (2 * ws[1] if ws else 64)
            n = ws[0] if ws else 1
            act = _dtype_bytes(dtype(x))
            before = estimate_q4_separate(ctx.hardware, tokens, k, n, act_bytes=act, bias=bias is not None, tma=False)
            after = estimate_q4_fused(ctx.hardware, tokens, k, n, act_bytes=act, bias=bias is not None)
            if ctx.config.q4_mode == "separate":
                ctx.record(self.name, False, "q4_mode='separate' keeps quantization and GEMM as two kernels",
                           node=node, before=before, after=after)
                continue
            ok, why = (True, "q4_mode='fused'") if ctx.config.q4_mode == "fused" else self.accept(ctx, before, after)
            if not ok:
                ctx.record(self.name, False, f"quantize->GEMM fusion: {why}", node=node, before=before, after=after)
                continue
            layer = dict(tokens=tokens if xs else None, mode="fused", in_features=k, act_dtype=dtype(x))
            kernel = _tuned_kernel(ctx, layer, ctx.example_value(qweight), ctx.example_value(scales), bias is not None)
            if kernel is None:
                ctx.record(self.name, False, f"quantize->GEMM fusion: {_no_tile_reason(layer, n)} as two kernels",
                           node=node, before=before, after=after)
                continue
            ctx.record(self.name, True, f"quantize_q8_1 -> q4_q8_gemm fused: {why}", node=node, before=before,
                       after=after, implementation="q4_linear fused", fusion="quantize_q8_1+q4_q8_gemm",
                       tile=_tile_name(kernel))
            replace_with_call(ctx, node, ops.q4_linear.default, (x, qweight, scales, bias, "fused", kernel), matched=[xq])

    # -- 2. fake-quant idiom: (round(x / s).clamp(a, b) * s) @ W_q4 ------------------------------
    def _fuse_fake_quant(self, ctx: PassContext) -> None:
        for m in find_linears(ctx):
            idiom = None if m.shard is not None else _match_fake_quant(m.input)
            if idiom is None:
                continue  # not an idiom (or tensor-parallel): the plain linear rewrite below sees it
            x, scale, qmin, qmax, nodes = idiom
            node = m.node
            promoted = dtype(node)
            if promoted != torch.float32:
                ctx.record(self.name, False, f"fake-quant idiom in {promoted}: the idiom rounds q*s to {promoted} before "
                           "its matmul, which the fused integer kernel does not reproduce; only float32 idioms are fused",
                           node=node)
                continue
            ok, why = ctx.can_freeze(m.weight_node)
            if not ok:
                ctx.record(self.name, False, why, node=node)
                continue
            if m.in_features % q4k.QK:
                ctx.record(self.name, False, f"in_features={m.in_features} is not a multiple of 32", node=node)
                continue
            if (why := bias_problem(m)) is not None:
                ctx.record(self.name, False, f"fake-quant idiom: {why}", node=node)
                continue
            w = ctx.example_value(m.weight_node).detach()
            w = w.t() if m.weight_transposed else w
            blocks = q4k.quantize_q4_0(w)
            if not torch.equal(q4k.dequantize_q4_0(blocks), w.to(torch.float32)):
                ctx.record(self.name, False, "fake-quant idiom, but the weight does not lie exactly on a Q4_0 grid "
                           "(dequantize(quantize(W)) != W); left to the plain q4_linear rewrite", node=node)
                continue
            tokens = m.tokens() or 1
            before = cost_model.chain(
                "fake-quant + dense linear",
                roofline(ctx.hardware, "round(x/s).clamp()*s", bytes_moved=8.0 * tokens * m.in_features, family="pointwise"),
                cost_model.linear(ctx.hardware, tokens, m.in_features, m.out_features, dtype_bytes=4, bias=m.bias_node is not None))
            after = estimate_q4_fused(ctx.hardware, tokens, m.in_features, m.out_features, act_bytes=4,
                                      bias=m.bias_node is not None)
            ok, why = self.accept(ctx, before, after)
            if not ok:
                ctx.record(self.name, False, f"fake-quant fusion: {why}", node=node, before=before, after=after)
                continue
            qweight, scales = q4k.pack_q4_0(blocks)
            m.weight(ctx)  # freeze
            qw_node = ctx.add_constant(qweight, "q4_weight")
            sc_node = ctx.add_constant(scales, "q4_scales")
            if not isinstance(scale, fx.Node):
                scale = ctx.add_constant(torch.tensor(float(scale), dtype=torch.float32, device=w.device), "q4_act_scale")
            ctx.record(self.name, True, f"fake-quant idiom + Q4_0-grid weight fused: {why}", node=node, before=before,
                       after=after, implementation="q4_linear_static", fusion="fake_quant+linear", qmin=qmin, qmax=qmax)
            replace_with_call(ctx, node, torch.ops.graphopt.q4_linear_static.default,
                              (x, scale, qw_node, sc_node, m.bias_node, qmin, qmax), matched=[*nodes, *m.extra_nodes])

    # -- 3. plain linears ------------------------------------------------------------------------
    def _quantize_linears(self, ctx: PassContext) -> None:
        budget = ctx.config.error_budget["q4_linear"]
        matches = find_linears(ctx)
        replaced: dict = {}  # erased linear node -> the node now computing it (later matches read it)
        tied: dict = {}  # (weight node, transposed) -> the Q4_0 constants its first linear made
        declined: set = set()  # members of a sibling group declined as a whole (each has its Decision)
        if ctx.config.fuse_sibling_linears:
            for group in sibling_groups(matches):
                for m, out in zip(group, self._siblings(ctx, group, budget, replaced, declined) or ()):
                    replaced[m.node] = out
        for m in matches:
            if m.node not in replaced and m.node not in declined:
                new = self._one(ctx, m, budget, replaced, tied)
                if new is not None:
                    replaced[m.node] = new

    def _decide(self, ctx: PassContext, m: LinearMatch, out_features: int | None = None) -> tuple[str | None, dict]:
        """(why not, details) or (None, the estimates and mode): every check before quantizing.
        out_features: cost the layer with this many outputs (a sibling group's total)."""
        if m.problem is not None:
            return m.problem, {}
        ok, why = ctx.can_freeze(m.weight_node)
        if not ok:
            return why, {}
        k, n = m.in_features, out_features or m.out_features
        if k % q4k.QK:
            return f"in_features={k} is not a multiple of 32 (Q4_0 blocks)", {}
        act_dtype = dtype(m.input)
        if act_dtype not in q4k.SUPPORTED_ACT_DTYPES:
            return f"activation dtype {act_dtype} not supported (float16, bfloat16, float32)", {}
        out_dtype = dtype(m.node)
        if out_dtype != act_dtype:  # e.g. under autocast: fp32 in, bf16 out
            return f"mixed dtypes (input {act_dtype}, output {out_dtype}); the op returns the input's dtype", {}
        if (why := bias_problem(m)) is not None:
            return why, {}
        static_tokens = m.tokens()
        note = "" if static_tokens is not None else " (symbolic token count: estimated at 1 token)"
        tokens = static_tokens or 1
        before, after, mode, fused, separate = predict_linear(ctx.hardware, tokens, k, n, act_bytes=_dtype_bytes(act_dtype),
                                                             bias=m.bias_node is not None, mode=ctx.config.q4_mode,
                                                             tma=ctx.config.cuda_graphs)
        info = dict(before=before, after=after, mode=mode, note=note, tokens=static_tokens, in_features=k,
                    act_dtype=act_dtype, details=dict(fused_ms=fused.ms, separate_ms=separate.ms, tokens=tokens))
        ok, why = self.accept(ctx, before, after)
        return (None if ok else why + note), {**info, "reason": why}

    def _one(self, ctx: PassContext, m: LinearMatch, budget: float, replaced: dict, tied: dict) -> fx.Node | None:
        """One linear. A weight that an earlier linear of this graph already quantized (tied
        weights) reuses that linear's constants: one Q4_0 copy, its memory saving counted once."""
        node = m.node
        why, info = self._decide(ctx, m)
        if why is not None:
            ctx.record(self.name, False, why, node=node, before=info.get("before"), after=info.get("after"),
                       **info.get("details", {}))
            return
        before, after, details = info["before"], info["after"], info["details"]
        w = m.value(ctx)  # a tensor-parallel linear: this rank's shard; Q4_0 blocks stay inside it
        tie_key = (m.weight_node, m.weight_transposed)
        first_use = tied.get(tie_key)
        if first_use is None:
            qweight, scales = q4k.quantize_weight(w)
            sqnr = q4k.weight_sqnr_db(w, qweight, scales)
        else:
            sqnr, (qweight, scales) = first_use["sqnr"], first_use["weights"]
        sqnr_ok = sqnr >= budget  # NaN (a block scale past fp16's range) fails too
        if not _agree(m, sqnr_ok):
            why = (f"weight SQNR {sqnr:.1f} dB is below the budget of {budget:.1f} dB" if not sqnr_ok else
                   f"the weight SQNR of another tensor-parallel rank's shard is below the budget of {budget:.1f} dB; "
                   "every rank keeps this layer dense")
            ctx.record(self.name, False, why, node=node, before=before, after=after, sqnr_db=sqnr, **details,
                       **m.shard_details)
            return
        kernel = _tuned_kernel(ctx, info, qweight, scales, m.bias_node is not None)
        if not _agree(m, kernel is not None):
            ctx.record(self.name, False, _no_tile_reason(info, m.out_features, local=kernel is None), node=node,
                       before=before, after=after, sqnr_db=sqnr, **details, **m.shard_details)
            return
        m.weight(ctx)  # freeze
        note = info["note"]
        if first_use is None:
            constants = self._constants(ctx, qweight, scales)
            saved = w.numel() * w.element_size() - qweight.numel() - scales.numel() * scales.element_size()
            tied[tie_key] = dict(sqnr=sqnr, constants=constants, weights=(qweight, scales),
                                 location=m.location or node.name)
        else:
            constants, saved = first_use["constants"], 0
            note += f"; shares the Q4_0 weight of {first_use['location']} (tied)"
        ctx.record(self.name, True, f"{info['reason']}; Q4_0 weight SQNR {sqnr:.1f} dB{note}{m.shard_note}", node=node,
                   before=before, after=after, implementation=f"q4_linear {info['mode']}", sqnr_db=sqnr,
                   memory_saved_bytes=saved, tile=_tile_name(kernel), **details, **m.shard_details)
        return replace_linear(ctx, m, torch.ops.graphopt.q4_linear.default,
                              (replaced.get(m.input, m.input), *constants,
                               replaced.get(m.bias_node, m.bias_node), _op_mode(info["mode"]), kernel))

    def _siblings(self, ctx: PassContext, group: list[LinearMatch], budget: float, replaced: dict,
                  declined: set) -> list | None:
        """One Q4 GEMM for a sibling group: the weights concatenated along the output features
        (Q4_0 blocks are per row, so this quantizes each weight exactly as on its own), one launch
        and one weight stream. Returns the members' new value nodes. Every member must pass on its
        own; otherwise nothing is changed or recorded (None) and the members go through _one.
        Where no tile computes the group's product on the GPU, the whole group stays dense: each
        member is recorded with the reason and added to `declined`. Under tensor parallelism each
        verdict is every rank's (_agree), so all ranks rewrite the same layers."""
        members = [self._decide(ctx, m) for m in group]
        if any(why is not None for why, _ in members):
            return None
        out_total = sum(m.out_features for m in group)
        why, total = self._decide(ctx, group[0], out_features=out_total)
        if why is not None:  # the group costed as one layer (cannot be slower than its members, but be safe)
            return None
        weights = [m.value(ctx) for m in group]
        quantized = [q4k.quantize_weight(w) for w in weights]
        sqnrs = [q4k.weight_sqnr_db(w, qw, sc) for w, (qw, sc) in zip(weights, quantized)]
        if not _agree(group[0], all(sqnr >= budget for sqnr in sqnrs)):  # NaN fails too
            return None
        qweight = torch.cat([qw for qw, _ in quantized])  # (N, K/2) rows
        scales = torch.cat([sc for _, sc in quantized], dim=-1)  # (K/32, N)
        kernel = _tuned_kernel(ctx, total, qweight, scales, False)
        names = ", ".join(m.location or m.node.name for m in group)
        if not _agree(group[0], kernel is not None):
            reason = _no_tile_reason(total, out_total, local=kernel is None, group=names)
            for m, (_, info), sqnr in zip(group, members, sqnrs):
                ctx.record(self.name, False, reason, node=m.node, before=info["before"], after=info["after"],
                           sqnr_db=sqnr, **info["details"], **m.shard_details)
                declined.add(m.node)
            return None
        for m in group:
            m.weight(ctx)  # freeze
        for m, (why, info), w, (qw, sc), sqnr in zip(group, members, weights, quantized, sqnrs):
            saved = w.numel() * w.element_size() - qw.numel() - sc.numel() * sc.element_size()
            ctx.record(self.name, True, f"{info['reason']}; Q4_0 weight SQNR {sqnr:.1f} dB{info['note']}; run as one "
                       f"{out_total}x{m.in_features} Q4 GEMM with its siblings ({names}), predicted {total['after'].ms:.4f} "
                       f"ms for all{m.shard_note}", node=m.node, before=info["before"], after=info["after"],
                       implementation=f"q4_linear {total['mode']}", sqnr_db=sqnr, memory_saved_bytes=saved,
                       tile=_tile_name(kernel), **info["details"], **m.shard_details)
        return replace_siblings_with_call(ctx, group, torch.ops.graphopt.q4_linear.default,
                                          (replaced.get(group[0].input, group[0].input),
                                           *self._constants(ctx, qweight, scales), None, _op_mode(total["mode"]),
                                           kernel))

    @staticmethod
    def _constants(ctx: PassContext, qweight: torch.Tensor, scales: torch.Tensor) -> tuple:
        return ctx.add_constant(qweight, "q4_weight"), ctx.add_constant(scales, "q4_scales")


def _op_mode(mode: str) -> str:
    """Off the GPU the op always runs its reference; it still takes a kernel mode."""
    return mode if mode in ("fused", "separate") else "fused"


def _tuned_kernel(ctx: PassContext, info: dict, qweight: torch.Tensor | None, scales: torch.Tensor | None,
                  bias: bool) -> str | None:
    """The op's kernel string for a decided layer (`info` from _decide): its tile timed now on the
    GPU (q4k.tune_q4_linear), where the target is a GPU, the packed weights live on it, the mode is
    a kernel mode, the token count is static and the graph goes to a compiler; else "" (the untuned
    default). None when no tile of the mode, the default included, computes the product on this
    GPU (tuning.NoCorrectTile): the layer must not run that mode here. The Gluon decodes (q4_tma's,
    decode_persistent's) are candidates only under CUDA graphs: their opaque op pays a Python launch
    path on every call."""
    if not _tunable(ctx, info, qweight):
        return ""
    try:
        return q4k.tune_q4_linear((info["tokens"], info["in_features"]), qweight, scales, bias, info["act_dtype"],
                                  info["mode"], allow_gluon=ctx.config.cuda_graphs)
    except NoCorrectTile as exc:
        log.warning("graphopt q4_linear: %s", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a failed timing costs speed, never the rewrite
        log.warning("graphopt q4_linear: tuning failed (%s: %s); the op runs its untuned default tile",
                    type(exc).__name__, exc)
        return ""


def _tunable(ctx: PassContext, info: dict, qweight: torch.Tensor | None) -> bool:
    """Whether the layer's tile is timed now (see _tuned_kernel)."""
    return (info["tokens"] is not None and info["mode"] in ("fused", "separate") and ctx.hardware.is_gpu
            and not ctx.for_export and isinstance(qweight, torch.Tensor) and qweight.is_cuda)


def _agree(m: LinearMatch, ok: bool) -> bool:
    """`ok`, or for a tensor-parallel linear whether it holds on every rank (one all-reduce): every
    rank must rewrite the same layers, and reach the same later agreements. Every rank reaches
    this for the same layers in the same order (_decide's checks see the same shapes on each)."""
    return ok if m.shard is None else all_ranks_agree(m.shard, ok)


def _no_tile_reason(info: dict, out_features: int, local: bool = True, group: str = "") -> str:
    """Why a layer (or a sibling `group`, named) stays dense: no tile of its mode, the default
    included, computed the product, on this GPU or (`local` False) on another tensor-parallel rank's."""
    where = "on this GPU" if local else "on another tensor-parallel rank's GPU, so every rank keeps it dense"
    what = f", the sibling group ({group}) as one GEMM," if group else ""
    return (f"no Q4 {info['mode']} tile, the default included, computed the product at {info['tokens']}x{out_features}"
            f"x{info['in_features']}{what} {where} (checked against the float64 product at compile time); kept dense")


def _tile_name(kernel: str) -> str:
    """A kernel string as the decision reports it."""
    return q4k.kernel_config(kernel).name if kernel else "untuned default"


def _same_scale(a, b) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return isinstance(a, numbers.Real) and isinstance(b, numbers.Real) and float(a) == float(b)


def _row_scale_ok(scale, x) -> bool:
    """A number, or a tensor that is per-tensor or per-row ([..., 1] matching x's leading dims)."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale) > 0
    if not isinstance(scale, fx.Node):
        return False
    s, x_value = shape(scale), fake(x)
    if s is None or not isinstance(x_value, torch.Tensor) or len(s) > x_value.dim():  # more dims would widen y
        return False
    if math.prod(s) == 1:  # per tensor, whatever x's (possibly symbolic) leading dims
        return True
    xs = shape(x)
    return (xs is not None and len(s) >= 1 and s[-1] == 1
            and torch.Size(torch.broadcast_shapes(s, (*xs[:-1], 1))) == torch.Size((*xs[:-1], 1)))


def _clamp_bounds(node: fx.Node) -> tuple[int, int] | None:
    lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v) == int(v) for v in (lo, hi)):
        return None
    lo, hi = int(lo), int(hi)
    return (lo, hi) if -128 <= lo <= hi <= 127 else None


def _match_fake_quant(node):
    """(x, s, qmin, qmax, matched nodes) of `round(x / s).clamp(qmin, qmax) * s`, else None."""
    if _name(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    for clamped, scale in (node.args, node.args[::-1]):
        if _name(clamped) != "clamp" or len(clamped.users) != 1:
            continue
        bounds = _clamp_bounds(clamped)
        rounded = clamped.args[0]
        if bounds is None or _name(rounded) != "round" or len(rounded.users) != 1 or len(rounded.args) != 1 \
                or rounded.kwargs.get("decimals", 0):
            continue
        quotient = rounded.args[0]
        if _name(quotient) != "div" or len(quotient.users) != 1 or quotient.kwargs.get("rounding_mode") is not None:
            continue
        x, divisor = quotient.args[0], quotient.args[1]
        if not isinstance(x, fx.Node) or not _same_scale(divisor, scale) or not _row_scale_ok(scale, x):
            continue
        if len(node.users) != 1:
            return None
        return x, scale, bounds[0], bounds[1], [node, clamped, rounded, quotient]
    return None


PASS = Q4LinearPass()


# =============================================================================================
# ONNX translations of graphopt::q4_linear
# =============================================================================================
def _onnx_nibbles(op, qweight, in_features: int):
    """Unsigned nibbles [N, K] (natural K order) of the kernel layout, as UINT8, with ONNX ops."""
    n, half = qweight.shape
    lo = op.BitwiseAnd(qweight, op.Constant(value=_u8(15)))
    hi = op.BitShift(qweight, op.Constant(value=_u8(4)), direction="RIGHT")
    pairs = [op.Reshape(t, op.Constant(value_ints=[n, half // 32, 1, 32])) for t in (lo, hi)]
    nib = op.Reshape(op.Concat(*pairs, axis=2), op.Constant(value_ints=[n, 2 * half]))
    return op.Slice(nib, op.Constant(value_ints=[0]), op.Constant(value_ints=[in_features]), op.Constant(value_ints=[1]))


def _u8(v: int):
    import numpy as np
    import onnx

    return onnx.numpy_helper.from_array(np.array(v, dtype=np.uint8))


def _onnx_scales(op, scales, in_features: int):
    """d as float32 [N, K/32] (straight from the stored fp16: through a bf16 x it would lose bits)."""
    d = op.Slice(scales, op.Constant(value_ints=[0]), op.Constant(value_ints=[in_features // 32]),
                 op.Constant(value_ints=[0]))
    return op.Cast(op.Transpose(d, perm=[1, 0]), to=1)  # FLOAT


def _onnx_q8_1_values(op, x, in_features: int):
    """x [..., K] -> float32 q * d, the Q8_1 values the kernels multiply, with ONNX ops: per 32-value
    block d = amax / 127, q = roundf(x / d) (half away from zero: the int32 cast truncates, then
    the fraction decides), and d rounded to fp16 as block_q8_1 stores it."""
    import onnx

    f32 = onnx.TensorProto.FLOAT
    blocks = op.Reshape(op.Cast(x, to=f32), op.Constant(value_ints=[-1, in_features // 32, 32]))
    d = op.Div(op.ReduceMax(op.Abs(blocks), op.Constant(value_ints=[-1]), keepdims=1), op.Constant(value_float=127.0))
    zero = op.Constant(value_float=0.0)
    inv_d = op.Where(op.Equal(d, zero), zero, op.Div(op.Constant(value_float=1.0), d))
    v = op.Mul(blocks, inv_d)
    whole = op.Cast(op.Cast(v, to=onnx.TensorProto.INT32), to=f32)
    frac = op.Sub(v, whole)
    q = op.Sub(op.Add(whole, op.Cast(op.GreaterOrEqual(frac, op.Constant(value_float=0.5)), to=f32)),
               op.Cast(op.LessOrEqual(frac, op.Constant(value_float=-0.5)), to=f32))
    d16 = op.Cast(op.Cast(d, to=onnx.TensorProto.FLOAT16), to=f32)
    return op.Reshape(op.Mul(q, d16), op.Shape(x))


def _onnx_static_values(op, x, act_scale, qmin: int, qmax: int):
    """x [..., K] -> float32 round(x / s).clamp(qmin, qmax) * s with ONNX ops (Round is half to even, as
    torch.round): graphopt::q4_linear_static's activations. The pass fuses float32 idioms only, so
    the quotient is float32 as in eager."""
    import onnx

    f32 = onnx.TensorProto.FLOAT
    s = op.Cast(act_scale, to=f32)
    q = op.Clip(op.Round(op.Div(op.Cast(x, to=f32), s)), op.Constant(value_float=float(qmin)),
                op.Constant(value_float=float(qmax)))
    return op.Mul(q, s)


def _onnx_q4_standard(op, values, like, qweight, scales, bias, k: int):
    """values (float32 activations) @ DequantizeLinear(INT4 nibble-8, scale d, axis=1, block_size=32)^T
    in float32, cast to `like`'s type (+ Add)."""
    import onnx

    signed = op.Sub(op.Cast(_onnx_nibbles(op, qweight, k), to=onnx.TensorProto.INT8),
                    op.Constant(value=onnx.numpy_helper.from_array(__import__("numpy").array(8, dtype="int8"))))
    w_int4 = op.Cast(signed, to=onnx.TensorProto.INT4)  # (N, K)
    w = op.DequantizeLinear(w_int4, _onnx_scales(op, scales, k), axis=1, block_size=32)  # (N, K) float32
    y = op.CastLike(op.MatMul(values, op.Transpose(w, perm=[1, 0])), like)
    return y if bias is None else op.Add(y, op.CastLike(bias, y))


@register_onnx_translation(torch.ops.graphopt.q4_linear.default, form="standard")
def _q4_linear_onnx_standard(x, qweight, scales, bias=None, mode: str = "fused", kernel: str = ""):
    """Q8_1 values of x (_onnx_q8_1_values) times the dequantized Q4_0 weight (_onnx_q4_standard)."""
    from onnxscript import opset23 as op

    k = int(x.shape[-1])
    return _onnx_q4_standard(op, _onnx_q8_1_values(op, x, k), x, qweight, scales, bias, k)


@register_onnx_translation(torch.ops.graphopt.q4_linear_static.default, form="standard")
def _q4_linear_static_onnx_standard(x, act_scale, qweight, scales, bias=None, qmin: int = -128, qmax: int = 127,
                                    kernel: str = ""):
    """The fake-quantized x (_onnx_static_values) times the dequantized Q4_0 weight, in float32 (the
    promoted dtype of the float32 idioms the pass fuses)."""
    from onnxscript import opset23 as op

    k = int(x.shape[-1])
    values = _onnx_static_values(op, x, act_scale, qmin, qmax)
    return _onnx_q4_standard(op, values, values, qweight, scales, bias, k)


def _matmul_nbits_schema():
    """onnx ships no schema for onnxruntime's contrib ops; the exporter needs one to build the node."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    return OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1")],
        outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], "")],
        attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "") for name in ("K", "N", "bits", "block_size")],
    )


def _onnx_q4_matmulnbits(op, values, like, qweight, scales, bias, k: int):
    """com.microsoft.MatMulNBits(bits=4, block_size=32) of float32 `values`, no zero points (default
    8), cast to `like`'s type (+ Add)."""
    from onnxscript.values import Op, Opset

    matmul_nbits = Op(Opset("com.microsoft", 1), "MatMulNBits", _matmul_nbits_schema())
    n = int(qweight.shape[0])
    nib = op.Reshape(_onnx_nibbles(op, qweight, k), op.Constant(value_ints=[n, k // 2, 2]))
    even = op.Slice(nib, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    odd = op.Slice(nib, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), op.Constant(value_ints=[2]))
    packed = op.BitwiseOr(even, op.BitShift(odd, op.Constant(value=_u8(4)), direction="LEFT"))
    blobs = op.Reshape(packed, op.Constant(value_ints=[n, k // 32, 16]))
    d = op.Reshape(_onnx_scales(op, scales, k), op.Constant(value_ints=[-1]))
    y = op.CastLike(matmul_nbits(values, blobs, d, K=k, N=n, bits=4, block_size=32), like)
    return y if bias is None else op.Add(y, op.CastLike(bias, y))


@register_onnx_translation(torch.ops.graphopt.q4_linear.default, form="matmulnbits")
def _q4_linear_onnx_matmulnbits(x, qweight, scales, bias=None, mode: str = "fused", kernel: str = ""):
    """MatMulNBits of the Q8_1 values of x (_onnx_q4_matmulnbits)."""
    from onnxscript import opset23 as op

    k = int(x.shape[-1])
    return _onnx_q4_matmulnbits(op, _onnx_q8_1_values(op, x, k), x, qweight, scales, bias, k)


@register_onnx_translation(torch.ops.graphopt.q4_linear_static.default, form="matmulnbits")
def _q4_linear_static_onnx_matmulnbits(x, act_scale, qweight, scales, bias=None, qmin: int = -128,
                                       qmax: int = 127, kernel: str = ""):
    """MatMulNBits of the fake-quantized x (_onnx_static_values)."""
    from onnxscript import opset23 as op

    k = int(x.shape[-1])
    values = _onnx_static_values(op, x, act_scale, qmin, qmax)
    return _onnx_q4_matmulnbits(op, values, values, qweight, scales, bias, k)


__all__ = ["PASS", "Q4LinearPass"]
