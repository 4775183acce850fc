"""Every launch config of the block-sparse attention kernel, timed one by one against cuDNN and
our dense flash kernel: which pipeline depth / index prefetch / TMA choice wins, and by how much.

    python bench/sparse_kernel_configs.py                 # H100/H200: bf16, B=1, H=16 (--heads), D=128
    python bench/sparse_kernel_configs.py --cpu-smoke     # tiny sizes through the interpreter

The autotuner picks among these at run time; this script shows the spread it picks from, so a
change to the kernel can be judged config by config. Block masks are random at the given
density (diagonal blocks kept under causality), the same for every config.
"""

from __future__ import annotations

import traceback

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
ARGS.add_argument("--lengths", default="8192,16384")
ARGS.add_argument("--densities", default="1.0,0.5,0.25")
ARGS.add_argument("--heads", type=int, default=16)
ARGS.add_argument("--only", default="", help="time only configs whose settings include these, e.g. USE_TMA=1")
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import median_ms, print_table, tflops, write_json  # noqa: E402
from graphopt.kernels import flash_attention as fa  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
HEADS, HEAD_DIM = (OPTS.heads, 128) if GPU else (2, 64)
LENGTHS = [int(v) for v in OPTS.lengths.split(",")] if GPU else [256]
DENSITIES = [float(v) for v in OPTS.densities.split(",")]


def block_mask(length: int, density: float, causal: bool) -> torch.Tensor:
    n_q, n_k = sa.cdiv(length, sa.BLOCK_M), sa.cdiv(length, sa.BLOCK_N)
    gen = torch.Generator().manual_seed(length)
    mask = torch.rand(1, HEADS, n_q, n_k, generator=gen) < density
    allowed, diagonal = sa.causal_block_geometry(n_q, n_k, length, length, sa.BLOCK_M, sa.BLOCK_N)
    if causal:
        mask = (mask & allowed) | diagonal
    mask[..., 0] = True
    return mask.to(DEVICE)


def main() -> None:
    configs = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in sa._attention_configs()]
    if not GPU:
        configs = [{"PREFETCH_INDEX": 1, "USE_TMA": t, "PAIR_BLOCKS": p, "num_warps": 4, "num_stages": 1}
                   for t in (0, 1) for p in (0, 1)]
    for setting in filter(None, OPTS.only.split(",")):
        name, value = setting.split("=")
        configs = [c for c in configs if str(c.get(name)) == value]
    if GPU and HEAD_DIM >= 128:  # what the autotuner keeps (sparse_attention._prune_attention_configs)
        configs = [c for c in configs if c["num_warps"] == 8 or c.get("SINGLE_LOOP")]
    rows = []
    for length in LENGTHS:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16 if GPU else torch.float32)
                       for _ in range(3))
            dense_flops = 4.0 * HEADS * length * length * HEAD_DIM * (0.5 if causal else 1.0)
            base = {"L": length, "causal": causal}
            if GPU:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    cudnn_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                flash_ms = median_ms(lambda: fa.flash_attention(q, k, v, is_causal=causal))
                rows.append({**base, "variant": "cuDNN dense", "ms": cudnn_ms, "tflops": tflops(dense_flops, cudnn_ms), "vs_cudnn": 1.0})
                rows.append({**base, "variant": "ours dense flash", "ms": flash_ms, "tflops": tflops(dense_flops, flash_ms),
                             "vs_cudnn": cudnn_ms / flash_ms})
            else:
                cudnn_ms = None
            for density in DENSITIES:
                mask = block_mask(length, density, causal)
                lut, counts = sa.block_mask_to_lut(mask)
                ref = sa.block_sparse_attention_reference(q.float(), k.float(), v.float(), mask, is_causal=causal)
                kept = mask.float().mean().item() / (0.5 if causal else 1.0)
                for cfg in configs:
                    row = {**base, "density": density, "variant": str(cfg)}
                    try:
                        run = lambda cfg=cfg: sa.block_sparse_attention(q, k, v, lut, counts, is_causal=causal, config=cfg)  # noqa: E731
                        err = (run().float() - ref).abs().max().item()
                        ms = median_ms(run)
                        row.update(check="PASS" if err < 3e-2 else "FAIL", err=err, ms=ms,
                                   dense_equiv_tflops=tflops(dense_flops * kept, ms),
                                   vs_cudnn=(cudnn_ms / ms) if cudnn_ms else None)
                    except Exception as exc:  # noqa: BLE001 - one config must not end the sweep
                        row.update(check="FAIL", error=f"{type(exc).__name__}: {str(exc)[:120]}")
                        traceback.print_exc()
                    print(row, flush=True)
                    rows.append(row)
    path = write_json("sparse_kernel_configs", rows)
    print(f"wrote {path}")
    print_table("block-sparse kernel configs (vs_cudnn = cuDNN dense ms / this ms)", rows,
                ["L", "causal", "density", "variant", "check", "ms", "dense_equiv_tflops", "tflops", "vs_cudnn", "error"])


if __name__ == "__main__":
    main()
