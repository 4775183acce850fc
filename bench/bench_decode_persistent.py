"""4-bit decode: the persistent Gluon kernels (fp4/decode_persistent.py for NVFP4 / MXFP4, one token;
q4/decode_persistent.py for Q4_0 x Q8_1, 1-8 tokens) against the Triton (and, past one token,
q4_tma) tiles that the tuners choose on these shapes (integer-dot FP4, dp4a Q4) and cuBLAS bf16.

LLaMA-3-8B's decode linears (K x N: 4096 x 6144 fused QKV, 4096 x 4096 O, 4096 x 28672 fused
gate/up, 14336 x 4096 down; --shapes 13b: LLaMA-2-13B's MLP, 5120 x 13824 and 13824 x 5120), bf16 activations, --tokens tokens (default one), each timed as
CUDA-graph replays over rotated weight copies (L2-cold, >= 120 MB per graph). Every kernel is first
checked against dequantize-then-matmul in fp32 (relative error of the max; a kernel past 2e-2 is
reported FAIL and not timed). Persistent variants: rows per warp, warps, programs per
multiprocessor, chunks loaded ahead.

    python bench/bench_decode_persistent.py                    # one H100/H200, about four minutes
    python bench/bench_decode_persistent.py --formats q4_0     # writes bench_decode_persistent.json
    python bench/bench_decode_persistent.py --formats q4_0 --tokens 2,4,8
    python bench/bench_decode_persistent.py --formats nvfp4 --tiles 1-8-4-3,2-8-2-1,2-8-2-3,4-4-4-1 --no-triton
    python bench/bench_decode_persistent.py --shapes 13b --formats nvfp4,q4_0
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cold_graph_ms, comma_ints, copies_for, gbps, print_table, write_json  # noqa: E402
from graphopt.kernels import fp4, q4  # noqa: E402
from graphopt.kernels.fp4 import KernelConfig  # noqa: E402
from graphopt.kernels.fp4 import decode_persistent as dp  # noqa: E402
from graphopt.kernels.q4 import decode_persistent as q4_dp  # noqa: E402

SHAPES = {"8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],  # LLaMA-3-8B's decode linears
          "13b": [(5120, 13824), (13824, 5120)]}  # LLaMA-2-13B's MLP
TRITON_TILES = [KernelConfig(16, 1, 1024, 1, num_warps=4, num_stages=1, int_dots=True),
                KernelConfig(16, 1, 512, 1, num_warps=4, num_stages=1, int_dots=True),
                KernelConfig(16, 1, 256, 8, num_warps=1, num_stages=1, int_dots=True),
                KernelConfig(32, 1, 256, 8, num_warps=1, num_stages=1, int_dots=True)]
PERSISTENT_TILES = [(1, 4, 4, 3), (1, 4, 8, 3), (1, 4, 16, 3), (1, 4, 4, 7), (1, 4, 8, 7), (1, 8, 4, 3), (1, 8, 4, 7),
                    (1, 2, 16, 7), (2, 4, 4, 1), (2, 4, 4, 3), (2, 4, 8, 3), (2, 8, 2, 1), (2, 8, 2, 3), (2, 2, 8, 3),
                    (4, 4, 4, 1), (4, 4, 8, 1)]  # (rows per warp, warps, programs per SM, chunks ahead)


Q4_TILES = [q4.TileConfig("dp4a", 0, 16, 4, 1, 1, 8, "last"), q4.TileConfig("dp4a", 0, 16, 8, 1, 1, 0, "workspace"),
            q4.TileConfig("dp4a", 0, 32, 4, 1, 1, 4, "last")]  # the tiles the Q4 tuner picks on these shapes
Q4_PERSISTENT_TILES = [(2, 8, 2, 1), (2, 4, 4, 1), (4, 4, 4, 1), (2, 8, 2, 2), (1, 8, 4, 3), (1, 4, 8, 3)]
# 2-8 tokens: the dp4a and q4_tma tiles among the Q4 tuner's candidates there, and persistent tiles
# that build without spills (one row per warp at K = 14336)
Q4_MULTI_TOKEN_TILES = [q4.TileConfig("dp4a", 0, 32, 4, 1, 1, 4, "workspace"),
                        q4.TileConfig("dp4a", 0, 16, 8, 1, 1, 0, "workspace"),
                        q4.TileConfig("tma", 8, 64, 4, 4, 2, 4, "last"), q4.TileConfig("tma", 8, 64, 4, 4, 3, 2, "last")]
Q4_MULTI_TOKEN_PERSISTENT_TILES = [(2, 8, 2, 1), (1, 8, 4, 1), (2, 4, 4, 1), (1, 8, 2, 1)]


def persistent_variants(tiles, decode) -> dict:
    """{name: run(weight copy)} for persistent tiles (rows per warp, warps, programs per SM, chunks
    ahead[, register cap]): decode(copy, rows=, num_warps=, programs_per_sm=, depth=[, max_registers=])."""
    variants = {}
    for rows, warps, per_sm, depth, *cap in tiles:
        tile = dict(rows=rows, num_warps=warps, programs_per_sm=per_sm, depth=depth)
        name = f"persistent r{rows} w{warps} p{per_sm} d{depth}"
        if cap:
            tile["max_registers"], name = cap[0], f"{name} cap{cap[0]}"
        variants[name] = lambda copy, tile=tile: decode(copy, **tile)
    return variants


def fp4_case(fmt: str, w: torch.Tensor, x: torch.Tensor, tiles=PERSISTENT_TILES, triton_tiles=TRITON_TILES):
    """(weight copies, fp32 reference, weight bytes, {variant: run(copy)}) for one FP4 format."""
    k, n = w.shape[1], w.shape[0]
    q = fp4.quantize_fp4(w, fmt)
    kw = fp4.to_kernel_layout(q)
    copies = [kw] + [fp4.to_kernel_layout(q) for _ in range(copies_for(kw.nbytes) - 1)]
    variants = {f"triton int {c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps}":
                (lambda c_=c: lambda kc: fp4.fp4_linear_triton(x, kc.codes, kc.scales, kc.global_scale, None, n, k, fmt,
                                                               path="gemv", config=c_))()
                for c in triton_tiles}
    variants.update(persistent_variants(tiles, lambda kc, **tile: dp.fp4_gemv_persistent(
        x, kc.codes, kc.scales, kc.global_scale, None, n, k, fmt, **tile)))
    return copies, F.linear(x.float(), fp4.dequantize_fp4(q)), fp4.fp4_weight_bytes(k, n, fmt), variants


def q4_case(w: torch.Tensor, x: torch.Tensor, tiles=None):
    """The same for Q4_0 weights (Q8_1 activations): the Triton / q4_tma tiles and q4's persistent kernel."""
    k, one = w.shape[1], x.shape[0] == 1
    qweight, scales = q4.quantize_weight(w)
    copies = [(qweight, scales)] + [(qweight.clone(), scales.clone())
                                    for _ in range(copies_for(qweight.nbytes + scales.nbytes) - 1)]
    variants = {c.name: (lambda c_=c: lambda wc: q4.q4_linear_triton(
        x, *wc, mode="separate" if c_.kernel == "tma" else "fused", config=c_))()
        for c in (Q4_TILES if one else Q4_MULTI_TOKEN_TILES)}
    variants.update(persistent_variants(tiles or (Q4_PERSISTENT_TILES if one else Q4_MULTI_TOKEN_PERSISTENT_TILES),
                                        lambda wc, **tile: q4_dp.q4_gemv_persistent(x, *wc, None, **tile)))
    reference = F.linear(x.float(), q4.dequantize_packed(qweight, scales, k).float())
    return copies, reference, qweight.nbytes + scales.nbytes, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4,q4_0", help="comma list of nvfp4, mxfp4, q4_0")
    parser.add_argument("--tokens", default="1", help="comma list of token counts, 1-8 (past 1: Q4_0 only; the FP4 "
                        "persistent kernel takes one token)")
    parser.add_argument("--tiles", default=None, help="persistent tiles to time, comma list of "
                        "rows-warps-programs_per_sm-depth[-register cap] (default: each format's built-in sweep)")
    parser.add_argument("--no-triton", action="store_true", help="FP4: time no Triton integer-dot tile")
    parser.add_argument("--shapes", default="8b", help=f"comma list of shape sets: {', '.join(SHAPES)}")
    opts = parser.parse_args()
    formats, token_counts = opts.formats.split(","), comma_ints(opts.tokens)
    unknown = sorted(set(formats) - {"nvfp4", "mxfp4", "q4_0"})
    if unknown:
        parser.error(f"unknown formats {unknown}; valid choices: nvfp4, mxfp4, q4_0")
    if not all(1 <= m <= q4_dp.MAX_TOKENS for m in token_counts):
        parser.error(f"--tokens {opts.tokens}: each count must be 1-{q4_dp.MAX_TOKENS}")
    shape_sets = opts.shapes.split(",")
    if not set(shape_sets) <= set(SHAPES):
        parser.error(f"--shapes {opts.shapes}: valid shape sets are {', '.join(SHAPES)}")
    try:
        tiles = ([tuple(int(v) for v in t.split("-")) for t in opts.tiles.split(",")] if opts.tiles
                 else PERSISTENT_TILES)
        assert all(len(t) in (4, 5) for t in tiles)
    except (ValueError, AssertionError):
        parser.error(f"--tiles {opts.tiles}: expected a comma list of rows-warps-programs_per_sm-depth[-register cap], "
                     "e.g. 1-8-4-3 or 2-4-5-3-96")
    rows_out, cublas_ms = [], {}
    for fmt, m in ((fmt, m) for fmt in formats for m in token_counts if m == 1 or fmt == "q4_0"):
        for k, n in (shape for name in shape_sets for shape in SHAPES[name]):
            gen = torch.Generator().manual_seed(k + n)
            w = (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            copies, ref, nbytes, variants = (q4_case(w, x, opts.tiles and tiles) if fmt == "q4_0" else
                                             fp4_case(fmt, w, x, tiles, [] if opts.no_triton else TRITON_TILES))
            if (k, n, m) not in cublas_ms:  # once per shape and token count: the formats share it
                dense = [w] + [w.clone() for _ in range(copies_for(2 * n * k) - 1)]
                cublas_ms[k, n, m] = ms = cold_graph_ms([lambda wc=wc: F.linear(x, wc) for wc in dense])
                rows_out.append(dict(format="bf16", shape=f"{k}->{n}", tokens=m, kernel="cuBLAS", ms=ms,
                                     gbps=gbps(2 * n * k, ms)))
            cublas = cublas_ms[k, n, m]
            for name, run in variants.items():
                try:
                    y = run(copies[0])
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err <= 2e-2:
                        print(f"[FAIL] {fmt} {k}->{n} {name}: rel err {err:.2e}", flush=True)
                        rows_out.append(dict(format=fmt, shape=f"{k}->{n}", tokens=m, kernel=name, rel_err=err,
                                             error="FAIL"))
                        continue
                    ms = cold_graph_ms([lambda wc=wc, run=run: run(wc) for wc in copies], reps=20)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported
                    print(f"[skip] {fmt} {k}->{n} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                rows_out.append(dict(format=fmt, shape=f"{k}->{n}", tokens=m, kernel=name, ms=ms, vs_cublas=cublas / ms,
                                     gbps=gbps(nbytes, ms), rel_err=err))
                print(rows_out[-1], flush=True)
    write_json("bench_decode_persistent", rows_out, options={"formats": formats, "tokens": token_counts,
                                                             "shapes": opts.shapes,
                                                             "tiles": tiles, "triton": not opts.no_triton})
    print_table("4-bit decode (CUDA graph, L2-cold; vs_cublas: cuBLAS bf16 ms / ms)", rows_out,
                ["format", "shape", "tokens", "kernel", "ms", "vs_cublas", "gbps", "rel_err"])


if __name__ == "__main__":
    main()
