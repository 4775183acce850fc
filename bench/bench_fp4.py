"""FP4 weight-only linear layers (graphopt::fp4_linear) vs cuBLAS bf16, plus a LLaMA-7B-shaped step.

    python bench/bench_fp4.py                      # one H100/H200, NVFP4, well under 5 minutes
    python bench/bench_fp4.py --formats nvfp4,mxfp4
    python bench/bench_fp4.py --cpu-smoke          # whole script at tiny sizes (Triton interpreter)

For every (format, shape K->N, tokens) it first checks the Triton kernel against
dequantize-then-matmul in fp32 (PASS/FAIL with the relative error) and reports the output SQNR
against the bf16 linear with the original weights. Then it times cuBLAS bf16 (F.linear) and the
FP4 kernel the cost model picks (gemv = decode/split-K, gemm = fused prefill, dequant = Triton
decode of W to bf16 + cuBLAS); >= 64 tokens also time every path (gemv_ms, gemm_ms, dequant_ms).
<= 64 tokens are timed as CUDA-graph replays for both (launch gaps would otherwise dominate), twice:
`*_ms` replays one call (its weights may stay in the 50 MB L2 between replays: the FP4 weights of
every shape here fit), `*_cold_ms` replays a graph of calls over enough distinct weight copies
(>= 120 MB) that every call reads its weights from HBM, as the layers of a real model do. GB/s
(from the cold time where there is one) counts the fewest bytes each must move (weights + scales
+ activations + outputs) and is compared with a device-to-device copy measured in the same run.
More than 64 tokens: cuBLAS and the FP4 path are timed in 7 interleaved rounds (median of the
rounds), because a long bf16 GEMM runs the GPU at its power limit and whichever is timed first
would otherwise run on cooler, faster clocks (measured: 0.73-0.89 ms across rounds for one
cuBLAS shape at 4096 tokens on an H100). The launcher never tunes: each (shape, tokens, path) first
tunes its tile explicitly with fp4.tune_config (as the fp4_linear pass does at compile time; not
timed), and every timed call runs that tile (`config` in the row, `tuned` in the JSON).
The last rows run transformers LLaMA with 7B shapes, 2 layers, one token, under Inductor bf16 and
under graphopt with fp4_linear.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import traceback

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--formats", default="nvfp4", help="comma-separated: nvfp4, mxfp4")
ARGS.add_argument("--no-e2e", action="store_true", help="skip the end-to-end LLaMA rows")
ARGS.add_argument("--shapes", default=None, help="comma-separated KxN shapes (default: six LLaMA shapes)")
ARGS.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,4,16,64,256,4096)")
ARGS.add_argument("--dequant-sweep", action="store_true", help="also time every DEQUANT_TILES tile of the W decode")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cold_graph_ms, copies_for, cuda_graph_ms, gbps, interleaved_ms, median_ms, print_table, tflops, write_json  # noqa: E402
from graphopt.cost import fp4 as fp4_cost  # noqa: E402
from graphopt.hardware import device_spec  # noqa: E402
from graphopt.kernels import fp4  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
FORMATS = [f.strip() for f in OPTS.formats.split(",") if f.strip()]
if GPU:
    SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (5120, 13824), (13824, 5120), (4096, 14336)]
    TOKENS = [1, 4, 16, 64, 256, 4096]
else:
    SHAPES = [(96, 80), (160, 48)]
    TOKENS = [1, 4, 64]
if OPTS.shapes:
    SHAPES = [tuple(int(v) for v in s.lower().split("x")) for s in OPTS.shapes.split(",")]
if OPTS.tokens:
    TOKENS = [int(t) for t in OPTS.tokens.split(",")]
# up to this many tokens the layers are memory-bound steps (decode, small batches): CUDA-graph replays,
# hot and L2-cold
GRAPH_TOKENS = 64


def time_ms(fn, tokens: int) -> float:
    if not GPU:
        return median_ms(fn, rep_ms=5)
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    if tokens <= GRAPH_TOKENS:
        return cuda_graph_ms(fn, rep_ms=50)
    # best of three medians: a single 50 ms median of the dequant path (which allocates W per call)
    # can be up to 2.6x slow at 64 tokens
    return min(median_ms(fn, warmup_ms=25, rep_ms=100) for _ in range(3))


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write), the ceiling for streaming kernels."""
    from graphopt.calibrate import measure_copy_bandwidth

    return measure_copy_bandwidth((512 << 20) if GPU else (8 << 20), DEVICE)


