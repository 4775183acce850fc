"""Decode attention: one query token per sequence against a static KV cache, GQA.

LLaMA-3-8B heads (32 query heads, 8 KV heads, head dim 128), bf16, a bool mask (B, 1, 1, Lk)
keeping all but the last 3 cache slots (a static cache's decode step), batch --batch, cache lengths
--lengths. Variants, each checked against a float64 reference (max |err| / max |ref|) and timed as
CUDA-graph replays (bench.common.cuda_graph_ms, median):
- decode: graphopt's split-key kernel (graphopt/kernels/decode_attention.py) with the chunk count
  the cost model picks, and decode/sN with N chunks (the sweep the cost model's fit reads);
- triton: graphopt's flash-attention kernel (one program per head and query block);
- sdpa-efficient, sdpa-cudnn: F.scaled_dot_product_attention with that backend on K/V repeated to
  32 heads and the mask, as transformers' SDPA attention calls it (the repeat included).
GB/s counts K and V read once (2 * B * 8 * Lk * 128 * 2 bytes). predicted_us is
graphopt.cost_model's estimate of each row (SDPA's decode coefficients are refit by
bench/validate_cost_model.py's sdpa_decode sweep).

--fit: fits decode_attention.fixed_s / step_s and attention.triton_flash_step_s (coefficients of
graphopt/cost/data/<gpu>.json) by least squares on the batch-1 rows at Lk 640 and 8192 and reports
the relative error of the estimates on every other row (held out).

    python bench/bench_decode_attention.py --fit --out $OUT/decode_attention_h100.json   # one H100, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.common import comma_ints, cuda_graph_ms, environment, gbps, print_table  # noqa: E402
from graphopt import cost_model, hardware  # noqa: E402
from graphopt.kernels import decode_attention as da  # noqa: E402
from graphopt.kernels.flash_attention import flash_attention_forward  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
FIT_LENGTHS = (640, 8192)


def variants(q, k, v, mask, hw, splits_sweep):
    scale = HEAD_DIM ** -0.5
    b, lk = q.shape[0], k.shape[2]
    chosen = cost_model.decode_attention_splits(hw, b, KV_HEADS, lk)
    out = {f"decode (s{chosen})": (lambda: da.decode_attention(q, k, v, mask, scale=scale, splits=chosen), chosen)}
    for s in splits_sweep:
        if s != chosen and s <= -(-lk // da.BLOCK_N):
            out[f"decode/s{s}"] = (lambda s=s: da.decode_attention(q, k, v, mask, scale=scale, splits=s), s)
    out["triton"] = (lambda: flash_attention_forward(q, k, v, mask, scale=scale, is_causal=False)[0], None)
    for name, backend in (("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                kr, vr = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
                return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale)
        out[name] = (call, None)
    return out


def measure(batch: int, lk: int, hw, splits_sweep) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(lk + batch)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, KV_HEADS, lk, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    mask = (torch.arange(lk, device="cuda") < lk - 3)[None, None, None, :].expand(batch, 1, 1, lk)
    ref = da.reference_decode_attention(q, k, v, mask, scale=HEAD_DIM ** -0.5).double()
    rows = []
    for name, (fn, splits) in variants(q, k, v, mask, hw, splits_sweep).items():
        row = {"batch": batch, "lk": lk, "variant": name, "splits": splits}
        try:
            err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
            ms = cuda_graph_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a backend that does not take the call says so in its row
            rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:160]})
            continue
        if name.startswith("decode"):
            predicted = cost_model.decode_attention(hw, batch, HEADS, 1, lk, HEAD_DIM, kv_heads=KV_HEADS, has_mask=True,
                                                    splits=splits).ms
        elif name == "triton":
            predicted = cost_model.fused_attention(hw, batch, HEADS, 1, lk, HEAD_DIM, family="triton_flash", has_mask=True,
                                                   kv_heads=KV_HEADS).ms
        else:  # SDPA on K/V repeated to every query head, the repeat included
            predicted = cost_model.sdpa(hw, batch, HEADS, 1, lk, HEAD_DIM, backend=name[len("sdpa-"):], has_mask=True,
                                        kv_heads=HEADS, repeated_from=KV_HEADS).ms
        rows.append({**row, "us": ms * 1e3, "GB/s": gbps(2 * batch * KV_HEADS * lk * HEAD_DIM * 2, ms), "max_rel_err": err,
                     "predicted_us": predicted * 1e3 if predicted else None})
    best = min(r["us"] for r in rows if "us" in r)
    for r in rows:
        r["x_best"] = r["us"] / best if "us" in r else None
    return rows


def fit(rows: list[dict], hw) -> dict:
    """Least squares of us = fixed + launches + walk * step on the fit rows; held-out errors."""
    launch_us = hw.launch_overhead * 1e6

    def walk(r):  # 64-key steps in sequence, as the cost model counts them
        if r["variant"] == "triton":
            return -(-r["lk"] // cost_model.DECODE_ATTENTION_BLOCK_N)
        return cost_model.decode_attention_walk(hw, r["batch"], KV_HEADS, r["lk"], r["splits"])

    result = {}
    for family, select, launches in (("decode", lambda r: r["variant"].startswith("decode"), 2),
                                     ("triton", lambda r: r["variant"] == "triton", 1)):
        data = [r for r in rows if select(r) and "us" in r]
        train = [r for r in data if r["batch"] == 1 and r["lk"] in FIT_LENGTHS]
        if len(train) < 2:
            continue
        xs = [walk(r) for r in train]
        ys = [r["us"] - launches * launch_us for r in train]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        step = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        fixed = my - step * mx
        if family == "triton":  # the cost model's flash walk has no fixed term of its own
            step, fixed = statistics.fmean(y / x for x, y in zip(xs, ys)), 0.0
        def predict(r):
            return launches * launch_us + fixed + step * walk(r)
        held = [r for r in data if r not in train]
        errors = [abs(predict(r) - r["us"]) / r["us"] for r in held]
        result[family] = {"fixed_us": fixed, "step_us": step, "fit_rows": len(train), "held_out_rows": len(held),
                          "held_out_median_rel_err": statistics.median(errors) if errors else None,
                          "held_out_max_rel_err": max(errors) if errors else None}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--lengths", default="256,640,2048,8192,32768")
    parser.add_argument("--splits", default="1,2,4,8,16,32,64", help="chunk counts of the decode/sN rows")
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention.py needs a CUDA GPU")
    hw = hardware.get_spec("auto")
    rows = []
    for batch in comma_ints(opts.batch):
        for lk in comma_ints(opts.lengths):
            rows += measure(batch, lk, hw, comma_ints(opts.splits))
    print_table(f"decode attention, H {HEADS} / KV {KV_HEADS}, D {HEAD_DIM}, bf16, bool mask", rows,
                ["batch", "lk", "variant", "us", "x_best", "GB/s", "predicted_us", "max_rel_err", "error"])
    fitted = fit(rows, hw) if opts.fit else None
    if fitted:
        print(json.dumps(fitted, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"environment": environment(), "options": vars(opts), "fit": fitted, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
