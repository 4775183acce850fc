"""Timing used by the CLI, the kernel autotuners and the benchmarks: median of many runs, CUDA
events on a GPU; cold-L2 timing over rotated weight copies replayed from a CUDA graph."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


def median_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100, device: str | None = None) -> float:
    """Median time of `fn` in ms.

    On CUDA: triton.testing.do_bench (CUDA events, L2 flushed between runs). On CPU: perf_counter
    around each call, at least 5 calls and as many as fit in `rep_ms`, after two warm-up calls.
    """
    on_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if on_cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return statistics.median(_cpu_times_ms(fn, rep_ms))


def _cpu_times_ms(fn: Callable[[], Any], rep_ms: float) -> list[float]:
    """perf_counter around each call: at least 5 calls and as many as fit in `rep_ms` (at most 200),
    after two warm-up calls."""
    for _ in range(2):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


@dataclass(frozen=True)
class Timing:
    """Per-call times of one function: the median and the quartiles, in ms."""

    median_ms: float
    q25_ms: float
    q75_ms: float

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how much one call's time varies (0.1 = 10%)."""
        return (self.q75_ms - self.q25_ms) / self.median_ms if self.median_ms > 0 else 0.0


def timed_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100, device: str | None = None) -> Timing:
    """median_ms with the quartiles of the same runs (CUDA: do_bench's quantiles)."""
    on_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if on_cuda:
        from triton.testing import do_bench

        q25, q50, q75 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.25, 0.5, 0.75])
        return Timing(float(q50), float(q25), float(q75))
    times = _cpu_times_ms(fn, rep_ms)
    q25, q50, q75 = statistics.quantiles(times, n=4)
    return Timing(statistics.median(times), q25, q75)


COLD_BYTES = 120 << 20  # > 2x the H100/H200 L2 (50 MB)


def copies_for(nbytes: int) -> int:
    """Distinct weight copies a cold-L2 timing rotates through, so every call reads from HBM."""
    return max(2, -(-COLD_BYTES // nbytes))


def cold_copies(tensors: tuple[torch.Tensor, ...], max_copies: int = 16) -> list[tuple[torch.Tensor, ...]] | None:
    """`tensors` (one layer's weights) plus clones, as many as copies_for asks but at most
    `max_copies` (a weight that many times smaller than the cold set is small next to the L2
    anyway): the argument sets of a cold_graph_ms timing. None when the clones do not fit."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    try:
        return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(min(max_copies, copies_for(nbytes)) - 1)]
    except torch.OutOfMemoryError:
        return None


def capture_cuda_graph(calls: list[Callable[[], Any]], *, warmups: int = 1) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of `calls` run back to back, captured after `warmups` passes on a side
    stream (compilation and autotuning happen there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def cold_graph_ms(calls: list[Callable[[], Any]], reps: int = 50) -> float:
    """Per-call median ms of one CUDA graph that runs `calls` back to back (each over distinct
    weights, see copies_for), as the layers of a real model read theirs. On CPU: one timed pass."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / len(calls)
    graph = capture_cuda_graph(calls)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]


def first_tensor(output: Any) -> torch.Tensor:
    """The main tensor of a model output (logits / last hidden state / first element)."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, dict):
        return first_tensor(next(iter(output.values())))
    if isinstance(output, (tuple, list)):
        return first_tensor(output[0])
    raise TypeError(f"no tensor in model output of type {type(output).__name__}")
