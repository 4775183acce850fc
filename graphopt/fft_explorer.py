"""`graphopt explore-fft`: where does an FFT-chain layer beat the dense GEMM?

Sweeps block size B and channel count K over MLP matrices of chosen layers (default shapes:
LLaMA-2-13B, hidden 5120, intermediate 13824, 40 layers), times the dense linear and the FFT-chain
op (the implementation the cost model picks), and prints one line per configuration with the
cost model's predicted speedup beside the measured one, then a closing analysis: success rate per
(B, K), the best configuration per layer, and the agreement rate of predicted vs measured
faster/slower. Writes a JSON of every row, a plot of speedup over (B, K), and suggested
per-layer-range configurations as the plan's "fft_linear" "suggested" list.

- `--quick`: layers [0, 10, 19, 25, 30, 35, 39]; down_proj and up_proj; 8 (B, K) combinations;
  20 runs each.
- `--full`: layers [0, 10, 19, 30, 39]; down_proj, up_proj, gate_proj; all 16 combinations of
  B in {256, 512, 1024, 2048} and K in {2, 4, 8, 16}; 30 runs.

Timing depends only on shapes, never on weight values: each distinct (shape, B, K) is timed once
and the time reused on every layer line (the report says so). With `--model`, real weights give a
per-layer projection error (relative Frobenius error of `project_dense`).
On CUDA the timed callables are replayed from CUDA graphs (as a decode loop under
`torch.compile(mode="reduce-overhead")` would), falling back to plain launches if capture fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from graphopt import cost_model
from graphopt.cost import fft_chain as fft_cost
from graphopt.hardware import get_spec
from graphopt.kernels import fft_chain as fft
from graphopt.hardware.timing import capture_cuda_graph

QUICK_LAYERS = [0, 10, 19, 25, 30, 35, 39]
FULL_LAYERS = [0, 10, 19, 30, 39]
ALL_COMBOS = [(b, k) for b in (256, 512, 1024, 2048) for k in (2, 4, 8, 16)]
QUICK_COMBOS = [(256, 2), (256, 4), (512, 2), (512, 4), (1024, 2), (1024, 8), (2048, 4), (2048, 16)]
QUICK_MATRICES = ["down_proj", "up_proj"]
FULL_MATRICES = ["down_proj", "up_proj", "gate_proj"]
LLAMA2_13B = {"hidden": 5120, "intermediate": 13824}


def matrix_shape(matrix: str, hidden: int, intermediate: int) -> tuple[int, int]:
    """(in_features, out_features) of an MLP matrix."""
    if matrix == "down_proj":
        return intermediate, hidden
    if matrix in ("up_proj", "gate_proj"):
        return hidden, intermediate
    raise ValueError(f"unknown matrix {matrix!r}; valid choices: down_proj, up_proj, gate_proj")


def time_ms(fn, *, warmup: int, runs: int, device: torch.device, cuda_graph: bool = True) -> tuple[float, str]:
    """Median ms of `fn` over `runs` runs after `warmup` calls, and the method used."""
    for _ in range(max(1, warmup)):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), "perf_counter"
    torch.cuda.synchronize()
    method = "events"
    call = fn
    if cuda_graph:
        try:
            call, method = capture_cuda_graph([fn]).replay, "cuda_graph"
        except Exception:  # noqa: BLE001 - capture can fail (e.g. host syncs): time plain launches
            torch.cuda.synchronize()
    flush = torch.empty(64 * 2**20, dtype=torch.int8, device=device)  # 64 MB > L2: cold caches
    times = []
    for _ in range(runs):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), method


def _real_weights(model_spec: str, layers: list[int], matrices: list[str]) -> dict[tuple[int, str], torch.Tensor]:
    from graphopt.fft_distill import layer_index, resolve_model

    model, _ = resolve_model(model_spec)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            idx = layer_index(name)
            for matrix in matrices:
                if idx in layers and name.endswith(matrix):
                    out[(idx, matrix)] = mod.weight.detach().float()
    return out


def predicted_speedup(hw, tokens: int, in_features: int, out_features: int, block_size: int, k: int, *,
                      device_type: str = "cuda", dtype_bytes: int = 2) -> tuple[str, float]:
    """(implementation, predicted cuBLAS time / FFT-chain time) as the explorer scores a row: the
    implementation the cost model picks (no bias) against the dense linear's estimate."""
    impl, est = fft_cost.choose_implementation(hw, tokens, in_features, out_features, block_size, k, device_type=device_type,
                                          dtype_bytes=dtype_bytes, bias=False)
    return impl, cost_model.linear(hw, tokens, in_features, out_features, dtype_bytes=dtype_bytes).ms / est.ms


