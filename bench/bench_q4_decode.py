"""Q4_0 x Q8_1 decode kernels only (1-16 tokens, the issue's two shapes): the best config of each
decode kernel ("gemv" fp32 FMAs, "dp4a" integer dots, "gemm" int8 tensor cores with the tokens on
the MMA's M side, "swap" with the weights there; "tma separate": q4_tma's Gluon decode after a
quantize launch) vs cuBLAS bf16, all timed as CUDA-graph replays
with weights cold in L2 (rotated copies, >= 120 MB per graph). The best fused config of each kernel
that also reads Q8_1 blocks is timed once more on the separate path (Q8_1 quantize launch + GEMM,
both in the graph), as "<kernel> separate".

    python bench/bench_q4_decode.py            # one H100/H200, ~2 minutes
    python bench/bench_q4_decode.py --cpu-smoke

bench_q4.py times every path and config at every token count (slow); this is the short decode
round used to judge kernel changes. Each config is checked against dequantize-then-matmul first.
"""

from __future__ import annotations

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--wide", action="store_true", help="also narrow dp4a tiles: 8-32 rows, 1-4 warps, K steps to 1024")
ARGS.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,4,16)")
ARGS.add_argument("--swap-sweep", action="store_true", help="also more swap tiles: 64/128 rows, 1-4 pairs, the --swap-stages depths, split-K auto or 16")
ARGS.add_argument("--swap-stages", default="1,3", help="pipeline depths of the --swap-sweep tiles (default 1,3)")
ARGS.add_argument("--swap-m", default="", help="also swap tiles with these comma-separated token blocks (wgmma N "
                  "side, e.g. 32,64 for 64 tokens): 128/256 rows, 1-2 pairs, 3 stages, split-K auto or 4")
ARGS.add_argument("--print-all", action="store_true", help="print every config's time (always on with --swap-sweep)")
ARGS.add_argument("--dp4a-splits", default="", help="also one-warp dp4a tiles (16/32 rows, 4/8 pairs, reduce 'last') "
                  "with these comma-separated split-K counts")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cold_graph_ms, copies_for, gbps, print_table, write_json  # noqa: E402
from graphopt.kernels import q4  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
SHAPES = [(5120, 13824), (13824, 5120)] if GPU else [(128, 48)]
TOKENS = [int(t) for t in OPTS.tokens.split(",")] if OPTS.tokens else ([1, 4, 16] if GPU else [1, 3])
WIDE_DP4A = [q4.TileConfig("dp4a", 0, bn, p, w, 1, sk) for bn in (8, 16, 32) for p in (4, 8, 16) for w in (1, 2, 4)
             for sk in (0, 1, 2, 4)] if OPTS.wide and GPU else []
SPLIT_DP4A = [q4.TileConfig("dp4a", 0, bn, p, 1, 1, int(sk), "last") for bn in (16, 32) for p in (4, 8)
              for sk in OPTS.dp4a_splits.split(",") if sk] if GPU else []
SWAP_WIDE_M = [q4.TileConfig("swap", int(bm), bn, p, 4, 3, sk, "last") for bm in OPTS.swap_m.split(",") if bm
               for bn in (128, 256) for p in (1, 2) for sk in (0, 4)] if GPU else []
SWAP_SWEEP = [(bn, p, w, s, "last", sk) for bn, w in ((64, 4), (128, 8), (128, 4)) for p in (1, 2, 4)
              for s in (int(x) for x in OPTS.swap_stages.split(",")) for sk in (0, 16)] if OPTS.swap_sweep and GPU else []


