"""graphopt.ops.ttir_cache: equal user-defined Triton kernel calls share one TTIR in a compile."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphopt.ops import ttir_cache

triton = pytest.importorskip("triton")


@pytest.fixture
def counting(monkeypatch):
    """ttir_cache.memoized over a stand-in generate_ttir that counts its calls."""
    ttir_cache.clear()
    calls = []

    def fake_generate(kernel, kwargs, tma):
        calls.append(dict(kwargs))
        return object(), [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]

    class Target:
        def get_current_target(self):
            return ("cuda", 90)

    monkeypatch.setattr(triton.runtime.driver, "_active", Target())
    yield ttir_cache.memoized(fake_generate), calls
    ttir_cache.clear()


def _store_kernel(x, out, N, BLOCK_N):
    pass


def _kernel():
    """A JIT function (the tests run Triton's interpreter, whose kernels Inductor never analyses)."""
    from triton.runtime.jit import JITFunction

    return JITFunction(_store_kernel)


def _fake(dtype):
    with FakeTensorMode():
        return torch.empty(8, dtype=dtype)


def test_equal_calls_share_one_generation_and_each_caller_gets_its_own_name_list(counting):
    generate, calls = counting
    kernel = _kernel()
    first = generate(kernel, {"x": _fake(torch.bfloat16), "N": 4096, "BLOCK_N": 16}, {})
    second = generate(kernel, {"x": _fake(torch.bfloat16), "N": 4096, "BLOCK_N": 16}, {})
    assert len(calls) == 1
    assert first[0] is second[0] and first[1] == second[1] and first[1] is not second[1]


@pytest.mark.parametrize("change", [
    {"x": "float16"},  # a tensor's dtype
    {"BLOCK_N": 32},  # a constexpr
    {"N": 1},  # a scalar Triton may specialize on
    {"N": True},  # same value, other type
])
def test_what_the_ttir_depends_on_is_in_the_key(counting, change):
    generate, calls = counting
    kernel = _kernel()
    base = {"x": _fake(torch.bfloat16), "N": 4096, "BLOCK_N": 16}
    generate(kernel, dict(base), {})
    changed = {**base, **{k: (_fake(getattr(torch, v)) if k == "x" else v) for k, v in change.items()}}
    generate(kernel, changed, {})
    assert len(calls) == 2


def test_symbolic_sizes_share_an_entry(counting):
    """generate_ttir writes 2 for every symbolic size, so two symbols key alike."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    generate, calls = counting
    env = ShapeEnv()
    m1, m2 = (env.create_unbacked_symint() for _ in range(2))
    kernel = _kernel()
    generate(kernel, {"x": _fake(torch.bfloat16), "M": m1}, {})
    generate(kernel, {"x": _fake(torch.bfloat16), "M": m2}, {})
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["real tensor", "tma metadata", "other argument", "not a JIT function"])
def test_calls_it_cannot_key_go_straight_through(counting, case):
    generate, calls = counting
    kernel, kwargs, tma = _kernel(), {"x": _fake(torch.bfloat16), "N": 4096}, {}
    if case == "real tensor":  # Triton specializes on a real tensor's alignment
        kwargs["x"] = torch.empty(8, dtype=torch.bfloat16)
    elif case == "tma metadata":
        tma = {"x": ("stable", ([16, 16],))}
    elif case == "other argument":
        kwargs["N"] = [4096]
    else:
        kernel = object()
    generate(kernel, dict(kwargs), tma)
    generate(kernel, dict(kwargs), tma)
    assert len(calls) == 2


def test_installed_over_torchs_generate_ttir_once():
    """Importing graphopt.ops puts the cache in front of torch's generate_ttir, and a second install
    does not wrap it twice."""
    from torch._higher_order_ops import triton_kernel_wrap

    assert ttir_cache.install()
    wrapped = triton_kernel_wrap.generate_ttir
    assert hasattr(wrapped, "wrapped") and not hasattr(wrapped.wrapped, "wrapped")
    assert ttir_cache.install() and triton_kernel_wrap.generate_ttir is wrapped


SM90_CHECK = """
import torch, triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap
from graphopt.ops import ttir_cache
from graphopt.kernels.fp4.decode import _fp4_gemv_int_kernel

class Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

triton.runtime.driver._active = Sm90()
generated = []
original = triton_kernel_wrap.generate_ttir.wrapped
generate = ttir_cache.memoized(lambda *a: generated.append(1) or original(*a))
with FakeTensorMode():
    t = {n: torch.empty(8, dtype=d) for n, d in (("x", torch.bfloat16), ("w", torch.uint8), ("s", torch.float8_e4m3fn),
                                                ("g", torch.float32), ("out", torch.bfloat16))}
k, n = 256, 64
kwargs = dict(x_ptr=t["x"], words_ptr=t["w"], scales_ptr=t["s"], global_scale_ptr=t["g"], bias_ptr=t["g"],
              out_ptr=t["out"], ws_ptr=t["out"], counter_ptr=t["out"], M=1, N=n, K=k, K_PADDED=k, stride_xm=k,
              stride_wn=k // 8, stride_sn=k // 16, stride_om=n, IS_NVFP4=True, HAS_BIAS=False, BLOCK_SIZE=16,
              BLOCK_M=1, BLOCK_N=16, WORDS_PER_ITER=32, SPLIT_K=1, USE_ASM=True)
module, names = generate(_fp4_gemv_int_kernel, dict(kwargs), {})
again, names_again = generate(_fp4_gemv_int_kernel, dict(kwargs), {})
assert again is module and names_again == names and len(generated) == 1, (len(generated), names, names_again)
assert "out_ptr" in names and "tt.store" in str(module)
print("shared")
"""


def test_torchs_generate_ttir_through_the_cache_for_an_sm90_target():
    """The real generate_ttir (Triton's frontend for an sm_90 target, no GPU needed) on graphopt's
    FP4 decode kernel, as Inductor calls it (fake tensors), in a process without Triton's
    interpreter: a second equal call returns the same module and argument names, generated once."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SM90_CHECK], env=env, capture_output=True, text=True, timeout=240)
    if run.returncode != 0 and "cuda" in run.stderr.lower() and "backend" in run.stderr.lower():
        pytest.skip(f"this Triton cannot build for sm_90 without a GPU: {run.stderr[-300:]}")
    assert run.returncode == 0 and "shared" in run.stdout, run.stderr[-3000:]
