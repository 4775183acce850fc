"""Ablation runs and the demo: the same model under eager, Inductor and graphopt pass subsets.

`run_ablation(model_name, passes)` measures three kinds of variant: all listed passes together,
each pass alone, and all but one (duplicates, e.g. "all" and "alone" with one pass, run once).
For each it reports median latency, speedup vs eager and vs Inductor, max and relative output
error vs eager, peak memory, compile time and the rewrites applied. On a GPU it also times the same
call replayed from a CUDA graph: the GPU work alone, without the host's launch path (a call can be
bound by its host time: each graphopt custom op adds a Python launch; bench/RESULTS.md section 5,
"The demo", shows both times for the demo's model). Output: a rich
table, a JSON file and a PNG bar chart.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphopt import compiler as backend_module
from graphopt.config import PASS_NAMES
from graphopt.passes.base import Decision, count_applied
from graphopt.hardware.timing import cold_graph_ms, first_tensor, timed_ms

_log = logging.getLogger("graphopt")


@dataclass
class VariantResult:
    name: str
    passes: list[str]
    median_ms: float
    compile_s: float
    max_abs_err: float
    rel_err: float
    peak_memory_mb: float
    speedup_vs_eager: float = 0.0
    speedup_vs_inductor: float = 0.0
    rewrites: dict[str, int] = field(default_factory=dict)
    graph_ms: float = float("nan")  # CUDA-graph replay of the same call (GPU only; NaN if capture failed)
    graph_speedup_vs_inductor: float = float("nan")
    spread: float = 0.0  # interquartile range of the timed calls over their median


# A spread above this makes ratios between variants unreliable: the table says so.
NOISY_SPREAD = 0.10


def variant_sets(passes: list[str]) -> list[tuple[str, list[str]]]:
    """all, each alone, all but one -- deduplicated by the set of passes."""
    for name in passes:
        if name not in PASS_NAMES:
            raise ValueError(f"unknown pass {name!r}; valid choices: {', '.join(PASS_NAMES)}")
    candidates = [("all", list(passes))]
    candidates += [(f"only {p}", [p]) for p in passes]
    candidates += [(f"all but {p}", [q for q in passes if q != p]) for p in passes]
    seen, out = set(), []
    for label, subset in candidates:
        key = frozenset(subset)
        if key not in seen:
            seen.add(key)
            out.append((label, subset))
    return out


def _peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    # CPU: the process's peak resident set (monotonic over the run, not per variant).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(model, inputs, *, backend: str | None, options: dict | None, device: str, reference: torch.Tensor | None,
            rep_ms: float, name: str, passes: list[str]) -> tuple[VariantResult, torch.Tensor, list[Decision]]:
    """Compile (or not), time the first call as compile time, then the median of many calls."""
    torch._dynamo.reset()
    with backend_module.recording_decisions() as sink:
        fn = model if backend is None else torch.compile(model, backend=backend, options=options or None)
        _reset_peak(device)
        with torch.no_grad():
            start = time.perf_counter()
            output = first_tensor(fn(*inputs)).float()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - start if backend is not None else 0.0

            def call():
                return fn(*inputs)

            timing = timed_ms(call, rep_ms=rep_ms, device=device)
            graph_ms = _graph_ms(call, name) if device.startswith("cuda") else float("nan")
    peak = _peak_memory_mb(device)
    if reference is None:
        max_abs, rel = 0.0, 0.0
    else:
        diff = (output - reference).abs()
        max_abs = float(diff.max())
        rel = float(diff.norm() / reference.norm().clamp(min=1e-30))
    return VariantResult(name, passes, timing.median_ms, compile_s, max_abs, rel, peak, rewrites=count_applied(sink),
                         graph_ms=graph_ms, spread=timing.spread), output, sink


def _graph_ms(call, name: str) -> float:
    """Median ms of `call` replayed from a CUDA graph; NaN (and a log line) when it cannot be captured."""
    try:
        return cold_graph_ms([call])
    except Exception as exc:  # noqa: BLE001 - a variant that cannot be captured keeps its plain timing
        _log.warning("%s: CUDA-graph timing skipped (%s: %s)", name, type(exc).__name__, exc)
        return float("nan")


def _set_speedups(results: list[VariantResult], eager: VariantResult, inductor: VariantResult) -> None:
    for r in results:
        r.speedup_vs_eager = eager.median_ms / r.median_ms
        r.speedup_vs_inductor = inductor.median_ms / r.median_ms
        r.graph_speedup_vs_inductor = inductor.graph_ms / r.graph_ms


def run_ablation(
    model_name: str,
    passes: list[str],
    *,
    seq_len: int | None = None,
    batch: int = 1,
    device: str | None = None,
    force: bool = False,
    downstream: str = "inductor",
    out_dir: str | Path = "graphopt_out/ablation",
    rep_ms: float = 200,
    extra_options: dict | None = None,
) -> list[VariantResult]:
    from graphopt.models import build

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, inputs = build(model_name, seq_len=seq_len, batch=batch, device=device)
    results: list[VariantResult] = []
    eager, reference, _ = measure(model, inputs, backend=None, options=None, device=device, reference=None,
                                  rep_ms=rep_ms, name="eager", passes=[])
    results.append(eager)
    inductor, _, _ = measure(model, inputs, backend="inductor", options=None, device=device, reference=reference,
                             rep_ms=rep_ms, name="inductor", passes=[])
    results.append(inductor)
    for label, subset in variant_sets(passes):
        options = {"passes": {p: p in subset for p in PASS_NAMES}, "force": force, "downstream": downstream,
                   **(extra_options or {})}
        result, _, _ = measure(model, inputs, backend="graphopt", options=options, device=device,
                               reference=reference, rep_ms=rep_ms, name=f"graphopt: {label}", passes=subset)
        results.append(result)
    _set_speedups(results, eager, inductor)
    write_outputs(results, Path(out_dir), title=f"ablation: {model_name} on {_device_name(device)}")
    return results


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"


def results_table(results: list[VariantResult], title: str):
    from rich.table import Table

    table = Table(title=title)
    graphs = any(not math.isnan(r.graph_ms) for r in results)  # CUDA-graph timings (GPU runs)
    columns = ["variant", "median ms", "spread", "vs eager", "vs inductor"]
    columns += ["CUDA graph ms", "graph vs inductor"] if graphs else []
    columns += ["max abs err", "rel err", "peak MB", "compile s", "rewrites"]
    for column in columns:
        table.add_column(column, justify="right" if column != "variant" else "left")
    for r in results:
        rewrites = ", ".join(f"{k}={v}" for k, v in r.rewrites.items()) or "-"
        row = [r.name, f"{r.median_ms:.3f}", f"±{50 * r.spread:.0f}%", f"{r.speedup_vs_eager:.2f}x",
               f"{r.speedup_vs_inductor:.2f}x"]
        row += [f"{r.graph_ms:.3f}", f"{r.graph_speedup_vs_inductor:.2f}x"] if graphs else []
        row += [f"{r.max_abs_err:.2e}", f"{r.rel_err:.2e}", f"{r.peak_memory_mb:.0f}", f"{r.compile_s:.1f}", rewrites]
        table.add_row(*row)
    caption = ["spread: half the interquartile range of the timed calls, against their median"]
    if graphs:
        caption.append("median ms: the call as a user makes it (host launch path included); CUDA graph ms: the same "
                       "call replayed from a CUDA graph, the GPU work alone (what options={'cuda_graphs': True} or a "
                       "serving engine's graph capture gets)")
    table.caption = "\n".join(caption)
    return table


def noise_warning(results: list[VariantResult]) -> str | None:
    """A warning when a variant's calls vary by more than NOISY_SPREAD: ratios closer to 1 than
    that spread can flip from one run to the next (a shared or busy CPU, frequency scaling)."""
    noisy = [r for r in results if r.spread > NOISY_SPREAD]
    if not noisy:
        return None
    worst = max(noisy, key=lambda r: r.spread)
    return (f"timings are noisy: the calls of {', '.join(r.name for r in noisy)} vary by up to ±{50 * worst.spread:.0f}% "
            f"({worst.name}); speedups within that of 1.00x can flip between runs. Rerun on an idle machine "
            f"(graphopt ablate: a longer --rep-ms) or on a GPU")


def write_outputs(results: list[VariantResult], out_dir: Path, *, title: str) -> dict[str, Path]:
    """Rich table to the console, plus ablation.json and ablation.png in out_dir, each path printed."""
    from rich.console import Console

    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=180)
    console.print(results_table(results, title))
    warning = noise_warning(results)
    if warning:
        _log.warning(warning)
        console.print(f"[yellow]warning:[/yellow] {warning}")
    json_path = out_dir / "ablation.json"
    json_path.write_text(json.dumps({"title": title, "environment": _environment(),
                                     "variants": [_json_ready(asdict(r)) for r in results]}, indent=2))
    png_path = out_dir / "ablation.png"
    plot(results, png_path, title)
    for path in (json_path, png_path):
        print(f"wrote {path}")
    return {"json": json_path, "png": png_path}


def _json_ready(fields: dict) -> dict:
    """NaN (no CUDA-graph timing) as null: strict JSON has no NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in fields.items()}