def main() -> None:
    rows = []
    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k + n)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
        qweight, scales = q4.quantize_weight(w.float())
        w_deq = q4.dequantize_packed(qweight, scales, k)
        q_bytes = qweight.numel() + scales.numel() * 2
        copies = copies_for(q_bytes) if GPU else 1
        q_copies = [(qweight, scales)] + [(qweight.clone(), scales.clone()) for _ in range(copies - 1)]
        d_copies = [w] + [w.clone() for _ in range(copies_for(2 * n * k) - 1 if GPU else 0)]
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
            ref = F.linear(q4.dequantize_q8_1(q4.quantize_q8_1(x.float())).reshape(m, -1), w_deq)
            cublas = cold_graph_ms([lambda wc=wc: F.linear(x, wc) for wc in d_copies])
            rows.append({"shape": f"{k}->{n}", "tokens": m, "kernel": "cuBLAS bf16", "ms": cublas, "vs_cublas": 1.0,
                         "gbps": gbps(2 * n * k, cublas)})
            best: dict[str, tuple[float, q4.TileConfig]] = {}
            sweep = list(dict.fromkeys(q4.candidate_configs(m, fused=True) + WIDE_DP4A + SPLIT_DP4A + q4.swap_configs(m, SWAP_SWEEP)
                                       + SWAP_WIDE_M))
            for cfg in sweep:
                try:
                    y = q4.q4_linear_triton(x, qweight, scales, None, "fused", config=cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"[FAIL] {k}->{n} m={m} {cfg.name}: rel err {err:.2e}", flush=True)
                        continue
                    ms = cold_graph_ms([lambda qw=qw, sc=sc, cfg=cfg: q4.q4_linear_triton(x, qw, sc, None, "fused", config=cfg)
                                        for qw, sc in q_copies])
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is skipped
                    print(f"[skip] {k}->{n} m={m} {cfg.name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                if OPTS.swap_sweep or OPTS.print_all:  # every config's time in the log, to read the sweep
                    print(f"  {k}->{n} m={m} {cfg.name}: {ms * 1e3:.1f} us", flush=True)
                label = f"swap m{cfg.block_m}" if cfg in SWAP_WIDE_M else cfg.kernel
                if label not in best or ms < best[label][0]:
                    best[label] = (ms, cfg)
            for kernel, (_, cfg) in list(best.items()):
                if kernel == "gemv":  # quantizes its own input: no separate path
                    continue
                y = q4.q4_linear_triton(x, qweight, scales, None, "separate", config=cfg)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    print(f"[FAIL] {k}->{n} m={m} {cfg.name} separate: rel err {err:.2e}", flush=True)
                    continue
                best[f"{kernel} separate"] = (cold_graph_ms([
                    lambda qw=qw, sc=sc, cfg=cfg: q4.q4_linear_triton(x, qw, sc, None, "separate", config=cfg)
                    for qw, sc in q_copies]), cfg)
            for cfg in q4.tma_configs(m) if GPU else []:  # q4_tma's Gluon decode: the separate path only
                try:
                    y = q4.q4_linear_triton(x, qweight, scales, None, "separate", config=cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"[FAIL] {k}->{n} m={m} {cfg.name}: rel err {err:.2e}", flush=True)
                        continue
                    ms = cold_graph_ms([lambda qw=qw, sc=sc, cfg=cfg: q4.q4_linear_triton(x, qw, sc, None, "separate",
                                                                                          config=cfg)
                                        for qw, sc in q_copies])
                except Exception as exc:  # noqa: BLE001 - no Gluon / not sm_90+: skipped
                    print(f"[skip] {k}->{n} m={m} {cfg.name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                print(f"  {k}->{n} m={m} {cfg.name} separate: {ms * 1e3:.1f} us", flush=True)
                if "tma separate" not in best or ms < best["tma separate"][0]:
                    best["tma separate"] = (ms, cfg)
            for kernel, (ms, cfg) in sorted(best.items()):
                rows.append({"shape": f"{k}->{n}", "tokens": m, "kernel": kernel, "config": cfg.name, "ms": ms,
                             "vs_cublas": cublas / ms, "gbps": gbps(q_bytes, ms)})
                print(rows[-1], flush=True)
    path = write_json("bench_q4_decode", rows)
    print(f"wrote {path}")
    print_table("Q4_0 x Q8_1 decode, best config per kernel (CUDA graph, L2-cold; vs_cublas = cuBLAS ms / ms)", rows,
                ["shape", "tokens", "kernel", "config", "ms", "vs_cublas", "gbps"])


if __name__ == "__main__":
    main()
