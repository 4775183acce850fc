"""Held-out agreement of the cost model with the committed measurements (no GPU needed).

Each fitted sweep in bench/results/ becomes a list of rows: one problem (a layer size and a token
count, or an attention shape and a length) with the measured time of every candidate the run timed
(cuBLAS, each kernel path or implementation, each attention backend). Its rows are split into a fit
set and a held-out set that shares neither a layer size nor a token count with it (rows that share
one of the two are "partly held out"). The coefficients fitted to that sweep (their data-file
entries cite it) are refit on the fit set only: a coordinate search on a log grid around the
data-file value, minimizing the mean |ln(predicted / measured)|. Then, per set:
  - within 25%: the share of (row, candidate) times predicted within 0.8-1.25x of the measurement;
  - ranked: the share of candidate pairs of a row that the model orders as measured (pairs measured
    within 5% of each other are ties and left out): faster or slower than cuBLAS, which kernel,
    which backend;
for the data-file coefficients and for the refit ones, on each GPU; and across GPUs: the
coefficients refit on one GPU's fit set, with the other GPU's measured rates, against every row
the other GPU measured.

    python bench/validate_cost_model.py        # writes bench/results/cost_model_validation.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from graphopt import cost_model as cm  # noqa: E402
from graphopt.cost import coefficients  # noqa: E402
from graphopt.cost import fft_chain as fft_cost  # noqa: E402
from graphopt.cost import fp4 as fp4_cost  # noqa: E402
from graphopt.cost import q4 as q4_cost  # noqa: E402
from graphopt.cost import sparse_attention as sparse_cost  # noqa: E402
from graphopt.cost.attention import estimate_flash_attention  # noqa: E402
from graphopt.hardware import SPECS  # noqa: E402

RESULTS = REPO / "bench" / "results"
OUT = RESULTS / "cost_model_validation.json"
WITHIN = 1.25  # a time "agrees" when predicted / measured is in [1 / WITHIN, WITHIN]
TIE = 1.05  # candidates measured closer than this are a tie: their order is not scored
GRID = [2 ** (i / 4) for i in range(-8, 9)]  # 0.25x-4x of the data-file value
REFIT_PASSES = 3
CUBLAS = "cuBLAS"


def _spec(gpu: str, **measured):
    return dataclasses.replace(SPECS[gpu], **measured)


# The rates each run measured: the copy bandwidth the FP4 / Q4 / sparse runs recorded (H100), the
# ceilings measured on the H200 those runs used, and bench_cost_model's own ceilings.
H100_RUN = _spec("h100", measured_memory_bandwidth=2.96e12)
H200_RUN = _spec("h200", measured_bf16_flops=690e12, measured_memory_bandwidth=4.22e12, measured_launch_overhead_s=6e-6)


def _cost_model_run_spec(gpu: str):
    c = json.loads((RESULTS / f"cost_model_{gpu}.json").read_text())["ceilings"]
    return _spec(gpu, measured_bf16_flops=c["matmul_tflops"] * 1e12, measured_memory_bandwidth=c["copy_tbps"] * 1e12,
                 measured_launch_overhead_s=c["launch_us"] * 1e-6)


@dataclass
class Row:
    layer: str  # the layer size (or attention shape / mask, density, batch) axis of the split
    size: int  # the token count (or sequence length, cache length) axis
    measured: dict[str, float]  # candidate -> ms
    args: dict = field(default_factory=dict)


@dataclass
class Sweep:
    family: str
    gpu: str
    files: list[str]
    command: str
    hw: object
    rows: list[Row]
    predict: Callable  # (hw, row) -> {candidate: predicted ms}
    refit: list[str]  # coefficient names ("name" or "name[i]" for one side of an efficiency pair)
    fit: tuple[set, set]  # (layers, sizes) of the fit set
    held: tuple[set, set]  # (layers, sizes) of the held-out set

    def split(self, row: Row) -> str:
        if row.layer in self.fit[0] and row.size in self.fit[1]:
            return "fit"
        if row.layer in self.held[0] and row.size in self.held[1]:
            return "held_out"
        return "partly_held_out"


def _shape(text: str) -> tuple[int, int]:
    k, n = text.split("->")
    return int(k), int(n)


def _read(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


# --- FFT chain ---------------------------------------------------------------------------------
def _fft_predict(hw, row: Row) -> dict[str, float]:
    a = row.args
    out = {impl: fft_cost.estimate_fft_chain(hw, a["tokens"], a["in"], a["out"], a["B"], a["K"], impl, bias=a["bias"]).ms
           for impl in row.measured if impl != CUBLAS}
    out[CUBLAS] = cm.linear(hw, a["tokens"], a["in"], a["out"], bias=a["bias"]).ms
    return out


def _fft_rows(records) -> list[Row]:
    """records: (in, out, B, K, tokens, impl, bias, ms, cuBLAS ms); one row per configuration."""
    by_key: dict = {}
    for k_in, n_out, b, k, t, impl, bias, ms, cublas in records:
        args = {"in": k_in, "out": n_out, "tokens": t, "B": b, "K": k, "bias": bias}
        row = by_key.setdefault(tuple(args.values()), Row(f"{k_in}->{n_out}", t, {CUBLAS: cublas}, args))
        row.measured.setdefault(impl, ms)
    return list(by_key.values())


_EXPLORE_LINE = re.compile(r"layer\s+\d+ \S+\s+(\d+)->(\d+)\s+B=(\d+)\s+K=(\d+)\s+dense\s+([\d.]+) ms\s+FFT\s+([\d.]+) ms "
                           r"\[\s*(\w+)\]")


def fft_h200_records() -> list[tuple]:
    """Distinct (in, out, B, K, tokens, impl, bias, ms, dense ms) CUDA-graph timings of the H200 runs of
    the current FFT-chain kernels: fft_chain_h200.json (all three implementations of its bench rows,
    and the explore-fft dft rows printed in its log), and the torch/triton rows of
    fft_chain_torch_triton_h200.json and explore_fft_h200/ (their dft rows timed another dft kernel).
    Files read later win on duplicates."""
    rows: dict[tuple, tuple] = {}
    for t in (16, 256, 4096):
        for r in _read(f"explore_fft_h200/explore_fft_quick_{t}tok.json")["rows"]:
            if r["impl"] in ("torch", "triton"):
                rows[(r["in_features"], r["out_features"], r["block_size"], r["k"], t, r["impl"], False)] = \
                    (r["fft_ms"], r["dense_ms"])
    for name, impls in (("fft_chain_torch_triton_h200.json", ("torch", "triton")),
                        ("fft_chain_h200.json", ("torch", "triton", "dft"))):
        for r in _read(name)["rows"]:
            if r["impl"] in impls:
                rows[(*_shape(r["shape"]), 512, 2, r["tokens"], r["impl"], True)] = (r["graph_ms"], r["cublas_graph_ms"])
    tokens = None
    for line in (RESULTS / "fft_chain_h200.log").read_text().splitlines():
        header = re.match(r"explore-fft --quick: .*?, (\d+) tokens", line)
        if header:
            tokens = int(header.group(1))
        match = _EXPLORE_LINE.match(line)
        if match:
            in_f, out_f, b, k = (int(v) for v in match.groups()[:4])
            rows[(in_f, out_f, b, k, tokens, match.group(7), False)] = (float(match.group(6)), float(match.group(5)))
    return [key + value for key, value in sorted(rows.items())]


FFT_FIT = ({"5120->13824"}, {16, 4096})
FFT_HELD = ({"13824->5120"}, {256})


def fft_sweeps() -> list[Sweep]:
    h100 = _fft_rows((r["in_features"], r["out_features"], r["block_size"], r["k"], r["tokens"], r["impl"], False,
                      r["graph_ms"], r["cublas_graph_ms"]) for r in _read("fft_fit_sweep_h100.json")["rows"])
    dft2 = ["fft_chain.dft2_latency_s", "fft_chain.dft2_gemm_step_s", "fft_chain.dft2_contract_step_s",
            "fft_chain.dft2_gather_step_s", "fft_chain.dft2_inkernel_gather_matrix_fraction"]
    # (fft_chain.fma_efficiency does not bind on these rows: they bound it only from below)
    h200_names = ["fft_chain.launch_fraction_in_graph", "fft_chain.serial_step_s", "fft_chain.dft_contract_step_s",
                  "fft_chain.dft_gemm_step_s"]
    return [
        Sweep("fft_chain", "h100", ["fft_fit_sweep_h100.json"], "python bench/bench_fft_chain.py --fit-sweep",
              H100_RUN, h100, _fft_predict, dft2, FFT_FIT, FFT_HELD),
        Sweep("fft_chain", "h200", ["fft_chain_h200.json", "fft_chain_h200.log", "fft_chain_torch_triton_h200.json",
                                    "explore_fft_h200/"],
              "python bench/bench_fft_chain.py; graphopt explore-fft --quick --seq-len N (N = 16, 256, 4096)",
              H200_RUN, _fft_rows(fft_h200_records()), _fft_predict, h200_names, FFT_FIT, FFT_HELD),
    ]


# --- FP4 linear --------------------------------------------------------------------------------
LINEAR_FIT_LAYERS = {"4096->11008", "11008->4096", "5120->13824", "4096->14336"}
LINEAR_HELD_LAYERS = {"4096->4096", "13824->5120"}


def _fp4_predict(hw, row: Row) -> dict[str, float]:
    k, n = _shape(row.layer)
    out = {p: fp4_cost.estimate_fp4_linear(hw, row.size, k, n, "nvfp4", path=p).ms for p in row.measured if p != CUBLAS}
    out[CUBLAS] = cm.linear(hw, row.size, k, n).ms
    return out


def _fp4_rows(files: list[str], decode_tokens: int) -> list[Row]:
    """Up to `decode_tokens`: cuBLAS and the decode path, weights L2-cold; beyond: every path timed,
    eager medians. The first file that has a (layer, tokens) gives its row."""
    rows: dict = {}
    for name in files:
        for r in _read(name)["rows"]:
            if "->" not in r["shape"] or r.get("check") != "PASS" or (r["shape"], r["tokens"]) in rows:
                continue
            if r["tokens"] <= decode_tokens:
                if "fp4_cold_ms" not in r:
                    continue
                measured = {CUBLAS: r["cublas_cold_ms"], r["path"]: r["fp4_cold_ms"]}
            else:
                measured = {CUBLAS: r["cublas_ms"], **{p: r[f"{p}_ms"] for p in ("gemv", "gemm", "dequant") if f"{p}_ms" in r}}
            rows[(r["shape"], r["tokens"])] = Row(r["shape"], r["tokens"], measured)
    return list(rows.values())


def fp4_sweeps() -> list[Sweep]:
    h100 = _fp4_rows(["fp4_linear_1_64tok_h100.json", "fp4_linear_1_2tok_h100.json", "fp4_linear_1_256tok_h100.json",
                      "fp4_linear_13b_mlp_h100.json"], decode_tokens=64)
    # 1-64 tokens from the decode sweep; fp4_linear_h200.json's rows up to 64 tokens timed other
    # decode kernels than graphopt's, so only its larger token counts are read
    h200 = _fp4_rows(["fp4_linear_1_64tok_h200.json"], decode_tokens=64) \
        + [r for r in _fp4_rows(["fp4_linear_h200.json"], decode_tokens=64) if r.size > 64]
    decode = ["fp4.int_gemv_decode_ops_per_weight", "fp4.int_gemv_ops_per_extra_row", "fp4.tma_decode_ops_per_weight",
              "fp4.tma_decode_latency_s", "fp4.tma_decode_latency_s_per_extra_row", "fp4.dequant_copy_fraction",
              "efficiency.fp4_gemv[1]"]
    split = (LINEAR_FIT_LAYERS, {1, 2, 4, 64, 4096}), (LINEAR_HELD_LAYERS, {16, 32, 256})
    return [
        Sweep("fp4_linear", "h100", ["fp4_linear_1_64tok_h100.json", "fp4_linear_1_2tok_h100.json",
                                     "fp4_linear_1_256tok_h100.json", "fp4_linear_13b_mlp_h100.json"],
              "python bench/bench_fp4.py --tokens 1,4,16,32,64 --no-e2e (and --tokens 1,2; 1,...,256; 4096)",
              H100_RUN, h100, _fp4_predict, decode, *split),
        Sweep("fp4_linear", "h200", ["fp4_linear_1_64tok_h200.json", "fp4_linear_h200.json"],
              "python bench/bench_fp4.py --tokens 1,2,4,16,32,64 --no-e2e (and --tokens 1,4,16,64,256,4096)",
              H200_RUN, h200, _fp4_predict, decode + ["fp4.mma_decode_ops_per_weight"], *split),
    ]


# --- Q4 linear ---------------------------------------------------------------------------------
def _q4_predict(hw, row: Row) -> dict[str, float]:
    k, n = _shape(row.layer)
    before, _, _, fused, separate = q4_cost.predict_linear(hw, row.size, k, n)
    return {CUBLAS: before.ms, "fused": fused.ms, "separate": separate.ms}


def _q4_decode_rows(name: str) -> list[Row]:
    """bench_q4_decode.py's rows: cuBLAS, and the best kernel of each mode (what the tuner would pick)."""
    by_key: dict = {}
    for r in _read(name)["rows"]:
        by_key.setdefault((r["shape"], r["tokens"]), {})[r["kernel"]] = r["ms"]
    return [Row(shape, t, {CUBLAS: ms["cuBLAS bf16"],
                           "fused": min(v for kind, v in ms.items() if kind in ("dp4a", "gemm", "gemv", "swap")),
                           "separate": min(v for kind, v in ms.items() if kind.endswith(" separate"))})
            for (shape, t), ms in by_key.items()]


