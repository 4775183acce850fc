"""The `fp4_linear` pass: weights to MXFP4 / NVFP4 at compile time (lossy, opt-in).

For every linear whose weight is a 2-D model parameter (F.linear, nn.Linear, addmm as in GPT-2's
Conv1D, x @ W, x @ W.T; graphopt.passes.fx_utils.find_linears) in an inference graph:
  1. the weight must be freezable (a parameter that does not require grad under grad mode);
  2. the cost model must predict a win: graphopt::fp4_linear (graphopt.kernels.fp4
     .estimate_fp4_linear, families fp4_gemv / fp4_gemm) against the dense linear
     (graphopt.cost_model.linear), by at least MIN_PREDICTED_SPEEDUP (a lossy rewrite must buy
     a real gain). Tiny layers (launch-bound) and the CPU target are declined, unless `force=True`;
  3. the weight is quantized once (option `fp4_format`, scale search on), and its SQNR in dB
     against the original weight must reach `error_budget["fp4_linear"]`;
  4. the linear becomes one `graphopt::fp4_linear` node reading the kernel-layout constants.
Where it wins: nowhere yet on an H200. bench/results/fp4_h200_round2.json (NVFP4, LLaMA shapes,
bf16 cuBLAS baseline, weights L2-cold for <= 16 tokens) measured 0.84-0.96x of cuBLAS at 1 token,
0.29-0.46x at 4-16, 0.17-0.31x at 64, 0.2-0.3x at 256 and 0.67-0.71x at 4096 tokens. The cost model
is fitted to that run (kernels/fp4.py, tests/test_cost_model_measured.py), so on an H200 the pass
declines every linear unless `force=True` (memory savings, 3.6x smaller weights, are then the only
gain). On targets with less bandwidth per CUDA-core FLOP (e.g. an uncalibrated H100 spec) the same
model predicts a ~1.1-1.25x 1-token win; that extrapolation is unmeasured.
Each match records one Decision; applied ones carry `memory_saved_bytes` (dense weight bytes
minus packed codes + scales), the weight SQNR, the format and the kernel path for this token count.
Output shape and dtype are unchanged. Inference only (the op has no autograd formula).

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

import torch

from graphopt import cost_model
from graphopt.kernels import fp4 as fp4k
from graphopt.onnx_export import register_onnx_translation
from graphopt.passes.base import GraphPass, PassContext
from graphopt.passes.fx_utils import LinearMatch, dtype, find_linears, replace_with_call

# Compile-time quantization uses the per-block MSE scale search (one-time cost; lowers weight
# error, see tests/kernels/test_fp4.py::test_scale_search_lowers_error).
SCALE_SEARCH = True
# A lossy rewrite must buy a real speedup: launch-bound layers predicted within 5% are declined.
MIN_PREDICTED_SPEEDUP = 1.05


def predict(hw, tokens: int, in_features: int, out_features: int, fmt: str, *, dtype_bytes: int = 2,
            bias: bool = False) -> tuple[cost_model.Estimate, cost_model.Estimate]:
    """(dense linear, graphopt::fp4_linear) predicted on `hw`: what the pass compares."""
    before = cost_model.linear(hw, tokens, in_features, out_features, dtype_bytes=dtype_bytes, bias=bias)
    after = fp4k.estimate_fp4_linear(hw, tokens, in_features, out_features, fmt, dtype_bytes=dtype_bytes, bias=bias)
    return before, after


def worth_rewriting(before: cost_model.Estimate, after: cost_model.Estimate) -> bool:
    """The unforced rule: predicted faster by at least MIN_PREDICTED_SPEEDUP."""
    return before.ms >= MIN_PREDICTED_SPEEDUP * after.ms


def _dtype_bytes(dt: torch.dtype | None) -> int:
    return torch.empty((), dtype=dt).element_size() if dt is not None else 2


class Fp4LinearPass(GraphPass):
    name = "fp4_linear"
    lossless = False

    def run(self, ctx: PassContext) -> None:
        fmt = ctx.config.fp4_format
        budget_db = ctx.config.error_budget["fp4_linear"]
        replaced: dict = {}  # erased linear node -> its graphopt::fp4_linear node (later matches read it)
        for m in find_linears(ctx):
            new = self._one(ctx, m, fmt, budget_db, replaced)
            if new is not None:
                replaced[m.node] = new

    def _one(self, ctx: PassContext, m: LinearMatch, fmt: str, budget_db: float, replaced: dict):
        node = m.node
        ok, why = ctx.can_freeze(m.weight_node)
        if not ok:
            ctx.record(self.name, False, why, node=node)
            return
        x_dtype, out_dtype = dtype(m.input), dtype(node)
        if x_dtype is None or out_dtype is None or not x_dtype.is_floating_point:
            ctx.record(self.name, False, "input/output dtype unknown or not floating point", node=node)
            return
        if x_dtype != out_dtype:
            ctx.record(self.name, False, f"mixed dtypes (input {x_dtype}, output {out_dtype}); the op returns the input's dtype",
                       node=node)
            return
        if m.bias_node is not None and m.kind != "linear" and m.bias_node.meta.get("example_value") is not None:
            bias_shape = tuple(m.bias_node.meta["example_value"].shape)
            if bias_shape != (m.out_features,):
                ctx.record(self.name, False, f"addmm bias of shape {bias_shape} is not a per-output-feature vector", node=node)
                return
        tokens = m.tokens()
        tokens_note = ""
        if tokens is None:
            tokens, tokens_note = 1, " (dynamic token count: costed at 1 token)"
        in_f, out_f = m.in_features, m.out_features
        dtype_bytes = _dtype_bytes(x_dtype)
        has_bias = m.bias_node is not None
        before, after = predict(ctx.hardware, tokens, in_f, out_f, fmt, dtype_bytes=dtype_bytes, bias=has_bias)
        accepted, reason = self.accept(ctx, before, after)
        if accepted and not ctx.config.force and not worth_rewriting(before, after):
            accepted, reason = False, (f"predicted gain {before.ms / after.ms:.2f}x is below {MIN_PREDICTED_SPEEDUP:.2f}x, "
                                       f"not worth a lossy rewrite ({before.ms:.4f} -> {after.ms:.4f} ms)")
        if not accepted:
            ctx.record(self.name, False, reason + tokens_note, node=node, before=before, after=after)
            return

        # Measure before freezing: a declined layer must not pin the parameter.
        value = ctx.example_value(m.weight_node).detach()
        weight = value.t() if m.weight_transposed else value  # (N, K)
        q = fp4k.quantize_fp4(weight, fmt, scale_search=SCALE_SEARCH)
        sqnr = fp4k.sqnr_db(weight, fp4k.dequantize_fp4(q))
        if sqnr < budget_db:
            ctx.record(self.name, False, f"weight SQNR {sqnr:.2f} dB below the budget of {budget_db:.2f} dB "
                       f"(error_budget['fp4_linear'])", node=node, before=before, after=after, sqnr_db=sqnr, format=fmt)
            return

        m.weight(ctx)  # freeze: the compiled graph now depends on this parameter's value
        kw = fp4k.to_kernel_layout(q)
        path = (fp4k.choose_fp4_path(ctx.hardware, tokens, in_f, out_f, fmt) if ctx.hardware.is_gpu else "reference")
        dense_bytes = weight.numel() * weight.element_size()
        saved = dense_bytes - kw.nbytes
        codes = ctx.add_constant(kw.codes, "fp4_codes")
        codes_fp4 = ctx.add_constant(kw.codes.view(torch.float4_e2m1fn_x2), "fp4_codes_e2m1")
        scales = ctx.add_constant(kw.scales, "fp4_scales")
        global_scale = ctx.add_constant(kw.global_scale, "fp4_global_scale")
        ctx.record(
            self.name, True, reason + tokens_note, node=node, before=before, after=after,
            implementation=f"fp4_{path}" if path != "reference" else "fp4_reference",
            memory_saved_bytes=int(saved), dense_weight_bytes=int(dense_bytes), fp4_weight_bytes=int(kw.nbytes),
            sqnr_db=sqnr, format=fmt, tokens=tokens,
        )
        x_node = replaced.get(m.input, m.input)
        bias_node = replaced.get(m.bias_node, m.bias_node)
        new = replace_with_call(
            ctx, node, torch.ops.graphopt.fp4_linear.default,
            (x_node, codes, codes_fp4, scales, global_scale, bias_node, out_f, in_f, fmt),
            matched=list(m.extra_nodes),
        )
        return new


PASS = Fp4LinearPass()


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
                              in_features: int = 0, format: str = "nvfp4"):
    """DequantizeLinear(FLOAT4E2M1, block scales, axis=1, block_size) -> reorder -> MatMul (+ Add)."""
    from onnxscript import opset23 as op

    bs = fp4k.BLOCK_SIZES[format]
    block_scale = _block_scales_onnx(op, scales, global_scale, format)  # (N, Kp/bs) fp32
    w = op.DequantizeLinear(codes_fp4, block_scale, axis=1, block_size=bs)  # (N, Kp), kernel order
    return _matmul_bias(op, x, _kernel_order_to_natural(op, w, out_features, in_features, bs), bias)


@register_onnx_translation(torch.ops.graphopt.fp4_linear.default, form="runnable")
def _fp4_linear_onnx_runnable(x, codes, codes_fp4, scales, global_scale, bias=None, out_features: int = 0,
                              in_features: int = 0, format: str = "nvfp4"):
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


__all__ = ["PASS", "Fp4LinearPass", "SCALE_SEARCH", "MIN_PREDICTED_SPEEDUP", "predict", "worth_rewriting"]