TUNED: dict[str, dict] = {}  # for the JSON: "<format> K->N t=<tokens> <path>" -> the tuned tile


def tuned_config(path: str, x: torch.Tensor, kw, n: int, k: int, fmt: str) -> fp4.KernelConfig:
    """The tile fp4.tune_config picks for this path and shape: timed on the GPU now (kept in
    graphopt's tuning file), fp4.default_config without a GPU (the interpreter). x: (M, K) bf16
    rows, as the launcher passes them."""
    args = (x, kw.codes, kw.scales.view(torch.uint8), kw.global_scale, None, n, k, fmt, x.dtype)
    cfg = fp4.tune_config(path, args)
    TUNED[f"{fmt} {k}->{n} t={x.shape[0]} {path}"] = dataclasses.asdict(cfg)
    return cfg


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return fp4.sqnr_db(ref.float(), out.float())


def kernel_rows(copy_bw: float) -> list[dict]:
    rows = []
    for fmt in FORMATS:
        for k, n in SHAPES:
            gen = torch.Generator(device="cpu").manual_seed(k * 7 + n)
            w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, DTYPE)
            q = fp4.quantize_fp4(w, fmt)
            kw = fp4.to_kernel_layout(q)
            w_deq = fp4.dequantize_fp4(q)  # fp32 (N, K)
            w_sqnr = fp4.sqnr_db(w.float(), w_deq)
            for m in TOKENS:
                row = {"format": fmt, "shape": f"{k}->{n}", "tokens": m, "weight_sqnr_db": w_sqnr}
                try:
                    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
                    path = fp4_cost.choose_fp4_path(device_spec(0), m, k, n, fmt) if GPU else (
                        "gemv" if m <= fp4.INTERPRET_DECODE_CONFIG.block_m else "gemm")
                    cfg = tuned_config(path, x, kw, n, k, fmt)
                    run = lambda: fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, fmt,  # noqa: E731
                                                        path=path, config=cfg)
                    y = run()
                    ref = F.linear(x.float(), w_deq)
                    rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    dense = F.linear(x, w)
                    row.update(path=path, config=dataclasses.asdict(cfg), check="PASS" if rel < 2e-2 else "FAIL",
                               rel_err=rel, out_sqnr_db=sqnr(dense, y))
                    print(f"[{row['check']}] {fmt} {k}->{n} M={m} {path}: rel err {rel:.2e}, "
                          f"output SQNR vs bf16 {row['out_sqnr_db']:.2f} dB", flush=True)
                    if GPU and m > GRAPH_TOKENS:  # GEMM-bound: interleaved rounds (see interleaved_ms)
                        run()
                        rounds = interleaved_ms({"cublas": lambda: F.linear(x, w), "fp4": run})
                        cublas_ms, fp4_ms = statistics.median(rounds["cublas"]), statistics.median(rounds["fp4"])
                    else:
                        cublas_ms = time_ms(lambda: F.linear(x, w), m)
                        fp4_ms = time_ms(run, m)
                    fp4_bytes = kw.nbytes + 2 * m * (k + n)
                    dense_bytes = 2 * (n * k + m * (k + n))
                    row.update(cublas_ms=cublas_ms, fp4_ms=fp4_ms, speedup=cublas_ms / fp4_ms)
                    cublas_t, fp4_t = cublas_ms, fp4_ms
                    if GPU and m <= GRAPH_TOKENS:
                        dense_copies = [w] + [w.clone() for _ in range(copies_for(dense_bytes) - 1)]
                        cublas_cold = cold_graph_ms([lambda wc=wc: F.linear(x, wc) for wc in dense_copies])
                        del dense_copies
                        fp4_copies = [kw] + [fp4.to_kernel_layout(q) for _ in range(copies_for(kw.nbytes) - 1)]
                        fp4_cold = cold_graph_ms([
                            lambda c=c: fp4.fp4_linear_triton(x, c.codes, c.scales, c.global_scale, None, n, k, fmt,
                                                              path=path, config=cfg)
                            for c in fp4_copies])
                        del fp4_copies
                        cublas_t, fp4_t = cublas_cold, fp4_cold
                        row.update(cublas_cold_ms=cublas_cold, fp4_cold_ms=fp4_cold, cold_speedup=cublas_cold / fp4_cold)
                    if m >= 64:
                        for alt in ("gemv", "gemm", "dequant"):
                            try:
                                alt_cfg = tuned_config(alt, x, kw, n, k, fmt)
                                row[f"{alt}_ms"] = time_ms(lambda alt=alt, alt_cfg=alt_cfg: fp4.fp4_linear_triton(
                                    x, kw.codes, kw.scales, kw.global_scale, None, n, k, fmt, path=alt, config=alt_cfg), m)
                            except Exception as exc:  # noqa: BLE001
                                print(f"[FAIL] {fmt} {k}->{n} M={m} {alt}: {type(exc).__name__}: {exc}", flush=True)
                    row.update(
                        fp4_gbps=gbps(fp4_bytes, fp4_t), fp4_of_copy_bw=fp4_bytes / (fp4_t * 1e-3) / copy_bw,
                        cublas_gbps=gbps(dense_bytes, cublas_t), fp4_tflops=tflops(2.0 * m * n * k, fp4_ms),
                        cublas_tflops=tflops(2.0 * m * n * k, cublas_ms),
                    )
                except Exception as exc:  # one failing variant must not end the run
                    row.update(check="FAIL", error=f"{type(exc).__name__}: {exc}")
                    print(f"[FAIL] {fmt} {k}->{n} M={m}: {row['error']}", flush=True)
                    traceback.print_exc()
                rows.append(row)
    return rows