def q4_sweeps() -> list[Sweep]:
    def prefill(name: str) -> list[Row]:
        rows: dict = {}
        for r in _read(name)["rows"]:
            if "->" in r["shape"] and not r.get("tile_sweep") and r["tokens"] >= 64 \
                    and r["variant"] in ("cublas_bf16", "fused", "separate"):
                rows.setdefault((r["shape"], r["tokens"]), {})[CUBLAS if r["variant"] == "cublas_bf16" else r["variant"]] = r["ms"]
        return [Row(shape, t, ms) for (shape, t), ms in rows.items()]

    gemm = ["q4.fused_requant_ops_per_value", "q4.gemm_unpack_ops_per_weight", "efficiency.q4_gemm[0]"]
    decode = ["q4.tma_ops_per_weight", "q4.tma_ops_per_weight_and_token_row", "q4.dp4a_ops_per_value_and_row",
              "efficiency.q4_gemv[1]"]
    return [
        Sweep("q4_linear", "h100", ["q4_decode_kernels_h100.json", "q4_linear_prefill_h100.json"],
              "python bench/bench_q4_decode.py; python bench/bench_q4.py --shapes 5120x13824,13824x5120 --tokens 64,256,4096",
              H100_RUN, _q4_decode_rows("q4_decode_kernels_h100.json") + prefill("q4_linear_prefill_h100.json"),
              _q4_predict, decode + gemm, ({"5120->13824"}, {1, 16, 256}), ({"13824->5120"}, {4, 64, 4096})),
        # 1-16 tokens from the decode sweep; q4_linear_h200.json's rows up to 16 tokens timed other
        # decode kernels than graphopt's, so only its prefill rows are read
        Sweep("q4_linear", "h200", ["q4_decode_kernels_h200.json", "q4_linear_h200.json"],
              "python bench/bench_q4_decode.py; python bench/bench_q4.py --tokens 1,4,16,64,256,4096",
              H200_RUN, _q4_decode_rows("q4_decode_kernels_h200.json") + prefill("q4_linear_h200.json"), _q4_predict,
              decode + gemm, (LINEAR_FIT_LAYERS, {1, 16, 64, 4096}), (LINEAR_HELD_LAYERS, {4, 256})),
    ]


