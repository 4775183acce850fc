"""GraphOptConfig: the options of one compile, and their validation.

`torch.compile(model, backend="graphopt", options={...})` hands the options dict to the backend;
its keys are the field names of `GraphOptConfig`. Anything unknown or out of range is a
`ValueError` that names the bad value and lists the valid ones, because a silently ignored
option in an ablation run produces a wrong conclusion, not an error.

Environment (read when a config is built, so ablation scripts can drive any program):
  GRAPHOPT_DISABLE=a,b   switch passes off
  GRAPHOPT_ENABLE=a,b    switch passes on (applied after GRAPHOPT_DISABLE)
  GRAPHOPT_LOG=info|debug  log every decision (see graphopt.logging_setup)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from graphopt.hardware import SPECS

# Registry order is also the order passes run in (see graphopt/passes/__init__.py).
PASS_NAMES: tuple[str, ...] = ("attention", "sparse_attention", "fp4_linear", "q4_linear", "fft_linear", "all_reduce")
# Lossless passes are on by default; lossy ones change numerics within a budget and are opt-in.
# all_reduce is lossless but off until its gain is measured in a decode loop on GPUs.
DEFAULT_PASSES: dict[str, bool] = {
    "attention": True,
    "sparse_attention": False,
    "fp4_linear": False,
    "q4_linear": False,
    "fft_linear": False,
    "all_reduce": False,
}
TARGETS: tuple[str, ...] = ("auto", *SPECS)  # every hardware table entry (a spec added there is a target)
DOWNSTREAMS: tuple[str, ...] = ("inductor", "eager", "tensorrt")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "triton", "triton_decode", "flash", "cudnn", "efficient", "math")
# the neighbours a one-token linear can take in: graphopt.kernels.linear_fusion.FUSIONS (kept here too, so
# that reading the options loads no torch)
DECODE_FUSIONS: tuple[str, ...] = ("rms_norm", "silu_gate", "residual")
FP4_FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")
Q4_MODES: tuple[str, ...] = ("auto", "fused", "separate")

# What each pass's budget means. Lossless passes have no budget.
#   sparse_attention: max relative L1 error sum|O-O'|/sum|O| of a head against dense attention
#   fp4_linear, q4_linear: min weight SQNR in dB; layers below it are declined
#   fft_linear: max relative output error of a planned dense->FFT-chain replacement
DEFAULT_ERROR_BUDGET: dict[str, float] = {
    "sparse_attention": 0.06,
    "fp4_linear": 15.0,
    "q4_linear": 15.0,
    "fft_linear": 0.05,
}


def _suggest(bad: str, valid: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(bad, list(valid), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; valid choices: {', '.join(valid)}"


def _check_plan(path) -> None:
    """Load the plan once when the options are read: a missing or malformed plan is an error
    here, not a pass that fails at compile time and is skipped with a warning."""
    from graphopt.plan import check_section, load_plan

    try:
        plan = load_plan(path)
    except OSError as exc:  # a directory, no permission
        raise ValueError(f"graphopt plan {str(path)!r} cannot be read: {exc}") from exc
    for name in PASS_NAMES:
        if name in plan and not isinstance(plan[name], Mapping):
            raise ValueError(f"graphopt plan {str(path)!r}: section {name!r} must be a JSON object, "
                             f"got {type(plan[name]).__name__}")
        problem = check_section(name, {**plan[name], "_dir": plan["_dir"]}) if name in plan else None
        if problem is not None:
            raise ValueError(f"graphopt plan {str(path)!r}: {problem}")


def _check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"graphopt option {name}={value!r} is not valid{_suggest(str(value), valid)}")


def _check_pass_names(names, where: str) -> None:
    for name in names:
        if name not in PASS_NAMES:
            raise ValueError(f"unknown pass {name!r} in {where}{_suggest(str(name), PASS_NAMES)}")


@dataclass
class GraphOptConfig:
    """Options of one graphopt compile. `options` dict keys are these field names."""

    passes: dict[str, bool] = field(default_factory=lambda: dict(DEFAULT_PASSES))
    target: str = "auto"
    downstream: str = "inductor"
    force: bool = False  # apply every match regardless of the cost model (never of correctness checks)
    error_budget: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_ERROR_BUDGET))
    plan: str | None = None  # path of a tuned plan (JSON), see graphopt.plan
    attention_backend: str = "auto"
    fp4_format: str = "nvfp4"
    q4_mode: str = "auto"
    fuse_sibling_linears: bool = True  # fp4_linear / q4_linear: one quantized GEMM for linears sharing an input
    # fp4_linear at one token: the RMSNorm before a linear, the SiLU gate and the residual add after it
    # run inside its kernel (graphopt.passes.linear_fusion). True: all of DECODE_FUSIONS; False: none; or
    # a list of those names (an ablation of one of them)
    fuse_decode_neighbours: bool | tuple[str, ...] = True
    # Replay the compiled graph from CUDA graphs (Inductor's CUDA-graph trees, as mode="reduce-overhead"
    # gives; torch.compile refuses mode= together with options=). Removes the host's launch path,
    # which dominates small-batch decode.
    cuda_graphs: bool = False
    # The caller replays the compiled step from a CUDA graph of its own (a serving engine's capture,
    # a benchmark's do_bench_cudagraph), so the host's launch path is not paid per call: decisions
    # price GPU time only. cuda_graphs=True implies it. Off, a graphopt op whose host path (Python
    # dispatch) outlasts its GPU work is priced at its host time.
    graph_replay: bool = False
    # Attention with dropout active on its probabilities (training) is rewritten to SDPA with
    # dropout_p: another random mask than eager's, drawn from the same distribution. Off, such
    # attention is left as written.
    attention_dropout: bool = True

    @property
    def prices_host_path(self) -> bool:
        """Whether a call's host launch path counts in the cost model's choice."""
        return not (self.cuda_graphs or self.graph_replay)

    def __post_init__(self) -> None:
        if not isinstance(self.passes, Mapping):
            raise ValueError(f"graphopt option passes must be a dict of pass name -> bool, got {self.passes!r}")
        _check_pass_names(self.passes, "passes")
        for name, on in self.passes.items():
            if not isinstance(on, bool):
                raise ValueError(f"graphopt option passes[{name!r}] must be True or False, got {on!r}")
        self.passes = {**DEFAULT_PASSES, **self.passes}
        if not isinstance(self.error_budget, Mapping):
            raise ValueError(f"graphopt option error_budget must be a dict, got {self.error_budget!r}")
        budget_keys = tuple(DEFAULT_ERROR_BUDGET)
        for name, value in self.error_budget.items():
            if name not in budget_keys:
                if name in DEFAULT_PASSES:
                    raise ValueError(f"error_budget[{name!r}]: the {name} pass is lossless and takes no budget; "
                                     f"valid choices: {', '.join(budget_keys)}")
                raise ValueError(f"unknown pass {name!r} in error_budget{_suggest(str(name), budget_keys)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                # NaN fails every comparison, so it would switch the pass's budget check off
                raise ValueError(f"error_budget[{name!r}] must be a finite non-negative number, got {value!r}")
        self.error_budget = {**DEFAULT_ERROR_BUDGET, **{k: float(v) for k, v in self.error_budget.items()}}
        _check_choice("target", self.target, TARGETS)
        _check_choice("downstream", self.downstream, DOWNSTREAMS)
        if self.downstream == "tensorrt" and importlib.util.find_spec("torch_tensorrt") is None:
            raise ValueError(
                "graphopt option downstream='tensorrt' needs torch-tensorrt, which is not installed "
                "(pip install 'graphopt[tensorrt]'); valid choices without it: inductor, eager"
            )
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("fp4_format", self.fp4_format, FP4_FORMATS)
        _check_choice("q4_mode", self.q4_mode, Q4_MODES)
        for flag in ("force", "fuse_sibling_linears", "cuda_graphs", "graph_replay", "attention_dropout"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"graphopt option {flag} must be True or False, got {getattr(self, flag)!r}")
        if not isinstance(self.fuse_decode_neighbours, bool):
            names = self.fuse_decode_neighbours
            if (not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names)
                    or set(names) - set(DECODE_FUSIONS)):
                raise ValueError(f"graphopt option fuse_decode_neighbours must be True, False or a list of "
                                 f"{', '.join(DECODE_FUSIONS)}, got {names!r}")
            self.fuse_decode_neighbours = tuple(names)
        if self.cuda_graphs and self.downstream != "inductor":
            raise ValueError(f"graphopt option cuda_graphs=True needs downstream='inductor' (its CUDA-graph trees "
                             f"record the compiled graph), got downstream={self.downstream!r}")
        if self.plan is not None:
            if not isinstance(self.plan, (str, os.PathLike)):
                raise ValueError(f"graphopt option plan must be a path to a JSON plan, got {self.plan!r}")
            _check_plan(self.plan)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> "GraphOptConfig":
        """Build a config from a `torch.compile(options=...)` dict plus the GRAPHOPT_* environment."""
        options = dict(options or {})
        valid = tuple(f.name for f in dataclasses.fields(cls))
        for key in options:
            if key not in valid:
                raise ValueError(f"unknown graphopt option {key!r}{_suggest(str(key), valid)}")
        config = cls(**options)
        environ = os.environ if environ is None else environ
        for var, state in (("GRAPHOPT_DISABLE", False), ("GRAPHOPT_ENABLE", True)):
            names = [n.strip() for n in environ.get(var, "").split(",") if n.strip()]
            _check_pass_names(names, var)
            for name in names:
                config.passes[name] = state
        return config

    def enabled(self, pass_name: str) -> bool:
        return self.passes.get(pass_name, False)
