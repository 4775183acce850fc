"""The quantized-linear ops: graphopt::fp4_linear and the Q4 ops (and their opaque Gluon twins).
Registered when graphopt.ops is imported."""

from __future__ import annotations

from typing import Optional as _Optional

import torch

from graphopt.kernels.linear_fusion import LinearFusion
from graphopt.ops.registration import _inference_fake, _inference_op, _refuse_gradients

# ==== fp4 (graphopt/kernels/fp4/, passes/fp4_linear.py) ========================================
# graphopt::fp4_linear(x, codes, codes_fp4, scales, global_scale, bias, out_features, in_features,
#                      format, kernel) -> y
#   x (..., K) -> y (..., N) in x's dtype; y = x @ W^T + bias, W the MXFP4/NVFP4 weight in the
#   kernel layout of graphopt.kernels.fp4.to_kernel_layout: codes uint8 (N, Kp/2); codes_fp4 the
#   same bytes viewed as torch.float4_e2m1fn_x2 (read only by the standard ONNX form, which needs a
#   FLOAT4E2M1 initializer; it shares storage with codes); scales (N, Kp/bs) uint8 e8m0 (mxfp4) or
#   float8_e4m3fn (nvfp4); global_scale fp32 (1,) (1.0 for mxfp4); format "mxfp4" | "nvfp4";
#   kernel: the path and tile the pass chose at compile time, per token range ("lo-hi=path=<tile>;...",
#   fp4.kernel_string; an empty hi has no upper bound, an empty tile is the path's untuned default,
#   and "" is fp4.default_path with it).
#   A triton_op: Inductor traces the body and launches its Triton kernels from its own generated
#   code (inside its CUDA graphs). CPU: the torch reference. The Gluon decodes (fp4_tma's, and
#   decode_persistent's for one token) are not Triton JIT functions that Inductor can emit, so a
#   kernel that selects one calls graphopt::fp4_gluon_linear, an opaque op.
#   norm_weight, norm_eps, gated, residual: neighbours taken in (graphopt.kernels.linear_fusion; the
#   passes' decode fusion, graphopt.passes.linear_fusion): an RMSNorm of x before the product; gated,
#   the weight's rows (and a bias's entries) interleave gate and up (linear_fusion.interleave_gate_up)
#   and y = silu(gate) * up is (..., N / 2); residual + y after it. The one-token persistent kernel computes them itself;
#   every other path runs them in torch around the product. dependent: x is the output of another
#   one-token call (the passes mark it), so the persistent kernel may start as the dependent of the
#   kernel before it (graphopt.kernels.dependent_launch).
#   Inference only: no autograd formula (the weights are frozen constants).
@torch.library.triton_op("graphopt::fp4_linear", mutates_args=())
def fp4_linear_op(x: torch.Tensor, codes: torch.Tensor, codes_fp4: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor, bias: _Optional[torch.Tensor], out_features: int, in_features: int,
                  format: str, kernel: str = "", norm_weight: _Optional[torch.Tensor] = None, norm_eps: float = 0.0,
                  gated: bool = False, residual: _Optional[torch.Tensor] = None, dependent: bool = False) -> torch.Tensor:
    from graphopt.kernels import fp4

    fusion = LinearFusion(norm_weight, norm_eps, gated, residual)
    if not x.is_cuda:  # the interpreter's tests call the launcher itself
        if fusion.active:
            fusion.check(x, in_features, out_features)
            x = fusion.prologue(x)
        y = fp4.reference_fp4_linear(x, codes, scales, global_scale, bias, out_features, in_features, format)
        return fusion.epilogue(y)
    path, config = fp4.kernel_choice(kernel, x.numel() // x.shape[-1])
    if config is not None and config.gluon:
        return torch.ops.graphopt.fp4_gluon_linear(x, codes, scales, global_scale, bias, out_features, in_features,
                                                   format, kernel, norm_weight, norm_eps, gated, residual, dependent)
    return fp4.fp4_linear_triton(x, codes, scales, global_scale, bias, out_features, in_features, format, path=path,
                                 config=config, fusion=fusion)


_refuse_gradients(fp4_linear_op, "fp4_linear")


@_inference_op("fp4_gluon_linear(Tensor x, Tensor codes, Tensor scales, Tensor global_scale, Tensor? bias, "
               "int out_features, int in_features, str format, str kernel, Tensor? norm_weight=None, "
               "float norm_eps=0.0, bool gated=False, Tensor? residual=None, bool dependent=False) -> Tensor")
def fp4_gluon_linear(x, codes, scales, global_scale, bias, out_features, in_features, format, kernel, norm_weight=None,
                     norm_eps=0.0, gated=False, residual=None, dependent=False):
    """graphopt::fp4_linear on a Gluon decode that `kernel` selects: fp4_tma's (NVFP4, bf16, sm_90+) or,
    for one token, decode_persistent's (sm_80+)."""
    from graphopt.kernels import fp4

    path, config = fp4.kernel_choice(kernel, x.numel() // x.shape[-1])
    if config is None or not config.gluon:
        raise ValueError(f"graphopt::fp4_gluon_linear: kernel {kernel!r} selects no Gluon tile for this call")
    return fp4.fp4_linear_triton(x, codes, scales, global_scale, bias, out_features, in_features, format, path=path,
                                 config=config, fusion=LinearFusion(norm_weight, norm_eps, gated, residual),
                                 dependent=dependent)


@_inference_fake("fp4_gluon_linear")
def _(x, codes, scales, global_scale, bias, out_features, in_features, format, kernel, norm_weight=None, norm_eps=0.0,
      gated=False, residual=None, dependent=False):
    return x.new_empty((*x.shape[:-1], out_features // 2 if gated else out_features))
# ==== end fp4 ==================================================================================

# ==== q4 (graphopt/kernels/q4/, passes/q4_linear.py) ==========================================
# Q4_0 weights (kernel layout from graphopt.kernels.q4.pack_q4_0: qweight uint8 [N, Kp/2], scales
# fp16 [Kp/32, N]) times Q8_1-quantized activations.
#   graphopt::quantize_q8_1(x [..., K]) -> ggml block_q8_1 bytes uint8 [..., K/32, 36]
#   graphopt::q4_q8_gemm(xq [..., K/32, 36], qweight, scales, bias?, out_dtype, kernel="") -> [..., N]
#   graphopt::q4_linear(x [..., K], qweight, scales, bias?, mode, kernel="") -> [..., N] in x's dtype;
#       mode "fused" (quantization inside the GEMM / decode kernel) or "separate" (two kernels);
#       both give the same numbers up to fp32 summation order.
#   graphopt::q4_linear_static(x, act_scale, qweight, scales, bias?, qmin, qmax, kernel="") -> [..., N]:
#       the fake-quant idiom (round(x / s).clamp(qmin, qmax) * s) @ W_q4.T with a per-tensor or
#       per-row scale s, fused (integer dots), in the promoted dtype of x and s.
#   kernel: the tile chosen at compile time (q4.tune_q4_linear; graphopt.kernels.tuning.encode of a
#   q4.TileConfig), "" for the untuned default of the token count. A "tma" tile (q4_linear's
#   separate mode, sm_90+) or a "persistent" one (1-8 tokens, sm_80+) runs graphopt::q4_gluon_linear,
#   an opaque op: Gluon kernels are not Triton JIT functions that Inductor can launch.
# triton_ops: Inductor traces the bodies and launches their Triton kernels from its own generated
# code (inside its CUDA graphs); a body never times a tile or keeps an allocation past the call.
# CPU: the torch references (integer math of the same formula), which a compile of a CPU graph
# traces; under TRITON_INTERPRET=1 an eager call on CPU tensors runs the Triton kernels.
# Inference only: a call that needs a gradient is refused (_refuse_gradients).
Q4_LINEAR_MODES: tuple[str, ...] = ("fused", "separate")


def _q4_out_features(qweight: torch.Tensor, scales: torch.Tensor, k: int) -> int:
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"graphopt q4 ops: qweight must be uint8 [N, Kp/2], got {qweight.dtype} {tuple(qweight.shape)}")
    if k % 32 or not (2 * qweight.shape[1] - 64 < k <= 2 * qweight.shape[1]):
        raise ValueError(f"graphopt q4 ops: K={k} does not fit qweight {tuple(qweight.shape)} (K % 32 == 0, Kp = K rounded up to 64)")
    if scales.dim() != 2 or scales.shape[1] != qweight.shape[0]:
        raise ValueError(f"graphopt q4 ops: scales must be [Kp/32, N={qweight.shape[0]}], got {tuple(scales.shape)}")
    return qweight.shape[0]


def _q4_check_bias(op: str, bias: _Optional[torch.Tensor], n: int) -> None:
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"graphopt::{op}: bias must be ({n},), got {tuple(bias.shape)}")


def _q4_check_call(op: str, x: torch.Tensor, bias: _Optional[torch.Tensor], n: int) -> None:
    """Clear errors for activations that are not floating point and a bias that is not (N,)."""
    if not x.is_floating_point():
        raise ValueError(f"graphopt::{op}: activations must be floating point (float16, bfloat16, float32), got {x.dtype}")
    _q4_check_bias(op, bias, n)


def _q4_runs_kernels(x: torch.Tensor) -> bool:
    """Whether a body launches the Triton kernels: on CUDA tensors, and on CPU tensors under
    TRITON_INTERPRET=1 when called (the interpreter cannot be traced, so a compile of a CPU graph
    traces the torch reference)."""
    from graphopt.kernels.launch import INTERPRET, traced

    return x.is_cuda or (INTERPRET and not traced((x,)))


@torch.library.triton_op("graphopt::quantize_q8_1", mutates_args=())
def q4_quantize_q8_1(x: torch.Tensor) -> torch.Tensor:
    from graphopt.kernels import q4

    if x.shape[-1] % 32:
        raise ValueError(f"graphopt::quantize_q8_1: the last dimension ({x.shape[-1]}) must be a multiple of 32")
    return q4.quantize_q8_1_triton(x) if _q4_runs_kernels(x) else q4.quantize_q8_1(x)


@torch.library.triton_op("graphopt::q4_q8_gemm", mutates_args=())
def q4_q8_gemm(xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: _Optional[torch.Tensor],
               out_dtype: torch.dtype, kernel: str = "") -> torch.Tensor:
    from graphopt.kernels import q4

    _q4_check_bias("q4_q8_gemm", bias, _q4_out_features(qweight, scales, xq.shape[-2] * 32))
    if not _q4_runs_kernels(xq):
        return q4.reference_q4_q8_gemm(xq, qweight, scales, bias, out_dtype)
    return q4.q4_q8_gemm_triton(xq, qweight, scales, bias, out_dtype, config=q4.kernel_config(kernel))


@torch.library.triton_op("graphopt::q4_linear", mutates_args=())
def q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: _Optional[torch.Tensor], mode: str,
              kernel: str = "") -> torch.Tensor:
    from graphopt.kernels import q4

    if mode not in Q4_LINEAR_MODES:
        raise ValueError(f"graphopt::q4_linear: mode {mode!r} is not valid; valid choices: {', '.join(Q4_LINEAR_MODES)}")
    n = _q4_out_features(qweight, scales, x.shape[-1])
    _q4_check_call("q4_linear", x, bias, n)
    if not _q4_runs_kernels(x):
        return q4.reference_q4_linear(x, qweight, scales, bias)
    config = q4.kernel_config(kernel)
    if config is not None and (config.kernel == "persistent" or (config.kernel == "tma" and mode == "separate")):
        x2 = x.reshape(-1, x.shape[-1])
        return torch.ops.graphopt.q4_gluon_linear(x2, qweight, scales, bias, kernel).reshape(*x.shape[:-1], n)
    return q4.q4_linear_triton(x, qweight, scales, bias, mode, config=config)


@_inference_op("q4_gluon_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, str kernel) -> Tensor")
def q4_gluon_linear(x, qweight, scales, bias, kernel):
    """graphopt::q4_linear on a Gluon decode that `kernel` selects: q4_tma's (the separate mode,
    sm_90+) or decode_persistent's (1-8 tokens, sm_80+): x (M, K) -> (M, N) in x's dtype."""
    from graphopt.kernels import q4

    config = q4.kernel_config(kernel)
    if config is None or config.kernel not in ("tma", "persistent"):
        raise ValueError(f"graphopt::q4_gluon_linear: kernel {kernel!r} selects no Gluon tile (tma or persistent)")
    if config.kernel == "persistent":
        return q4.persistent_linear(x.contiguous(), qweight, scales, bias, config)
    return q4.tma_linear(x.contiguous(), qweight, scales, bias, config)


@_inference_fake("q4_gluon_linear")
def _(x, qweight, scales, bias, kernel):
    return x.new_empty((x.shape[0], _q4_out_features(qweight, scales, x.shape[-1])))


@torch.library.triton_op("graphopt::q4_linear_static", mutates_args=())
def q4_linear_static(x: torch.Tensor, act_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     bias: _Optional[torch.Tensor], qmin: int, qmax: int, kernel: str = "") -> torch.Tensor:
    from graphopt.kernels import q4

    n = _q4_out_features(qweight, scales, x.shape[-1])
    if not -128 <= qmin <= qmax <= 127:
        raise ValueError(f"graphopt::q4_linear_static: qmin {qmin}, qmax {qmax}: expected -128 <= qmin <= qmax <= 127 "
                         "(int8 activations)")
    _q4_check_call("q4_linear_static", x, bias, n)
    if not _q4_runs_kernels(x):
        return q4.reference_q4_linear_static(x, act_scale, qweight, scales, bias, qmin, qmax)
    return q4.q4_linear_static_triton(x, act_scale, qweight, scales, bias, qmin, qmax, config=q4.kernel_config(kernel))


for _op, _name in ((q4_quantize_q8_1, "quantize_q8_1"), (q4_q8_gemm, "q4_q8_gemm"), (q4_linear, "q4_linear"),
                   (q4_linear_static, "q4_linear_static")):
    _refuse_gradients(_op, _name)
del _op, _name
# ==== end q4 ===================================================================================