def explore_fft(
    mode: str = "quick",
    *,
    layers: list[int] | None = None,
    matrices: list[str] | None = None,
    combos: list[tuple[int, int]] | None = None,
    hidden: int = LLAMA2_13B["hidden"],
    intermediate: int = LLAMA2_13B["intermediate"],
    batch_size: int = 1,
    seq_len: int = 16,
    device: str | None = None,
    warmup: int = 5,
    runs: int | None = None,
    model: str | None = None,
    out_dir: str | Path = ".",
    plan_path: str | Path | None = None,
    cuda_graph: bool = True,
    console=None,
) -> dict[str, Any]:
    """Run the sweep; returns {"rows", "analysis", "json", "plot", "plan"} (see module docstring)."""
    from rich.console import Console

    if mode not in ("quick", "full"):
        raise ValueError(f"unknown explore-fft mode {mode!r}; valid choices: quick, full")
    console = console or Console(width=200)
    layers = layers if layers is not None else (QUICK_LAYERS if mode == "quick" else FULL_LAYERS)
    matrices = matrices or (QUICK_MATRICES if mode == "quick" else FULL_MATRICES)
    combos = combos or (QUICK_COMBOS if mode == "quick" else ALL_COMBOS)
    runs = runs or (20 if mode == "quick" else 30)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hw = get_spec("auto") if dev.type == "cuda" else get_spec("cpu")
    tokens = batch_size * seq_len
    weights = _real_weights(model, layers, matrices) if model else {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    console.print(f"[bold]explore-fft --{mode}[/]: {hw.name} ({dev}), {tokens} tokens (batch {batch_size} x seq {seq_len}), "
                  f"{dtype}, {warmup} warmup + {runs} runs, layers {layers}, matrices {matrices}, {len(combos)} (B, K) combos")
    console.print("Timing depends only on shapes: each distinct (shape, B, K) is timed once and reused on every layer's line"
                  + ("; weights are random (identical at every layer), so projection errors are not reported." if not weights
                     else f"; real weights from {model} give per-layer projection errors."))
    dense_cache: dict[tuple[int, int], float] = {}
    fft_cache: dict[tuple[int, int, int, int], tuple[float, str, str]] = {}
    rows = []
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        for matrix in matrices:
            w = weights.get((layer, matrix))
            in_f, out_f = (w.shape[1], w.shape[0]) if w is not None else matrix_shape(matrix, hidden, intermediate)
            x = torch.randn(tokens, in_f, generator=gen).to(dev, dtype)
            if (in_f, out_f) not in dense_cache:
                wd = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dev, dtype)
                dense_cache[(in_f, out_f)] = time_ms(lambda: torch.nn.functional.linear(x, wd), warmup=warmup, runs=runs, device=dev, cuda_graph=cuda_graph)[0]
                del wd
            dense_ms = dense_cache[(in_f, out_f)]
            for block_size, k in combos:
                key = (in_f, out_f, block_size, k)
                impl, predicted = predicted_speedup(hw, tokens, in_f, out_f, block_size, k, device_type=dev.type,
                                                    dtype_bytes=x.element_size())
                if key not in fft_cache:
                    layer_mod = fft.FFTChainLinear(in_f, out_f, block_size, k, bias=False).to(dev)
                    with torch.no_grad():
                        cr, ci = fft.spectral_coefficients(layer_mod.coeffs)
                    perms = layer_mod.perms[1:].contiguous()
                    # the tables the fft_linear pass makes graph constants: built once, outside the timing
                    tables = fft.operand_tables(impl, x.dtype, block_size, in_f, dev, perms=perms, coeff_real=cr, coeff_imag=ci)
                    try:
                        ms, method = time_ms(lambda: fft.fft_chain_linear(x, cr, ci, perms, None, block_size, out_f, impl, **tables),
                                             warmup=warmup, runs=runs, device=dev, cuda_graph=cuda_graph)
                    except Exception as exc:  # noqa: BLE001 - one failing config must not end the sweep
                        ms, method = float("nan"), f"FAILED: {type(exc).__name__}: {exc}"
                    fft_cache[key] = (ms, method, impl)
                    del layer_mod, cr, ci, tables
                fft_ms, method, impl_used = fft_cache[key]
                proj_err = None
                if w is not None:
                    proj_err = fft.relative_error(fft.project_dense(w, block_size, k).to_dense(), w)
                speedup = dense_ms / fft_ms if fft_ms == fft_ms and fft_ms > 0 else float("nan")
                rows.append({"layer": layer, "matrix": matrix, "in_features": in_f, "out_features": out_f, "block_size": block_size,
                             "k": k, "tokens": tokens, "dense_ms": dense_ms, "fft_ms": fft_ms, "speedup": speedup,
                             "faster": bool(speedup > 1.0), "predicted_speedup": predicted, "predicted_faster": bool(predicted > 1.0),
                             "compression": in_f * out_f / (k * fft.chain_dims(in_f, out_f, block_size, k)["n_in"] * fft.chain_dims(in_f, out_f, block_size, k)["n_out"] * block_size),
                             "projection_rel_error": proj_err, "impl": impl_used, "timing": method})
                r = rows[-1]
                console.print(f"layer {layer:>3} {matrix:<9} {in_f:>6}->{out_f:<6} B={block_size:<5} K={k:<3} dense {dense_ms:8.4f} ms  "
                              f"FFT {fft_ms:8.4f} ms \\[{impl_used:>14}]  speedup {speedup:6.2f}x {'✓' if r['faster'] else '✗'}  "
                              f"(predicted {predicted:5.2f}x {'✓' if r['predicted_faster'] else '✗'})  compression {r['compression']:6.1f}x"
                              + (f"  proj. err {proj_err:.3f}" if proj_err is not None else ""))
    analysis = analyze(rows)
    print_analysis(analysis, console)
    json_path = out_dir / f"explore_fft_{mode}_{tokens}tok.json"
    json_path.write_text(json.dumps({"mode": mode, "device": hw.name, "tokens": tokens, "dtype": str(dtype),
                                     "timing_note": "each distinct (shape, B, K) timed once, reused per layer",
                                     "rows": rows, "analysis": analysis}, indent=2, default=str))
    plot_path = plot_speedups(rows, out_dir / f"explore_fft_{mode}_{tokens}tok.png", title=f"FFT-chain speedup vs dense, {hw.name}, {tokens} tokens")
    plan = None
    if plan_path is not None:
        from graphopt.plan import load_plan, save_plan

        plan_path = Path(plan_path)
        section = load_plan(plan_path).get("fft_linear", {}) if plan_path.exists() else {}
        section["suggested"] = analysis["suggested"]
        plan = str(save_plan(plan_path, {"fft_linear": section}))
    console.print(f"rows: {json_path}\nplot: {plot_path}" + (f"\nsuggested configs written to plan {plan}" if plan else ""))
    return {"rows": rows, "analysis": analysis, "json": str(json_path), "plot": str(plot_path), "plan": plan}


