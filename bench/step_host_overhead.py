"""Host time of a one-token decode step without CUDA graphs, and where it goes.

The step benchmarks (bench_fp4.py, bench_q4.py) judge the one-token step from CUDA-graph replays.
A user who calls the compiled model directly also pays the host path of every launch: in session
17 the graphopt step took 2.7-4.0 ms that way, against 0.19 ms replayed from a graph and 0.8-1.3
ms for Inductor bf16 called directly. This script measures, on the LLaMA-7B-shaped 2-layer model
(graphopt.models "llama-7b-2l", one token):

- `step_ms`: the step called directly (triton do_bench: host gaps included, as a user sees it);
- `host_us`: host time per step, from calls issued back to back without a sync;
- `graph_ms`: the same step replayed from a CUDA graph of ours (GPU time only);
- the same steps compiled with CUDA-graph trees: Inductor's mode="reduce-overhead", and graphopt's
  options={"cuda_graphs": True} (its equivalent: torch.compile takes either mode= or options=);
- a cProfile of the graphopt steps (the most expensive Python functions by own time), and
  torch.profiler's host view of them (ops and CUDA runtime calls by self time);
- the host time of one `graphopt::fp4_linear` call (4096 -> 4096, one token) through the op,
  through the launcher, and as the bare Triton launch with the launcher's arguments prebuilt.

    python bench/step_host_overhead.py              # one H100/H200, ~2 minutes
    python bench/step_host_overhead.py --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--no-profile", action="store_true", help="skip the cProfile listings")
ARGS.add_argument("--calls", type=int, default=200, help="back-to-back calls per host-time repeat")
OPTS = ARGS.parse_args()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import DECODE_STEP_VARIANTS, cuda_graph_ms, host_us, median_ms, print_table, write_json  # noqa: E402
from graphopt.models import build  # noqa: E402

VARIANTS = {
    **DECODE_STEP_VARIANTS,
    # the same three with Inductor's CUDA-graph trees (graphopt: options cuda_graphs)
    "inductor bf16, reduce-overhead": dict(backend="inductor", mode="reduce-overhead"),
    "graphopt fp4_linear, cuda_graphs": dict(backend="graphopt", options={"passes": {"fp4_linear": True},
                                                                          "cuda_graphs": True}),
    "graphopt q4_linear, cuda_graphs": dict(backend="graphopt", options={"passes": {"q4_linear": True},
                                                                        "cuda_graphs": True}),
}


def profile_top(fn, calls: int, top: int = 18) -> str:
    """cProfile of `calls` calls: the functions with the most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def op_table(fn, calls: int) -> str:
    """torch.profiler's host-side view of `calls` calls: ops and CUDA runtime calls by self time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)


def step_rows() -> list[dict]:
    model, inputs = build("llama-7b-2l", seq_len=1, device="cuda", dtype=torch.bfloat16)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    model.requires_grad_(False)
    rows = []
    with torch.no_grad():
        reference = model(*inputs).logits.float().flatten()
        for label, kwargs in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(model, **kwargs)
            recorded = kwargs.get("mode") == "reduce-overhead" or kwargs.get("options", {}).get("cuda_graphs", False)

            def step():
                if recorded:  # one inference step per call (CUDA-graph trees may reuse the last outputs' memory)
                    torch.compiler.cudagraph_mark_step_begin()
                return compiled(*inputs)
            try:
                for _ in range(3):
                    logits = step().logits.float().flatten()
                torch.cuda.synchronize()
                cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=0).item()
                row = {"variant": label, "check": "PASS" if cosine > 0.95 else "FAIL", "logits_cosine": cosine,
                       "step_ms": median_ms(step, rep_ms=300),
                       "host_us": host_us(step, OPTS.calls // 4),
                       # a CUDA-graph tree cannot be captured again inside our own graph
                       "graph_ms": None if recorded else cuda_graph_ms(step)}
            except Exception as exc:  # reported, and the other variants still run
                print(f"FAIL {label}: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"variant": label, "error": f"{type(exc).__name__}: {exc}"})
                continue
            print(f"{label}: {row}", flush=True)
            if not OPTS.no_profile and label.startswith("graphopt") and not recorded:
                print(f"--- cProfile, {label}, 50 steps ---\n{profile_top(step, 50)}", flush=True)
                print(f"--- torch.profiler (host), {label}, 20 steps ---\n{op_table(step, 20)}", flush=True)
            rows.append(row)
    torch._dynamo.reset()
    base = rows[0]
    for row in rows:
        if "step_ms" in row and "step_ms" in base:
            row["step_speedup"] = base["step_ms"] / row["step_ms"]
        if row.get("graph_ms") and base.get("graph_ms"):
            row["graph_speedup"] = base["graph_ms"] / row["graph_ms"]
    recorded_base = next((r for r in rows if r["variant"] == "inductor bf16, reduce-overhead" and "step_ms" in r), None)
    for row in rows:
        if recorded_base and "step_ms" in row:
            row["vs_reduce_overhead"] = recorded_base["step_ms"] / row["step_ms"]
    return rows


def fp4_call_rows() -> list[dict]:
    """Host time of one small FP4 linear: the op, the launcher, the bare launch."""
    from graphopt.kernels import fp4

    n = k = 4096
    weight = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k, device="cuda"), "nvfp4"))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    args = (x, weight.codes, weight.scales, weight.global_scale, None, n, k, "nvfp4")
    op_args = (x, weight.codes, weight.codes, weight.scales, weight.global_scale, None, n, k, "nvfp4")
    launcher = lambda: fp4.fp4_linear_triton(*args)  # noqa: E731
    launcher()  # tunes
    path = fp4._device_path(0, 1, k, n, "nvfp4")  # the launcher's own choice
    x2 = x.reshape(-1, k)
    launch_args = (x2, weight.codes, weight.scales.view(torch.uint8), weight.global_scale, None, n, k, "nvfp4", x.dtype)
    cfg = fp4._pick_config(path, launch_args)
    fns = {
        "graphopt::fp4_linear op": lambda: torch.ops.graphopt.fp4_linear(*op_args),
        "fp4_linear_triton": launcher,
        "_launch (config known)": lambda: fp4._launch(path, cfg, *launch_args),
    }
    rows = []
    for name, fn in fns.items():
        rows.append({"call": name, "config": str(cfg), "host_us": host_us(fn, OPTS.calls)})
        print(rows[-1], flush=True)
    if not OPTS.no_profile:
        print(f"--- cProfile, fp4_linear_triton, 500 calls ---\n{profile_top(launcher, 500)}", flush=True)
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("step_host_overhead.py needs a CUDA GPU")
    import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt)

    calls = fp4_call_rows()
    steps = step_rows()
    write_json("step_host_overhead", steps, fp4_calls=calls)
    print_table("One FP4 linear call (4096 -> 4096, one token): host time per call", calls, ["call", "config", "host_us"])
    print_table("One-token step, LLaMA-7B shapes, 2 layers: called directly vs replayed from a CUDA graph", steps,
                ["variant", "check", "logits_cosine", "step_ms", "host_us", "graph_ms", "step_speedup", "graph_speedup", "vs_reduce_overhead",
                 "error"])


if __name__ == "__main__":
    main()
