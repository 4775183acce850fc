"""Cost model of an all-reduce between the GPUs of one host: NCCL's (what DTensor runs) against
PyTorch's one-shot kernel over symmetric memory (graphopt::all_reduce; the all_reduce pass).

Each is a fixed latency plus its bytes at a rate, both fitted to all-reduces timed inside CUDA
graphs at 8 KB - 2 MB on two GPUs of an NVLink host: the "all_reduce.*" coefficients of the GPU's
data file (graphopt.cost.coefficients), which name that run. The latency is what decode's small
all-reduces pay; it is the one-shot kernel's whole advantage (no NCCL protocol, one launch).

Past two ranks the byte term scales with the data each rank moves: NCCL's ring sends and receives
2(R-1)/R of the tensor per rank, the one-shot kernel reads R-1 remote copies of it. So with more
ranks the one-shot kernel loses its lead on large tensors first. Four-rank timings, held out of the
fit, check this scaling (tests/cost/test_all_reduce.py); on an NVLink switch the R-1 reads overlap
more than this assumes, so it over-prices the one-shot kernel on megabyte tensors.
"""

from __future__ import annotations

from graphopt.cost import coefficients
from graphopt.cost_model import Estimate

IMPLEMENTATIONS: tuple[str, ...] = ("nccl", "one_shot")
MEASURED_RANKS = 2


def _traffic_factor(impl: str, ranks: int) -> float:
    """The bytes each rank moves relative to the fitted two-rank case."""
    if impl == "nccl":
        return (2 * (ranks - 1) / ranks) / (2 * (MEASURED_RANKS - 1) / MEASURED_RANKS)
    return (ranks - 1) / (MEASURED_RANKS - 1)


def estimate_all_reduce(hw, nbytes: int, ranks: int, impl: str) -> Estimate:
    """Predicted time of one sum all-reduce of `nbytes` over `ranks` GPUs of one host, replayed
    inside a CUDA graph (over one rank: its latency alone)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown all-reduce implementation {impl!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
    if ranks < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got ranks={ranks}")
    latency = coefficients.value(hw, f"all_reduce.{impl}_latency_s")
    rate = coefficients.value(hw, f"all_reduce.{impl}_bytes_per_s")
    traffic = nbytes * _traffic_factor(impl, ranks)
    transfer = traffic / rate
    name = "NCCL all-reduce" if impl == "nccl" else "one-shot all-reduce (symmetric memory)"
    return Estimate(name, (latency + transfer) * 1e3, 0.0, traffic, 1, "launch" if latency >= transfer else "memory")


__all__ = ["IMPLEMENTATIONS", "MEASURED_RANKS", "estimate_all_reduce"]
