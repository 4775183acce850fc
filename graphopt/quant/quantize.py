"""graphopt.quantize_: replace a model's linear layers by QuantizedLinear, in place.

    graphopt.quantize_(model, format="nvfp4")                       # every nn.Linear, lm_head included
    graphopt.quantize_(model, format="q4_0", filter_fn=lambda m, name: name != "lm_head")

Each selected layer is quantized where its weight lives (on the GPU for a model there) and
replaced by a QuantizedLinear holding the packed buffers; the dense weight is released as soon as
its layer is done, so memory never holds more than the model plus one layer's temporaries. The
output layer is quantized by default: on a small LLaMA its logits keep a cosine of 0.99 or more
with those of the same model with a dense output layer (tests/quant/test_quantize.py::
test_output_layer_keeps_logit_cosine), and on the LLaMA-3-8B shape it takes the resident NVFP4
weights, bf16 embedding counted, to 0.328x of the bf16 model's instead of 0.375x
(test_nvfp4_resident_weights_of_the_8b_shape_under_the_target).

plan: a tuned plan (graphopt.plan) whose "fp4_linear" section supplies pre-quantized weights
(e.g. GPTQ-calibrated ones, graphopt.passes.fp4_linear.save_fp4_plan) by module path; the layers it
names take those, the others are quantized as without a plan. FP4 formats only.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from graphopt.quant.linear import FP4_FORMATS, QuantizedLinear, check_format, unsupported_reason

log = logging.getLogger("graphopt")


def default_filter(module: nn.Module, name: str) -> bool:
    """Every nn.Linear except those that nn.MultiheadAttention reads the weight of directly."""
    return isinstance(module, nn.Linear) and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)


def quantize_(model: nn.Module, format: str = "nvfp4", plan=None,
              filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Replace the nn.Linear layers of `model` that `filter_fn(module, name)` selects (default: every
    nn.Linear) by QuantizedLinear layers of `format` (nvfp4, mxfp4 or q4_0), in place; returns the
    model. A layer the format cannot hold (q4_0 needs in_features % 32 == 0) stays dense, with a
    warning. Its forward then calls the same graphopt::* op that the fp4_linear / q4_linear pass
    emits, so the model runs eagerly, compiles with Inductor, and compiles with backend="graphopt"."""
    check_format(format)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ takes an nn.Module, got {type(model).__name__}")
    if plan is not None and format not in FP4_FORMATS:
        raise ValueError(f"quantize_: a plan supplies FP4 weights (its fp4_linear section); format={format!r} takes "
                         f"none. Valid formats with a plan: {', '.join(FP4_FORMATS)}")
    if isinstance(model, nn.Linear):
        raise ValueError("quantize_ replaces the linear layers inside a model; wrap a lone nn.Linear in a module "
                         "(nn.Sequential(linear)) or build QuantizedLinear.from_linear(linear, format)")
    select = filter_fn or default_filter
    plan_weights = _plan_weights(plan)
    # Names only: holding the modules would keep every dense weight alive until the end.
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and select(module, name)]
    skipped, used_cuda = [], False
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if (why := unsupported_reason(linear.out_features, linear.in_features, format)) is not None:
            skipped.append(f"{name} ({why})")
            continue
        fp4_weight = _planned(plan_weights, name, format, linear)
        try:
            layer = QuantizedLinear.from_linear(linear, format, fp4_weight=fp4_weight)
        except ValueError as exc:
            raise ValueError(f"quantize_: layer {name!r}: {exc}") from None
        used_cuda = used_cuda or linear.weight.is_cuda
        setattr(parent, child, layer)
        del linear, layer
    if skipped:
        log.warning("graphopt.quantize_(format=%r) left %d layer(s) dense: %s", format, len(skipped), "; ".join(skipped))
    if used_cuda:
        torch.cuda.empty_cache()  # hand the released dense weights back, so the drop shows outside the process too
    return model


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """{module path: QuantizedLinear} of a model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def _plan_weights(plan):
    if plan is None:
        return None
    from graphopt.passes.fp4_linear import PlanWeights
    from graphopt.plan import load_plan

    loaded = load_plan(plan)
    section = loaded.get("fp4_linear")
    if section is None:
        raise ValueError(f"quantize_: plan {str(plan)!r} has no fp4_linear section (write one with "
                         "graphopt.passes.fp4_linear.save_fp4_plan)")
    return PlanWeights({**section, "_dir": loaded["_dir"]})


def _planned(plan_weights, name: str, format: str, linear: nn.Linear):
    """The plan's FP4 weight for layer `name`, on the layer's device; None where the plan has none."""
    if plan_weights is None or not plan_weights.has(name):
        return None
    q, problem = plan_weights.get(name, format, (linear.out_features, linear.in_features))
    if q is None:
        raise ValueError(f"quantize_: plan weights for {name!r}: {problem}")
    device = linear.weight.device
    return type(q)(q.codes.to(device), q.scales.to(device), q.global_scale.to(device), q.shape, q.format)