# --- GEMMs and attention (bench_cost_model.py, bench_attention.py) ------------------------------
def _dense_predict(hw, row: Row) -> dict[str, float]:
    a = row.args
    if a["kind"] == "gemm":
        return {"cuBLAS": cm.linear(hw, a["m"], a["k"], a["n"]).ms}
    b, h, length, d, causal = a["B"], a["H"], row.size, a["D"], a["causal"]
    out = {}
    for name in row.measured:
        if name == "naive eager":
            out[name] = cm.naive_attention(hw, b, h, length, length, d, fused_pointwise=False, has_mask=causal).ms
        elif name == "naive inductor":
            out[name] = cm.naive_attention(hw, b, h, length, length, d, has_mask=causal).ms
        elif name in ("sdpa cudnn", "sdpa flash"):
            out[name] = cm.sdpa(hw, b, h, length, length, d, backend=name.split()[1], causal=causal).ms
        elif name == "triton flash":
            out[name] = estimate_flash_attention(hw, b, h, length, length, d, causal=causal).ms
    return out


def _dense_rows(gpu: str) -> list[Row]:
    rows: dict = {}
    for r in _read(f"cost_model_{gpu}.json")["rows"]:
        kind = r["kind"].removesuffix(" graph")
        if r["kind"] == "gemm":
            m, rest = r["shape"].split("x")
            k, n = _shape(rest)
            rows[r["shape"]] = Row(rest, int(m), {"cuBLAS": r["measured ms"]}, {"kind": "gemm", "m": int(m), "k": k, "n": n})
            continue
        parts = dict(p.split("=") for p in r["shape"].split() if "=" in p)
        h, d, length, causal = int(parts.get("H", 32)), int(parts.get("D", 128)), int(parts["L"]), "causal" in r["shape"]
        layer = f"B=1 H={h} D={d}{' causal' if causal else ''}{' (CUDA graph)' if r['kind'].endswith('graph') else ''}"
        row = rows.setdefault((layer, length), Row(layer, length, {}, {"kind": "attention", "B": 1, "H": h, "D": d,
                                                                         "causal": causal}))
        row.measured[kind] = r["measured ms"]
    if gpu == "h200":  # the attention kernels of bench_attention.py: B = 16384 / L, H=32, D=128
        names = {"naive eager": "naive eager", "naive + Inductor": "naive inductor", "SDPA flash": "sdpa flash",
                 "SDPA cuDNN": "sdpa cudnn", "Triton (ours)": "triton flash"}
        for r in _read("attention_h200.json")["rows"]:
            if r["variant"] in names and r["check"].startswith("PASS"):
                layer = f"B*L=16k H={r['H']} D={r['D']}{' causal' if r['causal'] else ''}"
                row = rows.setdefault((layer, r["L"]), Row(layer, r["L"], {}, {"kind": "attention", "B": r["B"],
                                                                               "H": r["H"], "D": r["D"], "causal": r["causal"]}))
                row.measured[names[r["variant"]]] = r["ms"]
    return list(rows.values())


