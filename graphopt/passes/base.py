"""What every pass shares: the Decision record, the per-compile PassContext, and GraphPass.

A pass is small: `match` finds candidate subgraphs, `decide` asks the cost model (and the
accuracy budget), `replace` emits one `torch.ops.graphopt.*` node. The base class runs that loop
and records one `Decision` per match, applied or not, with the reason and predicted times.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx

from graphopt.config import GraphOptConfig
from graphopt.cost_model import Estimate
from graphopt.hardware import HardwareSpec
from graphopt.passes.tensor_parallel import rank_and_world

log = logging.getLogger("graphopt")


@dataclass
class Decision:
    """One match of one pass: rewritten or not, and why."""

    pass_name: str
    applied: bool
    reason: str
    location: str = ""
    predicted_ms_before: float | None = None
    predicted_ms_after: float | None = None
    implementation: str | None = None  # the chosen candidate kernel, when applied
    details: dict[str, Any] = field(default_factory=dict)  # e.g. bytes saved, SQNR, sparsity
    rank: int | None = None  # the torch.distributed rank that compiled the graph (several processes)

    @property
    def predicted_speedup(self) -> float | None:
        if self.predicted_ms_before and self.predicted_ms_after:
            return self.predicted_ms_before / self.predicted_ms_after
        return None


def count_applied(decisions: list[Decision]) -> dict[str, int]:
    """Rewrites applied per pass; every pass with a decision appears, with 0 when none applied."""
    counts: dict[str, int] = {}
    for d in decisions:
        counts[d.pass_name] = counts.get(d.pass_name, 0) + int(d.applied)
    return counts


@dataclass
class FrozenWeight:
    """A parameter whose value a pass baked into the compiled graph (see PassContext.freeze), or a
    lifted module float (PassContext.is_lifted_scalar), guarded by its value instead: Dynamo hands
    it over as a new tensor on every call."""

    placeholder_index: int
    tensor_ref: "weakref.ref[torch.Tensor] | None"
    version: int | None  # None: an inference tensor (made under inference_mode), which keeps no version
    value: float | None = None


def _is_parameter_or_buffer_source(source: str) -> bool:
    return "._buffers[" in source or "._parameters[" in source


def placeholder_source(node: fx.Node) -> str:
    """Dynamo's name for where a placeholder's value comes from, e.g. "L['self']._modules['attn'].scaling"."""
    grapharg = node.meta.get("grapharg")
    source = getattr(getattr(grapharg, "source", None), "name", "")
    return source() if callable(source) else str(source)


class PassContext:
    """Everything a pass may read or change during one compile of one graph."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, config: GraphOptConfig, hardware: HardwareSpec):
        self.gm = gm
        self.example_inputs = list(example_inputs)
        self.config = config
        self.hardware = hardware
        self.decisions: list[Decision] = []
        self.frozen: dict[int, FrozenWeight] = {}
        self.grad_enabled = torch.is_grad_enabled()
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._constant_count = 0
        self.plan: dict | None = None  # loaded lazily by graphopt.plan
        self.for_export = False  # the graph goes to the ONNX exporter (run_passes)
        ranks = rank_and_world()
        self.rank = ranks[0] if ranks else None  # each rank compiles its own graph (tensor parallelism)

    # -- decisions -------------------------------------------------------------------------------
    def record(
        self,
        pass_name: str,
        applied: bool,
        reason: str,
        *,
        node: fx.Node | None = None,
        before: Estimate | None = None,
        after: Estimate | None = None,
        implementation: str | None = None,
        **details: Any,
    ) -> Decision:
        decision = Decision(
            pass_name, applied, reason, module_path(node) if node is not None else "",
            before.ms if before else None, after.ms if after else None, implementation, details, self.rank,
        )
        self.decisions.append(decision)
        log.info("%s%s %s at %s: %s", "" if self.rank is None else f"rank {self.rank}: ", pass_name,
                 "applied" if applied else "declined", decision.location or "?", reason)
        return decision

    # -- values of graph inputs ----------------------------------------------------------------
    def placeholder_index(self, node: fx.Node) -> int | None:
        try:
            return self._placeholders.index(node)
        except ValueError:
            return None

    def example_value(self, node: fx.Node) -> Any:
        """The real tensor behind a placeholder (parameters arrive as real Parameters), else None."""
        index = self.placeholder_index(node) if node.op == "placeholder" else None
        if index is None or index >= len(self.example_inputs):
            return None
        return self.example_inputs[index]

    def is_parameter(self, node: fx.Node) -> bool:
        return isinstance(self.example_value(node), torch.nn.Parameter)

    def is_model_state(self, node: fx.Node) -> bool:
        """A placeholder that holds a parameter or buffer of the model, or a float attribute of it that
        Dynamo lifted to an input (dynamic=True): not a user input."""
        return _is_parameter_or_buffer_source(placeholder_source(node)) or self.is_lifted_scalar(node)

    def reads_lifted_scalars(self) -> bool:
        """Whether any graph input is a lifted module float (see is_lifted_scalar)."""
        return any(self.is_lifted_scalar(n) for n in self._placeholders)

    def is_lifted_scalar(self, node: fx.Node) -> bool:
        """A Python float attribute of the model (HF attention's `self.scaling`) that Dynamo passes
        as a 0-d CPU tensor input when it does not specialize floats (`dynamic=True`). Dynamo does
        not guard its value; guard_tensor guards it by value."""
        value = self.example_value(node) if node.op == "placeholder" else None
        if (not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter) or value.dim() != 0
                or not value.is_floating_point() or value.device.type != "cpu"):
            return False
        source = placeholder_source(node)
        # the model as `self`, or as the first argument of a decorator's (*args, **kwargs) forward
        of_model = source.startswith("L['self']") or source.startswith("L['args'][0].")
        return of_model and not _is_parameter_or_buffer_source(source)

    def can_freeze(self, node: fx.Node) -> tuple[bool, str]:
        """Whether `node` is a weight whose value a pass may bake into the graph, and why not."""
        value = self.example_value(node)
        if not isinstance(value, torch.nn.Parameter):
            return False, "weight is not a model parameter (computed or passed as an input), so it cannot be frozen"
        if self.grad_enabled and value.requires_grad:
            return False, ("weight requires grad in a grad-enabled graph (training); weight-rewriting passes apply "
                           "to inference graphs: run under torch.no_grad()/inference_mode or requires_grad_(False)")
        return True, ""

    def differentiated_reason(self) -> str | None:
        """Why the graph will be differentiated (grad mode on and a graph input, parameters included,
        requires grad), else None. Passes that emit inference-only ops decline such graphs: those
        ops have no backward and refuse inputs that require grad."""
        if self.grad_enabled and any(isinstance(v, torch.Tensor) and v.requires_grad for v in self.example_inputs):
            return ("an input of this graph requires grad in grad mode (training): the pass emits inference-only "
                    "ops; run under torch.no_grad()/inference_mode or requires_grad_(False)")
        return None

    def freeze(self, node: fx.Node) -> torch.Tensor:
        """The value of a parameter, treated from now on as a compile-time constant.

        The backend checks, before every call of the compiled graph, that each frozen parameter is
        the same tensor at the same version counter; if a user swapped or updated it in place
        (optimizer.step(), `with torch.no_grad(): w.copy_(...)`), the graph is recompiled from the
        new values. Writes through `.data` bypass the version counter and are not detected.
        """
        ok, why = self.can_freeze(node)
        if not ok:
            raise ValueError(why)
        return self.guard_tensor(node).detach()

    def guard_tensor(self, node: fx.Node) -> torch.Tensor | None:
        """Record that a rewrite relied on the compile-time value of a graph input (a parameter,
        or a buffer such as a causal mask): the compiled graph is rebuilt if it changes in place
        or is replaced. Returns the value, or None for a node that is not a tensor input."""
        index = self.placeholder_index(node) if node.op == "placeholder" else None
        value = self.example_value(node)
        if index is None or not isinstance(value, torch.Tensor):
            return None
        if index not in self.frozen:
            if self.is_lifted_scalar(node):
                self.frozen[index] = FrozenWeight(index, None, 0, float(value))
            else:
                version = None if value.is_inference() else value._version
                self.frozen[index] = FrozenWeight(index, weakref.ref(value), version)
        return value

    def add_constant(self, tensor: torch.Tensor, hint: str) -> fx.Node:
        """Store a tensor on the GraphModule and return a get_attr node reading it."""
        name = f"_graphopt_{hint}_{self._constant_count}"
        self._constant_count += 1
        self.gm.register_buffer(name, tensor, persistent=False)
        # AOTAutograd (under Inductor) lifts buffers of a Dynamo graph and looks up where each
        # came from; ours come from the compile itself.
        sources = getattr(self.gm, "_param_name_to_source", None)
        if sources is not None:
            from torch._dynamo.source import ConstantSource

            sources[name] = ConstantSource(name)
        with self.gm.graph.inserting_after(self._placeholders[-1] if self._placeholders else None):
            node = self.gm.graph.get_attr(name)
        node.meta["example_value"] = tensor
        return node

    @property
    def counts(self) -> dict[str, int]:
        return count_applied(self.decisions)