def analyze(rows: list[dict]) -> dict[str, Any]:
    """Success rate per (B, K), best per (layer, matrix), predicted-vs-measured agreement, and
    suggested configurations per contiguous range of layers with the same best choice."""
    per_combo: dict[str, list[int]] = {}
    for r in rows:
        key = f"B={r['block_size']},K={r['k']}"
        per_combo.setdefault(key, [0, 0])
        per_combo[key][0] += int(r["faster"])
        per_combo[key][1] += 1
    best: dict[str, dict] = {}
    for r in rows:
        key = f"{r['layer']}:{r['matrix']}"
        if r["speedup"] != r["speedup"]:
            continue
        cur = best.get(key)

        def score(row):  # faster first; among faster, the lowest projection error when known
            err = row["projection_rel_error"]
            return (row["faster"], -(err if err is not None else 0.0), row["speedup"])

        if cur is None or score(r) > score(cur):
            best[key] = r
    agree = [r["faster"] == r["predicted_faster"] for r in rows if r["speedup"] == r["speedup"]]
    suggested = []
    for matrix in dict.fromkeys(r["matrix"] for r in rows):
        chosen = sorted(((int(k.split(":")[0]), v) for k, v in best.items() if k.split(":")[1] == matrix), key=lambda t: t[0])
        for layer, r in chosen:
            cfg = (r["block_size"], r["k"]) if r["faster"] else None
            if suggested and suggested[-1]["matrix"] == matrix and suggested[-1]["_cfg"] == cfg:
                suggested[-1]["layer_end"] = layer
                suggested[-1]["measured_speedup"] = min(suggested[-1]["measured_speedup"], r["speedup"])
            else:
                suggested.append({"matrix": matrix, "layer_start": layer, "layer_end": layer, "_cfg": cfg,
                                  "block_size": cfg[0] if cfg else None, "k": cfg[1] if cfg else None,
                                  "measured_speedup": r["speedup"], "tokens": r["tokens"]})
    for s in suggested:
        s.pop("_cfg")
    return {
        "success_rate": {k: {"faster": v[0], "total": v[1]} for k, v in per_combo.items()},
        "best_per_layer": {k: {"block_size": v["block_size"], "k": v["k"], "speedup": v["speedup"], "faster": v["faster"],
                               "projection_rel_error": v["projection_rel_error"]} for k, v in best.items()},
        "agreement": {"agree": sum(agree), "total": len(agree), "rate": (sum(agree) / len(agree)) if agree else None},
        "suggested": [s for s in suggested if s["block_size"] is not None],
        "no_winner": [s for s in suggested if s["block_size"] is None],
    }


