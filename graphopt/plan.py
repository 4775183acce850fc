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
