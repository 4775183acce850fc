"""QuantizedLinear: an nn.Linear whose weight lives as packed 4-bit buffers, run by graphopt's ops.

Formats (FORMATS):
  nvfp4, mxfp4  buffers `codes` uint8 (N, Kp/2), `scales` (N, Kp/bs) float8_e4m3fn (nvfp4) or uint8
                e8m0 bytes (mxfp4), `global_scale` fp32 (1,): graphopt.kernels.fp4's kernel layout
                (to_kernel_layout), Kp = K rounded up to 64. forward is graphopt::fp4_linear.
  q4_0          buffers `qweight` uint8 (N, Kp/2) and `scales` fp16 (Kp/32, N): graphopt.kernels.q4's
                kernel layout of ggml block_q4_0 (pack_q4_0); K must be a multiple of 32. forward is
                graphopt::q4_linear (activations quantized to Q8_1 inside the GEMM).
These are the constants the fp4_linear / q4_linear passes bake into a compiled graph, so a layer
quantized here computes what the pass computes on the same weight. The op's `kernel` argument is
"" (the op's static default path and tile); a compile with backend="graphopt" and the matching
pass enabled replaces it with the cost model's choice for the GPU (the weights stay as they are).

Tensor parallelism: a layer of a model split by torch.distributed.tensor.parallel.parallelize_module
(ColwiseParallel: weight Shard(0); RowwiseParallel: Shard(1)) is quantized on this rank's shard,
NVFP4 with the whole weight's global scale (one all-reduce), so its blocks are those of the
unsplit layer. It keeps the split's input and output hooks: forward takes the DTensor the input
hook makes, runs the op on the local tensors and returns the DTensor the dense layer would
(column: sharded on the last dim; row: partial sums, with the bias on mesh index 0 only).

The packed buffers keep their dtype through `model.to(dtype)`, `.half()` and the like (_apply): a
dtype conversion would destroy the bit patterns. The bias, when there is one, is a parameter that
needs no gradient and follows the model's dtype. Inference only: the ops have no backward.
"""

from __future__ import annotations

import torch
from torch import nn

from graphopt.kernels import fp4 as fp4k
from graphopt.kernels import q4 as q4k

FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4", "q4_0")
FP4_FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")
# Compile-time quantization in the fp4_linear pass uses the MSE scale search; so does quantize_,
# so that both give the same bytes for the same weight (graphopt.passes.fp4_linear.SCALE_SEARCH
# is this constant).
FP4_SCALE_SEARCH = True


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; valid choices: {', '.join(FORMATS)}")


