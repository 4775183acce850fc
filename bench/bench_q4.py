"""Q4_0 x Q8_1 linear layers: cuBLAS bf16 vs separate quantize+GEMM vs fused vs pre-quantized.

    python bench/bench_q4.py              # one H100/H200, a few minutes
    python bench/bench_q4.py --cpu-smoke  # whole script at tiny sizes on CPU (Triton interpreter)

Shapes and token counts are those of the FP4 benchmark. For every (shape, tokens) it first checks
each variant against dequantize-then-matmul (PASS/FAIL with the error), then times: cuBLAS bf16
(F.linear), separate (Q8_1 quantize kernel + integer GEMM), fused (quantization inside the GEMM /
decode GEMV), pre-quantized activations + GEMM (the case where fusion cannot pay), and, on the two
target shapes of the issue, every fused candidate config on its own. The launchers never tune: each
(shape, tokens) first tunes its tiles explicitly with q4.tune_q4_linear (as the q4_linear pass does
at compile time; not timed), and every variant runs its tuned tile (`tuned_config`).

Decode and small-batch sizes (<= 64 tokens) are timed as CUDA-graph replays for every variant, cuBLAS
included (a Python launch costs about as much as these kernels; timed eagerly, the two-launch
separate path swings 30-45% between runs at 17-64 tokens). Graph replays do not flush L2, and a Q4 weight of
these shapes (8-40 MB) fits in the 50 MB L2, so each replay runs the variant over enough copies of
its weights to exceed 3x the L2 size and the time is divided by the number of copies: weights come
from HBM, as in a real decode step. Larger sizes use CUDA events with an L2 flush per run.

GB/s counts the fewest bytes each variant must move (bf16 weights for cuBLAS, Q4_0 weights and
scales for the others, plus activations and outputs), and `of_copy` divides it by the
device-to-device copy bandwidth measured at the start of the same run. TOPS = 2*M*N*K / time. A
last row runs a LLaMA-7B-shaped 2-layer model on one token, Inductor bf16 vs graphopt q4_linear.
"""

from __future__ import annotations

import time
import traceback

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--no-e2e", action="store_true", help="skip the end-to-end LLaMA row")
ARGS.add_argument("--shapes", default=None, help="comma-separated KxN shapes (default: six LLaMA shapes)")
ARGS.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,4,16,64,256,4096)")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cuda_graph_ms, gbps, median_ms, print_table, tflops, write_json  # noqa: E402
from graphopt.kernels import q4  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
if GPU:
    SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (5120, 13824), (13824, 5120), (4096, 14336)]
    TOKENS = [1, 4, 16, 64, 256, 4096]
else:
    SHAPES = [(64, 96), (96, 64)]
    TOKENS = [1, 4, 17]
if OPTS.tokens:
    TOKENS = [int(t) for t in OPTS.tokens.split(",")]
if OPTS.shapes:
    SHAPES = [tuple(int(v) for v in s.lower().split("x")) for s in OPTS.shapes.split(",")]
