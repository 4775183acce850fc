"""HF generate() greedy decode speed of LLaMA-3.2-1B and LLaMA-3-8B (random weights), as users run it.

Each variant calls model.generate(prompt, max_new_tokens=N, do_sample=False,
cache_implementation="static", compile_config=CompileConfig(backend=..., mode=...)): generate runs
the prefill uncompiled and compiles the one-token forward it calls for every later token.
eos_token_id=None, so generation never stops before N tokens and no logits processor is added.
Variants (--variants): eager (disable_compile=True), inductor, int4 (gpt-fast's int4
weight-only baseline, bench/llama_models.py Int4Linear, compiled by Inductor), graphopt,
graphopt-fp4, graphopt-q4 (graphopt.backend() with its default passes, with fp4_linear, with
q4_linear; --force: force=True for the last two). Each compiled variant runs once per --modes
entry (default reduce-overhead, i.e. CUDA graphs).

Per variant: generate(N) once as warm-up (it compiles; "compile_s" is its wall time minus the
median timed generate(N)) and generate(1) once, then --repeats timed pairs, each timed with
perf_counter between device synchronizations; medians:
- tok_s, decode tokens/s = batch * (N - 1) / (t_N - t_1); t_1 is prefill and the first token;
- ttft_ms = t_1 (generate's setup included);
- peak_gb: torch.cuda.max_memory_allocated over the variant (one model serves every variant, so
  its bf16 weights count in the quantized variants too);
- agree / identical: the fraction of generated tokens equal to the eager variant's / all equal
  (random weights nearly tie the top logits: any numeric change parts the sequences early);
- regret / top1: each generated token scored by the plain model on the variant's own prefix
  (llama_models.choice_regret): the mean gap to the top logit in logit standard deviations, and
  the share of choices that are its argmax (garbage from a kernel shows as several units);
- vs_inductor / vs_int4: tok_s over that of the same shape, batch and mode.

HF overhead (hf_ms_token, on the inductor rows): what generate's own per-step work costs. The
same compiled forward (Inductor, same mode) is called directly in gpt-fast's loop
(llama_models.DecodeLoop: a StaticCache made once, the step called N - 1 times with
cudagraph_mark_step_begin); hf_ms_token = (t_N - t_1) / (N - 1) minus that loop's time per step.
It counts generate's Python per step (input preparation, the 4D mask it builds, stopping checks)
and, under CUDA graphs, the cost of generate making a new StaticCache each call: its tensors are
inputs the graph holds at fixed addresses, and CUDA-graph trees re-record when one moves.
--cache reused: one StaticCache made per variant, reset and passed to every generate call (as HF
documents for a cache the caller keeps), so its tensors keep their addresses between calls.

    python bench/bench_generate.py --out $OUT/generate_h100.json   # 1b and 8b, batch 1 and 8: ~25 min on one H100
    python bench/bench_generate.py --shapes tiny --new-tokens 8 --prompt 16 --batch 1 --repeats 1   # CPU
"""

from __future__ import annotations

import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script, bench/ is sys.path[0]; `bench.*` and `graphopt` live at the root
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.llama_models import (DecodeLoop, arguments, cache_argument, compile_kwargs, peak_gb, resolve,  # noqa: E402
                                rewrite_summary, sweep, timed)
from graphopt.compiler import recording_decisions  # noqa: E402

COLUMNS = ["variant", "mode", "tok_s", "vs_inductor", "vs_int4", "ttft_ms", "compile_s", "peak_gb", "regret", "top1", "agree",
           "rewrites", "identical", "loop_tok_s", "hf_ms_token", "error"]


def generate_fn(model, prompt: torch.Tensor, opts, variant: str, mode: str):
    """generate(new_tokens) for a variant, as a function of new_tokens returning the new tokens."""
    from transformers import CompileConfig

    kwargs = compile_kwargs(variant, mode, opts.force)
    if kwargs is None:
        kwargs = {"disable_compile": True}
    else:
        config = CompileConfig(**kwargs)
        config._compile_all_devices = True  # generate compiles only on accelerators unless told (the CPU smoke run)
        kwargs = {"compile_config": config}

    cache = None
    if opts.cache == "reused":
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + opts.new_tokens)
        cache_arg = cache_argument(model)

    def run(new_tokens: int) -> torch.Tensor:
        if cache is None:
            cache_kwargs = {"cache_implementation": "static"}
        else:
            cache.reset()
            cache_kwargs = {cache_arg: cache}
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             **cache_kwargs, **kwargs)
        return out[:, prompt.shape[1]:]
    return run


def measure(model, prompt: torch.Tensor, opts, variant: str, mode: str) -> tuple[dict, torch.Tensor]:
    """One variant's row and its generated tokens."""
    n, device = opts.new_tokens, opts.device
    generate = generate_fn(model, prompt, opts, variant, mode)
    with recording_decisions() as decisions:  # the first run compiles
        _, first_s = timed(lambda: generate(n), device)
    timed(lambda: generate(1), device)
    t_n, t_1 = [], []
    for _ in range(opts.repeats):
        tokens, seconds = timed(lambda: generate(n), device)
        t_n.append(seconds)
        t_1.append(timed(lambda: generate(1), device)[1])
    decode_s = statistics.median(t_n) - statistics.median(t_1)
    row = {"tok_s": prompt.shape[0] * (n - 1) / decode_s if decode_s > 0 else None, "ttft_ms": statistics.median(t_1) * 1e3,
           "compile_s": None if variant == "eager" else first_s - statistics.median(t_n),
           "peak_gb": peak_gb(device), "rewrites": rewrite_summary(decisions), "t_n_s": t_n, "t_1_s": t_1}
    if variant == "inductor" and getattr(opts, "hf_overhead", True):
        row.update(hf_overhead(model, prompt, opts, mode, decode_s))
    return row, tokens


def hf_overhead(model, prompt: torch.Tensor, opts, mode: str, generate_decode_s: float) -> dict:
    """The inductor step called directly in gpt-fast's loop, and generate's extra time per token."""
    loop = DecodeLoop(model, prompt, opts.new_tokens, compile_kwargs("inductor", mode, opts.force))
    loop.run(opts.device)  # compiles
    loop_s = statistics.median(loop.run(opts.device)[1] for _ in range(opts.repeats))
    steps = opts.new_tokens - 1
    return {"loop_tok_s": prompt.shape[0] * steps / loop_s, "hf_ms_token": (generate_decode_s - loop_s) / steps * 1e3}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--cache", choices=("new", "reused"), default="new",
                        help="new: cache_implementation='static' (a new StaticCache each call, as HF documents); "
                             "reused: one StaticCache, reset and passed to every call")
    opts = resolve(parser.parse_args())
    sweep(opts, measure, "HF generate", COLUMNS, name="generate")


if __name__ == "__main__":
    main()
