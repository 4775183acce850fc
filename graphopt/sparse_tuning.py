"""Per-head tuning of sparse-attention thresholds under an L1 error budget (SpargeAttn's procedure).

    plan = graphopt.tune(model, calibration_inputs, l1=0.06, pv_l1=0.07,
                              heldout_inputs=heldout, plan_path="plan.json")
    torch.compile(model, backend="graphopt", options={"passes": {"sparse_attention": True}, "plan": "plan.json"})

1. Capture. The model is compiled once per input with a capture backend: graphopt's `attention`
   pass turns every hand-written attention and SDPA call into a `graphopt::attention` node, and
   each node is swapped for a recorder that keeps its q, k, v (attentions with a bias or padding
   mask other than causal are counted and skipped: the sparse kernel does not take a bias).
   Layers are keyed by the attention's module path (e.g. `model.layers.3.self_attn`), as the pass
   looks them up.
2. Per layer, all heads at once (thresholds are per-head tensors, each head searched on its own):
   - for each `simthreshd1` of a grid, binary-search the smallest `cdfthreshd` (largest sparsity;
     the kept set grows with cdfthreshd) whose relative L1 error sum|O - O'| / sum|O| against
     dense attention stays below `l1`. The pooled error over the calibration inputs is reported;
     acceptance asks it of every input separately (stricter than SpargeAttn's pooled criterion:
     at a few hundred blocks one kept block more or less moves the error in steps, and the pooled
     mean let single inputs, and held-out ones, land far over the budget);
   - keep the (simthreshd1, cdfthreshd) with the highest sparsity, then move cdfthreshd halfway
     back to 1 (`cdf_margin`: only half the probability mass that calibration tolerated is dropped);
   - then binary-search the smallest `pvthreshd` (most PV skipping) keeping the error below `pv_l1`.
   Heads below `min_sparsity` fall back to dense (cdfthreshd=1, simthreshd1=-1, no PV skipping).
3. With held-out inputs, every head's error is measured on each of them; a head over its budget
   on any one falls back to dense (reported), so every tuned head is within budget on every
   held-out input too. The held-out L1 reported is the largest over those inputs.
4. A per-head table (sparsity, L1, held-out L1) is printed and the plan section is written with
   `graphopt.plan.save_plan(path, {"sparse_attention": section})`.

Evaluation runs the torch reference on CPU and the Triton kernel on CUDA, with the same block
mask and PV-skipping semantics.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from graphopt.kernels import sparse_attention as sa
from graphopt.ops import DENSE_ATTENTION_TARGETS

log = logging.getLogger("graphopt")

SIM_GRID: tuple[float, ...] = (-1.0, 0.2, 0.4, 0.6, 0.8)
CDF_STEPS = 9  # binary-search steps over cdfthreshd in [0, 1]: resolution 1/512
PV_RANGE = (0.0, 24.0)  # log2 units
PV_STEPS = 6
MIN_SPARSITY = 0.1
CDF_MARGIN = 0.5  # keep cdfthreshd = 1 - (1 - tuned) * (1 - CDF_MARGIN): half the dropped mass
PLAN_VERSION = 1


@dataclass
class LayerCapture:
    """q, k, v of one attention over several inputs."""

    key: str
    is_causal: bool
    scale: float
    samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    skipped: str | None = None  # why this attention cannot be tuned (e.g. it has a bias)


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for a graphopt::attention call: records q, k, v, then computes the attention."""

    def __init__(self, store: dict[str, LayerCapture], key: str, is_causal: bool, scale: float):
        self.store, self.key, self.is_causal, self.scale = store, key, is_causal, scale
        self.__name__ = f"record_attention_{key.replace('.', '_')}"

    def __call__(self, q, k, v, bias, scale, is_causal, num_kv_groups, backend):
        capture = self.store.setdefault(self.key, LayerCapture(self.key, is_causal, scale))
        if bias is not None:
            capture.skipped = "has a bias or padding mask other than causal (the sparse kernel takes none)"
        else:
            capture.samples.append((q.detach(), k.detach(), v.detach()))
        return torch.ops.graphopt.attention.default(q, k, v, bias, scale, is_causal, num_kv_groups, backend)