GRAPH_TOKENS = 64  # up to this many tokens: CUDA-graph replays over weight copies (see the docstring)
SWEEP_SHAPES = {(5120, 13824), (13824, 5120)} if GPU else set(SHAPES)  # the target shapes


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy bandwidth (read + write bytes) of a 512 MiB buffer, GB/s."""
    from graphopt.calibrate import measure_copy_bandwidth

    return measure_copy_bandwidth((512 << 20) if GPU else (8 << 20), DEVICE) / 1e9


def l2_copies(nbytes: int) -> int:
    """Weight copies to rotate through so that one CUDA-graph replay cannot be served from L2."""
    if not GPU:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, min(16, -(-3 * l2 // nbytes)))


def time_ms(fn, copies: int, tokens: int) -> float:
    """fn(i) runs the variant on weight copy i."""
    if not GPU:
        return median_ms(lambda: fn(0), rep_ms=5)
    if tokens <= GRAPH_TOKENS:
        return cuda_graph_ms(lambda: [fn(i) for i in range(copies)], rep_ms=40) / copies
    return median_ms(lambda: fn(0), warmup_ms=10, rep_ms=40)


def weight_bytes(n: int, k: int) -> int:
    kp = 64 * ((k + 63) // 64)
    return n * kp // 2 + n * (kp // 32) * 2


TUNED: dict[str, str] = {}  # for the JSON: "<mode>[ (Gluon allowed)] K->N t=<tokens>" -> the tuned tile's name


def tuned_tile(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mode: str,
               allow_gluon: bool) -> q4.TileConfig | None:
    """The tile q4.tune_q4_linear picks for `mode` on x's shape (timed on the GPU now; kept in
    graphopt's tuning file), or None for the launcher's untuned default (no GPU, the interpreter,
    GRAPHOPT_Q4_AUTOTUNE=0). allow_gluon: the separate mode also times q4_tma's decode tiles, and one
    token either mode decode_persistent's (the pass allows them under CUDA graphs, and these sizes
    are timed as graph replays)."""
    n, k = qweight.shape[0], x.shape[-1]
    kernel = q4.tune_q4_linear(tuple(x.shape), qweight, scales, False, x.dtype, mode, allow_gluon)
    config = q4.kernel_config(kernel)
    label = f"{mode}{' (Gluon allowed)' if allow_gluon else ''} {k}->{n} t={x.shape[0]}"
    TUNED[label] = config.name if config else "untuned default"
    return config


def check(name: str, got: torch.Tensor, ref: torch.Tensor, results: list) -> bool:
    err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    ok = err < (2e-2 if got.dtype == torch.bfloat16 else 1e-4)  # bf16 output rounding vs fp32 sum order
    print(f"  {'PASS' if ok else 'FAIL'} {name}: max error / max |ref| = {err:.2e}")
    results.append({"check": name, "ok": ok, "rel_err": err})
    return ok


def bench_shape(k: int, n: int, rows: list, checks: list, copy_gbps: float) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(k * 7 + n)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(DTYPE)
    qweight, scales = q4.quantize_weight(w)
    w_deq = q4.dequantize_packed(qweight, scales, k)  # fp32 (N, K)
    q_copies, d_copies = l2_copies(weight_bytes(n, k)), l2_copies(n * k * w.element_size())
    qws = [(qweight, scales)] + [(qweight.clone(), scales.clone()) for _ in range(q_copies - 1)]
    ws = [w] + [w.clone() for _ in range(d_copies - 1)]
    for tokens in TOKENS:
        x = torch.randn(tokens, k, device=DEVICE, generator=g).to(DTYPE)
        xq = q4.quantize_q8_1_triton(x)
        ref = q4.dequantize_q8_1(q4.quantize_q8_1(x)) @ w_deq.T  # dequantize-then-matmul, fp32
        # the tiles, tuned now (the launchers run the config they are given, or an untuned default):
        # fused; separate (Q8_1-bytes tiles, and at decode sizes on sm_90+ q4_tma's decode); and the
        # pre-quantized GEMM, which takes the separate mode's Q8_1-bytes tiles only (no tma)
        tuned: dict[str, q4.TileConfig | None] = {}
        for name, mode, allow_gluon in (("fused", "fused", False), ("separate", "separate", True),
                                        ("prequant_gemm", "separate", False)):
            try:
                tuned[name] = tuned_tile(x, qweight, scales, mode, allow_gluon)
            except Exception as exc:  # the variant then runs the untuned default
                print(f"  FAIL tuning {name}: {type(exc).__name__}: {exc}")
                tuned[name] = None
        variants = {
            "cublas_bf16": (lambda i: F.linear(x, ws[i]), d_copies),
            "separate": (lambda i: q4.q4_linear_triton(x, *qws[i], None, "separate", config=tuned["separate"]),
                         q_copies),
            "fused": (lambda i: q4.q4_linear_triton(x, *qws[i], None, "fused", config=tuned["fused"]), q_copies),
            "prequant_gemm": (lambda i: q4.q4_q8_gemm_triton(xq, *qws[i], None, x.dtype, config=tuned["prequant_gemm"]),
                              q_copies),
        }
        if (k, n) in SWEEP_SHAPES:
            for config in q4.candidate_configs(tokens, fused=True):
                variants[f"fused:{config.name}"] = (
                    lambda i, c=config: q4.q4_linear_triton(x, *qws[i], None, "fused", config=c), q_copies)
        print(f"{k}->{n}, {tokens} tokens")
        timings: dict[str, float] = {}
        for name, (fn, copies) in variants.items():
            try:
                out = fn(0)  # compiles the kernels, outside the timing
                if name != "cublas_bf16" and not check(f"{k}->{n} t={tokens} {name}", out, ref, checks):
                    continue
                timings[name] = time_ms(fn, copies, tokens)
            except Exception as exc:  # one failing variant never stops the run
                print(f"  FAIL {name}: {type(exc).__name__}: {exc}")
                checks.append({"check": f"{k}->{n} t={tokens} {name}", "ok": False, "error": repr(exc)})
        flops = 2.0 * tokens * n * k
        act = tokens * k * x.element_size()
        out_bytes = tokens * n * x.element_size()
        moved = {"cublas_bf16": n * k * w.element_size() + act + out_bytes,
                 "prequant_gemm": weight_bytes(n, k) + tokens * k * 36 / 32 + out_bytes}
        configs = {name: ms for name, ms in timings.items() if name.startswith("fused:")}
        best_config = min(configs, key=configs.get) if configs else None
        for name, ms in timings.items():
            nbytes = moved.get(name, weight_bytes(n, k) + act + out_bytes)
            row = {"shape": f"{k}->{n}", "tokens": tokens, "variant": name, "ms": ms, "GB/s": gbps(nbytes, ms),
                   "of_copy": gbps(nbytes, ms) / copy_gbps, "TOPS": tflops(flops, ms)}
            if name.startswith("fused:"):
                rows.append({**row, "tile_sweep": True})
                continue
            rows.append({
                **row, "vs_cublas": timings.get("cublas_bf16", float("nan")) / ms,
                "fused_vs_separate": (timings["separate"] / timings["fused"]) if name == "fused" and "separate" in timings else None,
                "tuned_config": tuned[name].name if tuned.get(name) else None,
                "best_swept": best_config if name == "fused" else None,
                "best_swept_ms": configs.get(best_config) if name == "fused" and best_config else None,
            })


def bench_e2e(rows: list) -> None:
    """One token through a LLaMA-7B-shaped 2-layer model: Inductor bf16 vs graphopt q4_linear."""
    from graphopt.models import build

    name = "llama-7b-2l" if GPU else "tiny-llama"
    model, inputs = build(name, seq_len=1, device=DEVICE, dtype=DTYPE)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    model.requires_grad_(False)
    results = {}
    with torch.no_grad():
        eager = model(*inputs).logits.float()
        setups = [("inductor_bf16", dict(backend="inductor"))] if GPU else [("eager", None)]
        # graph_replay: the step's headline figure is its CUDA-graph replay, so the cost model prices GPU time
        setups += [("graphopt_q4", dict(backend="graphopt", options={"passes": {"q4_linear": True}, "graph_replay": True})),
                   ("graphopt_q4, siblings unfused", dict(backend="graphopt", options={
                       "passes": {"q4_linear": True}, "fuse_sibling_linears": False, "graph_replay": True}))]
        if not GPU:
            for _, kwargs in setups[1:]:
                kwargs["options"].update(downstream="eager", force=True)
        for label, kwargs in setups:
            try:
                torch._dynamo.reset()
                fn = model if kwargs is None else torch.compile(model, **kwargs)
                start = time.perf_counter()
                logits = fn(*inputs).logits.float()
                compile_s = time.perf_counter() - start
                err = ((logits - eager).norm() / eager.norm()).item()
                ms = median_ms(lambda: fn(*inputs), rep_ms=100 if GPU else 5)
                graph_ms = None
                if GPU:  # the step replayed from a CUDA graph: no launch gaps (as bench_fp4 reports it)
                    try:
                        graph_ms = cuda_graph_ms(lambda: fn(*inputs), rep_ms=100)
                    except Exception as exc:
                        print(f"  (no CUDA-graph timing for {label}: {type(exc).__name__}: {exc})")
                results[label] = (ms, graph_ms)
                print(f"  e2e {label}: {ms:.4f} ms (CUDA graph {graph_ms} ms), rel. logits error {err:.3e}, "
                      f"first call {compile_s:.1f} s")
                rows.append({"shape": f"{name} e2e", "tokens": 1, "variant": label, "ms": ms, "cuda_graph_ms": graph_ms,
                             "rel_logit_err": err})
            except Exception as exc:
                print(f"  FAIL e2e {label}: {type(exc).__name__}: {exc}")
                traceback.print_exc(limit=3)
    base_ms, base_graph_ms = results.get("inductor_bf16", results.get("eager", (None, None)))
    for row in rows:
        if row.get("shape", "").endswith("e2e") and base_ms:
            row["vs_cublas"] = base_ms / row["ms"]
            if base_graph_ms and row.get("cuda_graph_ms"):
                row["graph_vs_inductor"] = base_graph_ms / row["cuda_graph_ms"]


def main() -> None:
    rows: list[dict] = []
    checks: list[dict] = []
    start = time.perf_counter()
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    for k, n in SHAPES:
        try:
            bench_shape(k, n, rows, checks, copy_gbps)
        except Exception as exc:
            print(f"FAIL shape {k}->{n}: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
        if GPU:
            torch.cuda.empty_cache()
    if not OPTS.no_e2e:
        try:
            bench_e2e(rows)
        except Exception as exc:
            print(f"FAIL e2e: {type(exc).__name__}: {exc}")
    failed = [c for c in checks if not c["ok"]]
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} PASS; total {time.perf_counter() - start:.0f} s")
    path = write_json("bench_q4", rows, checks=checks, copy_gbps=copy_gbps, tuned=TUNED)
    print(f"wrote {path}")
    sweep = [r for r in rows if r.get("tile_sweep")]
    print_table("Q4_0 x Q8_1 fused config sweep (target shapes)", sweep,
                ["shape", "tokens", "variant", "ms", "GB/s", "of_copy", "TOPS"])
    main_rows = [r for r in rows if not r.get("tile_sweep")]
    print_table(f"Q4_0 x Q8_1 linear (of_copy = GB/s / {copy_gbps:.0f} GB/s copy; vs_cublas = cuBLAS ms / variant ms; "
                "fused_vs_separate = separate ms / fused ms)",
                main_rows, ["shape", "tokens", "variant", "ms", "GB/s", "of_copy", "TOPS", "vs_cublas",
                            "fused_vs_separate", "tuned_config", "best_swept", "best_swept_ms", "cuda_graph_ms",
                            "graph_vs_inductor"])


if __name__ == "__main__":
    main()
