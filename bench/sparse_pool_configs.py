"""The sparse-attention predictor's pooling launch (v2: one program per Q or K block) timed per
load-slice size, warp count and slice-loop form (unrolled, or pipelined over n stages), against the bytes it must read (Q and K once): achieved GB/s and
the share of the copy bandwidth, with each config checked against the torch reference
(`pool_blocks`) first.

    python bench/sparse_pool_configs.py               # H100/H200: bf16, B=1, H=16, D=128
    python bench/sparse_pool_configs.py --heads 32 --slices 512,1024,2048 --warps 1,2 --stages 0,2,3
    python bench/sparse_pool_configs.py --cpu-smoke   # tiny sizes through the interpreter
"""

from __future__ import annotations

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--lengths", default="8192,16384")
ARGS.add_argument("--heads", type=int, default=16)
ARGS.add_argument("--slices", default="1024,2048,4096", help="elements per load slice (tokens x head dim)")
ARGS.add_argument("--warps", default="1,2,4")
ARGS.add_argument("--stages", default="0,2,3", help="0: unrolled slice loop; n: loop pipelined over n stages")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402

from bench.common import comma_ints, cuda_graph_ms, gbps, median_ms, print_table, write_json  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
LENGTHS = [int(v) for v in OPTS.lengths.split(",")] if GPU else [200]
HEADS, HEAD_DIM = (OPTS.heads, 128) if GPU else (2, 32)


CONFIGS = ([(e, w, st) for e in comma_ints(OPTS.slices) for w in comma_ints(OPTS.warps)
            for st in comma_ints(OPTS.stages)] if GPU
           else [(128, 1, 0), (256, 2, 2), (1024, 4, 0)])


def main() -> None:
    from graphopt.calibrate import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth(512 << 20, DEVICE) if GPU else float("nan")
    rows = []
    for length in LENGTHS:
        gen = torch.Generator().manual_seed(length)
        q = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
        k = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
        ref_q, ref_sq = sa.pool_blocks(q, sa.BLOCK_M)
        ref_k, ref_sk = sa.pool_blocks(k, sa.BLOCK_N)
        nbytes = 2 * q.numel() * q.element_size()
        for elements, warps, stages in CONFIGS:
            row = {"L": length, "slice_elements": elements, "warps": warps, "loop_stages": stages}
            options = dict(slice_elements=elements, num_warps=warps, loop_stages=stages)
            try:
                pq, sq, pk, sk = sa.pool_qk_triton(q, k, **options)
                err = max((a - b).abs().max().item() for a, b in ((pq, ref_q), (sq, ref_sq), (pk, ref_k), (sk, ref_sk)))
                fn = lambda: sa.pool_qk_triton(q, k, **options)  # noqa: E731
                ms = cuda_graph_ms(fn) if GPU else median_ms(fn, rep_ms=5)
                row.update(check="PASS" if err < 1e-3 else "FAIL", max_abs_err=err, ms=ms, gbps=gbps(nbytes, ms),
                           of_copy_bw=nbytes / (ms * 1e-3) / copy_bw)
            except Exception as exc:  # noqa: BLE001 - one config must not end the sweep
                row.update(check="FAIL", error=f"{type(exc).__name__}: {str(exc)[:120]}")
            print(row, flush=True)
            rows.append(row)
    path = write_json("sparse_pool_configs", rows, copy_bandwidth_gbps=copy_bw / 1e9)
    print(f"wrote {path}")
    print_table(f"predictor pooling (v2) per load slice, warps and loop stages; H={HEADS}; copy {copy_bw / 1e9:.0f} GB/s",
                rows, ["L", "slice_elements", "warps", "loop_stages", "check", "max_abs_err", "ms", "gbps", "of_copy_bw", "error"])


if __name__ == "__main__":
    main()