def dense_sweeps() -> list[Sweep]:
    attention_layers = lambda causal: {f"{pre}H={h} D={d}{' causal' if causal else ''}{g}"  # noqa: E731
                                       for pre in ("B=1 ", "B*L=16k ") for h, d in ((32, 128), (16, 64))
                                       for g in ("", " (CUDA graph)")}
    fit = ({"4096->4096", "4096->11008", "5120->5120", "13824->5120"} | attention_layers(False), {1, 64, 1024, 512, 2048, 8192})
    held = ({"11008->4096", "5120->13824"} | attention_layers(True), {16, 256, 4096, 16384})
    names = ["efficiency.cublas_gemm[1]", "gemm.partial_overlap", "efficiency.pointwise[1]", "efficiency.sdpa_cudnn[0]",
             "efficiency.sdpa_flash[0]", "efficiency.triton_flash[0]"]
    return [Sweep("gemm_and_attention", gpu, [f"cost_model_{gpu}.json"] + (["attention_h200.json"] if gpu == "h200" else []),
                  "python bench/bench_cost_model.py" + ("; python bench/bench_attention.py" if gpu == "h200" else ""),
                  _cost_model_run_spec(gpu), _dense_rows(gpu), _dense_predict, names, fit, held)
            for gpu in ("h100", "h200")]


