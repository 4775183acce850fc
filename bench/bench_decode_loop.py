"""Greedy decode tokens/s of LLaMA-3.2-1B and LLaMA-3-8B (random weights) in gpt-fast's loop.

The plain model fills a transformers StaticCache from a random prompt (max_cache_len = prompt +
new tokens) and gives the first token; then a one-token step, model(...).logits[:, -1].argmax(),
torch.compile'd per variant, runs new_tokens - 1 times in a Python loop (with
cudagraph_mark_step_begin before each call when the mode uses CUDA graphs). This is the loop
gpt-fast and most serving code run, without generate()'s per-step Python (bench_generate.py
measures that one). Variants (--variants):

- eager: the step uncompiled;
- inductor: backend="inductor";
- int4: gpt-fast's int4 weight-only baseline (bench/llama_models.py Int4Linear: the decoder
  layers' linears in 4 bits, groups of 128, aten's tinygemm kernel), compiled by Inductor;
- graphopt, graphopt-fp4, graphopt-q4: graphopt.backend() with its default passes, with
  fp4_linear, with q4_linear (--force: force=True for the last two);
- graphopt-fp4-unfused (only when named): graphopt-fp4 without the decode fusion
  (fuse_decode_neighbours=False), the ablation of graphopt.passes.linear_fusion.

Each compiled variant runs once per --modes entry (default reduce-overhead, i.e. CUDA graphs).
Per variant: one loop as warm-up (it compiles; "compile_s" is its wall time minus a timed
loop's), then --repeats timed loops. tok_s = batch * (new_tokens - 1) / the median decode time
(prefill excluded); ms_step is the same time per step. peak_gb: torch.cuda.max_memory_allocated
over the variant (the model's bf16 weights stay on the GPU in every variant, since one model
serves them all, so quantized variants count both copies). agree: the fraction of greedy tokens
equal to the eager loop's (identical: all of them; random weights nearly tie the top logits, so
any numeric change parts the sequences early). regret / top1: each chosen token scored by the
plain model on the variant's own prefix (llama_models.choice_regret): the mean gap to the top
logit in units of the logits' standard deviation, and the share of choices that are its argmax; a
kernel computing garbage shows as a regret of several units. vs_inductor / vs_int4: tok_s over
that of the same shape, batch and mode.

    python bench/bench_decode_loop.py --out $OUT/decode_loop_h100.json   # 1b and 8b, batch 1 and 8: ~25 min on one H100
    python bench/bench_decode_loop.py --shapes tiny --new-tokens 8 --prompt 16 --batch 1 --repeats 1   # CPU
"""

from __future__ import annotations

import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script, bench/ is sys.path[0]; `bench.*` and `graphopt` live at the root
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.llama_models import (DecodeLoop, arguments, compile_kwargs, peak_gb, resolve, rewrite_summary,  # noqa: E402
                                sweep, timed)
from graphopt.compiler import recording_decisions  # noqa: E402

COLUMNS = ["variant", "mode", "tok_s", "vs_inductor", "vs_int4", "ms_step", "compile_s", "peak_gb", "regret", "top1", "agree",
           "rewrites", "identical", "error"]


def measure(model, prompt: torch.Tensor, opts, variant: str, mode: str) -> tuple[dict, torch.Tensor]:
    """One variant's row and its greedy tokens."""
    loop = DecodeLoop(model, prompt, opts.new_tokens, compile_kwargs(variant, mode, opts.force),
                      skip_guard_eval=getattr(opts, "skip_guard_eval", False))
    with recording_decisions() as decisions:  # the first run compiles
        _, first_s = timed(lambda: loop.run(opts.device), opts.device)
    walls, decode = [], []
    for _ in range(opts.repeats):
        (tokens, decode_s), wall_s = timed(lambda: loop.run(opts.device), opts.device)
        walls.append(wall_s)
        decode.append(decode_s)
    seconds, steps = statistics.median(decode), opts.new_tokens - 1
    return {"tok_s": prompt.shape[0] * steps / seconds, "ms_step": seconds / steps * 1e3,
            "compile_s": None if variant == "eager" else first_s - statistics.median(walls),
            "peak_gb": peak_gb(opts.device), "rewrites": rewrite_summary(decisions), "decode_s": decode}, tokens


def main() -> None:
    opts = resolve(arguments(__doc__).parse_args())
    sweep(opts, measure, "decode loop", COLUMNS, name="decode_loop")


if __name__ == "__main__":
    main()
