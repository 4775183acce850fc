"""Launching a Triton kernel: recorded for the compiler while traced, straight to the compiled
kernel when called eagerly.

Inside a `torch.library.triton_op` body that Inductor traces (fake tensors), `launch` records the
kernel with `torch.library.wrap_triton`, so Inductor emits the launch in its own generated code
(and inside its CUDA graphs). Called eagerly, it launches the kernel itself, as follows.

`kernel[grid](*args, **meta)` re-derives the kernel's specialization from every argument on every
call, builds a cache key from it, looks the compiled kernel up, and only then launches. For the
decode kernels of fp4/ and q4/ (16-30 arguments) that launch path took longer on an H100 host
than a one-token layer's work on the GPU (host time per op: bench/bench_op_host.py,
bench/RESULTS.md section 1). `launch` makes the same launch, remembers the compiled kernel
under a key that fixes its specialization, and sends later calls with that key straight to the
compiled kernel's own launcher
(`CompiledKernel.__getitem__`, present in Triton 3.6 through 3.9). `launch_tuned` does the same
for a `triton.autotune` kernel once its autotuner has chosen a config for the call: the
autotuner's own call path (its key, then the JIT launch) costs as much host time again.

The key is a superset of what Triton specializes on: per tensor its dtype and whether its address
is 16-byte aligned; per host-side tensor descriptor its dtype, shape, strides and block shape;
every other argument, constexpr and launch option by value; the kernel; the current device. Two
calls with equal keys would get the same compiled kernel from the JIT.
Under TRITON_INTERPRET=1 (no compiled kernel exists), for a kernel that is not a plain
`@triton.jit` function (an autotuner), and where the first launch returns no compiled kernel or an
argument cannot be keyed, this is the plain JIT launch; GRAPHOPT_DIRECT_LAUNCH=0 (or DIRECT = False)
makes it the plain JIT launch everywhere.
"""

from __future__ import annotations

import inspect
import os
import threading

import torch
from torch._library.triton import is_wrap_triton_enabled
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

try:
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - the CPU references work without Triton
    JITFunction = ()
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host-side tensor descriptors
    TensorDescriptor = ()
try:  # Gluon's descriptors also carry their shared-memory layout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon
    GluonTensorDescriptor = ()

