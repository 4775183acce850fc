"""FP4 (NVFP4) decode kernels only, 1-16 tokens on the issue's two shapes: the best config of each
decode kernel vs cuBLAS bf16, all timed as CUDA-graph replays with weights cold in L2 (rotated
copies, >= 120 MB per graph), the way a model's layers read them.

    python bench/bench_fp4_decode.py               # one H100/H200, a few minutes
    python bench/bench_fp4_decode.py --cpu-smoke   # tiny shapes through the Triton interpreter
    python bench/bench_fp4_decode.py --profile-best bench_fp4_decode.json   # run each best config once (for ncu)

Kernels: "word" is the CUDA-core decode kernel (1-4 tokens per program), "word-mma" the
tensor-core one (16 tokens per program; --mma-m 16,32,64 sweeps 32 and 64 too), "word-int" the kernel with integer dot products
(int16 activations x int8 codes, dp2a; 1, 2 or 4 tokens per program), "tma" fp4_tma.py's Gluon
kernel (words and activations fed by TMA through a ring of shared-memory slots; sm_90+). All tile the weight as (rows x int32 code words); the
CUDA-core one reads each word's eight activations as two vector loads shared by the tile's rows,
the tensor-core one loads the tile's activations once and runs one MMA per shift of the words. bench_fp4.py times the path
the cost model picks at every token count; this is the short decode round used to judge kernel
changes. Each config is checked against dequantize-then-matmul (fp32) first; a config that fails
or cannot compile is skipped.
"""

from __future__ import annotations

import dataclasses
import json

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,4,16)")
ARGS.add_argument("--kernels", default="word,word-mma")
ARGS.add_argument("--wide", action="store_true", help="narrow row tiles, 1-2 warps, K tiles to 1024, MMA stages")
ARGS.add_argument("--profile-best", default=None, help="JSON from a previous run: run each best config once")
ARGS.add_argument("--shapes", default=None, help="comma-separated KxN shapes (default 5120x13824,13824x5120)")
ARGS.add_argument("--int-wide", action="store_true",
                  help="word-int: every tile of 16-64 rows x 256-2048 elements at 16 or 32 code words per thread")
ARGS.add_argument("--mma-m", default=None,
                  help="word-mma: comma-separated tokens per program (16, 32, 64) to sweep, each up to the token count")
ARGS.add_argument("--mma-bn", default="64,128,256", help="word-mma --mma-m sweep: rows per program")
ARGS.add_argument("--mma-bk", default="128,256", help="word-mma --mma-m sweep: K elements per step")
ARGS.add_argument("--mma-warps", default=None,
                  help="word-mma --mma-m sweep: comma-separated warp counts (default: 4, and 8 too above 16 tokens "
                       "or at 512-element steps)")
ARGS.add_argument("--mma-stages", default="1", help="word-mma --mma-m sweep: comma-separated num_stages (the "
                                                     "launcher's tiles use 1)")
ARGS.add_argument("--tma-quick", action="store_true", help="tma: only 64-row, 4-warp tiles")
ARGS.add_argument("--permuted-only", action="store_true", help="with --permute-x: time only the permuted tiles")
ARGS.add_argument("--permute-x", action="store_true",
                  help="word-mma: also time every tile on pre-permuted activations (the permutation's launch included)")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cold_graph_ms, comma_ints, copies_for, gbps, print_table, write_json  # noqa: E402
from graphopt.kernels import fp4  # noqa: E402
from graphopt.kernels.fp4 import KernelConfig  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
FORMAT = "nvfp4"
SHAPES = ([tuple(int(v) for v in shape.split("x")) for shape in OPTS.shapes.split(",")] if OPTS.shapes
          else [(5120, 13824), (13824, 5120)]) if GPU else [(256, 48)]
TOKENS = [int(t) for t in OPTS.tokens.split(",")] if OPTS.tokens else ([1, 4, 16] if GPU else [1, 3])
KERNELS = [k.strip() for k in OPTS.kernels.split(",") if k.strip()]


def _int_tiles(bm: int, block_ns, block_ks, words_per_thread, warp_counts, splits) -> list[KernelConfig]:
    """Integer-dot tiles of bm tokens: each (rows, elements) tile with the warps that give every
    thread `words_per_thread` code words, where that count of warps is allowed."""
    tiles = []
    for bn in block_ns:
        for bk in block_ks:
            for per_thread in words_per_thread:
                warps = bn * bk // 8 // (32 * per_thread)
                if warps in warp_counts:
                    tiles += [KernelConfig(bn, bm, bk, sk, num_warps=warps, num_stages=1, int_dots=True) for sk in splits]
    return tiles