def capture_attention(model: torch.nn.Module, inputs: Sequence[tuple]) -> dict[str, LayerCapture]:
    """Run `model` on each input tuple and record q, k, v of every matched attention."""
    from graphopt.config import GraphOptConfig
    from graphopt.hardware import get_spec
    from graphopt.passes import run_passes
    from graphopt.passes.sparse_attention import attention_key  # how plans name an attention

    store: dict[str, LayerCapture] = {}
    # force: every matched attention becomes a graphopt::attention node to record, including SDPA
    # calls the attention pass would leave to PyTorch's own dispatch.
    config = GraphOptConfig.from_options({"passes": {name: name == "attention" for name in GraphOptConfig().passes},
                                          "downstream": "eager", "force": True}, environ={})
    hardware = get_spec("auto")

    def backend(gm, example_inputs, **_):
        run_passes(gm, example_inputs, config, hardware)
        index = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in DENSE_ATTENTION_TARGETS:
                q, k, v, bias, scale, is_causal = node.args[:6]
                node.target = _Recorder(store, attention_key(node, index), bool(is_causal), float(scale))
                index += 1
        gm.recompile()
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        for args in inputs:
            compiled(*(args if isinstance(args, (tuple, list)) else (args,)))
    torch._dynamo.reset()
    return store


# ---------------------------------------------------------------------------------------------
# Evaluation of one layer at per-head thresholds
# ---------------------------------------------------------------------------------------------
def _run_sparse(q, k, v, *, is_causal, scale, sim, cdf, pv):
    """(out, kept blocks per head, candidate blocks per head)."""
    mask = sa.predict_block_mask(q, k, is_causal=is_causal, scale=scale, simthreshd1=sim, cdfthreshd=cdf)
    if q.is_cuda:
        lut, counts = sa.block_mask_to_lut(mask)
        out = sa.block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal, scale=scale, pvthreshd=pv)
    else:
        out = sa.block_sparse_attention_reference(q, k, v, mask, is_causal=is_causal, scale=scale, pvthreshd=pv)
    B, H, Lq, _ = q.shape
    total = sa.allowed_block_count(B, 1, Lq, k.shape[2], is_causal, sa.BLOCK_M, sa.BLOCK_N)
    return out, mask.sum(dim=(0, 2, 3)).double(), float(total)


