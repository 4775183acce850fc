"""The names of graphopt.hardware.timing, for code that imports them as graphopt.timing. The
measurement helpers live in the hardware layer, which the kernels may import."""

from graphopt.hardware.timing import (COLD_BYTES, capture_cuda_graph, cold_copies, cold_graph_ms, copies_for,
                                      first_tensor, median_ms)

__all__ = ["COLD_BYTES", "capture_cuda_graph", "cold_copies", "cold_graph_ms", "copies_for", "first_tensor",
           "median_ms"]
