"""FFT-chain (block-circulant) linear layers vs cuBLAS bf16 on one H100/H200.

1. The explorer's --quick sweep (LLaMA-2-13B MLP shapes, 8 (B, K) combos) at 16, 256, 4096 tokens:
   per-config lines, success rates, cost model agreement (target >= 90%).
2. The kernel candidates side by side for 5120->13824 and 13824->5120 at B=512, K=2:
   correctness of each against a float64 reference (PASS/FAIL), then times of cuBLAS bf16 and
   of each implementation (torch: cuFFT + complex bmm, ~13 launches; triton: cuFFT + Triton
   contraction, ~9 launches; dft: packed real DFT as B x B tensor-core GEMMs + packed FMA
   contraction, 3 launches; dft2: frequency-major spectra, in-kernel prefetched gather, tensor-core
   contraction, 3 launches; dft2_pregather: dft2 after one staged Triton gather, 4 launches) at
   1, 16, 256 and 4096 tokens, plain launches and CUDA-graph replays (cuBLAS also in a CUDA graph),
   with the cost model's predicted ms beside them (the JSON keeps the model constants, for a refit).
   Targets: >= 3x cuBLAS at <= 16 tokens, >= 1.0x at 256 tokens (CUDA-graph replays).
3. Per-kernel device time (torch.profiler, CUDA activity) of the dft pipelines at 16 and 256
   tokens: kernel name -> us per call, to see where the time goes.

    python bench/bench_fft_chain.py                  # GPU: explorer + candidates
    python bench/bench_fft_chain.py --skip-explorer  # GPU: candidates + breakdown only (~2 min)
    python bench/bench_fft_chain.py --cpu-smoke      # tiny sizes on CPU (Triton interpreter)
    python bench/bench_fft_chain.py --fit-sweep      # GPU: every implementation on the explorer's
        # --quick configurations (CUDA graph) plus the per-kernel times of the dft2 pipelines:
        # the data the dft2 cost-model coefficients are fitted to (bench/fit_fft_cost_model.py)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

if "--cpu-smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import

from bench.common import cuda_graph_ms, median_ms, out_dir, print_table, write_json  # noqa: E402
from graphopt import cost_model  # noqa: E402
from graphopt.fft_explorer import explore_fft  # noqa: E402
from graphopt.hardware import get_spec  # noqa: E402
from graphopt.cost import coefficients  # noqa: E402
from graphopt.cost import fft_chain as fft_cost  # noqa: E402
from graphopt.kernels import fft_chain as fft  # noqa: E402


def check(impl, x, layer, cr, ci, bias, b, out_f):
    ref = fft.reference_fft_chain(x.double(), layer.coeffs.detach().double(), layer.perms, bias.double(), b, out_f)
    y = fft._LAUNCHERS[impl](x, cr, ci, layer.perms[1:].contiguous(), bias, b, out_f)
    err = fft.relative_error(y, ref)
    return err, err < (2e-2 if x.dtype == torch.bfloat16 else 1e-3)


PROFILED = ("dft", "dft2", "dft2_pregather")  # per-kernel breakdown of these pipelines
PROFILED_TOKENS = (16, 256)


def kernel_breakdown(fn, device, iters: int = 20) -> list[tuple[str, float, float]]:
    """(kernel name, device us per call, launches per call) of `fn`, from torch.profiler.
    On CPU (smoke run) the same table is built from CPU operator self times."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    out = []
    for evt in prof.key_averages():
        if evt.device_type != want:
            continue
        if want == DeviceType.CUDA:
            total = getattr(evt, "self_device_time_total", None)
            total = getattr(evt, "self_cuda_time_total", 0.0) if total is None else total
        else:
            total = evt.self_cpu_time_total
        if total > 0:
            out.append((evt.key, total / iters, evt.count / iters))
    return sorted(out, key=lambda r: -r[1])


