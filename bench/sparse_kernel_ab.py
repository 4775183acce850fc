"""A/B of the block-sparse attention kernel against an earlier version of its module, in one process.

    git show <commit>:graphopt/kernels/sparse_attention.py > /tmp/sparse_baseline.py
    python bench/sparse_kernel_ab.py --baseline /tmp/sparse_baseline.py [more.py ...] [--fixed-config] [--heads 32]

Timing two versions in separate benchmark runs compares machines as much as kernels: the H100 runs
of session 12 moved by up to 8% between machines on unchanged rows. Here both modules run in one
process on the same masks (bench/common.random_block_mask, at 50% and 25% density, causal and
not, L = 8k and 16k, bf16, B=1, H=16 (--heads), D=128), timed interleaved over 9 rounds with cuDNN
dense, the starting variant rotating from round to round (bench.common.interleaved_ms), medians
reported. Several baselines may be given; each gets its own columns.

Each module autotunes on its own, so by default the two may pick different configs; with
--fixed-config both run the single loop at 4 warps and 2 stages (the config the tuner picked for
these rows in session 12), which isolates a change in the kernel body. The outputs are compared
(max abs difference) before timing; the baseline module must expose block_sparse_attention and
block_mask_to_lut as the current one does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import interleaved_ms, print_table, random_block_mask, split_key_blocks, write_json  # noqa: E402
from graphopt.kernels import sparse_attention as current  # noqa: E402

FIXED_CONFIG = {"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0, "SINGLE_LOOP": 1, "num_warps": 4, "num_stages": 2}
HEADS, HEAD_DIM = 16, 128


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("sparse_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, nargs="+", help="path(s) of earlier sparse_attention.py versions")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--fixed-config", action="store_true", help="both modules run FIXED_CONFIG, no autotuning")
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--densities", default="0.5,0.25")
    parser.add_argument("--causal", default="0,1", help="comma-separated 0/1")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME=JSON",
                        help='the current module again under FIXED_CONFIG updated with these keys, e.g. '
                             'merged=\'{"MERGED_SUFFIX": 1}\' (needs --fixed-config)')
    args = parser.parse_args()
    baselines = {("baseline" if i == 0 else f"baseline{i + 1}"): load_module(path) for i, path in enumerate(args.baseline)}
    config = FIXED_CONFIG if args.fixed_config else None
    if args.variants and config is None:
        parser.error("--variants needs --fixed-config")
    variants = {name: {**config, **json.loads(overrides)}
                for name, _, overrides in (item.partition("=") for item in args.variants)}
    others = {**baselines, **{name: current for name in variants}}  # every module run next to "current"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        q, k, v = (torch.randn(1, args.heads, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in [bool(int(c)) for c in args.causal.split(",")]:
            for density in [float(d) for d in args.densities.split(",")]:
                mask128 = random_block_mask(args.heads, length, density, causal, seed=3, block=current.BLOCK_M)
                lut, counts = current.block_mask_to_lut(split_key_blocks(mask128, length, current.BLOCK_M,
                                                                         current.BLOCK_N).cuda())

                def run(module, causal=causal, lut=lut, counts=counts, config=config):
                    return lambda: module.block_sparse_attention(q, k, v, lut, counts, is_causal=causal, config=config)
                fns = {**{name: run(module, config=variants.get(name, config)) for name, module in others.items()},
                       "current": run(current),
                       "cudnn": lambda causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
                current_out = fns["current"]().float()
                diffs = {f"max_abs_diff_{name}": (fns[name]().float() - current_out).abs().max().item() for name in others}
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    times = interleaved_ms(fns, rounds=args.rounds, rotate=True)
                ms = {name: statistics.median(t) for name, t in times.items()}
                row = {"L": length, "causal": causal, "density": density, **{f"{n}_ms": round(t, 4) for n, t in ms.items()}}
                for name in others:
                    row[f"current_vs_{name}"] = round(ms[name] / ms["current"], 3)
                    row[f"{name}_vs_cudnn"] = round(ms["cudnn"] / ms[name], 3)
                row["current_vs_cudnn"] = round(ms["cudnn"] / ms["current"], 3)
                rows.append({**row, **diffs})
                print(rows[-1], flush=True)
    write_json("sparse_kernel_ab", rows, baseline=args.baseline, fixed_config=config, variants=variants, heads=args.heads)
    print_table("sparse kernel A/B, one process, interleaved (speedups: > 1 is current faster)", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
