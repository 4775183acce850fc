"""The `graphopt` torch.compile backend.

    torch.compile(model, backend="graphopt", options={...})
    torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}), mode="reduce-overhead")

Dynamo hands us a torch-level FX graph. We build a GraphOptConfig from `options`, run the
enabled passes (graphopt.passes), and give the rewritten graph to the downstream compiler.

Why the passes run at torch level, before AOTAutograd, and not inside it: each rewrite emits one
`graphopt::*` custom op that carries its own autograd formula (torch.library.register_autograd)
and fake implementation. Inductor then runs its own AOTAutograd over the rewritten graph, so
training needs nothing from us beyond those formulas, the `eager` and `tensorrt` downstreams see
the same rewrites, and matching happens on the graph the user wrote (`x @ w.T`, `softmax`) rather
than on its aten decomposition (expand/view/bmm chains), which is much harder to match robustly.

Weight-rewriting passes bake parameter values into the compiled graph (PassContext.freeze). The
compiled function is wrapped in a cheap guard: before each call it checks that every frozen
parameter is the same tensor at the same version counter, and recompiles from the new values if
not. This keeps results correct after `optimizer.step()` or an in-place copy under no_grad;
writes through `.data` do not bump the version counter and are not detected.

Under dynamic=True, Dynamo hands over the model's Python floats (HF's `self.scaling`) as 0-d
inputs read by `.item()`, without guarding their values; the attention pass bakes such a float
and the guard checks its value. A graph that reads lifted floats cannot be recompiled here: the
downstream compile runs outside Dynamo, and AOTAutograd cannot trace `.item()` on real inputs. So
for such a graph the unrewritten graph is compiled too, up front, and when a guarded value changes
the wrapper switches to it for good (correct for every value, no recompile per call).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import warnings
from typing import Any, Callable, Iterator

import torch
import torch._dynamo.exc
import torch.fx as fx

import graphopt.ops  # noqa: F401  (the rewrites emit graphopt::* ops; `import graphopt` may not have loaded them)
from graphopt.config import GraphOptConfig
from graphopt.hardware import HardwareSpec, get_spec
from graphopt.logging_setup import configure_logging
from graphopt.passes import graph_copy, run_passes
from graphopt.passes.base import Decision, PassContext
from graphopt.passes.tensor_parallel import is_dtensor, localize_dtensor_inputs, rank_and_world

log = logging.getLogger("graphopt")

# Sinks that collect the decisions of every compiled graph (graphopt.explain pushes one).
_DECISION_SINKS: list[list[Decision]] = []


@contextlib.contextmanager
def recording_decisions(*, reset: bool = False) -> Iterator[list[Decision]]:
    """The decisions of every graphopt compile in the block, the recompiles a changed frozen
    parameter triggers included. reset: clear Dynamo's caches before and after, so the block
    compiles afresh and leaves nothing compiled behind."""
    import torch

    sink: list[Decision] = []
    _DECISION_SINKS.append(sink)
    try:
        if reset:
            torch._dynamo.reset()
        yield sink
    finally:
        _DECISION_SINKS.remove(sink)
        if reset:
            torch._dynamo.reset()


# Modes that mean CUDA graphs, as they do for Inductor.
CUDA_GRAPH_MODES: tuple[str, ...] = ("reduce-overhead", "max-autotune")
MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# Inductor's switch for launching triton_op kernels with its static CUDA launcher (_downstream).
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"

# Dynamo wraps what a backend raises in BackendCompilerFailed, except its own ShortenTraceback
# family, which it re-raises as it is. A bad option is the user's mistake, not a compiler failure:
# it reaches torch.compile's caller as this ValueError (torch.compile(backend="graphopt",
# options=...) hands the options over only at the first call; graphopt.backend(...) checks them
# where it is built).
_DYNAMO_PASSES_THROUGH = getattr(torch._dynamo.exc, "ShortenTraceback", None)


class GraphOptOptionError(ValueError, *((_DYNAMO_PASSES_THROUGH,) if _DYNAMO_PASSES_THROUGH else ())):
    """A bad graphopt option or mode, raised to the caller of the compiled model unwrapped."""

    def __init__(self, message: str):
        if _DYNAMO_PASSES_THROUGH is not None:
            _DYNAMO_PASSES_THROUGH.__init__(self, message, first_useful_frame=None)
        else:
            ValueError.__init__(self, message)


def graphopt_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None, mode: str | None = None):
    """Entry point named in pyproject's torch_dynamo_backends. Not registered here a second time:
    Dynamo registers entry points itself, and its registry rejects duplicate names."""
    configure_logging()
    try:
        config = config_for(options, mode)
    except ValueError as exc:
        raise GraphOptOptionError(str(exc)) from None
    hardware = get_spec(config.target, example_inputs)
    return compile_graph(gm, example_inputs, config, hardware, mode=mode)


def config_for(options: dict | None, mode: str | None) -> GraphOptConfig:
    """The config of one compile: `options`, with `mode` as torch.compile means it (a CUDA-graph mode
    turns cuda_graphs on)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"graphopt: mode {mode!r} is not valid; valid choices: {', '.join(MODES)}")
    config = GraphOptConfig.from_options(options)
    if mode in CUDA_GRAPH_MODES and config.downstream == "inductor":
        config.cuda_graphs = True
    return config


