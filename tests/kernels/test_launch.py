"""graphopt.kernels.launch: the direct launch through a compiled kernel's own launcher.

CPU: the key (dtype and 16-byte alignment per tensor), the trailing constexpr values, and the
plain launch under the interpreter. GPU: repeated launches take the compiled path and give the
same results as the JIT, a misaligned input gets its own compiled kernel, and the switch works."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from graphopt.kernels import launch as launch_module
from graphopt.kernels.launch import _launch_key, _trailing_values, launch


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask) * a
    if ADD_ONE:
        y += 1.0
    tl.store(y_ptr + offs, y, mask=mask)


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