DIRECT = os.environ.get("GRAPHOPT_DIRECT_LAUNCH", "1") != "0"
# Triton reads TRITON_INTERPRET when a kernel is decorated, so the mode is fixed at import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# key -> (compiled kernel, the trailing arguments the caller passes by keyword, in signature order)
_COMPILED: dict[tuple, tuple] = {}
MAX_ENTRIES = 4096  # shapes that vary per call (prefill lengths) each add one; past this, start over


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side of a launch (triton.cdiv is a jit helper, slow to call there)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for the host side of a launch."""
    return 1 << (n - 1).bit_length()


def _descriptor_key(d) -> tuple:
    """A host-side tensor descriptor's part of a launch key (Triton's, or Gluon's with its layout).
    Triton specializes on its dtype and block shape (and padding, and a Gluon descriptor's layout);
    shape and strides are launch-time values, keyed too so the key stays a superset whatever a
    Triton version reads from them."""
    return (type(d), d.base.dtype, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            getattr(d, "layout", None), getattr(d, "padding", None), getattr(d, "round_f32_to_tf32", None))


def _launch_key(kernel, device: int, args: tuple, meta: dict) -> tuple:
    """What fixes the compiled kernel of a launch: the kernel, the device, constexprs and launch
    options by value, per tensor argument its dtype and 16-byte alignment, per host tensor
    descriptor `_descriptor_key`, other arguments by value (one comprehension, no call per
    tensor: this runs on every launch)."""
    return (id(kernel), device, *meta.items(),
            *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
              else _descriptor_key(a) if isinstance(a, (TensorDescriptor, GluonTensorDescriptor)) else a for a in args])


def _trailing_values(kernel, positional: int, meta: dict) -> tuple | None:
    """The values of the kernel's parameters after the first `positional`, from `meta` or their
    defaults, in signature order (the compiled launcher takes every parameter positionally,
    constexprs included); None if one has neither, or is a tensor (it would be baked in)."""
    params = inspect.signature(kernel.fn).parameters
    values = []
    for name in kernel.arg_names[positional:]:
        if name in meta:
            value = meta[name]
        elif params[name].default is not inspect.Parameter.empty:
            value = params[name].default
        else:
            return None
        if isinstance(value, torch.Tensor):
            return None
        values.append(value)
    return tuple(values)


def _grid3(grid) -> tuple:
    """A grid of one to three ints as the three the compiled launcher takes."""
    grid = tuple(grid)
    return (*grid, *(1,) * (3 - len(grid)))


def _key_or_none(keyed, args: tuple, meta: dict) -> tuple | None:
    """The launch key of a call (`keyed`: the kernel, or the autotuner around it), or None where
    an argument cannot be hashed."""
    try:
        return _launch_key(keyed, torch.cuda.current_device(), args, meta)
    except TypeError:
        return None


def _remember(cache: dict, key: tuple, entry: tuple) -> None:
    if len(cache) >= MAX_ENTRIES:
        cache.clear()
    cache[key] = entry


def traced(args: tuple) -> bool:
    """Whether this launch is being traced (fake tensors: Inductor tracing a triton_op body, or its
    fake implementation) rather than run."""
    if not is_wrap_triton_enabled():  # a triton_op's eager call switches the wrapper off
        return False
    return any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)


def launch(kernel, grid: tuple, *args, **meta):
    """`kernel[grid](*args, **meta)`: recorded with wrap_triton while traced; otherwise through the
    compiled kernel's launcher once a call with the same key has compiled it. `grid` is a tuple of
    one to three ints; tensors go in `args` (positional, in signature order), constexprs and launch
    options in `meta`."""
    if isinstance(kernel, JITFunction) and traced(args):
        return wrap_triton(kernel)[tuple(grid)](*args, **meta)
    key = _key_or_none(kernel, args, meta) if DIRECT and not INTERPRET and isinstance(kernel, JITFunction) else None
    if key is None:
        return kernel[grid](*args, **meta)
    entry = _COMPILED.get(key)
    if entry is not None:
        compiled, trailing = entry
        compiled[_grid3(grid)](*args, *trailing)
        return compiled
    compiled = kernel[_grid3(grid)](*args, **meta)
    trailing = _trailing_values(kernel, len(args), meta)
    if compiled is not None and hasattr(compiled, "__getitem__") and trailing is not None:
        _remember(_COMPILED, key, (compiled, trailing))
    return compiled


# launch key of a call (with the autotuner in place of the kernel) -> (the compiled kernel of the
# config that autotuner chose, the trailing arguments, the meta-parameters with that config's)
_TUNED: dict[tuple, tuple] = {}
_TUNER_LOCK = threading.RLock()  # around an autotuner call and the read of the config it chose


def launch_tuned(tuner, grid, *args, **meta):
    """`tuner[grid](*args, **meta)` for a `triton.autotune` kernel; `grid` is a function of the
    launch's meta-parameters, as for the autotuner. The first call with a key goes through the
    autotuner (which benchmarks its configs once per tuning key of its own); later calls with the
    same key launch the compiled kernel of the config it chose directly. The key is `launch`'s,
    a superset of the autotuner's (its key arguments' values and every tensor's dtype), so a call
    never reuses a config chosen for another tuning key. Configs with a pre-hook always go
    through the autotuner."""
    direct = DIRECT and not INTERPRET and isinstance(getattr(tuner, "fn", None), JITFunction)
    key = _key_or_none(tuner, args, meta) if direct else None
    if key is None:
        with _TUNER_LOCK:
            return tuner[grid](*args, **meta)
    entry = _TUNED.get(key)
    if entry is not None:
        compiled, trailing, launch_meta = entry
        compiled[_grid3(grid(launch_meta))](*args, *trailing)
        return compiled
    # The autotuner keeps its choice in one shared attribute (best_config): a second thread's call
    # between this call and the read below would pair this kernel with the other call's config.
    with _TUNER_LOCK:
        compiled = tuner[grid](*args, **meta)
        config = getattr(tuner, "best_config", None)
    if config is not None and config.pre_hook is None and compiled is not None and hasattr(compiled, "__getitem__"):
        launch_meta = {**meta, **config.all_kwargs()}
        trailing = _trailing_values(tuner.fn, len(args), launch_meta)
        if trailing is not None:
            _remember(_TUNED, key, (compiled, trailing, launch_meta))
    return compiled
