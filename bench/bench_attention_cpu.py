"""CPU: the `graphopt::attention` op (SDPA's CPU kernel) against the naive form it replaces.

fp32, D=64, H=8, L in {512, 2048}, causal and not. Run: python bench/bench_attention_cpu.py
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import graphopt  # noqa: E402,F401  (registers graphopt::attention)
from bench.common import median_ms, naive_attention as naive, print_table, write_json  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for length in (512, 2048):
        q, k, v = (torch.randn(1, 8, length, 64) for _ in range(3))
        scale = 1 / math.sqrt(64)
        for causal in (False, True):
            mask = torch.ones(length, length, dtype=torch.bool).triu(1) if causal else None
            ref = naive(q.double(), k.double(), v.double(), scale, mask)
            out = torch.ops.graphopt.attention(q, k, v, None, scale, causal, 1, "sdpa_cpu")
            err = float((out.double() - ref).abs().max())
            naive_ms = median_ms(lambda: naive(q, k, v, scale, mask), rep_ms=500, device="cpu")
            op_ms = median_ms(lambda: torch.ops.graphopt.attention(q, k, v, None, scale, causal, 1, "sdpa_cpu"),
                              rep_ms=500, device="cpu")
            rows.append({"L": length, "causal": causal, "max abs err vs fp64": err, "naive ms": naive_ms,
                         "graphopt::attention ms": op_ms, "speedup": naive_ms / op_ms})
    write_json("attention_cpu", rows, threads=torch.get_num_threads())
    print_table(f"attention on CPU, fp32, B=1 H=8 D=64, {torch.get_num_threads()} threads", rows)


if __name__ == "__main__":
    main()
