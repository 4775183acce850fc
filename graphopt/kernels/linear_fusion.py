"""The neighbours a one-token quantized linear takes into its kernel (graphopt's decode fusion).

At batch 1 a decoder layer's small ops cost a launch each, as much as their work: a LLaMA layer runs
two RMSNorms, a SiLU gate and two residual adds around four GEMVs. A weight pass that rewrote the
linears (fp4_linear) hands them to the GEMV instead (graphopt.passes.linear_fusion):
  - prologue `norm_weight` / `norm_eps`: x -> RMSNorm(x) * norm_weight, LLaMA's form (fp32 mean of
    squares, rsqrt(mean + eps), the normalised row rounded to x's dtype, times the weight);
  - prologue `gated`: x holds [gate | up] side by side (2K wide) -> silu(gate) * up;
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
    residual: torch.Tensor | None = None  # y's shape and dtype

    @property
    def active(self) -> bool:
        return self.norm_weight is not None or self.gated or self.residual is not None

    def input_width(self, in_features: int) -> int:
        """The features of x the fused op reads: twice in_features for a gated prologue."""
        return 2 * in_features if self.gated else in_features

    def check(self, x: torch.Tensor, in_features: int, out_features: int) -> None:
        """A clear error for arguments that do not fit x and the weight."""
        width = self.input_width(in_features)
        if x.shape[-1] != width:
            raise ValueError(f"x has {x.shape[-1]} features; the weight expects {width}"
                             + (" ([gate | up] of a gated prologue)" if self.gated else ""))
        if self.norm_weight is not None:
            if tuple(self.norm_weight.shape) != (in_features,) or self.norm_weight.dtype != x.dtype:
                raise ValueError(f"norm_weight must be {x.dtype} ({in_features},) (x's dtype), got "
                                 f"{self.norm_weight.dtype} {tuple(self.norm_weight.shape)}")
            if not self.norm_eps > 0:
                raise ValueError(f"norm_eps must be > 0 with a norm_weight, got {self.norm_eps}")
        if self.residual is not None:
            expected = (*x.shape[:-1], out_features)
            if tuple(self.residual.shape) != expected or self.residual.dtype != x.dtype:
                raise ValueError(f"residual must be {x.dtype} {expected} (the output's shape and dtype), got "
                                 f"{self.residual.dtype} {tuple(self.residual.shape)}")
        for name, t in (("norm_weight", self.norm_weight), ("residual", self.residual)):
            if t is not None and t.device != x.device:
                raise ValueError(f"{name} is on {t.device} but x is on {x.device}")

    def prologue(self, x: torch.Tensor, in_features: int) -> torch.Tensor:
        """The linear's input from x, as the model computed it."""
        if self.gated:
            x = F.silu(x[..., :in_features]) * x[..., in_features:]
        if self.norm_weight is not None:
            rows = x.to(torch.float32)
            rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            x = self.norm_weight * rows.to(x.dtype)
        return x

    def epilogue(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.residual is None else self.residual + y


NO_FUSION = LinearFusion()
FUSIONS: tuple[str, ...] = ("rms_norm", "silu_gate", "residual")


def example_fusion(fused, tokens: int, in_features: int, out_features: int, dtype: torch.dtype,
                   device) -> LinearFusion:
    """Random operands for the neighbours named in `fused` (FUSIONS), to time or check a fused call."""
    unknown = [name for name in fused if name not in FUSIONS]
    if unknown:
        raise ValueError(f"unknown fused neighbours {unknown}; valid choices: {', '.join(FUSIONS)}")
    norm = 1.0 + 0.1 * torch.randn(in_features, device=device, dtype=dtype) if "rms_norm" in fused else None
    residual = torch.randn(tokens, out_features, device=device, dtype=dtype) if "residual" in fused else None
    return LinearFusion(norm, 1e-5 if norm is not None else 0.0, "silu_gate" in fused, residual)