def plot(results: list[VariantResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(results)), 4))
    names = [r.name.replace("graphopt: ", "go: ") for r in results]
    bars = ax.bar(names, [r.median_ms for r in results], color=["#888888", "#4477aa"] + ["#ee6677"] * (len(results) - 2))
    for bar, r in zip(bars, results):
        ax.annotate(f"{r.speedup_vs_eager:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median latency (ms)")
    ax.set_title(title + "\n(labels: speedup vs eager)", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _environment() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": _device_name("cuda" if torch.cuda.is_available() else "cpu")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def run_demo(*, device: str | None = None, out_dir: str | Path = "graphopt_out/demo", rep_ms: float = 300) -> list[VariantResult]:
    """The README's main job: a small LLaMA-style model with eager attention, explained and timed."""
    from rich.console import Console

    from graphopt.explain import explain
    from graphopt.models import build

    console = Console(width=180)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "small-llama" if device.startswith("cuda") else "tiny-llama"
    seq_len = 2048 if device.startswith("cuda") else 128
    model, inputs = build(name, seq_len=seq_len, device=device)
    console.print(f"[bold]graphopt demo[/bold]: {name} (transformers LlamaForCausalLM, eager attention, random "
                  f"weights), {seq_len} tokens, {next(model.parameters()).dtype}, on {_device_name(device)}")
    report = explain(model, *inputs)
    console.print(report.table())
    eager, reference, _ = measure(model, inputs, backend=None, options=None, device=device, reference=None,
                                  rep_ms=rep_ms, name="eager", passes=[])
    inductor, _, _ = measure(model, inputs, backend="inductor", options=None, device=device, reference=reference,
                             rep_ms=rep_ms, name="inductor", passes=[])
    graphopt, _, _ = measure(model, inputs, backend="graphopt", options=None, device=device, reference=reference,
                             rep_ms=rep_ms, name="graphopt", passes=[n for n, c in report.counts.items() if c])
    results = [eager, inductor, graphopt]
    _set_speedups(results, eager, inductor)
    write_outputs(results, Path(out_dir), title=f"demo: {name}, {seq_len} tokens on {_device_name(device)}")
    return results
