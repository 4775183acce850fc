"""Registration helpers of the `graphopt::*` ops: the op library, inference-only ops and the
refusal of gradients they cannot give."""

from __future__ import annotations

import torch

from graphopt.ops import ttir_cache as _ttir_cache

_LIB = torch.library.Library("graphopt", "FRAGMENT")
_ttir_cache.install()  # Inductor makes a kernel call's TTIR at each call site: equal calls share one


def _gradient_needed(args) -> bool:
    """Whether autograd would record this call: grad mode on and a tensor argument requires grad."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _refusing_grad(name: str, fn, message: str = ""):
    message = message or (f"graphopt::{name} is inference-only (no backward), and an input requires grad: run it "
                          "under torch.no_grad() or torch.inference_mode(), or compile models you train with "
                          "graphopt's lossy passes off")

    def checked(*args):
        if _gradient_needed(args):
            raise RuntimeError(message)
        return fn(*args)
    return checked


def _refuse_gradients(op, name: str) -> None:
    """A custom op's body runs below autograd with grad mode off, so it cannot see that a gradient
    is needed. Autograd calls the setup step registered here exactly then: it raises
    _refusing_grad's error (the forward has run, nothing is recorded)."""
    check = _refusing_grad(name, lambda *args: None)

    def setup_context(ctx, inputs, output):
        with torch.enable_grad():
            check(*inputs)

    def backward(ctx, *grads):  # unreachable: setup_context raised
        raise RuntimeError(f"graphopt::{name} has no backward")

    op.register_autograd(backward, setup_context=setup_context)


def _inference_op(schema: str):
    """Decorator: define graphopt::<schema> with the function as its kernel on every device (it
    branches on the device itself); returns the op (torch.ops.graphopt.<name>)."""
    name = schema.split("(", 1)[0]

    def register(kernel):
        _LIB.define(schema)
        _LIB.impl(name, _refusing_grad(name, kernel), "CompositeExplicitAutograd")
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
        return getattr(torch.ops.graphopt, name)
    return register


def _inference_fake(name: str):
    """Decorator: the fake (meta) implementation of the inference op graphopt::<name>."""
    def register(fake):
        torch.library.register_fake(f"graphopt::{name}", _refusing_grad(name, fake), lib=_LIB)
        return fake
    return register
