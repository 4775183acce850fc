"""A/B of the causal launch order (graphopt/kernels/tile_order.py) for the sparse and dense kernels.

    python bench/attention_tile_order.py [--lengths 8192,16384,32768]

Three orders, chosen through tile_order.L2_BUDGET_BYTES (read at each launch):
- "per-head": budget 0, a group of one head: the query blocks of one head, heaviest first, then the
  next head (the order before session 12);
- "grouped": the default budget (32 MB): heads in groups whose keys and values fit it;
- "all-heads": no budget: the heaviest block of every head first.
Rows: our block-sparse kernel at 100/50/25 % block density (random masks as in
bench_sparse_attention.py), our dense Triton flash kernel, causal, plus one non-causal control row
(the order is unchanged there); cuDNN dense is the baseline. bf16, B=1, H=16, D=128. Each row's
variants are timed interleaved (bench.common.interleaved_ms, 7 rounds). Checked first: the outputs
of all orders are bitwise equal, and match cuDNN (full masks) or the torch block-sparse reference
(two heads, sparse masks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import interleaved_ms, print_table, random_block_mask, split_key_blocks, write_json  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402
from graphopt.kernels import tile_order  # noqa: E402
from graphopt.kernels.flash_attention import flash_attention  # noqa: E402

ORDERS = {"per-head": 0, "grouped": tile_order.L2_BUDGET_BYTES, "all-heads": 1 << 62}
HEADS, HEAD_DIM = 16, 128


def block_mask(length: int, density: float, causal: bool, seed: int) -> torch.Tensor:
    """(1, H, nQ, nK) kernel blocks (128 x 64): bench_sparse_attention's random 128 x 128 masks."""
    mask128 = random_block_mask(HEADS, length, density, causal, seed, block=sa.BLOCK_M)
    return split_key_blocks(mask128, length, sa.BLOCK_M, sa.BLOCK_N)


def with_order(budget: int, fn):
    def run():
        tile_order.L2_BUDGET_BYTES = budget
        return fn()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384,32768")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, failures = [], 0
    for length in lengths:
        gen = torch.Generator(device="cuda").manual_seed(length)
        q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        cases = [("sparse", True, d) for d in (1.0, 0.5, 0.25)] + [("flash", True, 1.0), ("sparse", False, 0.5)]
        for kernel, causal, density in cases:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if kernel == "sparse":
                mask = block_mask(length, density, causal, seed=7).cuda()
                lut, counts = sa.block_mask_to_lut(mask)
                fn = lambda lut=lut, counts=counts, causal=causal: sa.block_sparse_attention(  # noqa: E731
                    q, k, v, lut, counts, is_causal=causal)
            else:
                mask = None
                fn = lambda causal=causal: flash_attention(q, k, v, is_causal=causal)  # noqa: E731
            outs = {name: with_order(budget, fn)() for name, budget in ORDERS.items()}
            tile_order.L2_BUDGET_BYTES = ORDERS["grouped"]
            same = all(torch.equal(outs["grouped"], o) for o in outs.values())
            if density == 1.0:  # a full mask is dense attention: compare with cuDNN
                err = (outs["grouped"].float() - ref.float()).abs().max().item()
            else:
                sub = sa.block_sparse_attention_reference(q[:, :2].float(), k[:, :2].float(), v[:, :2].float(),
                                                          mask[:, :2], is_causal=causal)
                err = (outs["grouped"][:, :2].float() - sub).abs().max().item()
            ok = same and err < 2e-2
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {kernel} L={length} causal={causal} density={density}: "
                  f"orders bitwise equal {same}, max abs error {err:.2e}")
            fns = {name: with_order(budget, fn) for name, budget in ORDERS.items()}
            fns["cudnn"] = lambda causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                times = interleaved_ms(fns)
            tile_order.L2_BUDGET_BYTES = ORDERS["grouped"]
            ms = {name: statistics.median(t) for name, t in times.items()}
            group = tile_order.causal_head_group(HEADS, 1, length, HEAD_DIM, 2) if causal else 1
            rows.append({"kernel": kernel, "L": length, "causal": causal, "density": density, "head_group": group,
                         **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
                         "grouped_vs_per_head": round(ms["per-head"] / ms["grouped"], 3),
                         "per_head_vs_cudnn": round(ms["cudnn"] / ms["per-head"], 3),
                         "grouped_vs_cudnn": round(ms["cudnn"] / ms["grouped"], 3),
                         "all_heads_vs_cudnn": round(ms["cudnn"] / ms["all-heads"], 3)})
            print(rows[-1], flush=True)
    write_json("attention_tile_order", rows)
    print_table("causal launch order: per-head (old) / grouped (new default) / all heads; speedup vs cuDNN", rows,
                ["kernel", "L", "causal", "density", "head_group", "cudnn_ms", "per-head_ms", "grouped_ms",
                 "all-heads_ms", "grouped_vs_per_head", "per_head_vs_cudnn", "grouped_vs_cudnn", "all_heads_vs_cudnn"])
    print(f"{failures} correctness failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