class GraphOptBackend:
    """A torch.compile backend that carries graphopt's options, so that a mode can go with them
    (torch.compile refuses mode= together with options=) and so that transformers' CompileConfig
    can hold it. Options are checked here, where the user builds it. Two backends with equal options
    compare equal (CompileConfig compares its backend to decide whether to compile again)."""

    def __init__(self, **options: Any):
        GraphOptConfig.from_options(options)  # bad options fail here, not inside Dynamo
        self.options = copy.deepcopy(options)
        self.__name__ = "graphopt"

    def __call__(self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                 options: dict | None = None):
        merged = {**self.options, **(options or {})}
        return graphopt_backend(gm, example_inputs, options=merged, mode=mode)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GraphOptBackend) and self.options == other.options

    def __hash__(self) -> int:
        return hash(_canonical(self.options))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"graphopt.backend({args})"


def _canonical(value: Any) -> Any:
    """A hashable form of an options value in which equal values are equal (dicts by sorted items,
    at any depth)."""
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return repr(value)


def compile_graph(gm: fx.GraphModule, example_inputs: list, config: GraphOptConfig, hardware: HardwareSpec, *, mode: str | None = None):
    pristine = copy.deepcopy(gm)
    ctx = run_passes(gm, example_inputs, config, hardware)
    compiled = _compile_rewritten(gm, example_inputs, ctx, config, mode)
    if compiled is None:  # the rewrites were dropped
        return _downstream(pristine, example_inputs, config, mode)
    if not ctx.frozen:
        return compiled
    if ctx.reads_lifted_scalars():
        fallback = _downstream(copy.deepcopy(pristine), example_inputs, config, mode)
        return _FrozenWeightGuard(compiled, ctx, recompile=None, fallback=fallback)
    if _has_symbolic_sizes(example_inputs):
        # a compile outside Dynamo sees one call's sizes and would fix the graph to them: after a
        # change the unrewritten graph runs op by op, for every size
        return _FrozenWeightGuard(compiled, ctx, recompile=None, fallback=_run_op_by_op(pristine))

    def recompile(args: list) -> tuple[Callable, PassContext]:
        log.info("graphopt: a frozen parameter (or a module float the rewrite baked in) changed since compile; "
                 "recompiling from the new values")
        fresh = copy.deepcopy(pristine)
        new_ctx = run_passes(fresh, args, config, hardware)  # a plan may no longer fit the new weights
        compiled = _compile_rewritten(fresh, args, new_ctx, config, mode)
        if compiled is None:  # the unrewritten graph bakes nothing in
            new_ctx.frozen = {}
            return _downstream(copy.deepcopy(pristine), args, config, mode), new_ctx
        return compiled, new_ctx

    return _FrozenWeightGuard(compiled, ctx, recompile)


def _has_symbolic_sizes(example_inputs: list) -> bool:
    return any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        isinstance(size, torch.SymInt) for size in (*x.shape, *x.stride()))) for x in example_inputs)