class LayerEvaluator:
    """Relative L1 per head (pooled over samples) and sparsity per head, at per-head thresholds."""

    def __init__(self, capture: LayerCapture):
        self.capture = capture
        self.heads = capture.samples[0][0].shape[1]
        self.dense = [self._dense(q, k, v) for q, k, v in capture.samples]
        self.evaluations = 0

    def _dense(self, q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        return torch.nn.functional.scaled_dot_product_attention(
            q.to(work), k.to(work), v.to(work), is_causal=self.capture.is_causal, scale=self.capture.scale)

    def __call__(self, sim: torch.Tensor, cdf: torch.Tensor, pv: torch.Tensor | None = None, samples=None, dense=None):
        """(pooled L1 per head, worst single-input L1 per head, sparsity per head): float64 (H,) CPU tensors."""
        samples = self.capture.samples if samples is None else samples
        dense = self.dense if dense is None else dense
        err = torch.zeros(self.heads, dtype=torch.float64)
        ref = torch.zeros(self.heads, dtype=torch.float64)
        worst = torch.zeros(self.heads, dtype=torch.float64)
        kept = torch.zeros(self.heads, dtype=torch.float64)
        total = 0.0
        for (q, k, v), d in zip(samples, dense):
            dev = q.device
            out, kept_h, total_h = _run_sparse(q, k, v, is_causal=self.capture.is_causal, scale=self.capture.scale,
                                               sim=sim.to(dev), cdf=cdf.to(dev), pv=None if pv is None else pv.to(dev))
            sample_err = (out.to(d.dtype) - d).abs().sum(dim=(0, 2, 3)).double().cpu()
            sample_ref = d.abs().sum(dim=(0, 2, 3)).double().cpu()
            err += sample_err
            ref += sample_ref
            worst = torch.maximum(worst, sample_err / sample_ref.clamp_min(1e-30))
            kept += kept_h.cpu()
            total += total_h * q.shape[0]
        self.evaluations += 1
        return err / ref.clamp_min(1e-30), worst, 1.0 - kept / total


@dataclass
class HeadPlan:
    simthreshd1: float
    cdfthreshd: float
    pvthreshd: float  # inf = off
    sparsity: float
    l1: float
    pv_l1: float
    dense: bool = False
    heldout_l1: float | None = None  # the largest relative L1 over the held-out inputs
    note: str = ""
    sparsity_found: float = 0.0  # the best sparsity the search found within budget (before any fallback)


def tune_layer(capture: LayerCapture, *, l1: float, pv_l1: float, sim_grid: Iterable[float] = SIM_GRID,
               cdf_steps: int = CDF_STEPS, pv_steps: int = PV_STEPS, min_sparsity: float = MIN_SPARSITY,
               cdf_margin: float = CDF_MARGIN, heldout: list | None = None, advance=None) -> list[HeadPlan]:
    """SpargeAttn's search for one layer, every head at once. `advance()` ticks a progress bar."""
    evaluate = LayerEvaluator(capture)
    H = evaluate.heads
    tick = advance or (lambda: None)
    best_sim = torch.full((H,), -1.0, dtype=torch.float64)
    best_cdf = torch.ones(H, dtype=torch.float64)
    best_sparsity = torch.zeros(H, dtype=torch.float64)
    best_l1 = torch.zeros(H, dtype=torch.float64)
    for sim_value in sim_grid:
        sim = torch.full((H,), float(sim_value))
        # cdfthreshd=1 keeps every block: exact (L1 0) and dense (sparsity 0), so `hi` always passes.
        lo, hi = torch.zeros(H, dtype=torch.float64), torch.ones(H, dtype=torch.float64)
        hi_l1, hi_sparsity = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        for _ in range(cdf_steps):
            mid = (lo + hi) / 2
            err, worst, sparsity = evaluate(sim, mid.float())
            ok = worst < l1
            hi = torch.where(ok, mid, hi)
            lo = torch.where(ok, lo, mid)
            hi_sparsity = torch.where(ok, sparsity, hi_sparsity)
            hi_l1 = torch.where(ok, err, hi_l1)
            tick()
        better = hi_sparsity > best_sparsity + 1e-9
        best_sim = torch.where(better, torch.full_like(best_sim, float(sim_value)), best_sim)
        best_cdf = torch.where(better, hi, best_cdf)
        best_sparsity = torch.where(better, hi_sparsity, best_sparsity)
        best_l1 = torch.where(better, hi_l1, best_l1)
    # Safety margin: drop only `1 - cdf_margin` of the probability mass the calibration inputs
    # tolerated (the error is a step function of the kept set; inputs not seen sit at other steps).
    best_cdf = 1.0 - (1.0 - best_cdf) * (1.0 - cdf_margin)
    sim, cdf = best_sim.float(), best_cdf.float()
    best_l1, _, best_sparsity = evaluate(sim, cdf)
    # PV skipping on top of the chosen mask: the smallest pvthreshd keeping the error under pv_l1.
    lo = torch.full((H,), PV_RANGE[0], dtype=torch.float64)
    hi = torch.full((H,), PV_RANGE[1], dtype=torch.float64)
    err_hi, worst_hi, _ = evaluate(sim, cdf, hi.float())
    hi_ok = worst_hi < pv_l1
    pv_err = torch.where(hi_ok, err_hi, best_l1)
    for _ in range(pv_steps):
        mid = (lo + hi) / 2
        err, worst, _ = evaluate(sim, cdf, mid.float())
        ok = worst < pv_l1
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
        pv_err = torch.where(ok & hi_ok, err, pv_err)
        tick()
    pv = torch.where(hi_ok, hi, torch.full_like(hi, math.inf))
    plans = []
    for h in range(H):
        dense = bool(best_sparsity[h] < min_sparsity)
        plans.append(HeadPlan(
            simthreshd1=-1.0 if dense else float(best_sim[h]), cdfthreshd=1.0 if dense else float(best_cdf[h]),
            pvthreshd=math.inf if dense else float(pv[h]), sparsity=0.0 if dense else float(best_sparsity[h]),
            l1=0.0 if dense else float(best_l1[h]), pv_l1=0.0 if dense else float(pv_err[h]), dense=dense,
            note=f"dense: best sparsity {float(best_sparsity[h]):.1%} < {min_sparsity:.0%}" if dense else "",
            sparsity_found=float(best_sparsity[h])))
    if heldout:
        sim_t = torch.tensor([p.simthreshd1 for p in plans])
        cdf_t = torch.tensor([p.cdfthreshd for p in plans])
        pv_t = torch.tensor([p.pvthreshd for p in plans])
        dense_heldout = [evaluate._dense(*s) for s in heldout]
        # the worst single held-out input, as calibration accepts thresholds (pooled errors let
        # one input over the budget through)
        _, err_mask, _ = evaluate(sim_t, cdf_t, None, samples=heldout, dense=dense_heldout)
        _, err_pv, _ = evaluate(sim_t, cdf_t, pv_t, samples=heldout, dense=dense_heldout)
        for h, p in enumerate(plans):
            p.heldout_l1 = float(err_pv[h]) if math.isfinite(p.pvthreshd) else float(err_mask[h])
            if not p.dense and (float(err_mask[h]) >= l1 or (math.isfinite(p.pvthreshd) and float(err_pv[h]) >= pv_l1)):
                p.note = (f"dense: held-out L1 {float(err_mask[h]):.4f} / with PV skip {float(err_pv[h]):.4f} "
                          "over budget on one input")
                p.simthreshd1, p.cdfthreshd, p.pvthreshd, p.sparsity, p.dense = -1.0, 1.0, math.inf, 0.0, True
                p.heldout_l1 = 0.0
    return plans


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------
def _json_float(x: float):
    return None if not math.isfinite(x) else round(float(x), 6)


def layer_section(capture: LayerCapture, plans: list[HeadPlan]) -> dict[str, Any]:
    q = capture.samples[0][0]
    return {
        "heads": len(plans), "is_causal": capture.is_causal, "seq_len": int(q.shape[2]), "head_dim": int(q.shape[3]),
        "simthreshd1": [_json_float(p.simthreshd1) for p in plans],
        "cdfthreshd": [_json_float(p.cdfthreshd) for p in plans],
        "pvthreshd": [_json_float(p.pvthreshd) for p in plans],  # null: PV skipping off
        "dense": [p.dense for p in plans],
        "sparsity": [_json_float(p.sparsity) for p in plans],
        "l1": [_json_float(p.l1) for p in plans],
        "pv_l1": [_json_float(p.pv_l1) for p in plans],
        "heldout_l1": [None if p.heldout_l1 is None else _json_float(p.heldout_l1) for p in plans],
        "mean_sparsity": _json_float(sum(p.sparsity for p in plans) / len(plans)),
    }


def tune_captures(captures: dict[str, LayerCapture], *, l1: float = 0.06, pv_l1: float = 0.07,
                  heldout: dict[str, LayerCapture] | None = None, sim_grid: Iterable[float] = SIM_GRID,
                  min_sparsity: float = MIN_SPARSITY, show: bool = True) -> dict[str, Any]:
    """Tune every captured layer; returns the plan section {"version", ..., "layers": {key: ...}}."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    sim_grid = tuple(sim_grid)
    tunable = {k: c for k, c in captures.items() if c.samples and c.skipped is None}
    console = Console(stderr=True, quiet=not show)
    for key, c in captures.items():
        if key not in tunable:
            console.print(f"[yellow]skipping {key}: {c.skipped or 'no samples'}")
    steps_per_layer = len(sim_grid) * CDF_STEPS + PV_STEPS
    section: dict[str, Any] = {"version": PLAN_VERSION, "block_m": sa.BLOCK_M, "block_n": sa.BLOCK_N, "l1": l1,
                               "pv_l1": pv_l1, "layers": {}}
    results: dict[str, list[HeadPlan]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show) as progress:
        task = progress.add_task("tuning sparse attention", total=steps_per_layer * len(tunable))
        for key, capture in tunable.items():
            progress.update(task, description=f"tuning {key}")
            held = heldout.get(key).samples if heldout and key in heldout and heldout[key].samples else None
            plans = tune_layer(capture, l1=l1, pv_l1=pv_l1, sim_grid=sim_grid, min_sparsity=min_sparsity,
                               heldout=held, advance=lambda: progress.advance(task))
            results[key] = plans
            section["layers"][key] = layer_section(capture, plans)
    if show:
        print_summary(results, l1=l1, pv_l1=pv_l1)
    advice = all_dense_advice(results, tunable, l1=l1, min_sparsity=min_sparsity)
    if advice:
        section["note"] = advice
        log.warning(advice)
        if show:
            console.print(f"[yellow]{advice}")
    return section


def all_dense_advice(results: dict[str, list[HeadPlan]], captures: dict[str, LayerCapture], *, l1: float,
                     min_sparsity: float) -> str | None:
    """Why a plan keeps every head dense, and what to change: None when some head is sparse."""
    heads = [p for plans in results.values() for p in plans]
    if not heads or any(not p.dense for p in heads):
        return None
    held_out = sum(p.note.startswith("dense: held-out") for p in heads)
    best = max((p.sparsity_found for p in heads), default=0.0)
    lengths = sorted({c.samples[0][0].shape[2] for c in captures.values() if c.samples})
    blocks = ", ".join(f"at {n} tokens a head has {-(-n // sa.BLOCK_M)} x {-(-n // sa.BLOCK_N)} blocks of "
                       f"{sa.BLOCK_M} x {sa.BLOCK_N} to choose from" for n in lengths)
    reasons = []
    if held_out < len(heads):
        reasons.append(f"{len(heads) - held_out} head(s) found at most {best:.1%} of their blocks skippable within "
                       f"L1 {l1}, under --min-sparsity {min_sparsity:.0%}")
    if held_out:
        reasons.append(f"{held_out} head(s) went over the budget on the held-out inputs")
    return (f"every head of the plan is dense, so sparse_attention will rewrite nothing: {'; '.join(reasons)}. "
            f"{blocks[:1].upper()}{blocks[1:]}. To try: longer sequences "
            f"(--seq-len; sparsity grows with length), a looser budget (--l1 {2 * l1:g}), a lower --min-sparsity, or "
            f"more --calibration inputs if the held-out check failed")


def print_summary(results: dict[str, list[HeadPlan]], *, l1: float, pv_l1: float, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sparse attention plan (budget: L1 < {l1}, with PV skipping < {pv_l1})")
    for column in ("layer", "head", "sim1", "cdf", "pv", "sparsity", "L1", "L1 +PV", "held-out L1", "note"):
        table.add_column(column, justify="right" if column not in ("layer", "note") else "left", no_wrap=column == "layer")
    for key, plans in results.items():
        for h, p in enumerate(plans):
            held = "-" if p.heldout_l1 is None else f"{p.heldout_l1:.4f}"
            table.add_row(key, str(h), f"{p.simthreshd1:.2f}", f"{p.cdfthreshd:.4f}",
                          "off" if not math.isfinite(p.pvthreshd) else f"{p.pvthreshd:.1f}",
                          f"{p.sparsity:.1%}", f"{p.l1:.4f}", f"{p.pv_l1:.4f}", held, p.note)
        mean = sum(p.sparsity for p in plans) / len(plans)
        table.add_row(key, "all", "", "", "", f"{mean:.1%}", "", "", "", "", end_section=True)
    (console or Console(width=160)).print(table)


def tune(model: torch.nn.Module, calibration_inputs: Sequence, l1: float = 0.06, pv_l1: float = 0.07, *,
         heldout_inputs: Sequence | None = None, plan_path=None, sim_grid: Iterable[float] = SIM_GRID,
         min_sparsity: float = MIN_SPARSITY, show: bool = True) -> dict[str, Any]:
    """Tune per-head thresholds of every attention of `model` (see the module docstring).

    calibration_inputs / heldout_inputs: sequences of argument tuples for `model(*args)`.
    Returns the plan section; with `plan_path`, also writes (merges) it into that plan file."""
    if not calibration_inputs:
        raise ValueError("tune needs at least one calibration input (a sequence of argument tuples)")
    captures = capture_attention(model, calibration_inputs)
    if not captures:
        raise ValueError("no attention was matched in the model (the attention pass found no softmax attention "
                         "to capture; models must use hand-written/eager attention)")
    heldout = capture_attention(model, heldout_inputs) if heldout_inputs else None
    section = tune_captures(captures, l1=l1, pv_l1=pv_l1, heldout=heldout, sim_grid=sim_grid,
                            min_sparsity=min_sparsity, show=show)
    if plan_path is not None:
        from graphopt.plan import save_plan

        save_plan(plan_path, {"sparse_attention": section})
    return section


# ---------------------------------------------------------------------------------------------
# CLI: `graphopt tune ...`
# ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama",
                        help="built-in model name (graphopt.models) or module:function returning (model, inputs)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: per model)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--calibration", type=int, default=2, help="calibration inputs (default 2)")
    parser.add_argument("--heldout", type=int, default=1, help="held-out inputs to check the budget on (default 1)")
    parser.add_argument("--l1", type=float, default=0.06, help="relative L1 budget per head (default 0.06)")
    parser.add_argument("--pv-l1", type=float, default=0.07, help="budget with PV skipping (default 0.07)")
    parser.add_argument("--min-sparsity", type=float, default=MIN_SPARSITY,
                        help=f"heads below this sparsity stay dense (default {MIN_SPARSITY})")
    parser.add_argument("--sim-grid", default=",".join(str(x) for x in SIM_GRID),
                        help=f"comma-separated simthreshd1 values to search (default {','.join(str(x) for x in SIM_GRID)})")
    parser.add_argument("--out", default="plan.json", help="plan file to write or merge into (default plan.json)")


def _inputs_for(args: argparse.Namespace, count: int, seed_offset: int) -> tuple[torch.nn.Module | None, list]:
    from graphopt.models import build

    model, inputs = None, []
    for i in range(count):
        # the same weights every time; the token ids differ per input and between the sets
        m, x = build(args.model, seq_len=args.seq_len, batch=args.batch, device=args.device,
                     input_seed=1000 * seed_offset + i)
        model = model or m
        inputs.append(tuple(x))
    return model, inputs


def _check_arguments(args: argparse.Namespace) -> None:
    """Clear errors for values the tuner would otherwise trip over later, or silently replace."""
    if args.device is not None:
        from graphopt.cli import check_device

        check_device(args.device, "--device")
    for name, value, least in (("--calibration", args.calibration, 1), ("--heldout", args.heldout, 0),
                               ("--batch", args.batch, 1), ("--seq-len", args.seq_len, 1)):
        if value is not None and value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    for name, value in (("--l1", args.l1), ("--pv-l1", args.pv_l1)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive relative L1 budget, got {value}")
    if not 0 <= args.min_sparsity <= 1:
        raise ValueError(f"--min-sparsity must lie in [0, 1], got {args.min_sparsity}")


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    model, calibration = _inputs_for(args, args.calibration, 1)
    _, heldout = _inputs_for(args, args.heldout, 2) if args.heldout > 0 else (None, [])
    if heldout and all(all(torch.equal(a, b) for a, b in zip(h, calibration[0])) for h in heldout):
        print(f"note: {args.model} builds the same inputs every time; the held-out check repeats the calibration data")
    try:
        sim_grid = tuple(float(x) for x in args.sim_grid.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--sim-grid must be comma-separated numbers, got {args.sim_grid!r}") from exc
    tune(model, calibration, l1=args.l1, pv_l1=args.pv_l1, heldout_inputs=heldout or None, plan_path=args.out,
         min_sparsity=args.min_sparsity, sim_grid=sim_grid)
    print(f"wrote plan {args.out}")
    return 0


__all__ = ["tune", "tune_captures", "tune_layer", "capture_attention", "LayerCapture", "HeadPlan", "add_arguments", "run"]
