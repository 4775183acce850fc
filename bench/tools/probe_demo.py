"""Probe (session 20): why the README demo (small-llama, 4 layers, hidden 1024, eager attention,
2048 tokens, bf16) runs slower under graphopt than under Inductor on an H100. For each backend:
the demo's timing (do_bench median), the GPU time alone (a CUDA-graph replay of the step), the host
time to enqueue one step, and the top CUDA kernels of five steps (torch.profiler)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import graphopt  # noqa: E402,F401
from graphopt.models import build  # noqa: E402
from graphopt.timing import cold_graph_ms, median_ms  # noqa: E402

length = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["inductor", "graphopt"]
model, (ids,) = build("small-llama", seq_len=length, device="cuda")
summary = []
for backend in variants:
    options = None
    if backend.startswith("graphopt:"):  # graphopt:<json options>
        import json
        backend, options = "graphopt", json.loads(backend.split(":", 1)[1])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, options=options) if options else torch.compile(model, backend=backend)
    with torch.no_grad():
        def step():
            return compiled(ids)
        from graphopt import compiler as graphopt_backend

        decisions: list = []
        graphopt_backend._DECISION_SINKS.append(decisions)  # the sink graphopt.explain uses
        try:
            for _ in range(3):
                step()
        finally:
            graphopt_backend._DECISION_SINKS.remove(decisions)
        for d in decisions:
            print(f"[{backend} {options or ''}] {d.pass_name} {'applied' if d.applied else 'declined'} "
                  f"{d.implementation or ''} {d.details.get('emitted', '')}: {d.reason}")
        torch.cuda.synchronize()
        bench_ms = median_ms(step, rep_ms=300, device="cuda")
        # host time to enqueue one step (GPU work queued behind; 20 steps, no sync inside)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3 / 20
        torch.cuda.synchronize()
        try:
            graph_ms = cold_graph_ms([step])
        except Exception as exc:  # noqa: BLE001
            print(f"[{backend}] CUDA graph capture failed: {type(exc).__name__}: {exc}")
            graph_ms = float("nan")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    name = backend + (f" {options}" if options else "")
    print(f"\n=== {name}: do_bench {bench_ms:.3f} ms, CUDA graph {graph_ms:.3f} ms, host enqueue {host_ms:.3f} ms/step ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=80))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=80))
    summary.append((name, bench_ms, graph_ms, host_ms))
    torch.cuda.empty_cache()
print("\nvariant | do_bench ms | CUDA graph ms | host enqueue ms/step")
for row in summary:
    print(" | ".join([row[0]] + [f"{v:.3f}" for v in row[1:]]))
