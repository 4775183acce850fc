"""Host time of one block-sparse attention launch (`block_sparse_attention`), and where it goes.

The benchmark times the kernel eagerly, so a row whose GPU time is shorter than the launcher's
host path measures the host (a short causal row at low density, called eagerly, takes longer than
its CUDA-graph replay). This script measures the host path on a problem whose GPU time is negligible
(B=1, H=1, L=1024, one kept block per row): calls are issued back to back with no sync, so the
time per call is the host's. Variants: the autotuned launcher, explicit single-loop configs with
host-side and device-side descriptors, the predictor (with graphopt's direct launches and with
plain JIT launches), the whole `sparse_attention`, and the `graphopt::sparse_attention` op that
compiled graphs call. cProfiles of the autotuned launcher and of the op list the most expensive
calls.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import host_us, print_table, write_json  # noqa: E402
import graphopt  # noqa: E402,F401  (registers graphopt::sparse_attention)
from graphopt.kernels import launch as launch_module  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

CALLS = 400


def without_direct_launch(fn):
    """fn with graphopt's direct launches off (every `launch` a plain JIT launch), for an A/B."""
    def run():
        launch_module.DIRECT = False
        try:
            return fn()
        finally:
            launch_module.DIRECT = True
    return run


def main() -> int:
    L, D = 1024, 128
    q, k, v = (torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n_q, n_k = L // sa.BLOCK_M, L // sa.BLOCK_N
    mask = torch.zeros(1, 1, n_q, n_k, dtype=torch.bool, device="cuda")
    mask[..., 0] = True
    rows = []
    op = torch.ops.graphopt.sparse_attention
    sim, cdf = (torch.full((1,), t, device="cuda") for t in (sa.DEFAULT_SIMTHRESHD1, sa.DEFAULT_CDFTHRESHD))
    no_pv = torch.empty(0, device="cuda")
    for causal in (False, True):
        m = mask.clone()
        if causal:
            allowed, diagonal = sa.causal_block_geometry(n_q, n_k, L, L, sa.BLOCK_M, sa.BLOCK_N, device="cuda")
            m = (m & allowed) | diagonal
        lut, counts = sa.block_mask_to_lut(m)
        single = {"USE_TMA": 1, "SINGLE_LOOP": 1, "num_warps": 4, "num_stages": 2}
        fns = {
            "autotuned (launcher default)": lambda: sa.block_sparse_attention(q, k, v, lut, counts, is_causal=causal),
            "single loop, host descriptors": lambda: sa.block_sparse_attention(
                q, k, v, lut, counts, is_causal=causal, config={**single, "HOST_DESCRIPTORS": 1}),
            "single loop, device descriptors": lambda: sa.block_sparse_attention(
                q, k, v, lut, counts, is_causal=causal, config={**single, "HOST_DESCRIPTORS": 0}),
            "predictor (predict_block_lut)": lambda: sa.predict_block_lut(q, k, is_causal=causal),
            "predictor, JIT launches (DIRECT off)": without_direct_launch(
                lambda: sa.predict_block_lut(q, k, is_causal=causal)),
            "sparse_attention (predictor + kernel)": lambda: sa.sparse_attention(q, k, v, is_causal=causal),
            "graphopt::sparse_attention op (per-head threshold tensors)": lambda: op(
                q, k, v, D**-0.5, causal, sim, cdf, no_pv, 0, "cudnn"),
            "torch.empty_like (one torch op)": lambda: torch.empty_like(q),
        }
        for name, fn in fns.items():
            rows.append({"causal": causal, "variant": name, "host_us_per_call": round(host_us(fn, CALLS), 1)})
            print(rows[-1], flush=True)
        for name in ("autotuned (launcher default)", "graphopt::sparse_attention op (per-head threshold tensors)"):
            profile = cProfile.Profile()
            fn = fns[name]
            profile.enable()
            for _ in range(CALLS):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            print(f"\ncProfile of {name}, causal={causal}, {CALLS} calls (cumulative time):")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(28)
    write_json("sparse_host_overhead", rows)
    print_table("host time per launch (us), GPU time negligible", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