def dequant_sweep_rows(copy_bw: float) -> list[dict]:
    """The prefill path's W decode alone, per tile: GB/s of codes + scales read and bf16 W written."""
    rows = []
    for fmt in FORMATS:
        for k, n in SHAPES:
            w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02).to(DEVICE, DTYPE)
            q = fp4.quantize_fp4(w, fmt)
            kw = fp4.to_kernel_layout(q)
            expected = fp4.dequantize_fp4(q).to(DTYPE)
            moved = kw.nbytes + 2 * n * k
            for tile in fp4.DEQUANT_TILES:
                row = {"format": fmt, "shape": f"{k}->{n}", "tile": str(tile)}
                try:
                    run = lambda tile=tile: fp4.dequantize_triton(kw.codes, kw.scales, kw.global_scale, n, k, fmt, DTYPE, tile=tile)  # noqa: E731
                    got = run()  # exact on a GPU; the interpreter's bf16 cast truncates instead of rounding
                    ok = torch.equal(got, expected) if GPU else torch.allclose(got.float(), expected.float(), rtol=2**-7)
                    ms = median_ms(run)
                    row.update(check="PASS" if ok else "FAIL", ms=ms, gbps=gbps(moved, ms),
                               of_copy_bw=moved / (ms * 1e-3) / copy_bw)
                except Exception as exc:  # noqa: BLE001
                    row.update(check="FAIL", error=f"{type(exc).__name__}: {exc}")
                print(f"[{row['check']}] dequant {fmt} {k}->{n} tile {tile}: {row.get('ms', float('nan')):.4f} ms", flush=True)
                rows.append(row)
    return rows


def llama_rows() -> list[dict]:
    """transformers LLaMA, 7B shapes, 2 layers, one-token forward: Inductor bf16 vs graphopt fp4,
    with HF's SDPA attention (transformers' default) and with its "eager" attention (the
    hand-written form that graphopt's attention pass rewrites)."""
    rows = []
    for attention in ("sdpa", "eager"):
        rows += _llama_rows(attention)
    return rows


