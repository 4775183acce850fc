"""Probe (session 22): host time per call of graphopt's FP4 and Q4 linear ops (4096 -> 4096, one
token, no grad), alternating rounds, for an A/B of two checkouts on the same host: run this file
from each checkout (its own graphopt is imported). Prints one line per op: the median of 7 rounds
of 500 back-to-back calls, in microseconds."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import graphopt  # noqa: E402
from bench.common import host_us  # noqa: E402
from graphopt.kernels import fp4, q4  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(4096, 4096, device="cuda"), "nvfp4"))
    fargs = (x, w.codes, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4")
    qweight, qscales = q4.quantize_weight(torch.randn(4096, 4096, device="cuda"))
    unit_input = torch.randn(64, device="cuda")
    w_small = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)  # negligible GPU work
    calls = {"torch.add (one launch)": lambda: torch.add(unit_input, 1.0),
             "F.linear bf16 4096->64 (cuBLAS)": lambda: torch.nn.functional.linear(x, w_small),
             "fp4_linear": lambda: torch.ops.graphopt.fp4_linear.default(*fargs),
             "q4_linear": lambda: torch.ops.graphopt.q4_linear.default(x, qweight, qscales, None, "fused")}
    with torch.no_grad():
        unit_us = None
        for name, fn in calls.items():
            for _ in range(20):  # tuning and warm-up
                fn()
            us = host_us(fn, 500, 7)
            unit_us = unit_us or us
            label = name if " " in name else f"graphopt::{name}"
            print(f"{graphopt.__file__}: {label} {us:.1f} us per call, {us / unit_us:.2f} launch units", flush=True)


if __name__ == "__main__":
    main()
