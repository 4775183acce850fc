"""The ordered pass registry, and the loop that runs enabled passes over a graph.

Matching machinery: our own anchor-based matchers over Dynamo's torch-level FX graph.

We considered the two stock options and chose neither:
- `torch.fx.subgraph_rewriter` matches one literal pattern graph at a time. Hand-written attention
  comes in a product of variants (scale before/after the matmul x mul/div x additive/masked_fill/
  where masks x fp32 upcast or not x eval dropout x repeat_kv GQA x bmm/matmul ...), which would
  need hundreds of patterns, and it cannot express "any chain of casts here".
- Inductor's pattern matcher (`register_replacement`) works on the aten-level graph inside
  Inductor. That ties rewrites to Inductor as the downstream compiler (our `eager` and `tensorrt`
  downstreams would never see them), and its own fuse_attention patterns fired zero times on
  `transformers` eager attention in our measurements.
So each pass anchors on one distinctive node (softmax for attention, a linear/addmm/matmul
against a parameter for the weight passes), walks up and down through ops it knows to be
transparent (casts, eval dropout, views), and checks the structure it needs. That is robust to
the variants and keeps every decline explainable ("probabilities have another user", ...).

A pass that raises is logged and skipped: the graph is restored to its state before that pass,
a Decision records the failure, and compilation continues with the remaining passes.
"""

from __future__ import annotations

import copy
import importlib
import logging

import torch.fx as fx

from graphopt.config import PASS_NAMES, GraphOptConfig
from graphopt.hardware import HardwareSpec
from graphopt.passes.base import Decision, GraphPass, PassContext

log = logging.getLogger("graphopt")

# name -> "module:attribute" of a GraphPass instance. Order = PASS_NAMES = run order:
# attention first; sparse_attention then re-lowers `graphopt::attention` nodes where the cost
# model and the plan say sparsity pays (with the attention pass off, it runs its matcher itself);
# then the weight passes; all_reduce last, after the weight passes have wrapped their local results
# back into the DTensors it reads.
REGISTRY: dict[str, str] = {
    "attention": "graphopt.passes.attention:PASS",
    "sparse_attention": "graphopt.passes.sparse_attention:PASS",
    "fp4_linear": "graphopt.passes.fp4_linear:PASS",
    "q4_linear": "graphopt.passes.q4_linear:PASS",
    "fft_linear": "graphopt.passes.fft_linear:PASS",
    "all_reduce": "graphopt.passes.all_reduce:PASS",
}
assert tuple(REGISTRY) == PASS_NAMES

# Passes injected for tests or experiments (name -> GraphPass), run after the registry.
_EXTRA: dict[str, GraphPass] = {}


def load_pass(name: str) -> GraphPass:
    module_name, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), attr)


def ordered_passes(config: GraphOptConfig) -> list[tuple[str, GraphPass | None]]:
    """Enabled passes in run order; a pass that fails to import is returned as None."""
    out: list[tuple[str, GraphPass | None]] = []
    for name in REGISTRY:
        if not config.enabled(name):
            continue
        try:
            out.append((name, load_pass(name)))
        except Exception as exc:  # a broken pass module must not break the user's compile
            log.warning("graphopt pass %s could not be loaded: %s", name, exc)
            out.append((name, None))
    out.extend(_EXTRA.items())
    return out


def run_passes(gm: fx.GraphModule, example_inputs: list, config: GraphOptConfig, hardware: HardwareSpec, *,
               for_export: bool = False) -> PassContext:
    """Run every enabled pass over `gm` in place; returns the context (decisions, frozen weights).
    for_export: the graph goes to the ONNX exporter, not to a compiler."""
    ctx = PassContext(gm, example_inputs, config, hardware)
    ctx.for_export = for_export
    for name, graph_pass in ordered_passes(config):
        if graph_pass is None:
            ctx.decisions.append(Decision(name, False, "pass module failed to import (see log)", rank=ctx.rank))
            continue
        snapshot = graph_copy(gm.graph)
        frozen_before = dict(ctx.frozen)
        n_decisions = len(ctx.decisions)
        try:
            graph_pass.run(ctx)
            gm.graph.lint()
            gm.recompile()
        except Exception as exc:
            log.warning("graphopt pass %s failed and was skipped: %s: %s", name, type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            gm.graph = snapshot
            gm.recompile()
            ctx.frozen = frozen_before
            del ctx.decisions[n_decisions:]
            ctx.decisions.append(Decision(name, False, f"pass failed and was skipped: {type(exc).__name__}: {exc}",
                                          rank=ctx.rank))
    return ctx


def graph_copy(graph: fx.Graph) -> fx.Graph:
    """A deep copy of `graph` whose nodes keep the attributes Dynamo set on the originals (e.g. a
    placeholder's `_dynamo_source`, which AOTAutograd reads): deepcopy copies only fx's own. Node
    metadata is copied shallowly and the module's tensors are not copied: a snapshot to restore
    with `gm.graph = snapshot; gm.recompile()`."""
    copied = copy.deepcopy(graph)
    for original, node in zip(graph.nodes, copied.nodes):
        for key, value in vars(original).items():
            if key not in vars(node):
                setattr(node, key, value)
    return copied


def register_extra_pass(graph_pass: GraphPass) -> None:
    """Run an extra pass after the registry (tests, experiments). Remove with unregister_extra_pass."""
    _EXTRA[graph_pass.name] = graph_pass


def unregister_extra_pass(name: str) -> None:
    _EXTRA.pop(name, None)


__all__ = ["REGISTRY", "Decision", "GraphPass", "PassContext", "run_passes", "load_pass", "graph_copy",
           "register_extra_pass", "unregister_extra_pass"]
