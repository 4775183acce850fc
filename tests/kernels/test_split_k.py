"""split_k.py: the buffers a split-K launch writes are separate allocations.

A triton_op passes the sums and the arrival counters to one kernel that writes both. Were they two
views of one allocation, torch's functionalization of the user-defined Triton kernel would rebuild
the mutated views through an as_strided of one of them, and Inductor would read that view's own
buffer past its end: the counters would not start at zero and the compiled graph's split-K outputs
would be wrong. The launches are recorded here under the interpreter (or on a GPU)."""

import pytest
import torch

from graphopt.kernels import fp4, q4, split_k
from graphopt.kernels.fp4 import KernelConfig, quantize_fp4, to_kernel_layout
from graphopt.kernels.launch import INTERPRET

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="the Triton kernels need a GPU or "
                                "TRITON_INTERPRET=1")


def _written_tensors_share_no_storage(monkeypatch, launcher_module, run):
    """Run `run()` with `launcher_module.launch` recording its tensor arguments; every pair of
    distinct tensor objects among them must live in different storages."""
    calls = []
    real_launch = launcher_module.launch

    def recording(kernel, grid, *args, **meta):
        calls.append([a for a in args if isinstance(a, torch.Tensor)])
        return real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher_module, "launch", recording)
    run()
    assert calls
    for tensors in calls:
        distinct = list({id(t): t for t in tensors}.values())
        storages = [t.untyped_storage().data_ptr() for t in distinct]
        assert len(set(storages)) == len(storages), "two tensor arguments of one launch share an allocation"


def test_fp4_split_k_launch_takes_sums_and_counters_in_their_own_allocations(monkeypatch):
    g = torch.Generator().manual_seed(3)
    kw = to_kernel_layout(quantize_fp4(torch.randn(40, 300, generator=g) * 0.05, "nvfp4"))
    kw = type(kw)(**{f: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for f, v in vars(kw).items()})
    x = torch.randn(3, 300, generator=g).to(DEVICE, torch.bfloat16)
    _written_tensors_share_no_storage(monkeypatch, fp4.launcher, lambda: fp4.fp4_linear(
        x, kw, None, path="gemv", config=KernelConfig(16, 4, 64, split_k=3)))


def test_q4_last_split_launch_takes_sums_and_counters_in_their_own_allocations(monkeypatch):
    g = torch.Generator().manual_seed(4)
    qweight, scales = q4.quantize_weight(torch.randn(40, 224, generator=g) * 0.05)
    x = torch.randn(3, 224, generator=g)
    _written_tensors_share_no_storage(monkeypatch, q4.launcher, lambda: q4.q4_linear_triton(
        x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), None, "fused",
        config=q4.TileConfig("dp4a", 0, 8, 1, 1, 1, split_k=3, reduce="last")))


def test_split_buffers_are_zeroed_fp32_sums_and_int32_counters():
    sums, counters = split_k.split_buffers(torch.device("cpu"), 3, 5, 7)
    assert sums.shape == (3, 5) and sums.dtype == torch.float32 and not sums.any()
    assert counters.shape == (7,) and counters.dtype == torch.int32 and not counters.any()
    assert sums.untyped_storage().data_ptr() != counters.untyped_storage().data_ptr()
