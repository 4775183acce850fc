"""How far 4-bit weights alone move the greedy choices of the random-weight LLaMA models: the
yardstick for the regret / top1 columns of bench_decode_loop.py and bench_generate.py.

Random weights make a deep model's top logits nearly tie, and a 32-layer random stack carries a
small perturbation of its weights all the way to the logits: the quantized model's greedy tokens
are then mostly not the plain model's, however correct the kernels. So a quantized variant's
regret in the loop benches is read against the regret of the same quantization computed here in
plain PyTorch (fp32, dequantized weights, HF generate), not against zero. Rows:

- random: uniformly random tokens, what a kernel computing garbage scores;
- bf16: the linears' weights rounded to bf16;
- nvfp4, mxfp4: every linear and lm_head through graphopt's quantize_fp4 with the scale search
  the fp4_linear pass uses (per weight: the pass's sibling groups share one NVFP4 tensor scale);
- q4_0: every linear and lm_head through ggml Q4_0, weights only (q4_linear also rounds the
  activations to Q8_1);
- int4: the decoder layers' linears through gpt-fast's int4 in groups of 128, as the int4
  baseline (llama_models.int4_groups; lm_head stays).

Each row generates --new-tokens greedy tokens from the same random prompt and scores them under
the plain fp32 model on the row's own prefix (llama_models.choice_regret). The schemes quantize the
fp32 weights (the passes get the bf16 ones: a difference far below the 4-bit error); a tied lm_head
(1B) is quantized apart from the input embeddings, as the passes do.

    python bench/quantization_regret.py --out $OUT/quantization_regret_h200.json   # 1b and 8b on one GPU, ~2 min
    python bench/quantization_regret.py --shapes 1b --prompt 64 --new-tokens 17    # CPU, ~3 min
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench import llama_models as lm  # noqa: E402
from bench.common import print_table  # noqa: E402
from graphopt.kernels import q4  # noqa: E402
from graphopt.kernels.fp4 import dequantize_fp4, quantize_fp4  # noqa: E402
from graphopt.passes.fp4_linear import SCALE_SEARCH  # noqa: E402

SCHEMES = ("random", "bf16", "nvfp4", "mxfp4", "q4_0", "int4")


def _fp4(fmt: str):
    return lambda w: dequantize_fp4(quantize_fp4(w, fmt, scale_search=SCALE_SEARCH))


def _q4_0(w: torch.Tensor) -> torch.Tensor:
    return q4.dequantize_packed(*q4.quantize_weight(w), w.shape[1])


WEIGHTS = {"bf16": lambda w: w.bfloat16().float(), "nvfp4": _fp4("nvfp4"), "mxfp4": _fp4("mxfp4"), "q4_0": _q4_0,
           "int4": lm.int4_dequantized}


def _linears(model: nn.Module, scheme: str) -> dict[str, nn.Linear]:
    """The linears a scheme quantizes: the decoder layers' for int4 (as gpt-fast), also lm_head
    for the others (as the fp4_linear and q4_linear passes do)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and (scheme != "int4" or name.startswith("model.layers."))}


def measure(model: nn.Module, prompt: torch.Tensor, new_tokens: int, scheme: str) -> dict:
    start = time.perf_counter()
    if scheme == "random":
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model.config.vocab_size, (prompt.shape[0], new_tokens), generator=gen)
        return {**lm.choice_regret(model, prompt, tokens.to(prompt.device)), "s": time.perf_counter() - start}
    head = model.lm_head
    if head.weight is model.get_input_embeddings().weight:  # tied (1B): the passes quantize lm_head only
        model.lm_head = copy.deepcopy(head)
    linears = _linears(model, scheme)
    plain = {name: m.weight.detach().clone() for name, m in linears.items()}
    try:
        for name, m in linears.items():
            m.weight.copy_(WEIGHTS[scheme](plain[name]))
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                attention_mask=torch.ones_like(prompt))[:, prompt.shape[1]:]
    finally:
        for name, m in linears.items():
            m.weight.copy_(plain[name])
        model.lm_head = head
    return {**lm.choice_regret(model, prompt, tokens), "s": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b,8b", help=f"comma list of {', '.join(lm.SHAPES)}")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma list of " + ", ".join(SCHEMES))
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=33, help="generated tokens (the first is not scored)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/quantization_regret_<gpu>.json)")
    opts = parser.parse_args()
    schemes, shapes = opts.schemes.split(","), opts.shapes.split(",")
    for name, values, valid in (("scheme", schemes, SCHEMES), ("shape", shapes, lm.SHAPES)):
        if bad := [v for v in values if v not in valid]:
            raise SystemExit(f"unknown {name} {bad}; valid choices: {', '.join(valid)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in shapes:
        model = lm.build_model(shape, device, torch.float32)
        prompt = lm.random_prompt(model, 1, opts.prompt)
        with torch.no_grad():
            for scheme in schemes:
                rows.append({"shape": shape, "scheme": scheme, **measure(model, prompt, opts.new_tokens, scheme)})
                print(rows[-1], flush=True)
        del model
        lm.fresh_start(device)
    print_table("greedy choices of 4-bit weights under the plain fp32 model (random weights)", rows)
    lm.write_result("quantization_regret", opts, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
