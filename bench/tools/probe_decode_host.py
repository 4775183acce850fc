"""Probe (session 34): host time per call of the decode ops at 16 tokens on a small layer (1024 ->
1024, so the GPU work is shorter than the host path): torch.add as the unit, graphopt::q4_linear
fused (the Triton swap kernel) and separate (a quantize launch plus q4_tma's Gluon decode, with its
four TMA descriptors built per call), and graphopt::fp4_linear (the Gluon TMA decode). Prints the
median of 7 rounds of 300 back-to-back calls per op, in microseconds and torch.add units."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.common import host_us  # noqa: E402
from graphopt.kernels import fp4, q4  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    n = k = 1024
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k, device="cuda"), "nvfp4"))
    qweight, qscales = q4.quantize_weight(torch.randn(n, k, device="cuda"))
    unit_input = torch.randn(64, device="cuda")
    calls = {"torch.add (one launch)": lambda: torch.add(unit_input, 1.0),
             "graphopt::q4_linear fused": lambda: torch.ops.graphopt.q4_linear.default(x, qweight, qscales, None,
                                                                                      "fused"),
             "graphopt::q4_linear separate": lambda: torch.ops.graphopt.q4_linear.default(x, qweight, qscales, None,
                                                                                         "separate"),
             "graphopt::fp4_linear": lambda: torch.ops.graphopt.fp4_linear.default(
                 x, w.codes, w.codes, w.scales, w.global_scale, None, n, k, "nvfp4")}
    with torch.no_grad():
        unit_us = None
        for name, fn in calls.items():
            for _ in range(20):  # tuning and warm-up
                fn()
            us = host_us(fn, 300, 7)
            unit_us = unit_us or us
            print(f"{name}: {us:.1f} us per call, {us / unit_us:.2f} units", flush=True)
    print("separate path's choice:", q4._TUNED.get(("separate-tma", 16, n, k, torch.bfloat16)))


if __name__ == "__main__":
    main()