def candidates(kernel: str, m: int) -> list[KernelConfig]:
    mma = kernel == "word-mma"
    if kernel == "tma":  # fp4_tma._fp4_decode_tma_kernel (Gluon, sm_90+): 16, 32 or 64 tokens per program
        if not GPU:
            return []
        bm = max(16, fp4._token_bucket(m))
        if OPTS.tma_quick:  # the 64-row, 4-warp tiles, which won the full sweep
            return [KernelConfig(64, bm, 256, sk, num_warps=4, num_stages=st, tma=True)
                    for sk in (1, 2, 4, 8) for st in (2, 3)]
        return [KernelConfig(bn, bm, 256, sk, num_warps=w, num_stages=st, tma=True)
                for bn, w in ((64, 4), (128, 4), (128, 8)) for sk in (1, 2, 4, 8) for st in (2, 3)]
    if kernel == "word-int":  # _fp4_gemv_int_kernel, 1, 2 or 4 tokens per program
        if m > 4:
            return []  # more tokens per program than it takes: W re-read per 4 tokens
        bm = fp4._token_bucket(m)
        if not GPU:
            return [KernelConfig(16, bm, 128, split_k=2, num_warps=1, num_stages=1, int_dots=True)]
        if OPTS.int_wide:
            return _int_tiles(bm, (16, 32, 64), (256, 512, 1024, 2048), (16, 32), (1, 2, 4, 8), (1, 2, 4, 8))
        if bm > 1:  # fewer code words per thread than one token's tiles: every token adds registers
            return _int_tiles(bm, (8, 16, 32), (128, 256, 512), (8, 16), (1, 2, 4), (1, 2, 4))
        return [KernelConfig(bn, 1, bk, sk, num_warps=w, num_stages=1, int_dots=True)
                for bn, bk, w, splits in ((16, 256, 1, (2, 4, 8)), (32, 256, 1, (2, 4, 8)), (32, 128, 1, (4, 8)),
                                          (64, 256, 4, (2, 4, 8)), (128, 256, 4, (2, 4)), (16, 512, 4, (1, 2, 4)),
                                          (16, 1024, 4, (1, 2)))
                for sk in splits]
    if not GPU:
        return [KernelConfig(16, 16 if mma else fp4._token_bucket(min(m, 4)), 128, split_k=2, num_stages=1)]
    if kernel == "word":
        if m > 4:
            return []  # 4 tokens per program re-read W per 4 tokens: far slower than word-mma there
        if OPTS.wide:
            return [KernelConfig(bn, fp4._token_bucket(m), bk, sk, num_warps=w, num_stages=1)
                    for bn in (8, 16, 32) for bk in (256, 512, 1024) for w in (1, 2, 4) for sk in (1, 2, 4)]
        return [KernelConfig(bn, fp4._token_bucket(m), bk, sk, num_warps=w, num_stages=1)
                for bn in (16, 64, 128) for bk in (256, 512) for w in (4, 8) for sk in (1, 2, 4, 8)]
    if mma and OPTS.mma_m:  # 16, 32 or 64 tokens per program (the MMA's N), at most the token bucket
        block_ms = [bm for bm in comma_ints(OPTS.mma_m) if bm <= max(16, fp4._token_bucket(m))]
        tiles = [KernelConfig(bn, bm, bk, sk, num_warps=w, num_stages=st)
                 for bm in block_ms for bn in comma_ints(OPTS.mma_bn) for bk in comma_ints(OPTS.mma_bk)
                 for sk in (2, 4, 8)
                 for w in (comma_ints(OPTS.mma_warps) if OPTS.mma_warps else (4,) if bm == 16 and bk < 512 else (4, 8))
                 for st in comma_ints(OPTS.mma_stages)]
        if not OPTS.permute_x:
            return tiles
        permuted = [dataclasses.replace(c, permute_x=True) for c in tiles]
        return permuted if OPTS.permuted_only else tiles + permuted
    if mma:  # num_stages 1: see _fp4_gemv_words_mma_kernel
        if OPTS.wide:
            return [KernelConfig(bn, 16, bk, sk, num_warps=w, num_stages=1)
                    for bn in (64, 128, 256) for bk in (64, 128, 256) for w in (4, 8) for sk in (4, 8, 16)]
        return [KernelConfig(bn, 16, bk, sk, num_warps=4, num_stages=1)
                for bn in (64, 128) for bk in (128, 256) for sk in (4, 8, 16)]
    raise ValueError(f"unknown kernel {kernel!r}; valid choices: word, word-mma, word-int, tma")


