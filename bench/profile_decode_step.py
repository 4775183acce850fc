"""Where a one-token decode step spends its GPU time: the LLaMA-7B-shaped 2-layer model
(graphopt.models "llama-7b-2l") compiled with Inductor bf16 and with graphopt's fp4_linear and
q4_linear, each step replayed from a CUDA graph under torch.profiler; prints the kernels by
total time per step (bench_fp4.py / bench_q4.py time the same steps end to end).

    python bench/profile_decode_step.py            # one H100/H200, ~2 minutes
    python bench/profile_decode_step.py --steps 5  # fewer profiled steps
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--steps", type=int, default=20, help="profiled CUDA-graph replays per variant")
OPTS = ARGS.parse_args()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import DECODE_STEP_VARIANTS, print_table, write_json  # noqa: E402
from graphopt.models import build  # noqa: E402
from graphopt.timing import capture_cuda_graph  # noqa: E402


def kernel_times(fn, steps: int) -> dict[str, float]:
    """Per-step GPU time (us) of each kernel name over `steps` replays of a CUDA graph of fn."""
    graph = capture_cuda_graph([fn], warmups=3)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / steps  # us per step
    return dict(totals)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("profile_decode_step.py needs a CUDA GPU")
    model, inputs = build("llama-7b-2l", seq_len=1, device="cuda", dtype=torch.bfloat16)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    model.requires_grad_(False)
    rows = []
    with torch.no_grad():
        for label, kwargs in DECODE_STEP_VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(model, **kwargs)
            times = kernel_times(lambda: compiled(*inputs), OPTS.steps)
            total = sum(times.values())
            print(f"{label}: {total:.1f} us of kernels per step", flush=True)
            for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
                rows.append({"variant": label, "kernel": name[:90], "us_per_step": us, "share": us / total})
            rows.append({"variant": label, "kernel": "(all kernels)", "us_per_step": total, "share": 1.0})
    write_json("profile_decode_step", rows)
    print_table("One-token step, LLaMA-7B shapes, 2 layers: GPU time per kernel (CUDA graph replays)", rows,
                ["variant", "kernel", "us_per_step", "share"])


if __name__ == "__main__":
    main()
