"""Tuned plans: one JSON file, one top-level section per pass.

    {"graphopt_plan": 1,
     "sparse_attention": {...written by graphopt tune...},
     "fft_linear": {...written by graphopt explore-fft / fftchain distill...}}

`options={"plan": path}` loads it; each pass reads its own section with `plan_section`.
Large tensors (e.g. fitted FFT-chain coefficients) live beside it in safetensors files that the
section names by relative path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLAN_VERSION = 1


def load_plan(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"graphopt plan {str(path)!r} does not exist")
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"graphopt plan {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(plan, dict) or plan.get("graphopt_plan") != PLAN_VERSION:
        raise ValueError(f"graphopt plan {str(path)!r} lacks \"graphopt_plan\": {PLAN_VERSION}; write plans with graphopt.plan.save_plan")
    plan["_dir"] = str(path.parent)
    return plan


# What each pass reads from a layer entry of its section: field -> (what it must be, test). The
# writers (graphopt.sparse_tuning, fp4_linear.save_fp4_plan, graphopt.fft_distill) add more fields;
# only these are checked, so that a hand-edited plan fails when the options are read, naming the
# field, rather than inside its pass at compile time (logged, and the pass skipped).
def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _per_head(test, allow_null: bool = False):
    def check(values, heads):
        return isinstance(values, list) and len(values) == heads and all(
            (allow_null and v is None) or test(v) for v in values)
    return check


_PER_HEAD = {  # sparse_attention layers: one value per head
    "simthreshd1": ("a list of numbers in [-1, 1], one per head", _per_head(lambda v: _number(v) and -1 <= v <= 1)),
    "cdfthreshd": ("a list of numbers in (0, 1], one per head", _per_head(lambda v: _number(v) and 0 < v <= 1)),
    "pvthreshd": ("a list of non-negative numbers or null (PV skipping off), one per head",
                  _per_head(lambda v: _number(v) and v >= 0, allow_null=True)),
    "sparsity": ("a list of numbers in [0, 1] or null, one per head",
                 _per_head(lambda v: _number(v) and 0 <= v <= 1, allow_null=True)),
    "dense": ("a list of booleans, one per head (optional)", _per_head(lambda v: isinstance(v, bool))),
}
_OPTIONAL = {"dense"}
_LAYER_FIELDS = {
    "fp4_linear": {"format": None, "out_features": ("a positive integer", _positive_int),
                   "in_features": ("a positive integer", _positive_int)},
    "fft_linear": {"in_features": ("a positive integer", _positive_int),
                   "out_features": ("a positive integer", _positive_int),
                   "block_size": ("a positive integer", _positive_int), "k": ("a positive integer", _positive_int),
                   "rel_error": ("a finite number >= 0", lambda v: _number(v) and math.isfinite(v) and v >= 0)},
}


def check_section(name: str, section: dict[str, Any]) -> str | None:
    """The first problem in a pass's plan section that its pass would trip over, or None."""
    layers = section.get("layers", {})
    if not isinstance(layers, dict):
        return f"section {name!r}: \"layers\" must be an object of layer entries, got {type(layers).__name__}"
    if layers and name in _LAYER_FIELDS and not isinstance(section.get("file"), str):
        return f"section {name!r}: \"file\" must name the tensor file beside the plan, got {section.get('file')!r}"
    if name == "sparse_attention":
        for field in ("l1", "pv_l1"):  # the budgets it was tuned under; the pass compares l1 with its own
            if field in section and not (_number(section[field]) and section[field] >= 0):
                return f"section {name!r}: {field!r} must be a non-negative number, got {section[field]!r}"
    for key, layer in layers.items():
        where = f"section {name!r}, layer {key!r}"
        if not isinstance(layer, dict):
            return f"{where} must be a JSON object, got {type(layer).__name__}"
        if name == "sparse_attention":
            heads = layer.get("heads")
            if not _positive_int(heads):
                return f"{where}: \"heads\" must be a positive integer, got {heads!r}"
            if "head_dim" in layer and not _positive_int(layer["head_dim"]):
                return f"{where}: \"head_dim\" must be a positive integer, got {layer['head_dim']!r}"
            if "is_causal" in layer and not isinstance(layer["is_causal"], bool):
                return f"{where}: \"is_causal\" must be true or false, got {layer['is_causal']!r}"
            for field, (expected, test) in _PER_HEAD.items():
                if field in layer or field not in _OPTIONAL:
                    if not test(layer.get(field), heads):
                        return f"{where}: {field!r} must be {expected} ({heads} heads), got {layer.get(field)!r}"
        for field, rule in _LAYER_FIELDS.get(name, {}).items():
            value = layer.get(field)
            if rule is None:  # fp4_linear's format
                from graphopt.kernels.fp4 import FORMATS

                if value not in FORMATS:
                    return f"{where}: \"format\" must be one of {', '.join(FORMATS)}, got {value!r}"
            elif not rule[1](value):
                return f"{where}: {field!r} must be {rule[0]}, got {value!r}"
    if layers and name in _LAYER_FIELDS and "_dir" in section and not (Path(section["_dir"]) / section["file"]).is_file():
        return f"section {name!r}: its tensor file {section['file']!r} is not beside the plan (in {section['_dir']})"
    return None


def weight_fingerprint(weight) -> list[float]:
    """Three float64 sums of a weight (plain, squared, against a ramp over its elements): what a
    plan fitted to that weight records, so a pass can tell the same weights from changed ones."""
    import torch

    w = weight.detach().reshape(-1).to(torch.float64)
    ramp = torch.linspace(-1.0, 1.0, w.numel(), dtype=torch.float64, device=w.device)
    return [float(w.sum()), float((w * w).sum()), float((w * ramp).sum())]


def same_weights(recorded: list[float], weight, rel: float = 1e-3) -> bool:
    """Whether `weight` matches a recorded weight_fingerprint. The tolerance lets a dtype cast
    through (bf16 moves these sums by ~1e-5 of their scale); an update or another checkpoint
    moves them by far more."""
    current = weight_fingerprint(weight)
    scale = (max(current[1], 0.0) * max(weight.numel(), 1)) ** 0.5 + 1e-30
    return (abs(recorded[1] - current[1]) <= rel * abs(current[1]) + 1e-30
            and all(abs(a - b) <= rel * scale for a, b in zip((recorded[0], recorded[2]), (current[0], current[2]))))


def plan_section(ctx, pass_name: str) -> dict[str, Any] | None:
    """The section of the configured plan for one pass (None without a plan or section)."""
    if ctx.config.plan is None:
        return None
    if ctx.plan is None:
        ctx.plan = load_plan(ctx.config.plan)
    section = ctx.plan.get(pass_name)
    if section is not None:
        section = {**section, "_dir": ctx.plan["_dir"]}
    return section


def save_plan(path: str | Path, sections: dict[str, Any], *, merge: bool = True) -> Path:
    """Write (or merge into) a plan file; sections are {pass_name: section}."""
    path = Path(path)
    plan: dict[str, Any] = {"graphopt_plan": PLAN_VERSION}
    if merge and path.exists():
        plan.update({k: v for k, v in load_plan(path).items() if k != "_dir"})
    plan.update(sections)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2, sort_keys=True))
    return path