class GraphPass:
    """Base class: subclasses set `name` and implement `run(ctx)`.

    `run` typically loops `for match in self.match(ctx)`, asks the cost model, and either calls
    a replacement helper (graphopt.passes.fx_utils.replace_with_call) or records a decline.
    """

    name: str = ""
    lossless: bool = True

    def run(self, ctx: PassContext) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def accept(self, ctx: PassContext, before: Estimate, after: Estimate) -> tuple[bool, str]:
        """The cost-model filter shared by passes: rewrite when predicted faster, or when forced."""
        if ctx.config.force:
            return True, f"forced (predicted {before.ms:.4f} -> {after.ms:.4f} ms)"
        if after.ms < before.ms:
            return True, f"predicted {before.ms / after.ms:.2f}x faster ({before.ms:.4f} -> {after.ms:.4f} ms)"
        return False, f"cost model predicts no win on {ctx.hardware.name} ({before.ms:.4f} -> {after.ms:.4f} ms)"


def module_path(node: fx.Node | None) -> str:
    """Dotted module path of a node in the user's model (from Dynamo's nn_module_stack)."""
    if node is None:
        return ""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    return _clean_module_path(raw)


def _clean_module_path(raw: str) -> str:
    # Dynamo writes e.g. "L['self'].model.layers[0].self_attn" or "L['self']._modules['layer'][0]".
    # A forward wrapped by a decorator taking (*args, **kwargs) (seen with transformers 5.24) has the root
    # module as a positional argument: "L['args'][0].model.layers[0]".
    import re

    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", raw)
    path = re.sub(r"^L\['self'\]\.?|^L\['[^']*'\](\[\d+\])?\.?", "", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def iter_nodes(gm: fx.GraphModule, ops: Iterable[str] | None = None):
    """Nodes in a stable snapshot (safe to mutate the graph while iterating)."""
    return [n for n in gm.graph.nodes if ops is None or n.op in ops]