def packed_layout(out_features: int, in_features: int, format: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{buffer name: (shape, dtype)} of a layer's packed weight."""
    check_format(format)
    if format == "q4_0":
        kp = fp4k._padded_k(in_features)  # Q4_0 blocks come in pairs: K rounded up to 64, as pack_q4_0 pads
        return {"qweight": ((out_features, kp // 2), torch.uint8), "scales": ((kp // q4k.QK, out_features), torch.float16)}
    bs = fp4k.BLOCK_SIZES[format]
    kp = fp4k._padded_k(in_features)
    scale_dtype = torch.float8_e4m3fn if format == "nvfp4" else torch.uint8
    return {"codes": ((out_features, kp // 2), torch.uint8), "scales": ((out_features, kp // bs), scale_dtype),
            "global_scale": ((1,), torch.float32)}


def unsupported_reason(out_features: int, in_features: int, format: str) -> str | None:
    """Why a layer of this shape cannot take `format`, or None."""
    check_format(format)
    if not (out_features and in_features):
        return f"empty weight ({out_features} x {in_features})"
    if format == "q4_0" and in_features % q4k.QK:
        return f"in_features={in_features} is not a multiple of {q4k.QK} (Q4_0 blocks)"
    return None


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W held as packed `format` buffers (see the module docstring).

    Built empty (shapes only: for loading a saved state dict) with QuantizedLinear(in, out, format),
    or from a dense layer with QuantizedLinear.from_linear(linear, format)."""

    def __init__(self, in_features: int, out_features: int, format: str = "nvfp4", bias: bool = False, *,
                 device=None, bias_dtype: torch.dtype | None = None):
        super().__init__()
        check_format(format)
        if (why := unsupported_reason(out_features, in_features, format)) is not None:
            raise ValueError(f"QuantizedLinear({in_features}, {out_features}, {format!r}): {why}")
        self.in_features, self.out_features, self.format = int(in_features), int(out_features), format
        for name, (shape, dtype) in packed_layout(out_features, in_features, format).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.output_placements: tuple | None = None  # a tensor-parallel shard's (see the module docstring)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", *, fp4_weight: fp4k.Fp4Tensor | None = None
                    ) -> "QuantizedLinear":
        """Quantize `linear`'s weight where it lives (on a GPU when the model is there).
        fp4_weight: an already quantized (e.g. GPTQ-calibrated) weight to use instead."""
        check_format(format)
        w = linear.weight.detach()
        shard = tensor_parallel_style(linear)
        if shard is not None:
            w = w.to_local()
        if w.is_meta:
            raise ValueError("QuantizedLinear.from_linear: the weight is on the meta device (not materialized); "
                             "load the model's weights first, or load a saved quantized model with graphopt.load_quantized")
        if w.numel() and not bool(torch.isfinite(w).all()):
            raise ValueError("QuantizedLinear.from_linear: the weight contains NaN or Inf")
        bias = linear.bias
        if shard is not None and bias is not None:  # row-parallel: partial sums, the bias counted once
            bias = bias.to_local() if shard[0] == "column" or _mesh_index(linear.weight) == 0 else None
        has_bias = bias is not None
        layer = cls(w.shape[1], w.shape[0], format, has_bias, device="meta")
        if format == "q4_0":
            qweight, scales = q4k.quantize_weight(w)
            if not bool(torch.isfinite(scales).all()):
                raise ValueError("QuantizedLinear.from_linear: a Q4_0 block scale overflows fp16 (weights beyond "
                                 "about 5e5 in magnitude); use nvfp4 or mxfp4 for this layer")
            packed = {"qweight": qweight, "scales": scales}
        else:
            if fp4_weight is None:
                amax = _whole_amax(linear.weight, w) if shard is not None and format == "nvfp4" else None
                fp4_weight = fp4k.quantize_fp4(w, format, scale_search=FP4_SCALE_SEARCH, tensor_amax=amax)
            elif fp4_weight.format != format or tuple(fp4_weight.shape) != tuple(w.shape):
                raise ValueError(f"QuantizedLinear.from_linear: the given weight is {fp4_weight.format} "
                                 f"{tuple(fp4_weight.shape)}, the layer needs {format} {tuple(w.shape)}")
            kw = fp4k.to_kernel_layout(fp4_weight)
            packed = {"codes": kw.codes, "scales": kw.scales, "global_scale": kw.global_scale}
        for name, tensor in packed.items():
            layer._buffers[name] = tensor.to(w.device).contiguous()
        if has_bias:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        if shard is not None:
            layer.output_placements = shard[1]
            for hooks in _HOOK_DICTS:  # the split's input and output hooks come along
                getattr(layer, hooks).update(getattr(linear, hooks))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_placements is None:
            return self._local_forward(x)
        from torch.distributed.tensor import DTensor

        if not isinstance(x, DTensor):
            raise TypeError("QuantizedLinear: this layer is a tensor-parallel shard and takes the DTensor its input "
                            f"hook (parallelize_module) makes; got a {type(x).__name__}")
        return DTensor.from_local(self._local_forward(x.to_local()), x.device_mesh, self.output_placements,
                                  run_check=False)

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "q4_0":
            return torch.ops.graphopt.q4_linear.default(x, self.qweight, self.scales, self.bias, "fused", "")
        return torch.ops.graphopt.fp4_linear.default(x, self.codes, self.codes, self.scales, self.global_scale, self.bias,
                                                     self.out_features, self.in_features, self.format, "")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out_features, in_features) weight the packed buffers represent."""
        if self.format == "q4_0":
            return q4k.dequantize_packed(self.qweight, self.scales, self.in_features, dtype)
        w = fp4k.dequantize_kernel_layout(self.codes, self.scales, self.global_scale, self.out_features,
                                          self.in_features, self.format)
        return w.to(dtype)

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed weight buffers (the bias not counted)."""
        return sum(self._buffers[name].nbytes for name in packed_layout(self.out_features, self.in_features, self.format))

    def _apply(self, fn, recurse: bool = True):
        # Move the packed buffers as bytes, so that a dtype conversion (model.to(torch.bfloat16))
        # moves them between devices but leaves their bit patterns and dtypes alone.
        names = list(packed_layout(self.out_features, self.in_features, self.format))
        dtypes = {name: self._buffers[name].dtype for name in names}
        for name in names:
            self._buffers[name] = self._buffers[name].view(torch.uint8)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name in names:
                self._buffers[name] = self._buffers[name].view(dtypes[name])

    def extra_repr(self) -> str:
        split = "" if self.output_placements is None else f", tensor-parallel shard (output {self.output_placements})"
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, " \
               f"bias={self.bias is not None}{split}"


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def tensor_parallel_style(linear: nn.Linear) -> tuple[str, tuple] | None:
    """("column" | "row", the placements of its output) for a linear whose weight is a DTensor split
    by ColwiseParallel / RowwiseParallel over a 1-D mesh; None for a plain weight. Another split is
    an error naming the ones quantize_ takes."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Partial, Shard

    w = linear.weight
    if not isinstance(w, DTensor):
        return None
    if "forward" in vars(linear):  # transformers' tensor parallelism replaces the layer's forward
        raise ValueError("a layer split by transformers' own tensor parallelism (tp_plan), whose replaced forward a "
                         "QuantizedLinear cannot keep; quantize_ takes layers split with torch's parallelize_module "
                         "(ColwiseParallel, RowwiseParallel). Under transformers' split, compile with the fp4_linear "
                         "or q4_linear pass instead: it quantizes each rank's shard")
    if w.device_mesh.ndim == 1 and tuple(w.placements) == (Shard(0),):
        return "column", (Shard(-1),)
    if w.device_mesh.ndim == 1 and tuple(w.placements) == (Shard(1),):
        return "row", (Partial(),)
    raise ValueError(f"a DTensor weight placed {tuple(w.placements)} on a {w.device_mesh.ndim}-D mesh; quantize_ takes "
                     "column-parallel (Shard(0)) and row-parallel (Shard(1)) weights on a 1-D mesh (ColwiseParallel, "
                     "RowwiseParallel)")


def local_shape(linear: nn.Linear) -> tuple[int, int]:
    """(out_features, in_features) of the weight this rank holds."""
    w = linear.weight
    w = w.to_local() if tensor_parallel_style(linear) is not None else w
    return int(w.shape[0]), int(w.shape[1])


def _mesh_index(weight) -> int:
    coordinate = weight.device_mesh.get_coordinate()
    return coordinate[0] if coordinate else 0


def _whole_amax(weight, local: torch.Tensor) -> torch.Tensor:
    """The largest |value| of the whole split weight: one all-reduce over its mesh (every rank
    quantizes the same layers in the same order)."""
    amax = local.abs().amax().to(torch.float32).reshape(1).clone()
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=weight.device_mesh.get_group(0))
    return amax.reshape(())
