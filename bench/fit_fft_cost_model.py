"""Check (and refit) the FFT-chain cost model against a measured sweep, without a GPU.

Reads the rows of `bench_fft_chain.py --fit-sweep` (every implementation at the explorer's --quick
configurations, CUDA-graph times, cuBLAS bf16 beside them), and for the hardware they ran on:
  * per implementation: the median and worst |log(predicted / measured)| of the time;
  * the explorer's faster/slower agreement, simulated exactly as `explore_fft` scores it: the
    cost model picks the implementation it predicts fastest, the row counts as agreeing when
    (cuBLAS predicted / picked predicted > 1) == (cuBLAS measured / picked measured > 1);
  * with --fit: a grid search of the dft2 coefficients (fft_chain.dft2_*) minimizing the mean
    |log error| of the dft2 and dft2_pregather rows, printed for the GPU's data file
    (graphopt/cost/data/<gpu>.json).

    python bench/fit_fft_cost_model.py bench/results/fft_fit_sweep_h100.json --gpu h100 [--fit]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.fft_explorer import predicted_speedup  # noqa: E402
from graphopt.cost import coefficients  # noqa: E402
from graphopt.cost import fft_chain as fft_cost  # noqa: E402
from graphopt.hardware import get_spec  # noqa: E402
from graphopt.kernels import fft_chain as fft  # noqa: E402

FIT_GRID = {
    "fft_chain.dft2_latency_s": [1.0e-6, 1.5e-6, 2.0e-6, 2.5e-6],
    "fft_chain.dft2_gemm_step_s": [0.2e-6, 0.3e-6, 0.4e-6, 0.5e-6],
    "fft_chain.dft2_contract_step_s": [0.2e-6, 0.3e-6, 0.5e-6, 0.8e-6],
    "fft_chain.dft2_gather_step_s": [0.0, 0.5e-6, 1.0e-6, 1.5e-6, 2.0e-6],
    "fft_chain.dft2_inkernel_gather_matrix_fraction": [0.06, 0.08, 0.1, 0.12],
}


def grid_fit(hw, rows):
    """(mean |log error|, {name: value}) of the FIT_GRID point that fits the dft2 rows of `rows` best."""
    best = None
    names = list(FIT_GRID)
    for values in itertools.product(*(FIT_GRID[n] for n in names)):
        point = dict(zip(names, values))
        s = score(coefficients.with_values(hw, point, "grid point"), rows)
        if best is None or s < best[0]:
            best = (s, point)
    return best


def predictions(hw, rows):
    """{(config): {impl: predicted ms}}."""
    preds = {}
    for r in rows:
        key = (r["in_features"], r["out_features"], r["tokens"], r["block_size"], r["k"])
        preds.setdefault(key, {})[r["impl"]] = fft_cost.estimate_fft_chain(hw, r["tokens"], r["in_features"], r["out_features"],
                                                                      r["block_size"], r["k"], r["impl"], bias=False).ms
    return preds


def evaluate(hw, rows) -> dict:
    preds = predictions(hw, rows)
    measured = {}
    for r in rows:
        key = (r["in_features"], r["out_features"], r["tokens"], r["block_size"], r["k"])
        measured.setdefault(key, {})[r["impl"]] = (r["graph_ms"], r["cublas_graph_ms"])
    errors: dict[str, list[float]] = {}
    for key, by_impl in measured.items():
        for impl, (ms, _) in by_impl.items():
            errors.setdefault(impl, []).append(math.log(preds[key][impl] / ms))
    agree, total, misses = 0, 0, []
    for key, by_impl in measured.items():
        if len(by_impl) < len(fft.available_implementations("cuda", key[3])):
            continue  # the sweep did not time every candidate of this configuration
        in_f, out_f, tokens, block_size, k = key
        picked, predicted = predicted_speedup(hw, tokens, in_f, out_f, block_size, k)
        ms, cublas_ms = by_impl[picked]
        total += 1
        agree += (predicted > 1.0) == (cublas_ms / ms > 1.0)
        if (predicted > 1.0) != (cublas_ms / ms > 1.0):
            misses.append((key, picked, predicted, cublas_ms / ms))
    return {"errors": errors, "agree": agree, "total": total, "misses": misses}


def score(hw, rows) -> float:
    errs = evaluate(hw, [r for r in rows if r["impl"] in ("dft2", "dft2_pregather")])["errors"]
    return statistics.fmean(abs(e) for v in errs.values() for e in v)


def report(hw, rows, title: str) -> None:
    res = evaluate(hw, rows)
    print(f"\n{title}")
    for impl, errs in res["errors"].items():
        ratio = [math.exp(e) for e in errs]
        print(f"  {impl:<15} predicted/measured: median {statistics.median(ratio):.2f}, range {min(ratio):.2f}-{max(ratio):.2f} ({len(errs)} rows)")
    rate = res["agree"] / res["total"] if res["total"] else float("nan")
    print(f"  explorer agreement (distinct configurations, cost-model pick): {res['agree']}/{res['total']} = {100 * rate:.0f}%")
    for key, picked, pred, meas in res["misses"]:
        print(f"    miss {key}: picked {picked}, predicted {pred:.2f}x, measured {meas:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--gpu", default="h100", help="graphopt.hardware spec key of the GPU the sweep ran on")
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    rows = json.loads(args.sweep.read_text())["rows"]
    hw = get_spec(args.gpu)
    report(hw, rows, f"coefficients of {coefficients.for_hardware(hw).path}")
    if not args.fit:
        return 0
    error, point = grid_fit(hw, rows)
    print("\nfitted: " + ", ".join(f"{n} = {v}" for n, v in point.items()) + f"  (mean |log error| {error:.3f})")
    report(coefficients.with_values(hw, point, "fit"), rows, "fitted coefficients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
