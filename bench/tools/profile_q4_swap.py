"""Probe (session 34): three calls of the Q4 fused decode's "swap" tile at 16 tokens on 5120 -> 13824,
for Nsight Compute. The profile in bench/RESULTS.md ("Session 34 ... Q4_0 x Q8_1 decode") came from

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section SchedulerStats --section LaunchStats --section SourceCounters --section InstructionStats \\
        -k regex:_q4_gemm_kernel --launch-skip 1 -c 2 -o q4 python bench/tools/profile_q4_swap.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from graphopt.kernels import q4  # noqa: E402


def main() -> None:
    k, n = 5120, 13824
    qweight, scales = q4.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    config = q4.TileConfig("swap", 16, 128, 1, 4, 3, 0, "last")
    for _ in range(3):
        q4.q4_linear_triton(x, qweight, scales, None, "fused", config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
