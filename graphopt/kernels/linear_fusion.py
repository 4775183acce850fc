"""The neighbours a one-token quantized linear takes into its kernel (graphopt's decode fusion).

At batch 1 a decoder layer's small ops cost a launch each, as much as their work: a LLaMA layer runs
two RMSNorms, a SiLU gate and two residual adds around four GEMVs. A weight pass that rewrote the
linears (fp4_linear) hands them to the GEMV instead (graphopt.passes.linear_fusion):
  - prologue `norm_weight` / `norm_eps`: x -> RMSNorm(x) * norm_weight, LLaMA's form (fp32 mean of
    squares, rsqrt(mean + eps), the normalised row rounded to x's dtype, times the weight);
  - epilogue `gated`: the product's rows interleave a gate and an up projection (row 2j is gate j,
    row 2j + 1 up j: `interleave_gate_up` of the [gate | up] weight) -> y = silu(gate) * up, half as
    wide; each gate value is computed once, by the program that owns the pair;
  - epilogue `residual`: y -> residual + y (a tensor of y's shape).
The kernels compute the same thing in fp32 without the intermediate roundings (the RMSNorm's row
scale, a common factor of the row, multiplies the dot product at the end); `prologue` and `epilogue`
below are the torch computation they replace, op for op, which every other path runs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, eq=False)
class LinearFusion:
    norm_weight: torch.Tensor | None = None  # (K,), x's dtype
    norm_eps: float = 0.0
    gated: bool = False
    residual: torch.Tensor | None = None  # y's shape and dtype (after the gate)

    @property
    def active(self) -> bool:
        return self.norm_weight is not None or self.gated or self.residual is not None

    def output_width(self, out_features: int) -> int:
        """The features of the fused op's output: half the product's behind a gate."""
        return out_features // 2 if self.gated else out_features

    def check(self, x: torch.Tensor, in_features: int, out_features: int) -> None:
        """A clear error for arguments that do not fit x and the weight."""
        if x.shape[-1] != in_features:
            raise ValueError(f"x has {x.shape[-1]} features; the weight expects {in_features}")
        if self.gated and out_features % 2:
            raise ValueError(f"a gated epilogue needs an even number of output features (interleaved gate and "
                             f"up rows), got {out_features}")
        if self.norm_weight is not None:
            if tuple(self.norm_weight.shape) != (in_features,) or self.norm_weight.dtype != x.dtype:
                raise ValueError(f"norm_weight must be {x.dtype} ({in_features},) (x's dtype), got "
                                 f"{self.norm_weight.dtype} {tuple(self.norm_weight.shape)}")
            if not self.norm_eps > 0:
                raise ValueError(f"norm_eps must be > 0 with a norm_weight, got {self.norm_eps}")
        if self.residual is not None:
            expected = (*x.shape[:-1], self.output_width(out_features))
            if tuple(self.residual.shape) != expected or self.residual.dtype != x.dtype:
                raise ValueError(f"residual must be {x.dtype} {expected} (the output's shape and dtype), got "
                                 f"{self.residual.dtype} {tuple(self.residual.shape)}")
        for name, t in (("norm_weight", self.norm_weight), ("residual", self.residual)):
            if t is not None and t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but x is on {x.device}")

    def prologue(self, x: torch.Tensor) -> torch.Tensor:
        """The linear's input from x, as the model computed it."""
        if self.norm_weight is not None:
            rows = x.to(torch.float32)
            rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            x = self.norm_weight * rows.to(x.dtype)
        return x

    def epilogue(self, y: torch.Tensor) -> torch.Tensor:
        """The fused op's output from the product y, as the model computed it."""
        if self.gated:
            y = F.silu(y[..., 0::2].contiguous()) * y[..., 1::2]  # contiguous: the vectorized silu, as the model ran
        return y if self.residual is None else self.residual + y


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Rows [gate 0..n-1 | up 0..n-1] of a (2n, ...) tensor -> gate 0, up 0, gate 1, up 1, ... (the row
    order a gated epilogue reads)."""
    if t.shape[0] % 2:
        raise ValueError(f"interleave_gate_up: {t.shape[0]} rows, expected an even count ([gate | up])")
    return t.reshape(2, t.shape[0] // 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


NO_FUSION = LinearFusion()
FUSIONS: tuple[str, ...] = ("rms_norm", "silu_gate", "residual")


def example_fusion(fused, tokens: int, in_features: int, out_features: int, dtype: torch.dtype,
                   device) -> LinearFusion:
    """Random operands for the neighbours named in `fused` (FUSIONS), to time or check a fused call."""
    unknown = [name for name in fused if name not in FUSIONS]
    if unknown:
        raise ValueError(f"unknown fused neighbours {unknown}; valid choices: {', '.join(FUSIONS)}")
    norm = 1.0 + 0.1 * torch.randn(in_features, device=device, dtype=dtype) if "rms_norm" in fused else None
    gated = "silu_gate" in fused
    width = out_features // 2 if gated else out_features
    residual = torch.randn(tokens, width, device=device, dtype=dtype) if "residual" in fused else None
    return LinearFusion(norm, 1e-5 if norm is not None else 0.0, gated, residual)