def config_name(cfg: KernelConfig) -> str:
    layout = " px" if cfg.permute_x else " tma" if cfg.tma else ""
    return f"{cfg.block_n}x{cfg.block_m}x{cfg.block_k} split{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}{layout}"


def weights(k: int, n: int):
    gen = torch.Generator().manual_seed(k + n)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    q = fp4.quantize_fp4(w, FORMAT)
    return gen, w, q, fp4.to_kernel_layout(q)


def run(x, kw, cfg):
    return fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, kw.out_features, kw.in_features,
                                 FORMAT, path="gemv", config=cfg)


def profile_best(path: str) -> None:
    """Each best config of the earlier run, three calls (warm-up + two for the profiler)."""
    rows = json.loads(open(path).read())["rows"]
    for k, n in SHAPES:
        _, _, _, kw = weights(k, n)
        for row in rows:
            if row["shape"] != f"{k}->{n}" or "config" not in row or row["config"].get("tile", "word") != "word":
                continue  # (rows of the removed scale-block kernels have tile "block")
            fields = {f.name for f in dataclasses.fields(KernelConfig)}
            cfg = KernelConfig(**{key: v for key, v in row["config"].items() if key in fields})  # older JSON: extra keys
            x = torch.randn(row["tokens"], k, device=DEVICE, dtype=torch.bfloat16)
            for _ in range(3):
                run(x, kw, cfg)
            torch.cuda.synchronize()
            print(f"profiled {k}->{n} m={row['tokens']} {row['kernel']} {config_name(cfg)}", flush=True)


def main() -> None:
    rows = []
    for k, n in SHAPES:
        gen, w, q, kw = weights(k, n)
        w_deq = fp4.dequantize_fp4(q)
        copies = copies_for(kw.nbytes) if GPU else 1
        fp4_copies = [kw] + [fp4.to_kernel_layout(q) for _ in range(copies - 1)]
        dense_copies = [w] + [w.clone() for _ in range(copies_for(2 * n * k) - 1 if GPU else 0)]
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
            ref = F.linear(x.float(), w_deq)
            cublas = cold_graph_ms([lambda wc=wc: F.linear(x, wc) for wc in dense_copies])
            rows.append({"shape": f"{k}->{n}", "tokens": m, "kernel": "cuBLAS bf16", "ms": cublas, "vs_cublas": 1.0,
                         "gbps": gbps(2 * n * k, cublas)})
            for kernel in KERNELS:
                best = None
                for cfg in candidates(kernel, m):
                    if not (fp4._valid_config(cfg, "gemv", m, n, kw.codes.shape[1] * 2, fp4.BLOCK_SIZES[FORMAT])
                            and fp4._runs_here(cfg, x, x.dtype)):
                        continue
                    try:
                        y = run(x, kw, cfg)
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        if err > 2e-2:
                            print(f"[FAIL] {k}->{n} m={m} {kernel} {config_name(cfg)}: rel err {err:.2e}", flush=True)
                            continue
                        ms = cold_graph_ms([lambda c=c, cfg=cfg: run(x, c, cfg) for c in fp4_copies], reps=20)
                    except Exception as exc:  # noqa: BLE001 - a config that cannot run is skipped
                        print(f"[skip] {k}->{n} m={m} {kernel} {config_name(cfg)}: {type(exc).__name__}: "
                              f"{str(exc)[:100]}", flush=True)
                        continue
                    print(f"  {k}->{n} m={m} {kernel} {config_name(cfg)}: {ms * 1e3:.1f} us", flush=True)
                    if best is None or ms < best[0]:
                        best = (ms, cfg, err)
                if best is None:
                    continue
                ms, cfg, err = best
                rows.append({"shape": f"{k}->{n}", "tokens": m, "kernel": kernel, "config": cfg.__dict__,
                             "tile": config_name(cfg), "ms": ms, "vs_cublas": cublas / ms, "rel_err": err,
                             "gbps": gbps(fp4.fp4_weight_bytes(k, n, FORMAT), ms)})
                print({key: v for key, v in rows[-1].items() if key != "config"}, flush=True)
    path = write_json("bench_fp4_decode", rows)
    print(f"wrote {path}")
    print_table("NVFP4 decode, best config per kernel (CUDA graph, L2-cold; vs_cublas = cuBLAS ms / ms)", rows,
                ["shape", "tokens", "kernel", "tile", "ms", "vs_cublas", "gbps", "rel_err"])


if __name__ == "__main__":
    if OPTS.profile_best:
        profile_best(OPTS.profile_best)
    else:
        main()
