"""Where the one-token decode step of a LLaMA model spends its GPU time, per variant.

The step of bench_decode_loop.py (llama_models.DecodeLoop: a transformers StaticCache filled from a
random prompt, then model(...).logits[:, -1].argmax() per token) is compiled per variant with
mode="reduce-overhead" and run once to compile and record; then one loop of --new-tokens - 1
steps (the prefill before it) runs under torch.profiler. Per variant: the wall time per step, the GPU kernel time per
step (summed over kernels, and the time any kernel ran: kernels launched as programmatic dependents
start before the one they follow ends, so their times overlap), the number of kernels per step, and
the kernels by exclusive time per step (`exclusive_us`: the part of a kernel's time no earlier kernel
covers), grouped by name (the `--top` largest; layer-wise kernels appear once per layer). --layers keeps the shape's widths
with fewer decoder layers, so a full-width step compiles in seconds; the per-layer kernels then
scale with the layer count and lm_head / embedding do not.

    python bench/profile_decode_step.py --shape 8b --layers 4 --out $OUT/profile_decode_8b.json   # ~3 min on one H100
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.common import environment, print_table  # noqa: E402
from bench.llama_models import (ABLATIONS, SHAPES, VARIANTS, DecodeLoop, build_model, compile_kwargs, fresh_start,  # noqa: E402
                                int4_weights, random_prompt, synchronize)


def exclusive_us(intervals: list[tuple[float, float]]) -> list[float]:
    """Each (start, end) kernel interval's time not already covered by the kernels that started
    before it. A kernel launched as a programmatic dependent starts before the one it follows ends,
    so kernel times overlap; these shares do not, and add up to the time the GPU ran any kernel."""
    shares = [0.0] * len(intervals)
    covered = float("-inf")
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        start, end = intervals[i]
        shares[i] = max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return shares


def profile_step(loop: DecodeLoop, steps: int) -> tuple[float, dict[str, tuple[float, int, float]]]:
    """(wall ms per step, {kernel name: (GPU us per step, launches per step, exclusive GPU us per
    step)}) of one loop: a kernel's exclusive time is exclusive_us's share of it."""
    loop.run("cuda")  # compiles and records
    _, seconds = loop.run("cuda")
    first = loop.prefill()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loop.decode(first, "cuda")
        synchronize("cuda")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    shares = exclusive_us([(e.time_range.start, e.time_range.end) for e in events])
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for event, share in zip(events, shares):
        totals[event.name][0] += event.device_time_total
        totals[event.name][1] += 1
        totals[event.name][2] += share
    per_step = {name: (us / steps, count // steps, own / steps)
                for name, (us, count, own) in totals.items() if count >= steps}
    return seconds / steps * 1e3, per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the shape's widths are kept)")
    parser.add_argument("--variants", default="inductor,int4,graphopt,graphopt-fp4,graphopt-q4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    parser.add_argument("--out", default=None, help="JSON path")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode_step.py needs a CUDA GPU")
    variants = opts.variants.split(",")
    valid = [v for v in VARIANTS + ABLATIONS if v != "eager"]
    bad = [v for v in variants if v not in valid]
    if bad:
        sys.exit(f"unknown variants {bad}; valid choices: {', '.join(valid)}")
    model = build_model(opts.shape, "cuda", torch.bfloat16, layers=opts.layers)
    prompt = random_prompt(model, opts.batch, opts.prompt)
    steps = opts.new_tokens - 1
    summary, kernels = [], []
    for variant in variants:
        fresh_start("cuda", model)
        with int4_weights(model) if variant == "int4" else contextlib.nullcontext(), torch.no_grad():
            loop = DecodeLoop(model, prompt, opts.new_tokens, compile_kwargs(variant, "reduce-overhead", False))
            wall_ms, per_step = profile_step(loop, steps)
        gpu_us = sum(us for us, _, _ in per_step.values())
        busy_us = sum(own for _, _, own in per_step.values())
        summary.append({"variant": variant, "wall_ms_step": wall_ms, "gpu_ms_step": gpu_us / 1e3,
                        "gpu_busy_ms_step": busy_us / 1e3, "kernels_step": sum(n for _, n, _ in per_step.values())})
        for name, (us, count, own) in sorted(per_step.items(), key=lambda kv: -kv[1][2])[:opts.top]:
            kernels.append({"variant": variant, "kernel": name[:80], "us_step": us, "exclusive_us_step": own,
                            "launches": count, "share": own / busy_us})
        print(f"{variant}: {wall_ms:.3f} ms/step wall, {gpu_us / 1e3:.3f} ms/step of kernels, "
              f"{busy_us / 1e3:.3f} with any kernel running", flush=True)
    title = f"one-token step, LLaMA {opts.shape} widths, {opts.layers} layers, batch {opts.batch}, prompt {opts.prompt}"
    print_table(title, summary, ["variant", "wall_ms_step", "gpu_ms_step", "gpu_busy_ms_step", "kernels_step"])
    print_table(title + ": kernels by exclusive GPU time per step", kernels,
                ["variant", "kernel", "us_step", "exclusive_us_step", "launches", "share"])
    if opts.out:
        import json

        with open(opts.out, "w") as f:
            json.dump({"environment": environment(), "options": vars(opts), "summary": summary, "kernels": kernels}, f,
                      indent=2, default=str)


if __name__ == "__main__":
    main()
