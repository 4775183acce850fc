"""Shared parts of the end-to-end LLaMA decode benchmarks (bench_generate.py, bench_decode_loop.py).

- SHAPES: LLaMA-3.2-1B and LLaMA-3-8B with random weights, and a tiny shape for CPU smoke runs;
- the variants and their torch.compile arguments (Inductor, graphopt with and without its lossy
  linear passes) and the gpt-fast int4 weight-only baseline (aten's tinygemm int4 kernel);
- DecodeLoop, gpt-fast's loop: a StaticCache filled by the plain model, then a one-token step in
  a Python loop;
- the shared command line, timing helpers, token agreement and the JSON result.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import inspect
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from bench.common import comma_ints, environment, print_table

_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_parameters=_ROPE),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_parameters=_ROPE),
}
VARIANTS: tuple[str, ...] = ("eager", "inductor", "int4", "graphopt", "graphopt-fp4", "graphopt-q4")
# ablations, run only when named: fp4_linear without its decode fusion (fuse_decode_neighbours=False)
ABLATIONS: tuple[str, ...] = ("graphopt-fp4-unfused",)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
INT4_GROUP = 128  # gpt-fast's default groupsize
INT4_INNER_K_TILES = 8


def arguments(doc: str) -> argparse.ArgumentParser:
    """The command line both scripts take, described by the script's first docstring line."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default 1b,8b; tiny on CPU)")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda or cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list (default all)")
    parser.add_argument("--modes", default="reduce-overhead", help="torch.compile modes of every compiled variant, comma list")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens")
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma list")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (the median is reported)")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="HF attention implementation")
    parser.add_argument("--force", action="store_true", help="graphopt-fp4/q4 with force=True: every enabled pass rewrites "
                        "every match whatever the cost model says (on CPU, the way to exercise the rewritten ops)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<script>_<gpu>.json)")
    return parser


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill in the device-dependent defaults and split the comma lists; bad names fail here."""
    opts.device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    opts.dtype = torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    if opts.device == "cpu":  # Inductor's OpenMP kernels spinning beside aten's threads slowed eager linears 50x
        torch.set_num_threads(1)
    opts.shapes = (opts.shapes or ("1b,8b" if opts.device.startswith("cuda") else "tiny")).split(",")
    opts.variants = opts.variants.split(",")
    opts.modes = opts.modes.split(",")
    opts.batch = comma_ints(opts.batch)
    for name, values, valid in (("shape", opts.shapes, SHAPES), ("variant", opts.variants, VARIANTS + ABLATIONS)):
        bad = [v for v in values if v not in valid]
        if bad:
            raise SystemExit(f"unknown {name} {bad}; valid choices: {', '.join(valid)}")
    if opts.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (decode speed is measured past the first token)")
    return opts


def build_model(shape: str, device: str, dtype: torch.dtype, attn: str = "sdpa", seed: int = 0,
                layers: int | None = None) -> nn.Module:
    """LlamaForCausalLM of `shape` with random weights (from `seed`), in eval mode; `layers`
    overrides the number of decoder layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    widths = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**widths, max_position_embeddings=8192, attn_implementation=attn)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: the 8B model in fp32 on the host would take minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def random_prompt(model: nn.Module, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(model.device)


def compile_kwargs(variant: str, mode: str, force: bool) -> dict[str, Any] | None:
    """torch.compile's backend and mode of a variant (None: eager). int4 is Inductor over the
    int4 model (int4_weights)."""
    if variant == "eager":
        return None
    if variant in ("inductor", "int4"):
        return dict(backend="inductor", mode=mode)
    import graphopt

    lossy = {"force": True} if force else {}
    options = {"graphopt": {}, "graphopt-fp4": dict(passes={"fp4_linear": True}, **lossy),
               "graphopt-q4": dict(passes={"q4_linear": True}, **lossy),
               "graphopt-fp4-unfused": dict(passes={"fp4_linear": True}, fuse_decode_neighbours=False, **lossy),
               # tensor-parallel models (bench_tensor_parallel.py): DTensor's all-reduces as graphopt::all_reduce
               "graphopt-allreduce": dict(passes={"all_reduce": True}, **lossy),
               "graphopt-fp4-allreduce": dict(passes={"fp4_linear": True, "all_reduce": True}, **lossy)}[variant]
    return dict(backend=graphopt.backend(**options), mode=mode)


def runs(variants: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(variant, mode) pairs: eager once and first (the reference of token agreement), every
    compiled variant once per mode."""
    pairs = [("eager", "-")] if "eager" in variants else []
    return pairs + [(v, m) for m in modes for v in variants if v != "eager"]


def int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-fast's asymmetric int4 of a weight (N, K) in groups of `group` inputs (see Int4Linear):
    int32 q (N, K) in 0..15 and fp32 scale and zero (N * K / group, 1), rounded to w's dtype."""
    n, k = w.shape
    groups = w.float().reshape(-1, group)
    lo, hi = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(w.dtype).float()
    zero = (lo + 8 * scale).to(w.dtype).float()
    q = ((groups - (zero - 8 * scale)) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, zero


def int4_dequantized(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The fp32 weight tinygemm computes with for int4_groups(w, group)."""
    q, scale, zero = int4_groups(w, group)
    return ((q.reshape(-1, group) - 8) * scale + zero).reshape(w.shape)


class Int4Linear(nn.Module):
    """gpt-fast's WeightOnlyInt4Linear: 4-bit weights, asymmetric, a scale and a zero per group of
    INT4_GROUP input features, run by aten's tinygemm kernel (_weight_int4pack_mm). Packing: the
    group's min/max give scale = (max - min) / 15 and zero = min + 8 * scale (both cast to the
    activation dtype first), q = (w - (zero - 8 * scale)) / scale to the nearest integer in 0..15,
    and the kernel computes w = (q - 8) * scale + zero; scales and zeros travel as one
    [K / group, N, 2] tensor. On CPU, aten's _for_cpu twins of the two ops run it, so the smoke
    run covers this variant too."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        assert linear.bias is None, "LLaMA linears have no bias"
        w = linear.weight.detach()
        n, k = w.shape
        self.out_features, self.group = n, min(INT4_GROUP, k)  # only the tiny shape has k < 128
        q, scale, zero = int4_groups(w, self.group)
        self.register_buffer("scales_and_zeros", torch.stack([scale.reshape(n, -1), zero.reshape(n, -1)], -1)
                             .transpose(0, 1).contiguous().to(w.dtype))
        self.register_buffer("packed", self._pack(q, int4_dequantized(w, self.group).to(w.dtype)))

    def _pack(self, q: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """The packed weight in the form this torch takes, checked against the dequantized weight:
        torch >= 2.5 on CUDA takes uint8 [N, K/2] (two values a byte, the even column in the high
        nibble), older torch the int32 [N, K] values; CPU has its own op taking int32."""
        if q.device.type == "cpu":
            forms = [lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)]
        else:
            forms = [lambda: torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                       INT4_INNER_K_TILES),
                     lambda: torch.ops.aten._convert_weight_to_int4pack(q, INT4_INNER_K_TILES)]
        x = torch.randn(4, q.shape[1], device=q.device, dtype=reference.dtype)
        expected = x.float() @ reference.float().T
        for form in forms:
            try:
                packed = form()
                got = self._mm(x, packed).float()
            except RuntimeError:  # this torch does not take this form
                continue
            if ((got - expected).norm() / expected.norm()).item() < 2e-2:
                return packed
        raise RuntimeError("no int4 packing form of this torch reproduces the dequantized weight")

    def _mm(self, x2d: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        if x2d.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x2d, packed, self.group, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, packed, self.group, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x.reshape(-1, x.shape[-1]), self.packed).reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def int4_weights(model: nn.Module) -> Iterator[nn.Module]:
    """The model with every nn.Linear of its decoder layers (not lm_head, not the embeddings) an
    Int4Linear, as gpt-fast quantizes; the bf16 linears are put back on exit."""
    swapped = []
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear):
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name)
                swapped.append((parent, child, module))
                setattr(parent, child, Int4Linear(module))
    try:
        yield model
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


