"""Where the FP4 prefill path (dequantize W to bf16, then cuBLAS) loses time at 4096 tokens, and
whether overlapping the decode of one slice of W with the GEMM of the previous slice pays.

For 5120->13824 and 13824->5120 (NVFP4, bf16, 4096 tokens), median times (triton do_bench):
  cublas        F.linear(x, w) on the original bf16 weight (the baseline)
  gemm_deq      F.linear(x, w_deq) on a pre-decoded weight (the GEMM half of the path alone)
  dequant       the Triton decode of W alone
  fp4_path      fp4_linear_triton(path="dequant"): decode + GEMM, as the pass runs it
  pipelined_S   W split into S slices of output rows: slice i+1 decoded on a side stream while
                slice i's GEMM runs, each GEMM writing its columns of one output in place
Each variant's output is compared with fp4_path (they must agree to bf16 rounding). A long
bf16 GEMM runs the H100 at its power limit, so whatever is timed first runs coolest: the variants
are timed in ROUNDS interleaved rounds and each reports the median of its rounds.

    python bench/fp4_prefill_overlap.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import interleaved_ms, print_table, write_json  # noqa: E402
from graphopt.kernels import fp4  # noqa: E402

SHAPES = [(5120, 13824), (13824, 5120)]
TOKENS = 4096
SLICES = (2, 4)
ROUNDS = 7


def pipelined(x, kw, n, k, fmt, slices: int, side: torch.cuda.Stream):
    """out[:, rows_i] = x @ decode(W[rows_i])^T with decode(i + 1) on `side` overlapping GEMM(i)."""
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    rows = -(-n // slices)
    rows = -(-rows // 64) * 64
    bounds = [(r, min(r + rows, n)) for r in range(0, n, rows)]
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    decoded, ready = [], []
    for lo, hi in bounds:  # all decodes queued on the side stream, in order
        with torch.cuda.stream(side):
            w = fp4.dequantize_triton(kw.codes[lo:hi], kw.scales[lo:hi], kw.global_scale, hi - lo, k, fmt, x.dtype)
            ev = torch.cuda.Event()
            ev.record(side)
        decoded.append(w)
        ready.append(ev)
    for (lo, hi), w, ev in zip(bounds, decoded, ready):
        main.wait_event(ev)
        torch.mm(x, w.t(), out=out[:, lo:hi])
        w.record_stream(main)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    fmt = "nvfp4"
    side = torch.cuda.Stream()
    rows = []
    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k + n)
        w = (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)
        kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, fmt))
        x = torch.randn(TOKENS, k, generator=gen).to("cuda", torch.bfloat16)
        w_deq = fp4.dequantize_triton(kw.codes, kw.scales, kw.global_scale, n, k, fmt, torch.bfloat16)
        ref = fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, fmt, path="dequant")
        variants = {
            "cublas": lambda: F.linear(x, w),
            "gemm_deq": lambda: F.linear(x, w_deq),
            "dequant": lambda: fp4.dequantize_triton(kw.codes, kw.scales, kw.global_scale, n, k, fmt, torch.bfloat16),
            "fp4_path": lambda: fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, fmt, path="dequant"),
        }
        for s in SLICES:
            variants[f"pipelined_{s}"] = lambda s=s: pipelined(x, kw, n, k, fmt, s, side)
        same = {}
        for name, fn in variants.items():
            y = fn()
            torch.cuda.synchronize()
            if name.startswith("pipelined"):
                same[name] = bool(torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.float().abs().max().item()))
        rounds = interleaved_ms(variants, rounds=ROUNDS)
        base = statistics.median(rounds["cublas"])
        for name, times in rounds.items():
            ms = statistics.median(times)
            rows.append({"shape": f"{k}->{n}", "variant": name, "ms": ms, "min_ms": min(times), "max_ms": max(times),
                         "vs_cublas": base / ms, "matches_fp4_path": same.get(name),
                         "tflops": 2.0 * TOKENS * n * k / (ms * 1e-3) / 1e12})
            print(f"{k}->{n} {name:<12} {ms:.4f} ms (rounds {min(times):.4f}-{max(times):.4f})  {base / ms:.3f}x cuBLAS  "
                  f"match={same.get(name)}", flush=True)
    path = write_json("fp4_prefill_overlap", rows)
    print_table(f"FP4 prefill at {TOKENS} tokens: where the time goes (vs_cublas = cuBLAS bf16 ms / variant ms)", rows)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