def _boxed(args: tuple) -> bool:
    """Whether a wrapper was called with one list of the graph's inputs: Inductor's output is
    "boxed" (one list argument), but Dynamo may call a wrapper either way; graph inputs are tensors
    and ints, never lists, so the shape of `args` tells."""
    return len(args) == 1 and isinstance(args[0], list)


def _run_op_by_op(gm: fx.GraphModule) -> Callable:
    """`gm` run eagerly, called either way the guard may be (one list of inputs, or the inputs)."""
    def run(*args: Any):
        return gm(*(args[0] if _boxed(args) else args))
    return run


def _compile_rewritten(gm: fx.GraphModule, example_inputs: list, ctx: PassContext, config: GraphOptConfig,
                       mode: str | None) -> Callable | None:
    """The downstream compile of the rewritten graph, its decisions handed to the recorders; None if
    the downstream compiler failed on it (a rewrite never turns a program that runs into one that
    fails): the failure is logged and warned about, and the applied decisions say the rewrite was
    dropped."""
    for sink in _DECISION_SINKS:
        sink.extend(ctx.decisions)
    try:
        return _downstream_local_shards(gm, example_inputs, config, mode)
    except Exception as exc:  # noqa: BLE001
        # Dynamo's restarts (e.g. Inductor asking to re-trace with scalars as tensors) are not failures
        if not any(d.applied for d in ctx.decisions) or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        message = (f"graphopt: the downstream compiler failed on the rewritten graph ({type(exc).__name__}: "
                   f"{str(exc)[:2000]}); compiling the graph without graphopt's rewrites")
        log.warning(message, exc_info=log.isEnabledFor(logging.DEBUG))
        # a user who configured no logging must still learn that the rewrites were dropped
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        for decision in ctx.decisions:
            if decision.applied:
                decision.applied = False
                decision.reason = f"dropped: the downstream compiler failed on the rewritten graph ({type(exc).__name__})"
        return None


class _FrozenWeightGuard:
    """Calls the compiled graph after checking that frozen parameters are unchanged."""

    def __init__(self, compiled: Callable, ctx: PassContext, recompile: Callable | None,
                 fallback: Callable | None = None):
        self.compiled = compiled
        self.frozen = ctx.frozen
        self.recompile = recompile
        self.fallback = fallback  # the unrewritten graph, compiled (graphs that read lifted floats)
        self._boxed_call = bool(getattr(compiled, "_boxed_call", False))

    def _stale(self, args) -> bool:
        for index, frozen in self.frozen.items():
            current = args[index]
            if frozen.value is not None:  # a lifted module float (a new 0-d CPU tensor every call)
                if float(current) != frozen.value:
                    return True
            elif frozen.tensor_ref() is not current or (frozen.version is not None and current._version != frozen.version):
                return True
        return False

    def __call__(self, *args: Any):
        call_args = args[0] if _boxed(args) else args
        if self._stale(call_args):
            if self.recompile is None:
                log.warning("graphopt: a value this graph's rewrites baked in (a model float or a frozen parameter) "
                            "changed; it runs without graphopt's rewrites from now on (a graph with symbolic sizes, or "
                            "one that reads the model's floats as inputs, as under dynamic=True, cannot be recompiled "
                            "outside Dynamo; torch._dynamo.reset() before the next call compiles it afresh)")
                self.compiled, self.frozen = self.fallback, {}
            else:
                # Same downstream as the first compile, so the same (boxed or not) calling convention.
                compiled, ctx = self.recompile(list(call_args))
                self.compiled, self.frozen = compiled, ctx.frozen
        return self.compiled(*args)