def sweep(opts: argparse.Namespace, measure: Callable, title: str, columns: list[str], name: str) -> list[dict]:
    """Every shape, batch and (variant, mode) of `opts`: measure(model, prompt, opts, variant, mode)
    gives a row and the greedy tokens, run under no_grad with the int4 linears in place for int4.
    Prints a table per shape and batch; writes the rows so far with write_result(name, ...) after
    each variant (a run cut short keeps what it measured) and at the end; returns all the rows."""
    rows: list[dict] = []
    for shape in opts.shapes:
        model = build_model(shape, opts.device, opts.dtype, opts.attn)  # one model for every variant (8B: 16 GB)
        for batch in opts.batch:
            prompt = random_prompt(model, batch, opts.prompt)
            reference, table = None, []
            for variant, mode in runs(opts.variants, opts.modes):
                fresh_start(opts.device, model)
                base = {"shape": shape, "batch": batch, "variant": variant, "mode": mode}
                try:
                    with int4_weights(model) if variant == "int4" else contextlib.nullcontext(), torch.no_grad():
                        row, tokens = measure(model, prompt, opts, variant, mode)
                except Exception as exc:  # noqa: BLE001 - reported in its row; the other variants still run
                    print(f"FAIL {shape} batch {batch} {variant} {mode}: {type(exc).__name__}: {exc}", flush=True)
                    table.append({**base, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                reference = tokens if variant == "eager" else reference
                try:
                    with torch.no_grad():  # the plain bf16 model, the int4 linears gone again
                        scores = choice_regret(model, prompt, tokens)
                except Exception as exc:  # noqa: BLE001 - the row keeps its timings without the scores
                    print(f"no regret for {shape} batch {batch} {variant}: {type(exc).__name__}: {exc}", flush=True)
                    scores = {"regret": None, "top1": None}
                table.append({**base, **row, **agreement(tokens, reference), **scores})
                print(f"{shape} batch {batch} {variant} {mode}: {row['tok_s'] or 0:.1f} tok/s", flush=True)
                write_result(name, opts, rows + table)
            fresh_start(opts.device, model)
            add_ratios(table, "tok_s", opts.modes)
            print_table(f"{title}, LLaMA {shape}, batch {batch}, prompt {opts.prompt}, {opts.new_tokens} new tokens, "
                        f"attn {opts.attn}", table, columns)
            rows += table
        del model
        fresh_start(opts.device)
    write_result(name, opts, rows)
    return rows


def rewrite_summary(decisions) -> str:
    """The rewrites graphopt applied, as 'pass[implementation] xN' (e.g. attention[triton_decode] x32), or '-'."""
    counts = collections.Counter(f"{d.pass_name}[{d.implementation}]" if d.implementation else d.pass_name
                                 for d in decisions if d.applied)
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "-"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """fn's result and its wall time in seconds, the device's queue drained on both sides."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def fresh_start(device: str, model: nn.Module | None = None) -> None:
    """Forget every compiled graph (Dynamo caches, CUDA-graph trees, generate's compiled call) and
    start a new peak-memory count, so each variant compiles and is measured on its own."""
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config"):  # generate's cached torch.compile of __call__
        if model is not None and hasattr(model, attr):
            delattr(model, attr)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None


def agreement(tokens: torch.Tensor, reference: torch.Tensor | None) -> dict[str, Any]:
    """The fraction of greedy tokens equal to the reference's, position by position, and whether
    all are (with random weights the top logits are close, so any numeric change can flip one and
    the sequences part from there)."""
    if reference is None:
        return {"agree": None, "identical": None}
    same = tokens.cpu() == reference.cpu()
    return {"agree": same.float().mean().item(), "identical": bool(same.all())}


def choice_regret(model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """How good each greedy token a variant chose is under the plain (uncompiled) model, on the
    variant's own prefix: one forward over the prompt and its tokens gives the logits at every
    decode position. regret: (the top logit - the chosen token's) / the logits' standard deviation,
    averaged over positions: 0 when every choice is the plain model's own, a few units for random
    choices (a kernel computing garbage), small for a lossy but working one. top1: the share of
    choices that are the plain model's argmax. `agree` compares whole sequences, which random
    weights (nearly tied top logits) part early; this scores each choice on its own. The first
    token comes from the uncompiled prefill in both loops, so it is not scored."""
    if tokens.shape[1] < 2:
        return {"regret": None, "top1": None}
    sequence = torch.cat([prompt, tokens[:, :-1].to(prompt.device)], 1)
    logits = model(input_ids=sequence, use_cache=False, logits_to_keep=tokens.shape[1] - 1).logits.float()
    chosen = logits.gather(-1, tokens[:, 1:].to(logits.device).unsqueeze(-1)).squeeze(-1)
    best = logits.max(-1).values
    regret = (best - chosen) / logits.std(-1)
    return {"regret": regret.mean().item(), "top1": (chosen >= best).float().mean().item()}


def add_ratios(rows: list[dict], key: str, modes: list[str]) -> None:
    """vs_inductor and vs_int4: row[key] over that of the inductor / int4 row of the same shape,
    batch and mode (eager's against the first mode)."""
    for row in rows:
        mode = row["mode"] if row["mode"] in modes else modes[0]
        for base in ("inductor", "int4"):
            ref = next((r for r in rows if r["variant"] == base and r["mode"] == mode and r["shape"] == row["shape"]
                        and r["batch"] == row["batch"] and r.get(key)), None)
            row[f"vs_{base}"] = row[key] / ref[key] if ref and row.get(key) else None


def gpu_slug() -> str:
    """'h100' for 'NVIDIA H100 80GB HBM3': the first word of the device name with a digit in it."""
    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name(0).replace("NVIDIA", "").split()
    return next((w.lower() for w in words if re.search(r"\d", w)), "_".join(words).lower() or "gpu")


def write_result(name: str, opts: argparse.Namespace, rows: list[dict]) -> Path:
    """The rows, the options and the environment as JSON at opts.out, default
    bench/results/<name>_<gpu>.json."""
    path = Path(opts.out) if opts.out else Path(__file__).parent / "results" / f"{name}_{gpu_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {k: str(v) for k, v in vars(opts).items()}
    path.write_text(json.dumps({"environment": environment(), "options": options, "rows": rows}, indent=2, default=str))
    print(f"wrote {path}")
    return path


def cache_argument(model: nn.Module) -> str:
    """The name forward and generate take a cache by: `past_key_values` up to transformers 5.17,
    `cache` later."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class DecodeLoop:
    """gpt-fast style greedy decoding of `new_tokens` tokens: the plain model fills a StaticCache
    from the prompt and gives the first token, then `new_tokens - 1` calls of a one-token step
    (torch.compile'd with `compile_kwargs`, or eager when None) in a Python loop. The cache and
    the position tensors are made once, so a CUDA-graph tree records once and then replays."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, new_tokens: int, compile_kwargs: dict | None,
                 skip_guard_eval: bool = False):
        from transformers import StaticCache

        self.model, self.prompt = model, prompt
        batch, length = prompt.shape
        # StaticCache(config, max_cache_len) in transformers 5.x; it sizes itself at the first update
        self.cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
        self.cache_arg = cache_argument(model)
        self.positions = [torch.full((batch, 1), length + i, dtype=torch.long, device=prompt.device)
                          for i in range(new_tokens - 1)]
        self.step = torch.compile(self._forward, **compile_kwargs) if compile_kwargs else self._forward
        self.graphs = bool(compile_kwargs) and compile_kwargs.get("mode") in CUDA_GRAPH_MODES
        # Dynamo's guards run in Python at every step (a DTensor parameter's spec check among them);
        # skip_guard_eval: after the first decode, steps run under set_stance(skip_guard_eval_unsafe=True)
        self.skip_guard_eval, self.warm = skip_guard_eval, False

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **{self.cache_arg: self.cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def run(self, device: str) -> tuple[torch.Tensor, float]:
        """(batch, new_tokens) greedy tokens, and the seconds of the decode steps (prefill excluded)."""
        return self.decode(self.prefill(), device)

    def prefill(self) -> torch.Tensor:
        """Empty the cache, fill it from the prompt and return the first token."""
        self.cache.reset()
        return self._forward(self.prompt, None)

    def decode(self, token: torch.Tensor, device: str) -> tuple[torch.Tensor, float]:
        """The decode steps from the first token: all the tokens and the steps' seconds."""
        warm, self.warm = self.warm, True
        if self.skip_guard_eval and warm:  # compiled and recorded: no guard can fail in this loop
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._decode(token, device)
        return self._decode(token, device)

    def _decode(self, token: torch.Tensor, device: str) -> tuple[torch.Tensor, float]:
        tokens = [token]
        synchronize(device)
        start = time.perf_counter()
        for position in self.positions:
            if self.graphs:  # one inference step per call: the tree may reuse the last output's memory
                torch.compiler.cudagraph_mark_step_begin()
            token = self.step(token, position).clone()
            tokens.append(token)
        synchronize(device)
        return torch.cat(tokens, 1), time.perf_counter() - start
