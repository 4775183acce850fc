"""Timing used by the CLI and the benchmarks: median of many runs, CUDA events on a GPU."""

from __future__ import annotations

import statistics
import time
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
    for _ in range(2):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
