"""One TTIR per distinct Triton kernel call in a compile, not one per call site.

When Inductor meets a user-defined Triton kernel (a `triton_op` body's `wrap_triton` call, as every
graphopt::fp4_linear and Q4 op makes), it asks which tensors the call writes, and answers by
generating the kernel's TTIR with Triton's frontend (torch's `triton_kernel_wrap.generate_ttir`),
at every call site and more than once per site. For a model with hundreds of quantized linears
that is a large share of its compile: Triton's code generator led a profile of one (the compile
times are in bench/RESULTS.md, section 10). The TTIR depends only on the kernel, its
constexpr and scalar arguments and its tensors' dtypes: generate_ttir itself stands in a
two-element tensor of the dtype for every fake tensor and 2 for every symbolic size. So calls that
agree on those share one TTIR. `install` wraps torch's generate_ttir with that cache, for every
kernel Inductor compiles; a call it cannot key (a real tensor, whose alignment Triton specializes
on, a TMA descriptor, an autotuned kernel, an argument of another type) goes straight through.

Gluon kernels (fp4_tma, fp4/decode_persistent) need one more thing there. generate_ttir builds every
kernel with Triton's plain ASTSource and default options, which leaves a Gluon module without the
warp count its layouts are checked against: the TTIR fails to verify, and torch then assumes the
call writes every tensor it is given, so Inductor copies the packed weights around each call. For a
Gluon kernel, `install`'s wrapper builds the TTIR as Gluon's own launcher does (GluonASTSource, the
call's num_warps).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import threading
from typing import Any, Callable

import torch

CACHE_ENTRIES = 512  # distinct (kernel, arguments) TTIRs kept; a model has a few dozen

_lock = threading.Lock()
_cache: collections.OrderedDict = collections.OrderedDict()


def _argument_key(value: Any):
    """What generate_ttir's output depends on for one argument, or None when it cannot be keyed."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        return ("tensor", value.dtype)
    if isinstance(value, torch.Tensor):
        return None  # a real tensor reaches Triton's specialization as it is (its alignment counts)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbolic",)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return (type(value).__name__, value)
    try:
        from torch._inductor.ir import TensorBox

        if isinstance(value, TensorBox):
            return ("tensor", value.get_dtype())
    except Exception:  # noqa: BLE001 - an IR node without a dtype: not keyed
        return None
    return None


def call_key(kernel: Any, kwargs: dict, tma_descriptor_metadata: Any):
    """The cache key of one generate_ttir call, or None when the call must not be cached."""
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction) or tma_descriptor_metadata:
        return None
    parts = []
    for name in sorted(kwargs):
        key = _argument_key(kwargs[name])
        if key is None:
            return None
        parts.append((name, key))
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no target: generate_ttir will say so itself
        return None
    return (kernel, target, tuple(parts))


_source_lock = threading.Lock()  # held while triton.compiler.compiler.ASTSource is swapped


def _is_gluon(kernel: Any) -> bool:
    return callable(getattr(kernel, "is_gluon", None)) and kernel.is_gluon()


def _gluon_source(num_warps: int):
    """A stand-in for Triton's ASTSource that builds a Gluon kernel's module as Gluon's launcher does:
    GluonASTSource, with the launch's num_warps in the options."""
    from triton.experimental.gluon._runtime import GluonASTSource

    class GluonSource(GluonASTSource):
        def make_ir(self, target, options, codegen_fns, module_map, context):
            return super().make_ir(target, dataclasses.replace(options, num_warps=num_warps), codegen_fns,
                                   module_map, context)

    GluonSource.make_ir.__signature__ = inspect.signature(GluonASTSource.make_ir)  # generate_ttir counts its parameters
    return GluonSource


def gluon_aware(generate_ttir: Callable, kernel: Any, kwargs: dict) -> Callable:
    """generate_ttir, or for a Gluon kernel a call of it with Gluon's source in place of Triton's."""
    if not _is_gluon(kernel):
        return generate_ttir
    import triton.compiler.compiler as triton_compiler

    source = _gluon_source(int(kwargs.get("num_warps", 4)))

    def generate(*args, **kw):
        with _source_lock:
            plain = triton_compiler.ASTSource
            triton_compiler.ASTSource = source
            try:
                return generate_ttir(*args, **kw)
            finally:
                triton_compiler.ASTSource = plain
    return generate


def memoized(generate_ttir: Callable) -> Callable:
    """generate_ttir with the cache in front of it, and Gluon kernels built as Gluon builds them."""

    def generate_ttir_once(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        generate_ttir_here = gluon_aware(generate_ttir, kernel, kwargs)
        key = call_key(kernel, kwargs, tma_descriptor_metadata) if not (args or kw) else None
        if key is None:
            return generate_ttir_here(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
        if hit is None:
            hit = generate_ttir_here(kernel, kwargs, tma_descriptor_metadata)
            with _lock:
                _cache[key] = hit
                while len(_cache) > CACHE_ENTRIES:
                    _cache.popitem(last=False)
        module, names = hit
        return module, list(names)  # callers may extend their copy of the names

    generate_ttir_once.wrapped = generate_ttir
    return generate_ttir_once


def install() -> bool:
    """Put the cache in front of torch's generate_ttir (once); False where this torch has none."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return False
    current = getattr(triton_kernel_wrap, "generate_ttir", None)
    if current is None:
        return False
    if not hasattr(current, "wrapped"):
        triton_kernel_wrap.generate_ttir = memoized(current)
    return True


def clear() -> None:
    with _lock:
        _cache.clear()
