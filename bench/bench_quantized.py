"""Quantized models in place (graphopt.quantize_): memory, quantization time, load and first-token time, compile time.

LLaMA-3-8B shape (bench/llama_models.py SHAPES["8b"], random weights), bf16, batch 1, on one GPU.

In this process:
- the bf16 model, built on the GPU, saved with save_pretrained to a scratch directory;
- per format (nvfp4, mxfp4, q4_0): a copy quantized by graphopt.quantize_ (every linear, lm_head
  included), timed between device synchronizations (quantize_s), its resident weights
  (weights_gb: bytes of every parameter and buffer; ratio_vs_bf16), saved by save_quantized
  (save_s, file_gb).
In a fresh subprocess per row (--rows), with empty Inductor and graphopt caches, timed from just
before the process starts:
- load: "bf16" (from_pretrained of the bf16 directory: with device_map where accelerate is
  installed, else to the host and then moved; dense_load says which), "saved-<fmt>" (load_quantized of that
  file), "quantize-<fmt>" (the bf16 directory, then quantize_);
- ttft_s: process start to the first generated token (generate, prompt --prompt, one new token,
  static cache, uncompiled); vs_bf16: over the bf16 row's;
- resident_gb: torch.cuda.memory_allocated after loading; peak_gb: max_memory_allocated during
  generate of --new-tokens tokens (static cache, uncompiled: the memory the weights, the cache
  and the activations take);
- compile (optional per row): llama_models.DecodeLoop's one-token step compiled with that
  backend (inductor; graphopt, the pass of the row's format on), compile_s = the first compiled
  step minus the median of the next five; graphopt rows also report how many quantized layers
  the pass kept and how many it quantized at compile time; vs_inductor: over the inductor row of
  the same load.
Rows run in the order given and stop before the --budget-s of wall time would be passed (a row
that would not fit is recorded as skipped), so the whole run fits the device's 10-minute limit.

    python bench/bench_quantized.py                       # 8B shape on the GPU, within --budget-s (500 s)
    python bench/bench_quantized.py --layers 8            # the same rows on an 8-layer 8B-wide model
    python bench/bench_quantized.py --shape tiny --prompt 16 --new-tokens 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script, bench/ is sys.path[0]; `bench.*` and `graphopt` live at the root
    sys.path.insert(0, REPO)

FORMATS = ("nvfp4", "mxfp4", "q4_0")
PASS_OF = {"nvfp4": "fp4_linear", "mxfp4": "fp4_linear", "q4_0": "q4_linear"}
# load:compile ("-" for no compile); the order is the order of importance, the budget cuts the tail.
DEFAULT_ROWS = ("bf16:inductor,saved-nvfp4:inductor,saved-nvfp4:graphopt,quantize-nvfp4:-,saved-q4_0:graphopt,"
                "saved-mxfp4:-,bf16:graphopt-fp4,bf16:graphopt-q4")
# Wall time of one 8B row's process on an H200 (load, first token, compile, step timing, generate), above
# the load and compile times the rows record: a row the budget starts has to finish, or its device
# time is lost.
ROW_ESTIMATE_S = {"-": 60, "inductor": 170, "graphopt": 210, "graphopt-fp4": 240, "graphopt-q4": 240}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help="8b (default on a GPU) or tiny (default on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--formats", default=",".join(FORMATS), help="formats quantized in this process")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="subprocess rows, comma list of load:compile; load is bf16, "
                        "saved-<fmt> or quantize-<fmt>; compile is -, inductor, graphopt (the pass of the load's format), "
                        "graphopt-fp4 or graphopt-q4")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated for the peak-memory run")
    parser.add_argument("--mode", default="default", help="torch.compile mode of the compile rows")
    parser.add_argument("--budget-s", type=float, default=500.0, help="wall time the run stays under")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/quantized_<gpu>.json)")
    opts = parser.parse_args()
    return opts


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    import torch

    opts.device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    opts.shape = opts.shape or ("8b" if opts.device == "cuda" else "tiny")
    opts.dtype = "bfloat16" if opts.device == "cuda" else "float32"
    opts.formats = opts.formats.split(",")
    opts.rows = [tuple(r.split(":")) for r in opts.rows.split(",") if r]
    for fmt in opts.formats:
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; valid choices: {', '.join(FORMATS)}")
    for row in opts.rows:
        load, compile_with = row if len(row) == 2 else (row[0], "")
        fmt = load.split("-", 1)[1] if "-" in load else None
        if len(row) != 2 or not (load == "bf16" or (load.split("-")[0] in ("saved", "quantize") and fmt in opts.formats)) \
                or compile_with not in ROW_ESTIMATE_S:
            raise SystemExit(f"bad row {':'.join(row)!r}: load is bf16 or saved-/quantize-<one of {opts.formats}>, compile "
                             f"one of {', '.join(ROW_ESTIMATE_S)}")
    return opts


def weights_gb(model) -> float:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 1e9


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# This process: build, quantize, save
# ------------------------------------------------------------------------------------------------
def prepare(opts, scratch: str) -> list[dict]:
    import torch

    import graphopt
    from bench.llama_models import build_model

    rows = []
    model = build_model(opts.shape, opts.device, getattr(torch, opts.dtype), layers=opts.layers)
    bf16_gb = weights_gb(model)
    start = time.perf_counter()
    model.save_pretrained(os.path.join(scratch, "bf16"))
    rows.append({"section": "quantize", "format": opts.dtype, "weights_gb": bf16_gb, "ratio_vs_bf16": 1.0,
                 "save_s": time.perf_counter() - start})
    print(f"{opts.dtype}: {bf16_gb:.2f} GB of weights", flush=True)
    for fmt in opts.formats:
        quantized = copy.deepcopy(model)
        synchronize(opts.device)
        start = time.perf_counter()
        graphopt.quantize_(quantized, format=fmt)
        synchronize(opts.device)
        quantize_s = time.perf_counter() - start
        gb = weights_gb(quantized)
        start = time.perf_counter()
        path = graphopt.save_quantized(quantized, os.path.join(scratch, f"{fmt}.safetensors"))
        save_s = time.perf_counter() - start
        rows.append({"section": "quantize", "format": fmt, "quantize_s": quantize_s, "weights_gb": gb,
                     "ratio_vs_bf16": gb / bf16_gb, "save_s": save_s, "file_gb": path.stat().st_size / 1e9})
        print(f"{fmt}: quantized in {quantize_s:.2f} s, {gb:.2f} GB ({gb / bf16_gb:.3f}x)", flush=True)
        del quantized
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_rows(opts, scratch: str, deadline: float) -> list[dict]:
    rows = []
    for load, compile_with in opts.rows:
        estimate = ROW_ESTIMATE_S[compile_with] * (1 if opts.shape == "8b" else 0.3)
        base = {"section": "process", "load": load, "compile": compile_with}
        if time.monotonic() + estimate > deadline:
            rows.append({**base, "error": f"skipped: would pass the {opts.budget_s:.0f} s budget"})
            print(f"skip {load}:{compile_with} (budget)", flush=True)
            continue
        spec = {"load": load, "compile": compile_with, "scratch": scratch, "device": opts.device, "dtype": opts.dtype,
                "prompt": opts.prompt, "new_tokens": opts.new_tokens, "mode": opts.mode}
        caches = tempfile.mkdtemp(prefix="caches_", dir=scratch)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
               "GRAPHOPT_CACHE_DIR": os.path.join(caches, "graphopt"), "TRITON_CACHE_DIR": os.path.join(caches, "triton")}
        spec["t0"] = time.time()
        try:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                                 capture_output=True, text=True, timeout=max(10.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rows.append({**base, "error": f"stopped at the {opts.budget_s:.0f} s budget"})
            print(f"stopped {load}:{compile_with} (budget)", flush=True)
            continue
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            rows.append({**base, "error": (run.stderr or run.stdout)[-400:]})
            print(f"FAIL {load}:{compile_with}\n{run.stderr[-2000:]}", flush=True)
            continue
        row = {**base, **json.loads(lines[-1][len("RESULT "):])}
        rows.append(row)
        print(f"{load}:{compile_with}: ttft {row['ttft_s']:.2f} s, resident {row['resident_gb']}, peak {row['peak_gb']}, "
              f"compile {row.get('compile_s')}", flush=True)
    bf16 = next((r for r in rows if r["load"] == "bf16" and "ttft_s" in r), None)
    for row in rows:
        if "ttft_s" in row and bf16 is not None:
            row["vs_bf16"] = row["ttft_s"] / bf16["ttft_s"]
        inductor = next((r for r in rows if r["load"] == row["load"] and r["compile"] == "inductor" and r.get("compile_s")),
                        None)
        if row.get("compile_s") and inductor:
            row["vs_inductor"] = row["compile_s"] / inductor["compile_s"]
    return rows


# ------------------------------------------------------------------------------------------------
# A subprocess row
# ------------------------------------------------------------------------------------------------
def child(spec: dict) -> None:
    import importlib.util

    import torch
    from transformers import AutoConfig

    import graphopt

    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    bf16_dir = os.path.join(spec["scratch"], "bf16")
    kind, _, fmt = spec["load"].partition("-")
    if kind == "saved":
        model = graphopt.load_quantized(AutoConfig.from_pretrained(bf16_dir), os.path.join(spec["scratch"], f"{fmt}.safetensors"),
                                        device=device)
    else:
        model = load_dense(bf16_dir, dtype, device)
        if kind == "quantize":
            graphopt.quantize_(model, format=fmt)
    model.requires_grad_(False)
    prompt = torch.randint(0, model.config.vocab_size, (1, spec["prompt"]), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    def generate(n: int):
        return model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static", eos_token_id=None,
                              pad_token_id=0, disable_compile=True)

    with torch.no_grad():
        generate(1)
        synchronize(device)
        ttft = time.time() - spec["t0"]
        resident = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        generate(spec["new_tokens"])
        synchronize(device)
        peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
        result = {"ttft_s": ttft, "resident_gb": resident, "peak_gb": peak, "weights_gb": weights_gb(model),
                  "dense_load": "device_map" if importlib.util.find_spec("accelerate") else "host, then moved"}
        if spec["compile"] != "-":
            result.update(compile_time(model, prompt, spec, fmt))
    print("RESULT " + json.dumps(result), flush=True)


def load_dense(directory: str, dtype, device: str):
    """from_pretrained straight to the device (device_map, which needs accelerate), else to the host
    and then moved."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, device_map=device).eval()
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def compile_time(model, prompt, spec: dict, fmt: str) -> dict:
    import graphopt
    from bench.llama_models import DecodeLoop
    from graphopt.compiler import recording_decisions

    backend = spec["compile"]
    if backend == "inductor":
        kwargs = {"backend": "inductor"}
    else:
        name = {"graphopt": PASS_OF.get(fmt, "fp4_linear"), "graphopt-fp4": "fp4_linear", "graphopt-q4": "q4_linear"}[backend]
        kwargs = {"backend": graphopt.backend(passes={name: True})}
    if spec["mode"] != "default":
        kwargs["mode"] = spec["mode"]
    loop = DecodeLoop(model, prompt, 8, kwargs)
    token = loop.prefill()
    steps = []
    with recording_decisions() as decisions:
        for position in loop.positions:
            if loop.graphs:
                import torch

                torch.compiler.cudagraph_mark_step_begin()
            synchronize(spec["device"])
            start = time.perf_counter()
            token = loop.step(token, position).clone()
            synchronize(spec["device"])
            steps.append(time.perf_counter() - start)
    out = {"compile_s": steps[0] - statistics.median(steps[1:]), "step_ms": statistics.median(steps[1:]) * 1e3}
    if backend != "inductor":
        out["kept_quantized"] = sum(bool(d.details.get("quantized_in_place")) for d in decisions)
        out["quantized_at_compile"] = sum(d.applied for d in decisions if d.pass_name in ("fp4_linear", "q4_linear"))
    return out


def main() -> None:
    opts = arguments()
    if opts.child is not None:
        child(json.loads(opts.child))
        return
    started = time.monotonic()
    opts = resolve(opts)
    from bench.llama_models import print_table, write_result

    scratch = tempfile.mkdtemp(prefix="graphopt_quantized_")
    try:
        rows = prepare(opts, scratch)
        write_result("quantized", opts, rows)
        rows += run_rows(opts, scratch, started + opts.budget_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table("Weights quantized in place", [r for r in rows if r["section"] == "quantize"],
                ["format", "quantize_s", "weights_gb", "ratio_vs_bf16", "save_s", "file_gb"])
    print_table("Fresh processes", [{**r, "error": r.get("error", "")[-80:]} for r in rows if r["section"] == "process"],
                ["load", "compile", "ttft_s", "vs_bf16", "resident_gb", "peak_gb", "compile_s", "vs_inductor", "step_ms",
                 "kept_quantized", "quantized_at_compile", "error"])
    write_result("quantized", opts, rows)


if __name__ == "__main__":
    main()
