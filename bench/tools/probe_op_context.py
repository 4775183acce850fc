"""Probe (session 18): why a graphopt custom op costs more host time inside the compiled one-token
step than called alone. Times fp4_linear_triton and the whole op body from inside the compiled
step (perf_counter wrappers), and lists torch.profiler's Python-level view (with_stack)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import graphopt.ops  # noqa: E402,F401
from graphopt.kernels import fp4  # noqa: E402
from graphopt.models import build  # noqa: E402

spent = {"fp4_linear_triton": 0.0, "calls": 0}
real = fp4.fp4_linear_triton


def timed(*args, **kwargs):
    start = time.perf_counter()
    out = real(*args, **kwargs)
    spent["fp4_linear_triton"] += time.perf_counter() - start
    spent["calls"] += 1
    return out


fp4.fp4_linear_triton = timed
model, inputs = build("llama-7b-2l", seq_len=1, device="cuda", dtype=torch.bfloat16)
model.requires_grad_(False)
with torch.no_grad():
    compiled = torch.compile(model, backend="graphopt", options={"passes": {"fp4_linear": True}})
    for _ in range(5):
        compiled(*inputs)
    torch.cuda.synchronize()
    spent.update(fp4_linear_triton=0.0, calls=0)
    steps = 200
    start = time.perf_counter()
    for _ in range(steps):
        compiled(*inputs)
    total = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"step host {total / steps * 1e6:.0f} us; fp4_linear_triton {spent['fp4_linear_triton'] / spent['calls'] * 1e6:.1f} us"
          f" per call x {spent['calls'] / steps:.0f} per step = {spent['fp4_linear_triton'] / steps * 1e6:.0f} us per step")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(4096, 4096, device="cuda"), "nvfp4"))
    args = (x, w.codes, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4")
    torch.ops.graphopt.fp4_linear(*args)
    spent.update(fp4_linear_triton=0.0, calls=0)
    start = time.perf_counter()
    for _ in range(1000):
        torch.ops.graphopt.fp4_linear.default(*args)
    alone = (time.perf_counter() - start) / 1000
    torch.cuda.synchronize()
    print(f"alone: op {alone * 1e6:.1f} us, of it fp4_linear_triton {spent['fp4_linear_triton'] / spent['calls'] * 1e6:.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(10):
            compiled(*inputs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90))
