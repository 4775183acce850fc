"""Peak memory while graphopt compiles a LLaMA-3-8B-wide model with a 4-bit pass forced on: what
quantizing and checking the weights (the lm_head's 128256 x 4096 above all) costs beyond the model.

One decoder layer by default (--layers), bf16, random weights; torch.compile with
graphopt.backend(passes={PASS: True}, force=True) and one forward of one token, which compiles.
Reports the model's own bytes and the peak over the compile, above the model: on a GPU
torch.cuda.max_memory_allocated, on the CPU the process's peak resident set (ru_maxrss), which
also holds the compiler's own memory.

    python bench/compile_memory.py --out $OUT/compile_memory_h200.json
    python bench/compile_memory.py --passes q4_linear                 # CPU: about 1 min (fp4_linear: 5)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import graphopt  # noqa: E402
from bench import llama_models as lm  # noqa: E402
from bench.common import print_table  # noqa: E402

PASSES = ("fp4_linear", "q4_linear")


def _peak_gb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def measure(pass_name: str, layers: int, device: str) -> dict:
    """Built in a child process on the CPU (ru_maxrss never falls), in this one on a GPU."""
    model = lm.build_model("8b", device, torch.bfloat16, layers=layers)
    model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _peak_gb(device)
    start = time.perf_counter()
    compiled = torch.compile(model, backend=graphopt.backend(passes={pass_name: True}, force=True))
    with torch.no_grad():
        compiled(input_ids=torch.ones((1, 1), dtype=torch.long, device=device), use_cache=False)
    return {"pass": pass_name, "layers": layers, "model_gb": model_gb, "peak_above_model_gb": _peak_gb(device) - before,
            "compile_s": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", default=",".join(PASSES), help="comma list of " + ", ".join(PASSES))
    parser.add_argument("--layers", type=int, default=1, help="decoder layers")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's pass
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/compile_memory_<gpu>.json)")
    opts = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.one:  # a child: one pass, its row as the last line
        print(repr(measure(opts.one, opts.layers, device)))
        return 0
    passes = opts.passes.split(",")
    if bad := [p for p in passes if p not in PASSES]:
        raise SystemExit(f"unknown pass {bad}; valid choices: {', '.join(PASSES)}")
    rows = []
    for pass_name in passes:
        if device == "cuda":
            rows.append(measure(pass_name, opts.layers, device))
            lm.fresh_start(device)
        else:
            import ast
            import subprocess

            out = subprocess.run([sys.executable, __file__, "--one", pass_name, "--layers", str(opts.layers)],
                                 check=True, capture_output=True, text=True).stdout
            rows.append(ast.literal_eval(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print_table("peak memory while compiling an 8B-wide model with a 4-bit pass", rows)
    lm.write_result("compile_memory", opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
