"""Cost model vs measurement on the present GPU.

Sweeps dense GEMMs (LLaMA-7B/13B linear shapes, 1..4096 tokens) and attention (L 512..16k, causal
and not: naive eager, naive under Inductor, SDPA cuDNN and flash, graphopt's Triton flash kernel),
and prints the predicted time beside the measured one. Small attention problems (the demo's
heads at 512-2048 tokens), whose GPU time is shorter than a launch path, are timed as CUDA-graph
replays and marked "graph". Two predictions per row: from datasheet-derived ceilings (what a user
gets without calibrating) and from ceilings measured at the start of this run (what
`graphopt calibrate` would store). Run: python bench/bench_cost_model.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cuda_graph_ms, environment, median_ms, naive_attention, print_table, write_json  # noqa: E402
from graphopt import cost_model as cm  # noqa: E402
from graphopt.hardware import spec_for_device_name  # noqa: E402

GEMM_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (5120, 5120), (5120, 13824), (13824, 5120)]
TOKENS = [1, 16, 64, 256, 1024, 4096]
ATTN_L = [512, 1024, 2048, 4096, 8192, 16384]
# (heads, head dim, length): the demo model's attention (16 heads of 64) and a 32 x 128 one
SMALL_ATTENTION = [(16, 64, 512), (16, 64, 2048), (32, 128, 512)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_cost_model needs a CUDA GPU"
    from graphopt.calibrate import measure_copy_bandwidth, measure_launch_overhead, measure_matmul_rate

    torch.set_grad_enabled(False)  # forward-only timings, as the cost model prices them
    name = torch.cuda.get_device_name()
    datasheet = spec_for_device_name(name)
    assert datasheet is not None, f"no HardwareSpec for {name}"
    measured = dataclasses.replace(
        datasheet, measured_bf16_flops=measure_matmul_rate(), measured_memory_bandwidth=measure_copy_bandwidth(),
        measured_launch_overhead_s=measure_launch_overhead(),
    )
    print(f"ceilings on {name}: matmul {measured.matrix_ceiling / 1e12:.0f} TFLOP/s (datasheet-derived "
          f"{datasheet.matrix_ceiling / 1e12:.0f}), copy {measured.memory_ceiling / 1e12:.2f} TB/s "
          f"({datasheet.memory_ceiling / 1e12:.2f}), launch {measured.launch_overhead * 1e6:.1f} us "
          f"({datasheet.launch_overhead * 1e6:.1f})")
    rows = []
    dt = torch.bfloat16
    tokens = [1, 64, 4096] if args.quick else TOKENS
    for in_f, out_f in (GEMM_SHAPES[:2] if args.quick else GEMM_SHAPES):
        w = torch.randn(out_f, in_f, device="cuda", dtype=dt)
        for m in tokens:
            x = torch.randn(m, in_f, device="cuda", dtype=dt)
            ms = median_ms(lambda: F.linear(x, w))
            rows.append(_row("gemm", f"{m}x{in_f}->{out_f}", ms, cm.linear(datasheet, m, in_f, out_f),
                             cm.linear(measured, m, in_f, out_f)))
    h, d = 32, 128
    for length in (ATTN_L[:4] if args.quick else ATTN_L):
        q, k, v = (torch.randn(1, h, length, d, device="cuda", dtype=dt) for _ in range(3))
        scale = 1 / math.sqrt(d)
        for causal in (False, True):
            mask = torch.ones(length, length, device="cuda", dtype=torch.bool).triu(1) if causal else None
            shape = f"L={length}{' causal' if causal else ''}"
            kw = dict(has_mask=causal)
            if length <= 8192:
                ms = median_ms(lambda: naive_attention(q, k, v, scale, mask))
                rows.append(_row("naive eager", shape, ms,
                                 cm.naive_attention(datasheet, 1, h, length, length, d, fused_pointwise=False, **kw),
                                 cm.naive_attention(measured, 1, h, length, length, d, fused_pointwise=False, **kw)))
                compiled = torch.compile(naive_attention)
                ms = median_ms(lambda: compiled(q, k, v, scale, mask))
                rows.append(_row("naive inductor", shape, ms,
                                 cm.naive_attention(datasheet, 1, h, length, length, d, **kw),
                                 cm.naive_attention(measured, 1, h, length, length, d, **kw)))
            rows += _fused_attention_rows(q, k, v, causal, shape, median_ms, "", datasheet, measured)
        torch.cuda.empty_cache()
    for h, d, length in SMALL_ATTENTION:
        q, k, v = (torch.randn(1, h, length, d, device="cuda", dtype=dt) for _ in range(3))
        for causal in (False, True):
            shape = f"H={h} D={d} L={length}{' causal' if causal else ''}"
            rows += _fused_attention_rows(q, k, v, causal, shape, cuda_graph_ms, " graph", datasheet, measured)
    summary = {}
    for label in ("datasheet", "calibrated"):
        ratios = [r[f"ratio {label}"] for r in rows]
        logs = sorted(abs(math.log(x)) for x in ratios)
        summary[label] = {
            "median |log ratio|": logs[len(logs) // 2],
            "within 1.5x": sum(1 for x in ratios if 1 / 1.5 <= x <= 1.5) / len(ratios),
            "within 2x": sum(1 for x in ratios if 0.5 <= x <= 2) / len(ratios),
        }
    write_json("cost_model", rows, summary=summary, ceilings={
        "matmul_tflops": measured.matrix_ceiling / 1e12, "copy_tbps": measured.memory_ceiling / 1e12,
        "launch_us": measured.launch_overhead * 1e6})
    print_table("cost model: predicted vs measured (ratio = predicted / measured)", rows)
    env = environment()
    for label, s in summary.items():
        print(f"{label:>10}: median |ln(pred/meas)| = {s['median |log ratio|']:.3f}, within 1.5x: "
              f"{s['within 1.5x']:.0%}, within 2x: {s['within 2x']:.0%}   [{env['gpu']}, torch {env['torch']}]")


def _fused_attention_rows(q, k, v, causal: bool, shape: str, timer, suffix: str, datasheet, measured) -> list[dict]:
    """Rows for SDPA cuDNN, SDPA flash and graphopt's Triton flash kernel on one problem, timed by
    `timer` (median_ms, or cuda_graph_ms for problems shorter than a launch path); `suffix` marks
    the kind ("" or " graph"). A backend that rejects the problem is reported and skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphopt.cost.attention import estimate_flash_attention
    from graphopt.kernels.flash_attention import flash_attention

    _, h, length, d = q.shape
    rows = []
    for backend, enum in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa_call(enum=enum):
            with sdpa_kernel(enum):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            ms = timer(sdpa_call)
        except RuntimeError as exc:
            print(f"SDPA {backend} {shape}: FAIL {exc}")
            continue
        rows.append(_row(f"sdpa {backend}{suffix}", shape, ms,
                         cm.sdpa(datasheet, 1, h, length, length, d, backend=backend, causal=causal),
                         cm.sdpa(measured, 1, h, length, length, d, backend=backend, causal=causal)))
    ms = timer(lambda: flash_attention(q, k, v, is_causal=causal))
    rows.append(_row(f"triton flash{suffix}", shape, ms,
                     estimate_flash_attention(datasheet, 1, h, length, length, d, causal=causal),
                     estimate_flash_attention(measured, 1, h, length, length, d, causal=causal)))
    return rows


def _row(kind: str, shape: str, measured_ms: float, pred_datasheet: cm.Estimate, pred_calibrated: cm.Estimate) -> dict:
    return {
        "kind": kind, "shape": shape, "measured ms": measured_ms,
        "pred ms datasheet": pred_datasheet.ms, "ratio datasheet": pred_datasheet.ms / measured_ms,
        "pred ms calibrated": pred_calibrated.ms, "ratio calibrated": pred_calibrated.ms / measured_ms,
        "bound": pred_calibrated.bound,
    }


if __name__ == "__main__":
    main()
