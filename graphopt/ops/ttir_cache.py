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
"""

from __future__ import annotations

import collections
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


def memoized(generate_ttir: Callable) -> Callable:
    """generate_ttir with the cache in front of it."""

    def generate_ttir_once(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        key = call_key(kernel, kwargs, tma_descriptor_metadata) if not (args or kw) else None
        if key is None:
            return generate_ttir(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
        if hit is None:
            hit = generate_ttir(kernel, kwargs, tma_descriptor_metadata)
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