# --- decode attention (bench_decode_attention.py) -------------------------------------------------
def _decode_predict(hw, row: Row) -> dict[str, float]:
    b, lk = int(row.layer.split("=")[1]), row.size
    out = {}
    for name in row.measured:
        if name == "triton":
            out[name] = cm.fused_attention(hw, b, 32, 1, lk, 128, family="triton_flash", has_mask=True, kv_heads=8).ms
        else:
            out[name] = cm.decode_attention(hw, b, 32, 1, lk, 128, kv_heads=8, has_mask=True, splits=int(name[1:])).ms
    return out


def _decode_rows(name: str) -> list[Row]:
    rows: dict = {}
    for r in _read(name)["rows"]:
        if "us" not in r or not (r["variant"].startswith("decode") or r["variant"] == "triton"):
            continue
        label = "triton" if r["variant"] == "triton" else f"s{r['splits']}"
        rows.setdefault((r["batch"], r["lk"]), Row(f"batch={r['batch']}", r["lk"], {})).measured[label] = r["us"] / 1e3
    return list(rows.values())


# The H200 decode-attention run ran uncalibrated: its predicted_us are the datasheet rates'.
DECODE_RUNS = {"h100": H100_RUN, "h200": _spec("h200")}


def decode_sweeps() -> list[Sweep]:
    return [Sweep("decode_attention", gpu, [f"decode_attention_{gpu}.json"],
                  "python bench/bench_decode_attention.py --fit --lengths 640,2048,8192,32768 --splits 1,4,16,64",
                  hw, _decode_rows(f"decode_attention_{gpu}.json"), _decode_predict,
                  ["decode_attention.step_s", "decode_attention.fixed_s", "attention.triton_flash_step_s"],
                  ({"batch=1"}, {640, 8192}), ({"batch=8"}, {2048, 32768}))
            for gpu, hw in DECODE_RUNS.items()]


