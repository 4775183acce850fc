"""Shared benchmark template: timing, environment, tables and JSON.

Every bench_<family>.py builds configs from real model shapes, times each variant with
`median_ms` (CUDA events through triton.testing.do_bench, median of many runs, L2 flushed
between runs), prints a rich table with achieved TFLOP/s or GB/s and ratios to the baseline,
and writes the rows as JSON (to $OUT when set, else bench/out/).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from graphopt.hardware.timing import cold_graph_ms, copies_for, median_ms  # noqa: F401  (re-exported for the bench scripts)


def environment() -> dict[str, Any]:
    """GPU, driver and library versions, for the header of every result."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    else:
        info["gpu"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def cuda_graph_ms(fn: Callable[[], Any], *, rep_ms: float = 100) -> float:
    """Median replay time of `fn` captured in a CUDA graph (removes launch gaps for tiny kernels)."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def host_us(fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Median over repeats of the wall time per call of `calls` calls issued back to back without a
    sync: when the GPU work per call is shorter than the host's, this is the host's launch path."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def interleaved_ms(fns: dict[str, Callable[[], Any]], *, rounds: int = 7, rep_ms: float = 40,
                   rotate: bool = False) -> dict[str, list[float]]:
    """Median times of several variants measured in `rounds` interleaved rounds (A, B, A, B, ...):
    a long bf16 GEMM runs the GPU at its power limit, so a variant timed alone right after a cool
    idle period gets higher clocks than one timed after it. With `rotate`, round r starts at
    variant r (mod the count), so no variant always follows the same one (the one timed right
    after a power-hungry cuDNN run can lose several percent). Returns each variant's per-round
    times; report their median."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            times[name].append(median_ms(fns[name], warmup_ms=5, rep_ms=rep_ms))
    return times


def random_block_mask(heads: int, length: int, density: float, causal: bool, seed: int, *, block: int) -> torch.Tensor:
    """bool (1, H, nQ, nK) at block x block granularity: `density` of each row's candidate blocks
    (under causality those at or below the diagonal), chosen at random, the diagonal always kept."""
    n = -(-length // block)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, heads, n, n, generator=gen)
    idx = torch.arange(n)
    allowed = (idx[None, :] <= idx[:, None]) if causal else torch.ones(n, n, dtype=torch.bool)
    diagonal = torch.eye(n, dtype=torch.bool)
    scores = scores.masked_fill(~allowed, -1.0).masked_fill(diagonal, 2.0)  # diagonal first, never disallowed
    per_row = allowed.sum(-1)  # candidates per row
    keep_count = torch.clamp((per_row.float() * density).round().long(), min=1)  # (nQ,)
    ranks = scores.argsort(-1, descending=True).argsort(-1)
    return (ranks < keep_count[:, None]) & allowed


def split_key_blocks(mask: torch.Tensor, length: int, block: int, block_n: int) -> torch.Tensor:
    """A mask of block-wide key blocks with each split into block // block_n narrower ones (the
    sparse kernel's BLOCK_N), trimmed to the key blocks of `length` tokens."""
    assert block % block_n == 0
    return mask.repeat_interleave(block // block_n, dim=-1)[..., : -(-length // block_n)].contiguous()


def naive_attention(q, k, v, scale, mask=None):
    """softmax(q @ k^T * scale) @ v with an optional boolean mask (True = masked out): the
    unfused form graphopt rewrites, timed as the eager baseline."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def comma_ints(text: str) -> list[int]:
    """A command-line list such as "16,32,64"."""
    return [int(v) for v in text.split(",")]


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or Path(__file__).parent / "out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, rows: list[dict], **extra: Any) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **extra, "rows": rows}, indent=2, default=str))
    return path


def print_table(title: str, rows: list[dict], columns: list[str] | None = None) -> None:
    """A rich table of `rows` (floats shown with 4 significant digits)."""
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    columns = columns or list(rows[0].keys())
    env = environment()
    table = Table(title=f"{title}  [{env.get('gpu') or 'CPU'}, torch {env['torch']}, triton {env.get('triton')}]")
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*[_fmt(row.get(c)) for c in columns])
    Console(width=200).print(table)


def _fmt(value: Any) -> str:
    from rich.markup import escape

    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else escape(str(value))  # a cell's brackets are text, not rich markup
