"""One-token NVFP4 / MXFP4 decode: the persistent Gluon kernel (fp4/decode_persistent.py) against the
integer-dot Triton kernel (its tiles that the tuner chooses on these shapes) and cuBLAS bf16.

LLaMA-3-8B's decode linears (K x N: 4096 x 6144 fused QKV, 4096 x 4096 O, 4096 x 28672 fused
gate/up, 14336 x 4096 down), bf16 activations, one token, each timed as CUDA-graph replays over
rotated weight copies (L2-cold, >= 120 MB per graph). Every kernel is first checked against
dequantize-then-matmul in fp32 (relative error of the max; a kernel past 2e-2 is reported FAIL and
not timed). Persistent variants: rows per warp, warps, programs per multiprocessor, chunks loaded ahead.

    python bench/bench_fp4_persistent.py           # one H100/H200, about three minutes
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import cold_graph_ms, copies_for, gbps, print_table, write_json  # noqa: E402
from graphopt.kernels import fp4  # noqa: E402
from graphopt.kernels.fp4 import KernelConfig  # noqa: E402
from graphopt.kernels.fp4 import decode_persistent as dp  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
TRITON_TILES = [KernelConfig(16, 1, 1024, 1, num_warps=4, num_stages=1, int_dots=True),
                KernelConfig(16, 1, 512, 1, num_warps=4, num_stages=1, int_dots=True),
                KernelConfig(16, 1, 256, 8, num_warps=1, num_stages=1, int_dots=True),
                KernelConfig(32, 1, 256, 8, num_warps=1, num_stages=1, int_dots=True)]
PERSISTENT_TILES = [(1, 4, 4, 3), (1, 4, 8, 3), (1, 4, 16, 3), (1, 4, 4, 7), (1, 4, 8, 7), (1, 8, 4, 3), (1, 8, 4, 7),
                    (1, 2, 16, 7), (2, 4, 4, 1), (2, 4, 4, 3), (2, 4, 8, 3), (2, 8, 2, 1), (2, 8, 2, 3), (2, 2, 8, 3),
                    (4, 4, 4, 1), (4, 4, 8, 1)]  # (rows per warp, warps, programs per SM, chunks ahead)


def main() -> None:
    rows_out, cublas_ms = [], {}
    for fmt in ("nvfp4", "mxfp4"):
        for k, n in SHAPES:
            gen = torch.Generator().manual_seed(k + n)
            w = (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)
            q = fp4.quantize_fp4(w, fmt)
            kw = fp4.to_kernel_layout(q)
            copies = [kw] + [fp4.to_kernel_layout(q) for _ in range(copies_for(kw.nbytes) - 1)]
            x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
            ref = F.linear(x.float(), fp4.dequantize_fp4(q))
            nbytes = fp4.fp4_weight_bytes(k, n, fmt)
            if (k, n) not in cublas_ms:  # once per shape: the formats share it
                dense = [w] + [w.clone() for _ in range(copies_for(2 * n * k) - 1)]
                cublas_ms[k, n] = ms = cold_graph_ms([lambda wc=wc: F.linear(x, wc) for wc in dense])
                rows_out.append(dict(format="bf16", shape=f"{k}->{n}", kernel="cuBLAS", ms=ms,
                                     gbps=gbps(2 * n * k, ms)))
            cublas = cublas_ms[k, n]
            variants = {f"triton int {c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps}":
                        (lambda c_=c: lambda kc: fp4.fp4_linear_triton(x, kc.codes, kc.scales, kc.global_scale, None, n,
                                                                       k, fmt, path="gemv", config=c_))()
                        for c in TRITON_TILES}
            variants.update({f"persistent r{r} w{wp} p{per_sm} d{depth}": (
                lambda r_=r, wp_=wp, p_=per_sm, d_=depth: lambda kc: dp.fp4_gemv_persistent(
                    x, kc.codes, kc.scales, kc.global_scale, None, n, k, fmt, rows=r_, num_warps=wp_, programs_per_sm=p_,
                    depth=d_))()
                for r, wp, per_sm, depth in PERSISTENT_TILES})
            for name, run in variants.items():
                try:
                    y = run(kw)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err <= 2e-2:
                        print(f"[FAIL] {fmt} {k}->{n} {name}: rel err {err:.2e}", flush=True)
                        rows_out.append(dict(format=fmt, shape=f"{k}->{n}", kernel=name, rel_err=err, error="FAIL"))
                        continue
                    ms = cold_graph_ms([lambda kc=kc, run=run: run(kc) for kc in copies], reps=20)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported
                    print(f"[skip] {fmt} {k}->{n} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                rows_out.append(dict(format=fmt, shape=f"{k}->{n}", kernel=name, ms=ms, vs_cublas=cublas / ms,
                                     gbps=gbps(nbytes, ms), rel_err=err))
                print(rows_out[-1], flush=True)
    write_json("bench_fp4_persistent", rows_out)
    print_table("One-token FP4 decode (CUDA graph, L2-cold; vs_cublas: cuBLAS bf16 ms / ms)", rows_out,
                ["format", "shape", "kernel", "ms", "vs_cublas", "gbps", "rel_err"])


if __name__ == "__main__":
    main()