def _sdpa_decode_predict(hw, row: Row) -> dict[str, float]:
    b, lk = int(row.layer.split("=")[1]), row.size
    return {name: cm.sdpa(hw, b, 32, 1, lk, 128, backend=name, has_mask=True, kv_heads=32, repeated_from=8).ms
            for name in row.measured}


def _sdpa_decode_rows(name: str) -> list[Row]:
    rows: dict = {}
    for r in _read(name)["rows"]:
        if "us" in r and r["variant"].startswith("sdpa-"):
            row = rows.setdefault((r["batch"], r["lk"]), Row(f"batch={r['batch']}", r["lk"], {}))
            row.measured[r["variant"][5:]] = r["us"] / 1e3
    return list(rows.values())


def sdpa_decode_sweeps() -> list[Sweep]:
    """SDPA's cuDNN and efficient backends on a decode call (K/V repeated, as transformers writes GQA).
    Batch 1 binds the step and batch 8 the streaming rate, so both batches are in the fit set: the
    rows at the other cache lengths are partly held out."""
    names = [f"attention.sdpa_decode_{kind}.{backend}" for backend in cm.SDPA_DECODE_BACKENDS
             for kind in ("step_s", "memory_efficiency")]
    return [Sweep("sdpa_decode", gpu, [f"decode_attention_{gpu}.json"],
                  "python bench/bench_decode_attention.py --fit --lengths 640,2048,8192,32768 --splits 1,4,16,64",
                  hw, _sdpa_decode_rows(f"decode_attention_{gpu}.json"), _sdpa_decode_predict, names,
                  ({"batch=1", "batch=8"}, {640, 8192}), (set(), set()))
            for gpu, hw in DECODE_RUNS.items()]


# --- block-sparse attention (bench_sparse_attention.py) -----------------------------------------
def _sparse_predict(hw, row: Row) -> dict[str, float]:
    a, length = row.args, row.size
    kernel = sparse_cost.estimate_sparse_kernel(hw, 1, a["H"], a["H"], length, length, a["D"], causal=a["causal"],
                                                sparsity=1.0 - a["density"])
    out = {"sparse kernel": kernel.ms,
           "cuDNN dense": cm.sdpa(hw, 1, a["H"], length, length, a["D"], backend="cudnn", causal=a["causal"]).ms}
    if "Triton dense" in row.measured:
        out["Triton dense"] = cm.fused_attention(hw, 1, a["H"], length, length, a["D"], family="triton_flash",
                                                 causal=a["causal"]).ms
    return out


def _sparse_rows(files: list[str]) -> list[Row]:
    rows: dict = {}
    for name in files:
        doc = _read(name)
        h, d = doc["config"]["H"], doc["config"]["D"]
        for r in doc["rows"]:
            layer = f"density {r['nominal']:g}{' causal' if r['causal'] else ''}"
            measured = {"sparse kernel": r["ours_graph_ms"], "cuDNN dense": r["cudnn_ms"]}
            if "triton_dense_ms" in r:  # timed on the density-1 rows
                measured["Triton dense"] = r["triton_dense_ms"]
            rows.setdefault((layer, r["L"]), Row(layer, r["L"], measured,
                                                 {"H": h, "D": d, "causal": r["causal"], "density": r["density"]}))
    return list(rows.values())


