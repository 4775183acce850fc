"""How fast can the Q4 one-token decode's access pattern read its weights at all? A probe, not a
kernel of graphopt: Triton programs that only read a (N, K/2) byte matrix of packed 4-bit weights
and XOR the words together, timed as CUDA-graph replays over rotated copies (L2-cold).

Patterns, all reading the same bytes with 16-byte loads:
- "rows": the dp4a decode kernel's tiling. A program owns BLOCK_N weight rows and a split of K, and
  each step reads STEP_BYTES from each of its rows (rows K/2 bytes apart).
- "tiles": the same programs and steps, over a layout where each (BLOCK_N rows x STEP_BYTES) tile
  is one contiguous block, so each program reads one contiguous range (a layout a decode kernel
  could be given offline).
A torch.sum over the same bytes (as fp32) is timed too, for scale.

    python bench/decode_read_pattern.py               # one H100/H200, under a minute
    python bench/decode_read_pattern.py --cpu-smoke   # tiny sizes through the Triton interpreter
"""

from __future__ import annotations

from script_args import bench_arguments, parse_bench_arguments  # a sibling: bench/ is sys.path[0]

ARGS = bench_arguments(__doc__)
OPTS = parse_bench_arguments(ARGS)  # before any kernel module is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import gbps, print_table, write_json  # noqa: E402
from graphopt.hardware.timing import cold_graph_ms, copies_for  # noqa: E402

GPU = torch.cuda.is_available() and not OPTS.cpu_smoke
DEVICE = "cuda" if GPU else "cpu"
SHAPES = [(5120, 13824), (13824, 5120)] if GPU else [(256, 64)]
# (rows per program, bytes per row and step, warps, programs along K): the best one-token dp4a
# tiles of bench/results/q4_decode_h100_splits.* and wider variants
TILES = [(32, 128, 1, 4), (16, 128, 1, 8), (16, 256, 1, 2), (32, 256, 1, 4), (64, 256, 4, 4),
         (64, 1024, 4, 1), (64, 512, 4, 1), (128, 512, 8, 1), (32, 512, 4, 2), (64, 256, 4, 1), (128, 256, 8, 1)] if GPU else [(16, 64, 1, 2)]


@triton.jit
def _read_kernel(w_ptr, out_ptr, row_words, steps_per_split, n_steps,
                 PATTERN: tl.constexpr, BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr):
    """PATTERN 0 rows, 1 tiles (see the module docstring); one int32 out per program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, STEP_WORDS)
    acc = tl.zeros((BLOCK_N, STEP_WORDS), dtype=tl.int32)
    s_begin = pid_k * steps_per_split
    s_end = tl.minimum(s_begin + steps_per_split, n_steps)
    for s in range(s_begin, s_end):
        if PATTERN == 0:
            ptrs = w_ptr + (pid_n * BLOCK_N + offs_n)[:, None].to(tl.int64) * row_words + s * STEP_WORDS + offs_w[None, :]
        else:  # tile (pid_n, s) is one contiguous block
            tile = pid_n.to(tl.int64) * n_steps + s
            ptrs = w_ptr + tile * (BLOCK_N * STEP_WORDS) + offs_n[:, None] * STEP_WORDS + offs_w[None, :]
        acc ^= tl.load(ptrs)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def main() -> None:
    rows = []
    for k, n in SHAPES:
        nbytes = n * k // 2
        base = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=DEVICE)
        copies = [base] + [base.clone() for _ in range(copies_for(nbytes) - 1 if GPU else 0)]
        expected = int(np.bitwise_xor.reduce(base.cpu().numpy().ravel()))  # every word read once
        # torch's own reduction over the same bytes, for scale
        ms = cold_graph_ms([lambda w=w: torch.sum(w.view(torch.float32)) for w in copies])
        rows.append({"shape": f"{k}->{n}", "tile": "torch.sum (fp32 view)", "programs": "", "pattern": "flat",
                     "us": ms * 1e3, "gbps": gbps(nbytes, ms)})
        print(rows[-1], flush=True)
        for block_n, step_bytes, warps, split in TILES:
            step_words = step_bytes // 4
            if (k // 8) % step_words:
                continue  # steps must tile a row (and be a power of two of words)
            n_steps = (k // 8) // step_words
            per_split = triton.cdiv(n_steps, split)
            grid = (n // block_n, triton.cdiv(n_steps, per_split))
            out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=DEVICE)
            for pattern, name in ((0, "rows"), (1, "tiles")):
                def layout(w):  # tiles: (N / BN, steps, BN, step words)
                    return w if pattern == 0 else \
                        w.reshape(n // block_n, block_n, n_steps, step_words).transpose(1, 2).contiguous()
                arranged = [layout(w) for w in copies]

                def run(w):
                    _read_kernel[grid](w, out, k // 8, per_split, n_steps, PATTERN=pattern, BLOCK_N=block_n,
                                       STEP_WORDS=step_words, num_warps=warps)
                run(arranged[0])
                value = int(np.bitwise_xor.reduce(out.cpu().numpy()))
                assert value == expected, f"{name}: XOR {value} != {expected} (words skipped or read twice)"
                ms = cold_graph_ms([lambda w=w: run(w) for w in arranged])
                rows.append({"shape": f"{k}->{n}", "tile": f"{block_n}x{step_bytes}B w{warps} split{split}",
                             "programs": grid[0] * grid[1], "pattern": name, "us": ms * 1e3, "gbps": gbps(nbytes, ms)})
                print(rows[-1], flush=True)
    path = write_json("decode_read_pattern", rows)
    print(f"wrote {path}")
    print_table("Reading Q4 weight bytes in the decode kernel's tiling (CUDA graph, L2-cold)", rows,
                ["shape", "tile", "programs", "pattern", "us", "gbps"])


if __name__ == "__main__":
    main()
