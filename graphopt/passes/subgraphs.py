"""Bodies of higher-order ops: Dynamo puts the code of some regions in a GraphModule attribute of
the graph and calls it through a higher-order op, e.g. `torch.utils.checkpoint` regions through
`tag_activation_checkpoint(body, *operands)`. A pass that rewrites such a body runs on it with a
BodyContext, whose placeholders stand for the op's operands in the enclosing graph."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx as fx

from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import fake


def _checkpoint_op() -> Any:
    return getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def is_checkpoint(call: fx.Node) -> bool:
    """A call of an activation-checkpointed region's body."""
    op = _checkpoint_op()
    return op is not None and call.op == "call_function" and call.target is op


def higher_order_bodies(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.GraphModule]]:
    """(call, body) for every GraphModule attribute of `gm` that a higher-order op call takes (the
    body it runs; torch.cond takes two)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        for operand in node.args:
            if isinstance(operand, fx.Node) and operand.op == "get_attr":
                body = getattr(gm, str(operand.target), None)
                if isinstance(body, fx.GraphModule):
                    yield node, body


def op_name(call: fx.Node) -> str:
    return getattr(call.target, "__name__", str(call.target))


class BodyContext(PassContext):
    """A PassContext for the body of a higher-order op call in `parent`'s graph: decisions and
    guards go to the parent. In an activation checkpoint's body, a placeholder fed by a parent
    placeholder reads (and guards) that input, so masks built from buffers are evaluated as in the
    enclosing graph; other bodies' placeholders read as inputs."""

    def __init__(self, parent: PassContext, call: fx.Node, body: fx.GraphModule):
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        operands = list(call.args[1:]) if is_checkpoint(call) else []  # checkpoint(body, *operands)
        self._outer = {p: o for p, o in zip(placeholders, operands) if isinstance(o, fx.Node) and o.op == "placeholder"}
        inputs = [parent.example_value(self._outer[p]) if p in self._outer else fake(p) for p in placeholders]
        super().__init__(body, inputs, parent.config, parent.hardware)
        self.parent = parent
        self.decisions = parent.decisions
        self.frozen = parent.frozen
        self.grad_enabled = parent.grad_enabled
        self.for_export = parent.for_export
        self.plan = parent.plan

    def is_model_state(self, node: fx.Node) -> bool:
        outer = self._outer.get(node)
        return outer is not None and self.parent.is_model_state(outer)

    def is_lifted_scalar(self, node: fx.Node) -> bool:
        outer = self._outer.get(node)
        return outer is not None and self.parent.is_lifted_scalar(outer)

    def guard_tensor(self, node: fx.Node) -> torch.Tensor | None:
        outer = self._outer.get(node)
        return self.parent.guard_tensor(outer) if outer is not None else None

    def add_constant(self, tensor: torch.Tensor, hint: str) -> fx.Node:
        raise NotImplementedError("constants inside a higher-order op's body are not supported")