def print_analysis(analysis: dict, console) -> None:
    console.print("\n[bold]Success rate per (B, K)[/] (FFT-chain faster than dense):")
    for key, v in analysis["success_rate"].items():
        console.print(f"  {key:<14} faster on {v['faster']}/{v['total']}")
    console.print("[bold]Best configuration per layer[/]:")
    for key, v in analysis["best_per_layer"].items():
        err = f", proj. err {v['projection_rel_error']:.3f}" if v["projection_rel_error"] is not None else ""
        console.print(f"  {key:<18} B={v['block_size']}, K={v['k']}: {v['speedup']:.2f}x {'✓' if v['faster'] else '✗'}{err}")
    a = analysis["agreement"]
    rate = f"{100 * a['rate']:.0f}%" if a["rate"] is not None else "n/a"
    console.print(f"[bold]Cost model agreement[/] (predicted vs measured faster/slower): {a['agree']}/{a['total']} = {rate}")
    console.print("[bold]Suggested per-layer-range configurations[/]:")
    for s in analysis["suggested"]:
        console.print(f"  {s['matrix']:<9} layers {s['layer_start']}..{s['layer_end']}: B={s['block_size']}, K={s['k']} (>= {s['measured_speedup']:.2f}x)")
    for s in analysis["no_winner"]:
        console.print(f"  {s['matrix']:<9} layers {s['layer_start']}..{s['layer_end']}: keep dense (no configuration was faster)")