def _llama_rows(attention: str) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if GPU:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                          num_hidden_layers=2, vocab_size=32000, max_position_embeddings=2048,
                          attn_implementation=attention)
    else:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                          num_hidden_layers=2, vocab_size=256, max_position_embeddings=64,
                          attn_implementation=attention)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEVICE, DTYPE).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 1), device=DEVICE)
    rows = []
    with torch.no_grad():
        eager_logits = model(ids).logits.float()
        variants = [("inductor bf16", dict(backend="inductor"))]
        for fmt in FORMATS:
            # graph_replay: the step's headline figure is its CUDA-graph replay, so the cost model prices GPU time
            variants.append((f"graphopt {fmt}", dict(backend="graphopt", options={
                "passes": {"fp4_linear": True}, "fp4_format": fmt, "graph_replay": True})))
            variants.append((f"graphopt {fmt}, siblings unfused", dict(backend="graphopt", options={
                "passes": {"fp4_linear": True}, "fp4_format": fmt, "fuse_sibling_linears": False, "graph_replay": True})))
        base_ms = None
        for name, kwargs in variants:
            row = {"format": "e2e", "shape": "LLaMA-7B shapes, 2 layers", "tokens": 1, "variant": name,
                   "attention": attention}
            try:
                torch._dynamo.reset()
                if not GPU and kwargs.get("backend") == "graphopt":
                    kwargs["options"] = {**kwargs["options"], "force": True}  # CPU target: cost model declines
                if not GPU and kwargs.get("backend") == "inductor":
                    kwargs = {"backend": "eager"}
                compiled = torch.compile(model, **kwargs)
                logits = compiled(ids).logits.float()
                cos = F.cosine_similarity(logits.flatten(), eager_logits.flatten(), dim=0).item()
                ms = median_ms(lambda: compiled(ids), rep_ms=200 if GPU else 5)
                graph_ms = None
                if GPU:
                    try:
                        graph_ms = cuda_graph_ms(lambda: compiled(ids), rep_ms=100)
                    except Exception as exc:  # some compiled callables cannot be captured
                        print(f"  (no CUDA-graph timing for {name}: {type(exc).__name__}: {exc})")
                if base_ms is None:
                    base_ms, base_graph_ms = ms, graph_ms
                row.update(check="PASS" if cos > 0.95 else "FAIL", logits_cosine=cos, e2e_ms=ms, speedup=base_ms / ms,
                           e2e_cuda_graph_ms=graph_ms,
                           graph_speedup=(base_graph_ms / graph_ms) if graph_ms and base_graph_ms else None)
                print(f"[{row['check']}] e2e {name} ({attention} attention): {ms:.4f} ms, logits cosine vs the uncompiled model {cos:.5f}", flush=True)
            except Exception as exc:
                row.update(check="FAIL", error=f"{type(exc).__name__}: {exc}")
                print(f"[FAIL] e2e {name}: {row['error']}", flush=True)
                traceback.print_exc()
            rows.append(row)
    torch._dynamo.reset()
    return rows


def main() -> None:
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.1f} GB/s", flush=True)
    sweep = dequant_sweep_rows(bw) if OPTS.dequant_sweep else []
    rows = kernel_rows(bw)
    e2e = [] if OPTS.no_e2e else llama_rows()
    path = write_json("bench_fp4", rows + e2e + sweep, copy_bandwidth_gbps=bw / 1e9, formats=FORMATS, tuned=TUNED)
    print(f"wrote {path}")
    if e2e:
        print_table("LLaMA-7B shapes, 2 layers, one token (speedup vs Inductor bf16 with the same attention)", e2e,
                    ["variant", "attention", "check", "logits_cosine", "e2e_ms", "speedup", "e2e_cuda_graph_ms",
                     "graph_speedup", "error"])
    if sweep:
        print_table("W decode (dequant path) per tile", sweep, ["format", "shape", "tile", "check", "ms", "gbps", "of_copy_bw", "error"])
    print("tuned configs:", json.dumps(TUNED, default=str)[:4000])
    print_table(f"FP4 weight-only linear vs cuBLAS bf16 (copy {bw / 1e9:.0f} GB/s; GB/s from the cold time)", rows,
                ["format", "shape", "tokens", "path", "check", "rel_err", "out_sqnr_db", "cublas_ms", "fp4_ms", "speedup",
                 "cublas_cold_ms", "fp4_cold_ms", "cold_speedup", "gemv_ms", "gemm_ms", "dequant_ms",
                 "fp4_gbps", "fp4_of_copy_bw", "cublas_tflops", "fp4_tflops", "error"])


if __name__ == "__main__":
    main()
