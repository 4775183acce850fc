"""graphopt::all_reduce: the sum over a group's ranks. On CPU (gloo) it runs the functional
all-reduce, whatever its slot: two processes check it against the float64 sum. The symmetric
buffers' bookkeeping (two per group and dtype, grown and never freed) is checked with the
allocation replaced by torch.empty; the one-shot kernel itself needs two GPUs
(tests/passes/test_all_reduce.py::test_the_one_shot_all_reduce_under_cuda_graphs_equals_nccl)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt  # noqa: F401  (registers the ops)
from graphopt.ops import all_reduce as ops
from tests.conftest import free_port

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
WORLD = 2
CASES = [((7, 33), torch.float32), ((2, 5, 64), torch.bfloat16), ((3, 17), torch.float16), ((1, 1, 4096), torch.float32)]


def _inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in CASES]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD.group_name
        results = []
        for slot, x in zip((0, 1, -1, 0), _inputs(rank)):
            results.append(torch.ops.graphopt.all_reduce(x, group, slot))
        strided = _inputs(rank)[0].t()  # not contiguous: the result is, with the same values
        results.append(torch.ops.graphopt.all_reduce(strided, group, 1))
        try:
            torch.ops.graphopt.all_reduce(torch.randn(3, requires_grad=True), group, 0)
            results.append("no error")
        except RuntimeError as exc:
            results.append(str(exc))
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_functional_all_reduce_sums_every_ranks_tensor(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    inputs = [_inputs(r) for r in range(WORLD)]
    for i, (shape, dtype) in enumerate(CASES):
        expected = sum(x[i].double() for x in inputs).to(dtype)
        for rank in range(WORLD):
            got = results[rank][i]
            assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
            torch.testing.assert_close(got, expected)  # two addends: one rounding, as the reference's
    expected = sum(x[0].double() for x in inputs).t().float()
    for rank in range(WORLD):
        assert results[rank][-2].is_contiguous()
        torch.testing.assert_close(results[rank][-2], expected)
        assert "graphopt::all_reduce is inference-only" in results[rank][-1]  # a gradient is refused


def test_the_fake_gives_a_contiguous_tensor_of_the_inputs_shape():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 6).t())
        out = torch.ops.graphopt.all_reduce(x, "0", 0)
        assert out.shape == (6, 4) and out.is_contiguous() and out.dtype == torch.float32


def test_what_the_one_shot_kernel_takes():
    assert ops.one_shot_problem(torch.bfloat16, 8192) is None
    assert ops.one_shot_problem(torch.float32, 16) is None
    assert ops.one_shot_problem(torch.float16, 8192) == "dtype float16: the one-shot kernel takes float32, bfloat16"
    assert ops.one_shot_problem(torch.bfloat16, 8190) == "8190 bytes: the one-shot kernel moves multiples of 16 bytes"
    assert ops.symmetric_memory_problem(torch.device("cpu")) == "the tensors are on cpu: symmetric memory needs CUDA GPUs"
    assert ops.buffer_for(torch.randn(8), "0", 0) is None  # CPU: the functional all-reduce


def test_buffers_come_in_pairs_grow_and_are_kept(monkeypatch):
    """Two buffers per (group, dtype), rendezvoused at once; a smaller request keeps them, a larger
    one makes a new pair and keeps the old for the CUDA graphs that recorded it."""
    import torch.distributed._symmetric_memory as symm_mem

    rendezvous = []
    monkeypatch.setattr(symm_mem, "empty", lambda numel, dtype, device: torch.empty(numel, dtype=dtype))
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buffer, group: rendezvous.append((buffer, group)))
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda group: None, raising=False)
    monkeypatch.setattr(ops, "_BUFFERS", {})
    monkeypatch.setattr(ops, "_REPLACED", [])
    cpu = torch.device("cpu")
    assert ops.prepare_buffers("tp", torch.bfloat16, 4096, cpu) == 4096
    first = dict(ops._BUFFERS)
    assert sorted(first) == [("tp", torch.bfloat16, 0), ("tp", torch.bfloat16, 1)]
    assert first[("tp", torch.bfloat16, 0)] is not first[("tp", torch.bfloat16, 1)]
    assert [group for _, group in rendezvous] == ["tp", "tp"]
    assert ops.prepare_buffers("tp", torch.bfloat16, 1024, cpu) == 4096  # fits: nothing new
    assert len(rendezvous) == 2
    assert ops.prepare_buffers("tp", torch.float32, 512, cpu) == 512  # another dtype: its own pair
    assert ops.prepare_buffers("tp", torch.bfloat16, 8192, cpu) == 8192
    assert len(rendezvous) == 6 and len(ops._REPLACED) == 2
    assert all(any(old is kept for kept in ops._REPLACED) for old in first.values())