def plot_speedups(rows: list[dict], path: Path, *, title: str) -> Path:
    """Heatmap of the mean measured speedup over (B, K), one panel per matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrices = list(dict.fromkeys(r["matrix"] for r in rows))
    bs = sorted({r["block_size"] for r in rows})
    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.5 * len(matrices), 3.8), squeeze=False)
    for ax, matrix in zip(axes[0], matrices):
        grid = [[float("nan")] * len(ks) for _ in bs]
        for i, b in enumerate(bs):
            for j, k in enumerate(ks):
                vals = [r["speedup"] for r in rows if r["matrix"] == matrix and r["block_size"] == b and r["k"] == k and r["speedup"] == r["speedup"]]
                if vals:
                    grid[i][j] = sum(vals) / len(vals)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=max(2.0, max((v for row in grid for v in row if v == v), default=2.0)))
        for i in range(len(bs)):
            for j in range(len(ks)):
                if grid[i][j] == grid[i][j]:
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.set_xlabel("K (channels)")
        ax.set_ylabel("B (block size)")
        ax.set_title(matrix)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# CLI: graphopt explore-fft --quick | --full
# ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="7 layers, 8 (B, K) combos, 20 runs (default)")
    mode.add_argument("--full", action="store_const", dest="mode", const="full", help="5 layers x 3 matrices, 16 combos, 30 runs")
    parser.set_defaults(mode="quick")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=None, help="timed runs per config (default 20 quick / 30 full)")
    parser.add_argument("--model", default=None, help="take real weights (and shapes) from this model (see graphopt fftchain distill)")
    parser.add_argument("--hidden", type=int, default=LLAMA2_13B["hidden"], help="hidden size (default LLaMA-2-13B 5120)")
    parser.add_argument("--intermediate", type=int, default=LLAMA2_13B["intermediate"], help="MLP size (default 13824)")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="override the layer list")
    parser.add_argument("--block-sizes", type=int, nargs="*", default=None, help="override B values (with --ks: their product)")
    parser.add_argument("--ks", type=int, nargs="*", default=None, help="override K values")
    parser.add_argument("--out", default="explore_fft_out", help="directory for the JSON and the plot")
    parser.add_argument("--plan", default=None, help="write suggested configs into this plan's fft_linear section")
    parser.add_argument("--no-cuda-graph", action="store_true", help="time plain launches instead of CUDA graph replays")


def run(args: argparse.Namespace) -> int:
    if args.device is not None:
        from graphopt.cli import check_device

        check_device(args.device, "--device")
    for name, values, least in (("--block-sizes", args.block_sizes, 1), ("--ks", args.ks, 1), ("--layers", args.layers, 0)):
        bad = [v for v in values or () if v < least]
        if bad:
            raise ValueError(f"{name} takes {'positive' if least else 'non-negative'} integers, got {bad}")
    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len), ("--hidden", args.hidden),
                        ("--intermediate", args.intermediate)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    combos = None
    if args.block_sizes or args.ks:
        base_b = args.block_sizes or sorted({b for b, _ in ALL_COMBOS})
        base_k = args.ks or sorted({k for _, k in ALL_COMBOS})
        combos = [(b, k) for b in base_b for k in base_k]
    explore_fft(args.mode, layers=args.layers, combos=combos, hidden=args.hidden, intermediate=args.intermediate,
                batch_size=args.batch_size, seq_len=args.seq_len, device=args.device, warmup=args.warmup, runs=args.runs,
                model=args.model, out_dir=args.out, plan_path=args.plan, cuda_graph=not args.no_cuda_graph)
    return 0