def kernel_candidates(shapes, token_counts, b, k, device, smoke, only=None):
    hw = get_spec("auto") if device.type == "cuda" else get_spec("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = fft.available_implementations(device.type, b) if not smoke else fft.IMPLEMENTATIONS
    impls = tuple(i for i in impls if only is None or i in only)
    profiled_tokens = token_counts[1:3] if smoke else PROFILED_TOKENS
    rows, breakdown = [], []
    for in_f, out_f in shapes:
        torch.manual_seed(0)
        layer = fft.FFTChainLinear(in_f, out_f, b, k).to(device)
        with torch.no_grad():
            cr, ci = fft.spectral_coefficients(layer.coeffs)
        bias = layer.bias.detach().to(dtype)
        perms = layer.perms[1:].contiguous()
        w = (torch.randn(out_f, in_f, device=device) / in_f**0.5).to(dtype)
        # correctness at 8 tokens and at 1 token (the worst error of the two)
        verdict = {}
        for impl in impls:
            try:
                errs = [check(impl, torch.randn(tc, in_f, device=device).to(dtype), layer, cr, ci, bias, b, out_f) for tc in (8, 1)]
                err, ok = max(e for e, _ in errs), all(o for _, o in errs)
                verdict[impl] = (ok, err)
                print(f"{'PASS' if ok else 'FAIL'} {impl:<14} {in_f}->{out_f} B={b} K={k}: rel. error {err:.2e} vs float64 reference (T=8 and T=1)")
            except Exception as exc:  # noqa: BLE001
                verdict[impl] = (False, float("nan"))
                print(f"FAIL {impl:<14} {in_f}->{out_f}: {type(exc).__name__}: {exc}")
        for t in token_counts:
            x = torch.randn(t, in_f, device=device).to(dtype)
            dense_fn = lambda: torch.nn.functional.linear(x, w, bias)  # noqa: E731
            dense_ms = median_ms(dense_fn)
            dense_graph = cuda_graph_ms(dense_fn) if device.type == "cuda" else dense_ms
            dense_pred = cost_model.linear(hw, t, in_f, out_f, bias=True).ms
            chosen, _ = fft_cost.choose_implementation(hw, t, in_f, out_f, b, k, device_type=device.type)
            for impl in impls:
                row = {"shape": f"{in_f}->{out_f}", "tokens": t, "impl": impl, "correct": verdict[impl][0], "rel_error": verdict[impl][1],
                       "timing": "cuda-graph" if device.type == "cuda" else "eager (cpu)", "cublas_ms": dense_ms, "cublas_graph_ms": dense_graph}
                try:
                    # the tables the fft_linear pass makes graph constants: built once, outside the timing
                    tables = fft.operand_tables(impl, dtype, b, in_f, device, perms=perms, coeff_real=cr, coeff_imag=ci)
                    fn = lambda impl=impl, tables=tables: fft._LAUNCHERS[impl](x, cr, ci, perms, bias, b, out_f, **tables)  # noqa: E731
                    ms = median_ms(fn)
                    graph = cuda_graph_ms(fn) if device.type == "cuda" else ms
                except Exception as exc:  # noqa: BLE001
                    print(f"FAIL timing {impl} {in_f}->{out_f} T={t}: {type(exc).__name__}: {exc}")
                    ms = graph = float("nan")
                pred = fft_cost.estimate_fft_chain(hw, t, in_f, out_f, b, k, impl).ms
                row.update(ms=ms, graph_ms=graph, speedup=dense_ms / ms, graph_speedup=dense_graph / graph,
                           predicted_ms=pred, predicted_speedup=dense_pred / pred, chosen_by_cost_model=impl == chosen,
                           spectra_GBps=(8.0 * t * (k * -(-in_f // b) + -(-out_f // b)) * (b // 2 + 1) * 2) / (graph * 1e-3) / 1e9)
                rows.append(row)
                if impl in PROFILED and t in profiled_tokens and not math.isnan(ms):
                    try:
                        kernels = kernel_breakdown(fn, device)
                    except Exception as exc:  # noqa: BLE001
                        print(f"FAIL profiling {impl} {in_f}->{out_f} T={t}: {type(exc).__name__}: {exc}")
                        continue
                    total = sum(us for _, us, _ in kernels)
                    for name, us, count in kernels:
                        breakdown.append({"shape": f"{in_f}->{out_f}", "tokens": t, "impl": impl, "kernel": name[:60], "us_per_call": us,
                                          "launches_per_call": count, "share": us / total if total else None,
                                          "sum_kernels_us": total, "graph_replay_us": graph * 1e3})
    return rows, breakdown


def fit_sweep(device, smoke: bool) -> Path:
    """Each (shape, B, K) of the explorer's --quick set at its token counts: every implementation
    replayed from a CUDA graph, cuBLAS bf16 beside it, and the per-kernel device time of the dft2
    pipelines (what `bench/fit_fft_cost_model.py` fits the fft_chain.dft2_* coefficients to)."""
    from graphopt.fft_explorer import QUICK_COMBOS, matrix_shape

    hw = get_spec("auto") if device.type == "cuda" else get_spec("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(64, 96), (96, 64)] if smoke else [matrix_shape(m, 5120, 13824) for m in ("up_proj", "down_proj")]
    combos = [(16, 2), (32, 4)] if smoke else QUICK_COMBOS
    tokens = [4, 8] if smoke else [16, 256, 4096]
    impls = fft.IMPLEMENTATIONS if smoke else fft.available_implementations(device.type, 512)
    rows, breakdown = [], []
    for in_f, out_f in shapes:
        w = (torch.randn(out_f, in_f, device=device) / in_f**0.5).to(dtype)
        for t in tokens:
            x = torch.randn(t, in_f, device=device).to(dtype)
            dense_fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            dense_ms = cuda_graph_ms(dense_fn) if device.type == "cuda" else median_ms(dense_fn)
            for b, k in combos:
                layer = fft.FFTChainLinear(in_f, out_f, b, k, bias=False).to(device)
                with torch.no_grad():
                    cr, ci = fft.spectral_coefficients(layer.coeffs)
                perms = layer.perms[1:].contiguous()
                for impl in impls:
                    try:
                        tables = fft.operand_tables(impl, dtype, b, in_f, device, perms=perms, coeff_real=cr, coeff_imag=ci)
                        fn = lambda impl=impl, tables=tables: fft._LAUNCHERS[impl](x, cr, ci, perms, None, b, out_f, **tables)  # noqa: E731
                        ms = cuda_graph_ms(fn) if device.type == "cuda" else median_ms(fn)
                    except Exception as exc:  # noqa: BLE001 - one failing config must not end the sweep
                        print(f"FAIL {impl} {in_f}->{out_f} B={b} K={k} T={t}: {type(exc).__name__}: {exc}")
                        continue
                    pred = fft_cost.estimate_fft_chain(hw, t, in_f, out_f, b, k, impl, bias=False)
                    rows.append({"in_features": in_f, "out_features": out_f, "block_size": b, "k": k, "tokens": t, "impl": impl,
                                 "graph_ms": ms, "cublas_graph_ms": dense_ms, "speedup": dense_ms / ms, "predicted_ms": pred.ms})
                    print(f"{in_f:>6}->{out_f:<6} T={t:<5} B={b:<5} K={k:<3} {impl:<15} {ms:8.4f} ms  cuBLAS {dense_ms:8.4f}  "
                          f"{dense_ms / ms:5.2f}x  (predicted {pred.ms:8.4f} ms)", flush=True)
                    if impl.startswith("dft2"):
                        for name, us, count in kernel_breakdown(fn, device, iters=10):
                            breakdown.append({"in_features": in_f, "out_features": out_f, "block_size": b, "k": k, "tokens": t,
                                              "impl": impl, "kernel": name[:60], "us_per_call": us, "launches_per_call": count})
    return write_json("fft_fit_sweep", rows, kernel_breakdown=breakdown)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU to exercise the script")
    parser.add_argument("--skip-explorer", action="store_true")
    parser.add_argument("--fit-sweep", action="store_true", help="only the cost-model fitting sweep (see the module docstring)")
    parser.add_argument("--impls", default=None, help="comma-separated implementations for the kernel candidates "
                        f"(default: all that run here; valid: {', '.join(fft.IMPLEMENTATIONS)})")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if device.type != "cuda" and not smoke:
        print("no CUDA device: run with --cpu-smoke for the CPU exercise")
        return 1
    if args.fit_sweep:
        print(f"JSON: {fit_sweep(device, smoke)}")
        return 0
    explore_tokens = [4, 8] if smoke else [16, 256, 4096]
    token_counts = [1, 4, 8, 16] if smoke else [1, 16, 256, 4096]
    goals = {t: (3.0 if t <= 16 else 1.0 if t <= 256 else None) for t in token_counts}
    explorer = {}
    if not args.skip_explorer:
        for t in explore_tokens:
            kw = dict(hidden=64, intermediate=96, combos=[(16, 2), (32, 4)], layers=[0, 39], runs=3, warmup=1) if smoke else {}
            res = explore_fft("quick", seq_len=t, device=str(device), out_dir=out_dir() / "explore_fft", **kw)
            explorer[t] = res["analysis"]
    shapes = [(64, 96), (96, 64)] if smoke else [(5120, 13824), (13824, 5120)]
    b, k = (16, 2) if smoke else (512, 2)
    only = tuple(args.impls.split(",")) if args.impls else None
    if only and not set(only) <= set(fft.IMPLEMENTATIONS):
        parser.error(f"--impls {args.impls}: valid choices are {', '.join(fft.IMPLEMENTATIONS)}")
    rows, breakdown = kernel_candidates(shapes, token_counts, b, k, device, smoke, only)
    agree = sum(a["agreement"]["agree"] for a in explorer.values())
    total = sum(a["agreement"]["total"] for a in explorer.values())
    fitted = coefficients.for_hardware(get_spec("auto") if device.type == "cuda" else get_spec("cpu"))
    targets = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for t in token_counts:
            goal = goals[t]
            cands = [r for r in rows if r["shape"] == shape and r["tokens"] == t and r["correct"] and r["graph_speedup"] == r["graph_speedup"]]
            best = max(cands, key=lambda r: r["graph_speedup"], default=None)
            if best:
                targets.append({"shape": shape, "tokens": t, "best_impl": best["impl"], "best_ms": best["graph_ms"],
                                "cublas_ms": best["cublas_graph_ms"], "speedup_vs_cublas": best["graph_speedup"],
                                "target": goal, "met": (best["graph_speedup"] >= goal) if goal else None})
    path = write_json("bench_fft_chain", rows, block_size=b, k=k, targets=targets, kernel_breakdown=breakdown,
                      explorer_agreement={"agree": agree, "total": total, "rate": agree / total if total else None},
                      explorer={str(t): a for t, a in explorer.items()},
                      cost_model_coefficients={name: fitted[name] for name in fitted.names("fft_chain.")
                                               + ["efficiency.fft_chain", "gemm.partial_overlap"]},
                      cost_model_data=fitted.path)
    print(f"explorer cost-model agreement over all token counts: {agree}/{total}" + (f" = {100 * agree / total:.0f}% (target >= 90%)" if total else ""))
    print(f"JSON: {path}")
    unit = "device us per call, torch.profiler CUDA activity" if device.type == "cuda" else "CPU op self us per call (smoke: no CUDA)"
    print_table(f"Per-kernel breakdown of {', '.join(PROFILED)} ({unit}; graph_replay_us = the whole chain replayed from a CUDA graph)",
                breakdown, ["shape", "tokens", "impl", "kernel", "us_per_call", "launches_per_call", "share", "sum_kernels_us", "graph_replay_us"])
    print_table("FFT-chain targets (best correct implementation; CUDA-graph replay vs cuBLAS bf16 also in a CUDA graph)", targets)
    print_table(f"FFT-chain kernel candidates, B={b}, K={k} (speedup = cuBLAS bf16 / impl; graph_* = both sides replayed from CUDA graphs)", rows,
                ["shape", "tokens", "impl", "correct", "rel_error", "cublas_ms", "ms", "speedup", "cublas_graph_ms", "graph_ms", "graph_speedup",
                 "predicted_ms", "predicted_speedup", "chosen_by_cost_model", "spectra_GBps"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