def _downstream_local_shards(gm: fx.GraphModule, example_inputs: list, config: GraphOptConfig, mode: str | None):
    """The downstream compile, with DTensor inputs handed over as their local shards where that
    applies (graphopt.passes.tensor_parallel.localize_dtensor_inputs), recorded as a Decision. If
    the compile of the localized graph fails, the graph is compiled as it came."""
    if config.downstream != "inductor" or not any(is_dtensor(x) for x in example_inputs):
        return _downstream(gm, example_inputs, config, mode)
    snapshot = graph_copy(gm.graph)  # the graph only: the module's constants are shared, not copied
    positions, local_inputs = localize_dtensor_inputs(gm, example_inputs)
    if not positions:
        return _downstream(gm, example_inputs, config, mode)
    try:
        compiled = _downstream(gm, local_inputs, config, mode)
    except torch._dynamo.exc.RestartAnalysis:
        raise
    except Exception as exc:  # noqa: BLE001 - the unchanged inputs still compile
        log.warning("graphopt: compiling with DTensor inputs as local shards failed (%s: %s); compiling the graph "
                    "with its DTensor inputs", type(exc).__name__, str(exc)[:500])
        gm.graph = snapshot
        gm.recompile()
        return _downstream(gm, example_inputs, config, mode)
    placed = rank_and_world()
    decision = Decision("tensor_parallel", True,
                        f"{len(positions)} DTensor inputs (parameter shards) passed to the compiled graph as their local "
                        "tensors and wrapped back inside it: no DTensor unwrapping in Python at each call",
                        location="graph inputs", rank=placed[0] if placed else None,
                        details={"local_inputs": len(positions)})
    for sink in _DECISION_SINKS:
        sink.append(decision)
    return _LocalShardInputs(compiled, positions)


class _LocalShardInputs:
    """Calls a graph compiled by localize_dtensor_inputs: each DTensor argument at `positions` is
    replaced by its local tensor (an attribute read; `to_local()` would run an autograd function).
    Arguments are passed on the way they came, one list or one by one (see _FrozenWeightGuard)."""

    def __init__(self, compiled: Callable, positions: list[int]):
        self.compiled, self.positions = compiled, positions
        self._boxed_call = bool(getattr(compiled, "_boxed_call", False))

    def __call__(self, *args: Any):
        boxed = _boxed(args)
        values = args[0] if boxed else list(args)
        for position in self.positions:
            values[position] = values[position]._local_tensor
        return self.compiled(values) if boxed else self.compiled(*values)


def _downstream(gm: fx.GraphModule, example_inputs: list, config: GraphOptConfig, mode: str | None):
    if config.downstream == "eager":
        return gm.forward
    if config.downstream == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {}
        if mode and mode != "default":
            from torch._inductor import list_mode_options

            patches = dict(list_mode_options(mode))
        if config.cuda_graphs:
            patches["triton.cudagraphs"] = True
        # Inductor launches its own Triton kernels through its static CUDA launcher, and the kernels
        # of triton_ops (graphopt's) through Triton's Python launcher unless this is set; a kernel
        # the static launcher cannot take falls back.
        from torch._inductor import config as inductor_config

        static = hasattr(inductor_config, "static_launch_user_defined_triton_kernels")
        if static:
            patches["static_launch_user_defined_triton_kernels"] = True
        with _static_launch_environment(static):
            return compile_fx(gm, example_inputs, config_patches=patches or None)
    if config.downstream == "tensorrt":
        require_tensorrt()
        from torch_tensorrt.dynamo.backend import torch_tensorrt_backend  # type: ignore[import-not-found]

        return torch_tensorrt_backend(gm, example_inputs)
    raise AssertionError(config.downstream)  # validated by GraphOptConfig


@contextlib.contextmanager
def _static_launch_environment(active: bool) -> Iterator[None]:
    """Inductor's compile workers read the static-launch switch from the environment they start
    with, not from the compile's config patch, and they start inside the first compile that needs
    them: the switch is set (unless the user set it) for the downstream compile only. Workers it
    starts launch every triton_op's kernels statically in this and later compiles (graphopt's and
    any other's); processes started later do not inherit it. Workers an earlier compile started
    keep Triton's launcher for graphopt's kernels."""
    if not active or STATIC_LAUNCH_ENV in os.environ:
        yield
        return
    os.environ[STATIC_LAUNCH_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(STATIC_LAUNCH_ENV, None)


def tensorrt_available() -> bool:
    return importlib.util.find_spec("torch_tensorrt") is not None


def require_tensorrt() -> None:
    if not tensorrt_available():
        raise ValueError(
            "downstream='tensorrt' needs torch-tensorrt, which is not installed: "
            "pip install 'graphopt[tensorrt]'; valid choices without it: inductor, eager"
        )


__all__ = ["graphopt_backend", "GraphOptBackend", "GraphOptOptionError", "config_for", "compile_graph",
           "tensorrt_available"]
