"""graphopt.kernels.launch: the direct launch through a compiled kernel's own launcher.

CPU: the key (dtype and 16-byte alignment per tensor), the trailing constexpr values, the
autotuner's key, and the plain launches under the interpreter. GPU: repeated launches take the
compiled path and give the same results as the JIT, a misaligned input gets its own compiled
kernel, and the switch works; an autotuned kernel is tuned once per key of its own, then
launched directly with the config its autotuner chose."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from graphopt.kernels import launch as launch_module
from graphopt.kernels.launch import INTERPRET, _launch_key, _trailing_values, launch, launch_tuned


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask) * a
    if ADD_ONE:
        y += 1.0
    tl.store(y_ptr + offs, y, mask=mask)


# Two configs on a GPU, so the autotuner benchmarks and caches a choice per key (the interpreter
# cannot benchmark: one config there, as in the package's kernels).
_TUNED_CONFIGS = [triton.Config({"BLOCK": 128}, num_warps=4)] + (
    [] if INTERPRET else [triton.Config({"BLOCK": 256}, num_warps=2)])


@triton.autotune(configs=_TUNED_CONFIGS, key=["n_bucket"])
@triton.jit
def _scale_tuned_kernel(x_ptr, y_ptr, n, a, n_bucket, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * a, mask=mask)


def _scale_tuned(x: torch.Tensor, a: float) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    launch_tuned(_scale_tuned_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, a,
                 triton.next_power_of_2(n))
    return y


def _axpb(x: torch.Tensor, a: float, add_one: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    launch(_axpb_kernel, (triton.cdiv(n, 128),), x, y, n, a, BLOCK=128, ADD_ONE=add_one)
    return y


def test_key_records_dtype_and_alignment():
    t = torch.arange(64, dtype=torch.uint8)

    def key(*args, **meta):
        return _launch_key(_axpb_kernel, 0, args, meta)

    assert key(t, 7, None, 0.5, BLOCK=64) == (id(_axpb_kernel), 0, ("BLOCK", 64), (torch.uint8, True), 7, None, 0.5)
    assert key(t[1:], 7) != key(t, 7)  # Triton specializes on 16-byte alignment
    assert key(t[16:], 7) == key(t, 7)
    assert key(t.float(), 7) != key(t, 7)  # the pointer's element type
    assert key(t, 7, BLOCK=64) != key(t, 7, BLOCK=128) != key(t, 8, BLOCK=128)


def test_key_records_host_descriptors():
    # a host-side tensor descriptor (unhashable itself) counts by dtype, shape, strides and block
    from triton.tools.tensor_descriptor import TensorDescriptor

    def key(x, block):
        return _launch_key(_axpb_kernel, 0, (TensorDescriptor(x, list(x.shape), list(x.stride()), block),), {})

    x = torch.randn(256, 64, dtype=torch.bfloat16)
    assert hash(key(x, [64, 64])) == hash(key(x.clone(), [64, 64]))  # another tensor, same kernel
    assert key(x, [64, 64]) == key(x.clone(), [64, 64])
    assert key(x, [128, 64]) != key(x, [64, 64])  # Triton specializes on the block shape
    assert key(x.half(), [64, 64]) != key(x, [64, 64])  # and on the dtype
    assert key(x[:128], [64, 64]) != key(x, [64, 64])  # shapes and strides are keyed too


def test_trailing_values_in_signature_order():
    kernel = JITFunction(_axpb_kernel.fn)  # the plain JIT object, also under the interpreter
    assert _trailing_values(kernel, 4, {"BLOCK": 64}) == (64, False)  # ADD_ONE from its default
    assert _trailing_values(kernel, 4, {"ADD_ONE": True, "BLOCK": 32, "num_warps": 4}) == (32, True)
    assert _trailing_values(kernel, 3, {"BLOCK": 64}) is None  # `a` has no value: not cacheable
    assert _trailing_values(kernel, 4, {"BLOCK": torch.ones(1)}) is None  # a tensor would be baked in


def test_launch_matches_reference():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for n, add_one in ((1000, False), (77, True)):
        x = torch.randn(n, device=device)
        torch.testing.assert_close(_axpb(x, 1.5, add_one), x * 1.5 + (1.0 if add_one else 0.0))


def test_tuned_launch_matches_reference():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for n in (1000, 77, 1000):
        x = torch.randn(n, device=device)
        torch.testing.assert_close(_scale_tuned(x, -2.5), x * -2.5)


@pytest.mark.gpu
def test_tuned_kernel_is_tuned_once_per_key_then_launched_directly():
    torch.manual_seed(0)
    launch_module._TUNED.clear()
    _scale_tuned_kernel.cache.clear()
    x = torch.randn(3000, device="cuda")
    torch.testing.assert_close(_scale_tuned(x, 2.0), 2.0 * x)
    assert len(_scale_tuned_kernel.cache) == 1 and len(launch_module._TUNED) == 1
    (chosen,) = _scale_tuned_kernel.cache.values()
    (compiled, _, launch_meta), = launch_module._TUNED.values()
    assert launch_meta["BLOCK"] == chosen.kwargs["BLOCK"] and launch_meta["num_warps"] == chosen.num_warps
    assert compiled.metadata.num_warps == chosen.num_warps  # the chosen config's compiled kernel

    def autotuner_called(*args, **kwargs):
        raise AssertionError("the autotuner's call path was taken for a known key")

    _scale_tuned_kernel.run = autotuner_called
    try:
        for _ in range(3):  # fresh data, same key (scalars count by value): that kernel, launched directly
            x = torch.randn(3000, device="cuda")
            torch.testing.assert_close(_scale_tuned(x, 2.0), 2.0 * x)
    finally:
        del _scale_tuned_kernel.run
    assert len(launch_module._TUNED) == 1
    x = torch.randn(2049, device="cuda")  # same tuning key (bucket 4096), another launch key
    torch.testing.assert_close(_scale_tuned(x, 2.0), 2.0 * x)
    assert len(_scale_tuned_kernel.cache) == 1 and len(launch_module._TUNED) == 2
    x = torch.randn(100, device="cuda")  # another bucket: tuned again
    torch.testing.assert_close(_scale_tuned(x, 2.0), 2.0 * x)
    assert len(_scale_tuned_kernel.cache) == 2 and len(launch_module._TUNED) == 3
    x16 = torch.randn(3000, device="cuda", dtype=torch.float16)  # a dtype is part of both keys
    torch.testing.assert_close(_scale_tuned(x16, 2.0), 2.0 * x16)
    assert len(_scale_tuned_kernel.cache) == 3 and len(launch_module._TUNED) == 4


@pytest.mark.gpu
def test_repeated_launches_take_the_compiled_path():
    torch.manual_seed(0)
    launch_module._COMPILED.clear()
    x = torch.randn(4096, device="cuda")
    _axpb(x, 2.0, False)
    keys = [k for k in launch_module._COMPILED if k[0] == id(_axpb_kernel)]
    assert len(keys) == 1
    compiled = launch_module._COMPILED[keys[0]][0]
    for _ in range(3):  # fresh data, same key: the compiled launcher, same results
        x = torch.randn(4096, device="cuda")
        torch.testing.assert_close(_axpb(x, 2.0, False), 2.0 * x)
    assert [k for k in launch_module._COMPILED if k[0] == id(_axpb_kernel)] == keys
    assert launch_module._COMPILED[keys[0]][0] is compiled
    # A view 4 bytes off a 16-byte boundary: Triton compiles another specialization, and so do we.
    base = torch.randn(4097, device="cuda")
    torch.testing.assert_close(_axpb(base[1:], 2.0, False), 2.0 * base[1:])
    assert len([k for k in launch_module._COMPILED if k[0] == id(_axpb_kernel)]) == 2
    # The switch: the plain JIT launch, same results, nothing new cached.
    launch_module.DIRECT = False
    try:
        torch.testing.assert_close(_axpb(x, 3.0, True), 3.0 * x + 1.0)
        assert len([k for k in launch_module._COMPILED if k[0] == id(_axpb_kernel)]) == 2
    finally:
        launch_module.DIRECT = True