def sparse_sweeps() -> list[Sweep]:
    layers = lambda densities: {f"density {x:g}{c}" for x in densities for c in ("", " causal")}  # noqa: E731
    fit, held = (layers((1.0, 0.25)), {8192, 32768}), (layers((0.5, 0.1)), {4096, 16384})
    names = ["sparse_attention.row_cost_tiles", "efficiency.triton_sparse[0]"]
    h100_files = ["sparse_attention_h100_host_desc_8k.json", "sparse_attention_h100_host_desc_16k_32k.json",
                  "sparse_attention_h100_mask_loop.json"]
    return [Sweep("sparse_attention", "h100", h100_files, "python bench/bench_sparse_attention.py --lengths 8192 "
                  "(and --lengths 16384,32768)", H100_RUN, _sparse_rows(h100_files), _sparse_predict, names, fit, held),
            Sweep("sparse_attention", "h200", ["sparse_attention_h200.json"], "python bench/bench_sparse_attention.py",
                  H200_RUN, _sparse_rows(["sparse_attention_h200.json"]), _sparse_predict, names, fit, held)]


# --- scoring and refitting ------------------------------------------------------------------------
def score(sweep: Sweep, hw, rows: list[Row]) -> dict:
    logs, pairs, agree = [], 0, 0
    for row in rows:
        predicted = sweep.predict(hw, row)
        names = [n for n in row.measured if n in predicted and math.isfinite(predicted[n])]
        logs += [math.log(predicted[n] / row.measured[n]) for n in names]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ma, mb = row.measured[a], row.measured[b]
                if max(ma, mb) / min(ma, mb) < TIE:
                    continue
                pairs += 1
                agree += (predicted[a] < predicted[b]) == (ma < mb)
    return {"rows": len(rows), "times": len(logs),
            "within_25pct": sum(abs(x) <= math.log(WITHIN) for x in logs) / len(logs) if logs else None,
            "median_abs_ln_ratio": statistics.median(abs(x) for x in logs) if logs else None,
            "pairs": pairs, "ranked_as_measured": agree / pairs if pairs else None}


def _objective(sweep: Sweep, hw, rows: list[Row]) -> float:
    errors = [abs(math.log(p[n] / row.measured[n])) for row in rows for p in [sweep.predict(hw, row)]
              for n in row.measured if n in p and math.isfinite(p[n]) and p[n] > 0]
    return statistics.fmean(errors)


def _apply(values: dict, name: str, x: float) -> dict:
    base, _, index = name.partition("[")
    out = dict(values)
    if index:
        pair = list(out[base])
        pair[int(index[0])] = x
        out[base] = tuple(pair)
    else:
        out[base] = x
    return out


def _get(values: dict, name: str) -> float:
    base, _, index = name.partition("[")
    return values[base][int(index[0])] if index else values[base]


def refit(sweep: Sweep, rows: list[Row]) -> dict:
    """Coefficient values (the whole table) refit on `rows`: each of sweep.refit within 0.25-4x of
    its data-file value (efficiencies and fractions <= 1), by coordinate search."""
    values = dict(coefficients.for_hardware(sweep.hw).values)
    start = {name: _get(values, name) for name in sweep.refit}
    best = _objective(sweep, coefficients.with_values(sweep.hw, values, "refit"), rows)
    for _ in range(REFIT_PASSES):
        for name in sweep.refit:
            for factor in GRID:
                x = start[name] * factor
                if ("efficiency" in name or "fraction" in name) and x > 1.0:
                    continue
                trial = _apply(values, name, x)
                err = _objective(sweep, coefficients.with_values(sweep.hw, trial, "refit"), rows)
                if err < best - 1e-12:
                    best, values = err, trial
    return values


def validate() -> dict:
    sweeps = fft_sweeps() + fp4_sweeps() + q4_sweeps() + dense_sweeps() + decode_sweeps() + sdpa_decode_sweeps() + sparse_sweeps()
    results, refits = [], {}
    for sweep in sweeps:
        sets = {s: [r for r in sweep.rows if sweep.split(r) == s] for s in ("fit", "held_out", "partly_held_out")}
        values = refit(sweep, sets["fit"])
        refits[(sweep.family, sweep.gpu)] = values
        refit_hw = coefficients.with_values(sweep.hw, values, "refit")
        shipped = coefficients.for_hardware(sweep.hw).values
        results.append({
            "family": sweep.family, "gpu": sweep.gpu, "files": [f"bench/results/{f}" for f in sweep.files],
            "command": sweep.command,
            "split": {"fit": {"layers": sorted(map(str, sweep.fit[0])), "sizes": sorted(sweep.fit[1])},
                      "held_out": {"layers": sorted(map(str, sweep.held[0])), "sizes": sorted(sweep.held[1])}},
            "coefficients": {n: {"data_file": _get(shipped, n), "refit": _get(values, n)} for n in sweep.refit},
            "data_file": {**{s: score(sweep, sweep.hw, rows) for s, rows in sets.items()},
                          "all": score(sweep, sweep.hw, sweep.rows)},
            "refit": {s: score(sweep, refit_hw, rows) for s, rows in sets.items()},
        })
    for result, sweep in zip(results, sweeps):
        other = next((s for s in sweeps if s.family == sweep.family and s.gpu != sweep.gpu), None)
        if other is None:
            continue
        # this GPU's refit coefficients with the other GPU's measured rates, on every row it measured
        hw = coefficients.with_values(other.hw, refits[(sweep.family, sweep.gpu)], f"{sweep.gpu} refit")
        result["other_gpu"] = {"gpu": other.gpu, **score(other, hw, other.rows)}
    return {"about": __doc__.split("\n\n    python")[0], "command": "python bench/validate_cost_model.py",
            "torch": torch.__version__, "within": WITHIN, "tie": TIE, "summary": summary(results), "sweeps": results}


def _pooled(metrics: list[dict]) -> dict:
    times, pairs = sum(m["times"] for m in metrics), sum(m["pairs"] for m in metrics)
    return {"rows": sum(m["rows"] for m in metrics), "times": times, "pairs": pairs,
            "within_25pct": sum(m["times"] * (m["within_25pct"] or 0) for m in metrics) / times if times else None,
            "ranked_as_measured": sum(m["pairs"] * (m["ranked_as_measured"] or 0) for m in metrics) / pairs if pairs else None}


def summary(results: list[dict]) -> dict:
    """Every sweep pooled: the refit coefficients on fit, held-out and partly held-out rows, on the
    other GPU's rows, and the data files' coefficients on all rows."""
    out = {s: _pooled([r["refit"][s] for r in results]) for s in ("fit", "held_out", "partly_held_out")}
    out["other_gpu"] = _pooled([r["other_gpu"] for r in results if "other_gpu" in r])
    out["data_file_all_rows"] = _pooled([r["data_file"]["all"] for r in results])
    return out


def _cell(m: dict | None) -> str:
    """'rows: within 25% / ranked as measured'."""
    if not m or not m["rows"]:
        return "-"
    pct = lambda key: "-" if m.get(key) is None else f"{100 * m[key]:.0f}%"  # noqa: E731
    return f"{m['rows']}: {pct('within_25pct')} / {pct('ranked_as_measured')}"


def table(report: dict) -> str:
    """Markdown: per sweep and GPU, rows and (times within 25%, candidate pairs ranked as measured)."""
    lines = ["| sweep | GPU | fit set (refit) | held out | partly held out | other GPU's rows | all rows, data-file coefficients |",
             "|---|---|---|---|---|---|---|"]
    for r in report["sweeps"]:
        refit, other = r["refit"], r.get("other_gpu")
        lines.append(f"| {r['family']} | {r['gpu'].upper()} | {_cell(refit['fit'])} | {_cell(refit['held_out'])} | "
                     f"{_cell(refit['partly_held_out'])} | "
                     f"{(other['gpu'].upper() + ' ' + _cell(other)) if other else '-'} | {_cell(r['data_file']['all'])} |")
    t = report["summary"]
    lines.append(f"| all sweeps | both | {_cell(t['fit'])} | {_cell(t['held_out'])} | {_cell(t['partly_held_out'])} | "
                 f"{_cell(t['other_gpu'])} | {_cell(t['data_file_all_rows'])} |")
    return "\n".join(lines)


def main() -> int:
    report = validate()
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"JSON: {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
