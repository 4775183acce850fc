"""Attention benchmark: naive attention under eager / Inductor / graphopt against
SDPA's flash and cuDNN backends and our Triton kernel, then a LLaMA-7B-shaped end-to-end prefill.

    python bench/bench_attention.py                  # one H100/H200, bf16, well under 5 minutes
    python bench/bench_attention.py --cpu-smoke      # whole script at tiny sizes on CPU (interpreter)
    python bench/bench_attention.py --skip-e2e --lengths 4096,8192

Kernel rows: bf16, D=128, H=32, L in {1k, 4k, 8k, 16k}, causal and not, B = 16384 // L (16k tokens
per row, so short sequences still fill the GPU). FLOPs = 4*B*H*L*L*D, halved when causal. Every
variant is first checked against SDPA (default backend) - max |err| / max |ref| <= 2e-2 - then timed
with bench.common.median_ms. "x SDPA best" = time / fastest of SDPA flash and cuDNN (< 1 is faster).
Naive variants materialize (B, H, L, L) scores; they are skipped when that does not fit in free
memory (the row says so).

Backward rows: the training path of graphopt::attention on our Triton kernel (its forward keeps
the log-sum-exp, graphopt::attention_backward reads it), called as the attention pass emits it and
compiled from the naive module with graphopt under Inductor, against SDPA flash / cuDNN; fwd+bwd,
and the backward alone (autograd.grad with retain_graph on one recorded forward); "x cuDNN" = cuDNN
time / this time (> 1 is faster). Gradients are checked against SDPA's, at L in {1k, 4k} unless
--bwd-lengths says otherwise:

    python bench/bench_attention.py --skip-kernels --skip-variants --skip-e2e --bwd-lengths 1024,4096,8192,16384

End-to-end rows: transformers LlamaForCausalLM with LLaMA-7B shapes (hidden 4096, 32 heads,
intermediate 11008, vocab 32000), 2 layers, random weights, bf16, batch 1, prefill of 2048 and
4096 tokens under torch.no_grad(): attn_implementation="eager" under eager / Inductor / graphopt,
and attn_implementation="sdpa" under Inductor (the baseline) and under graphopt (whose attention pass
also takes SDPA calls), and under graphopt with every linear in NVFP4 (`E2E_FP4_OPTIONS`: the prefill
of a model that keeps only its FP4 weights). Logits are checked against eager.

Decode rows (--decode): one query token against Lk cached keys, B=1, each SDPA backend and the
graphopt op on our Triton kernel, timed as CUDA-graph replays.

Variant rows: our Triton kernel with soft-capped scores (cap 50, Gemma 2's) and with ALiBi (BLOOM's
slopes) against the plain kernel, forward and fwd+bwd, L=4096, D=128, causal and not ("x plain" =
plain time / variant time, >= 0.9 is the goal). Each is checked in bf16 against a float64
reference: the forward on two heads of the timed call, the backward on a (1, 2, 1024, 128) problem.

    python bench/bench_attention.py --skip-kernels --skip-backward --skip-e2e    # the variant rows only
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if "--cpu-smoke" in sys.argv:  # Triton kernels run in the interpreter; must be set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import cuda_graph_ms, median_ms, print_table, tflops, write_json  # noqa: E402
import graphopt  # noqa: E402
from graphopt.compiler import recording_decisions  # noqa: E402

CHECK_TOL = 2e-2  # bf16: max |out - ref| / max |ref|
E2E_TOL = 3e-2  # bf16 through two layers: ||logits - eager|| / ||eager||
# 4-bit weights (about 20 dB each) move this random-weight model's logits by about 0.4 of their norm,
# on the CPU's dequantize-then-matmul reference path as on the GPU; a wrong kernel moves them by 1 or more
E2E_FP4_TOL = 0.5
# fp4_linear on every linear of the model (force: the cost model keeps prefill-sized linears dense), so
# that the prefill runs on the one FP4 copy of the weights a quantized model keeps
E2E_FP4_OPTIONS = dict(passes={"fp4_linear": True}, force=True)


class NaiveAttention(nn.Module):
    """softmax(q @ k^T * scale) @ v, as users write it; causal through a triu mask and masked_fill."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, L, L)
        if self.causal:
            len_q, len_k = scores.shape[-2:]
            upper = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(upper, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_gpu_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _training_inputs(batch, heads, length, head_dim, causal, seed, device, dtype):
    """q, k, v and an output gradient (B, H, L, D) from `seed`, after freeing cached GPU memory, and
    the forward's FLOPs (halved when causal)."""
    _free_gpu_memory()
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))
    return q, k, v, grad_out, 4.0 * batch * heads * length * length * head_dim / (2 if causal else 1)


def _free_bytes() -> float:
    if torch.cuda.is_available():
        return float(torch.cuda.mem_get_info()[0])
    return float("inf")


def _rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _ms(value) -> str:
    return f"{value:10.4f}" if value is not None else f"{'-':>10}"


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:90]


def _failed(row: dict, exc: BaseException, args) -> None:
    """Mark a variant's row failed (one failing variant never stops the run)."""
    row["check"] = "FAIL"
    row["note"] = _short(exc)
    if args.verbose:
        traceback.print_exc()


def _attention_summary(decisions) -> str:
    """The attention pass's rewrites among graphopt's Decisions, and the first decline's reason."""
    applied = [d for d in decisions if d.pass_name == "attention" and d.applied]
    declined = [d for d in decisions if d.pass_name == "attention" and not d.applied]
    impls = sorted({d.implementation or "?" for d in applied})
    text = f"{len(applied)} attention rewrite(s)" + (f" -> {', '.join(impls)}" if impls else "")
    if declined:
        text += f"; declined: {declined[0].reason[:60]}"
    others = {d.pass_name for d in decisions if d.pass_name != "attention"}
    for name in sorted(others):
        kernels = sorted({d.implementation or "?" for d in decisions if d.pass_name == name and d.applied})
        text += f"; {name} {sum(d.applied for d in decisions if d.pass_name == name)} of " \
                f"{sum(d.pass_name == name for d in decisions)} ({', '.join(kernels)})"
    return text


def _compile(module, backend):
    torch._dynamo.reset()
    return torch.compile(module, backend=backend, dynamic=False)


def _sdpa(backend_name: str | None, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}.get(backend_name)

    def run(q, k, v):
        if chosen is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


# ---------------------------------------------------------------------------------------------
# kernel rows
# ---------------------------------------------------------------------------------------------
def bench_kernels(args, device, dtype) -> list[dict]:
    from graphopt.kernels import flash_attention as fa

    rows = []
    heads, head_dim = args.heads, args.head_dim
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        for causal in (False, True):
            _free_gpu_memory()
            gen = torch.Generator(device=device).manual_seed(length)
            q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=gen)
                       for _ in range(3))
            flops = 4.0 * batch * heads * length * length * head_dim / (2 if causal else 1)
            ref = _sdpa(None, causal)(q, k, v)
            naive_bytes = 3.0 * batch * heads * length * length * q.element_size()  # scores, masked, probs

            variants = []
            variants.append(("naive eager", lambda: NaiveAttention(causal), naive_bytes))
            variants.append(("naive + Inductor", lambda: _compile(NaiveAttention(causal), "inductor"), naive_bytes * 2 / 3))
            variants.append(("naive + graphopt", lambda: _compile(NaiveAttention(causal), "graphopt"), 0.0))
            variants.append(("SDPA flash", lambda: _sdpa("flash", causal), 0.0))
            variants.append(("SDPA cuDNN", lambda: _sdpa("cudnn", causal), 0.0))
            variants.append(("Triton (ours)", lambda: (lambda q, k, v: fa.flash_attention_forward(
                q, k, v, scale=head_dim ** -0.5, is_causal=causal)[0]), 0.0))

            shape_rows = []
            for name, build, need_bytes in variants:
                row = {"B": batch, "H": heads, "L": length, "D": head_dim, "causal": causal, "variant": name,
                       "check": "", "ms": None, "TFLOP/s": None, "x SDPA best": None, "note": ""}
                shape_rows.append(row)
                if need_bytes > 0.85 * _free_bytes():
                    row["check"] = "skipped"
                    row["note"] = f"needs ~{need_bytes / 2**30:.0f} GiB for (B,H,L,L) scores; {_free_bytes() / 2**30:.0f} GiB free"
                    continue
                try:
                    t0 = time.perf_counter()
                    if name == "naive + graphopt":
                        with recording_decisions() as decisions:
                            fn = build()
                            out = fn(q, k, v)
                        row["note"] = _attention_summary(decisions)
                    else:
                        fn = build()
                        out = fn(q, k, v)
                    _sync()
                    if "Inductor" in name or "graphopt" in name:
                        row["note"] = (row["note"] + "; " if row["note"] else "") + f"compile {time.perf_counter() - t0:.1f}s"
                    err = _rel_err(out, ref)
                    del out
                    row["check"] = f"{'PASS' if err <= CHECK_TOL else 'FAIL'} {err:.1e}"
                    row["ms"] = median_ms(lambda: fn(q, k, v), warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                    row["TFLOP/s"] = tflops(flops, row["ms"])
                    if name == "Triton (ours)":
                        best = getattr(fa._flash_attention_fwd_kernel, "best_config", None)
                        if best is not None:
                            row["note"] = (f"BM{best.kwargs['BLOCK_M']} BN{best.kwargs['BLOCK_N']} "
                                           f"w{best.num_warps} s{best.num_stages}")
                except Exception as exc:  # one failing variant never stops the run
                    _failed(row, exc, args)
                finally:
                    fn = None
                    _free_gpu_memory()
                print(f"  L={length:>6} causal={causal!s:5} {name:18} {row['check']:14} "
                      f"{_ms(row['ms'])} ms  {row['note']}", flush=True)
            sdpa_ms = [r["ms"] for r in shape_rows if r["variant"] in ("SDPA flash", "SDPA cuDNN") and r["ms"]]
            if sdpa_ms:
                for r in shape_rows:
                    if r["ms"]:
                        r["x SDPA best"] = r["ms"] / min(sdpa_ms)
            rows += shape_rows
            q = k = v = ref = None  # free this shape before allocating the next
    return rows


# ---------------------------------------------------------------------------------------------
# decode rows: one query token against a cache of Lk keys
# ---------------------------------------------------------------------------------------------
def bench_decode(args, device, dtype) -> list[dict]:
    """Lq = 1 (a decode step), B=1: each SDPA backend, the graphopt op on our Triton kernel, CUDA-graph
    replays (the kernels are a few microseconds, shorter than a launch from Python)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"SDPA dispatched": None, "SDPA flash": SDPBackend.FLASH_ATTENTION,
                "SDPA efficient": SDPBackend.EFFICIENT_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}
    rows = []
    heads, head_dim = args.heads, args.head_dim
    for length in args.decode_lengths:
        gen = torch.Generator(device=device).manual_seed(length + 1)
        q = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(1, heads, length, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
        ref = torch.softmax(q.double() @ k.double().transpose(-2, -1) * head_dim ** -0.5, dim=-1) @ v.double()
        variants = {}
        for name, backend in backends.items():
            def run(backend=backend):
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v)
            variants[name] = run
        variants["graphopt op, Triton"] = lambda: torch.ops.graphopt.attention(q, k, v, None, head_dim ** -0.5, False, 1, "triton")
        shape_rows = []
        for name, fn in variants.items():
            row = {"B": 1, "H": heads, "Lq": 1, "Lk": length, "D": head_dim, "variant": name, "check": "",
                   "us (CUDA graph)": None, "GB/s": None, "note": ""}
            shape_rows.append(row)
            try:
                out = fn()
                _sync()
                err = float((out.double() - ref).abs().max() / ref.abs().max())
                row["check"] = f"{'PASS' if err <= CHECK_TOL else 'FAIL'} {err:.1e}"
                ms = cuda_graph_ms(fn, rep_ms=args.rep_ms) if device == "cuda" else median_ms(fn, warmup_ms=1, rep_ms=5)
                row["us (CUDA graph)"] = ms * 1e3
                row["GB/s"] = 2.0 * k.numel() * k.element_size() / (ms * 1e-3) / 1e9
            except Exception as exc:  # e.g. a backend that rejects Lq = 1
                _failed(row, exc, args)
            print(f"  decode Lk={length:>6} {name:20} {row['check']:14} {row['us (CUDA graph)'] or 0:8.2f} us  {row['note']}",
                  flush=True)
        rows += shape_rows
    return rows


# ---------------------------------------------------------------------------------------------
# backward rows
# ---------------------------------------------------------------------------------------------
def _graphopt_op_triton(scale: float, causal: bool):
    """graphopt::attention on our Triton kernel, called as the attention pass emits it."""
    def run(q, k, v):
        return torch.ops.graphopt.attention(q, k, v, None, scale, causal, 1, "triton")
    return run


def _graphopt_triton_training(causal: bool):
    """The naive module compiled with graphopt, its attention forced onto our Triton kernel: the
    training path as users hit it (graphopt::attention_forward_with_lse, whose LSE the backward
    reads, under Inductor)."""
    import graphopt

    torch._dynamo.reset()
    return torch.compile(NaiveAttention(causal), dynamic=False,
                         backend=graphopt.backend(attention_backend="triton", force=True))


def bench_backward(args, device, dtype) -> list[dict]:
    """fwd+bwd, and the backward alone (autograd.grad with retain_graph on one recorded forward),
    for SDPA flash and cuDNN against graphopt::attention on our Triton kernel, called as the
    rewrite emits it and compiled from a naive module under Inductor."""
    import graphopt  # noqa: F401  registers the graphopt::* ops

    # The backward alone replays one recorded backward (retain_graph), which AOT autograd's donated
    # buffers forbid in the compiled row; donation saves memory, not time.
    with torch._functorch.config.patch(donated_buffer=False):
        return _backward_rows(args, device, dtype)


def _backward_rows(args, device, dtype) -> list[dict]:
    rows = []
    heads, head_dim = args.heads, args.head_dim
    for length in args.bwd_lengths:
        batch = max(1, args.tokens // length)
        for causal in (False, True):
            q, k, v, grad_out, fwd_flops = _training_inputs(batch, heads, length, head_dim, causal, length + 1, device, dtype)
            scale = head_dim ** -0.5
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(grad_out)
            ref_grads = [t.grad for t in leaves]
            leaves = None

            def fwd_bwd(attn):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                return torch.autograd.grad(attn(qq, kk, vv), (qq, kk, vv), grad_out)

            def bwd_alone(attn):
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                out = attn(qq, kk, vv)
                return lambda: torch.autograd.grad(out, (qq, kk, vv), grad_out, retain_graph=True)

            variants = [
                ("SDPA flash", lambda: _sdpa("flash", causal)),
                ("SDPA cuDNN", lambda: _sdpa("cudnn", causal)),
                ("graphopt::attention triton", lambda: _graphopt_op_triton(scale, causal)),
                ("naive + graphopt (triton)", lambda: _graphopt_triton_training(causal)),
            ]
            shape_rows = []
            for name, make in variants:
                row = {"B": batch, "H": heads, "L": length, "D": head_dim, "causal": causal, "variant": name,
                       "check": "", "fwd+bwd ms": None, "TFLOP/s": None, "x cuDNN": None, "bwd ms": None,
                       "bwd TFLOP/s": None, "bwd x cuDNN": None, "note": ""}
                shape_rows.append(row)
                try:
                    attn = make()
                    with recording_decisions() as decisions:
                        grads = fwd_bwd(attn)
                    if name.startswith("naive"):
                        row["note"] = _attention_summary(decisions)
                    err = max(_rel_err(g, r) for g, r in zip(grads, ref_grads))
                    grads = None
                    row["check"] = f"{'PASS' if err <= CHECK_TOL else 'FAIL'} {err:.1e}"
                    row["fwd+bwd ms"] = median_ms(lambda: fwd_bwd(attn), warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                    row["TFLOP/s"] = tflops(fwd_flops * 3.5, row["fwd+bwd ms"])  # fwd 1 + bwd 2.5
                    row["bwd ms"] = median_ms(bwd_alone(attn), warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                    row["bwd TFLOP/s"] = tflops(fwd_flops * 2.5, row["bwd ms"])
                except Exception as exc:
                    _failed(row, exc, args)
                finally:
                    attn = None
                    _free_gpu_memory()
                print(f"  bwd L={length:>6} causal={causal!s:5} {name:28} {row['check']:14} {_ms(row['fwd+bwd ms'])} ms "
                      f"fwd+bwd {_ms(row['bwd ms'])} ms bwd  {row['note']}", flush=True)
            cudnn = next((r for r in shape_rows if r["variant"] == "SDPA cuDNN"), {})
            for r in shape_rows:
                for column, ratio in (("fwd+bwd ms", "x cuDNN"), ("bwd ms", "bwd x cuDNN")):
                    if r[column] and cudnn.get(column):
                        r[ratio] = cudnn[column] / r[column]
            rows += shape_rows
            q = k = v = grad_out = ref_grads = None
    return rows


# ---------------------------------------------------------------------------------------------
# soft-capped and ALiBi variants of our kernel against the plain one
# ---------------------------------------------------------------------------------------------
def _alibi_slopes(heads: int, device) -> torch.Tensor:
    """BLOOM's slopes for a power-of-two head count: 2^(-8 (i + 1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)


def bench_variants(args, device, dtype) -> list[dict]:
    from graphopt.kernels import flash_attention as fa

    rows = []
    heads, head_dim = args.heads, args.head_dim
    variants = {"plain": {}, "soft-capped (cap 50)": {"softcap": 50.0},
                "ALiBi": {"alibi_slopes": _alibi_slopes(heads, device)}}
    for length in args.variant_lengths:
        batch = max(1, args.tokens // length)
        for causal in (False, True):
            q, k, v, grad_out, flops = _training_inputs(batch, heads, length, head_dim, causal, length + 2, device, dtype)
            small = [t[:1, :2, : args.variant_check_length].contiguous() for t in (q, k, v, grad_out)]
            shape_rows = []
            for name, extra in variants.items():
                options = dict(scale=head_dim ** -0.5, is_causal=causal, **extra)
                small_options = dict(options, alibi_slopes=extra["alibi_slopes"][:2]) if "alibi_slopes" in extra else options
                for mode in ("forward", "fwd+bwd"):
                    row = {"B": batch, "H": heads, "L": length, "D": head_dim, "causal": causal, "variant": name,
                           "mode": mode, "check": "", "ms": None, "TFLOP/s": None, "x plain": None, "note": ""}
                    shape_rows.append(row)
                    try:
                        if mode == "forward":
                            out = fa.flash_attention_forward(q, k, v, **options)[0]
                            ref = fa.reference_attention(*(t[:1, :2].double() for t in (q, k, v)), **small_options)
                            err = _rel_err(out[:1, :2], ref)
                            out = ref = None
                            fn = lambda: fa.flash_attention_forward(q, k, v, **options)  # noqa: E731
                            row_flops = flops
                        else:
                            err = _variant_grad_error(fa, small, small_options)
                            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                            def fn(leaves=leaves, options=options):
                                fa.flash_attention(*leaves, **options).backward(grad_out)
                            row_flops = flops * 3.5
                        row["check"] = f"{'PASS' if err <= CHECK_TOL else 'FAIL'} {err:.1e}"
                        row["ms"] = median_ms(fn, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                        row["TFLOP/s"] = tflops(row_flops, row["ms"])
                        if mode == "forward":
                            best = getattr(fa._flash_attention_fwd_kernel, "best_config", None)
                            if best is not None:
                                row["note"] = f"BM{best.kwargs['BLOCK_M']} BN{best.kwargs['BLOCK_N']} w{best.num_warps} s{best.num_stages}"
                    except Exception as exc:  # one failing variant never stops the run
                        _failed(row, exc, args)
                    finally:
                        fn = None
                        _free_gpu_memory()
                    print(f"  variant L={length:>6} causal={causal!s:5} {name:22} {mode:8} {row['check']:14} "
                          f"{_ms(row['ms'])} ms  {row['note']}", flush=True)
            for row in shape_rows:
                plain = next((r["ms"] for r in shape_rows if r["variant"] == "plain" and r["mode"] == row["mode"]), None)
                if plain and row["ms"]:
                    row["x plain"] = plain / row["ms"]
            rows += shape_rows
            q = k = v = grad_out = None
    return rows


def _variant_grad_error(fa, small, options) -> float:
    """Max relative error of our fwd+bwd gradients against float64 autograd of the reference."""
    q, k, v, grad_out = small
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa.flash_attention(*leaves, **options).backward(grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    fa.reference_attention(*ref_leaves, **options).backward(grad_out.double())
    return max(_rel_err(a.grad, b.grad) for a, b in zip(leaves, ref_leaves))


# ---------------------------------------------------------------------------------------------
# end-to-end rows
# ---------------------------------------------------------------------------------------------
def bench_e2e(args, device, dtype) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    shape = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                 vocab_size=32000) if not args.cpu_smoke else dict(
                 hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    common = dict(num_hidden_layers=2, max_position_embeddings=max(args.e2e_lengths), **shape)
    torch.manual_seed(0)
    with torch.device(device):
        eager_model = LlamaForCausalLM(LlamaConfig(attn_implementation="eager", **common)).to(dtype).eval()
        sdpa_model = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **common)).to(dtype).eval()
    sdpa_model.load_state_dict(eager_model.state_dict())

    for length in args.e2e_lengths:
        ids = torch.randint(0, common["vocab_size"], (1, length), device=device,
                            generator=torch.Generator(device=device).manual_seed(length))
        with torch.no_grad():
            ref = eager_model(input_ids=ids, use_cache=False).logits
        variants = [
            ("eager-attn, eager", lambda: eager_model),
            ("eager-attn + Inductor", lambda: _compile(eager_model, "inductor")),
            ("eager-attn + graphopt", lambda: _compile(eager_model, "graphopt")),
            ("sdpa-attn + Inductor", lambda: _compile(sdpa_model, "inductor")),
            ("sdpa-attn + graphopt", lambda: _compile(sdpa_model, "graphopt")),
            ("sdpa-attn + graphopt fp4", lambda: _compile(sdpa_model, graphopt.backend(**E2E_FP4_OPTIONS))),
        ]
        shape_rows = []
        for name, build in variants:
            row = {"model": "LLaMA-7B shapes, 2 layers" if not args.cpu_smoke else "LLaMA tiny, 2 layers",
                   "tokens": length, "variant": name, "check": "", "ms": None, "x sdpa+Inductor": None, "note": ""}
            shape_rows.append(row)
            try:
                t0 = time.perf_counter()
                with torch.no_grad():
                    if "+ graphopt" in name:
                        with recording_decisions() as decisions:
                            model = build()
                            logits = model(input_ids=ids, use_cache=False).logits
                        row["note"] = _attention_summary(decisions)
                    else:
                        model = build()
                        logits = model(input_ids=ids, use_cache=False).logits
                    _sync()
                    if "+" in name:
                        row["note"] = (row["note"] + "; " if row["note"] else "") + f"compile {time.perf_counter() - t0:.1f}s"
                    err = float((logits.float() - ref.float()).norm() / ref.float().norm())
                    del logits
                    tol = E2E_FP4_TOL if name.endswith("fp4") else E2E_TOL
                    row["check"] = f"{'PASS' if err <= tol else 'FAIL'} {err:.1e}"
                    row["ms"] = median_ms(lambda: model(input_ids=ids, use_cache=False), warmup_ms=args.warmup_ms,
                                          rep_ms=args.rep_ms)
            except Exception as exc:
                _failed(row, exc, args)
            finally:
                model = None
                _free_gpu_memory()
            print(f"  e2e tokens={length:>5} {name:22} {row['check']:14} {_ms(row['ms'])} ms  {row['note']}", flush=True)
        base = next((r["ms"] for r in shape_rows if r["variant"] == "sdpa-attn + Inductor" and r["ms"]), None)
        if base:
            for r in shape_rows:
                if r["ms"]:
                    r["x sdpa+Inductor"] = r["ms"] / base
        rows += shape_rows
    torch._dynamo.reset()
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (Triton interpreter), fp32")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-backward", action="store_true")
    parser.add_argument("--bwd-lengths", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="sequence lengths of the backward rows (default 1024,4096)")
    parser.add_argument("--skip-kernels", action="store_true", help="no forward kernel rows")
    parser.add_argument("--decode", action="store_true", help="add one-query-token rows (CUDA-graph replays)")
    parser.add_argument("--skip-variants", action="store_true", help="no soft-capped / ALiBi kernel rows")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.heads, args.head_dim, args.tokens = 2, 32, 48
        args.lengths = args.lengths or [48]
        args.bwd_lengths = args.bwd_lengths or [40]
        args.e2e_lengths = [24]
        args.decode_lengths = [1, 40]
        args.variant_lengths, args.variant_check_length = [48], 40
        args.warmup_ms, args.rep_ms = 1, 5
    else:
        args.heads, args.head_dim, args.tokens = 32, 128, 16384
        args.lengths = args.lengths or [1024, 4096, 8192, 16384]
        args.bwd_lengths = args.bwd_lengths or [1024, 4096]
        args.e2e_lengths = [2048, 4096]
        args.decode_lengths = [1, 256, 2048, 8192]
        args.variant_lengths, args.variant_check_length = [4096], 1024
        args.warmup_ms, args.rep_ms = 25, 100
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
    else:
        print("bench_attention.py times CUDA kernels and needs a GPU; none is visible here (--cpu-smoke runs it "
              "at tiny sizes on the CPU).")
        return
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    start = time.perf_counter()
    kernel_rows = [] if args.skip_kernels else bench_kernels(args, device, dtype)
    decode_rows = bench_decode(args, device, dtype) if args.decode else []
    backward_rows = [] if args.skip_backward else bench_backward(args, device, dtype)
    variant_rows = [] if args.skip_variants else bench_variants(args, device, dtype)
    e2e_rows = [] if args.skip_e2e else bench_e2e(args, device, dtype)
    path = write_json("bench_attention", kernel_rows + backward_rows, e2e=e2e_rows, decode=decode_rows,
                      variants=variant_rows, dtype=str(dtype), elapsed_s=time.perf_counter() - start)
    print(f"\nwrote {path}; total {time.perf_counter() - start:.0f}s\n")
    if backward_rows:
        print_table("Attention fwd+bwd and bwd alone (TFLOP/s: 3.5x and 2.5x forward FLOPs; x cuDNN > 1 is faster)",
                    backward_rows)
    if variant_rows:
        print_table("Our kernel: soft-capped and ALiBi scores against plain (x plain = plain ms / variant ms)",
                    variant_rows)
    if e2e_rows:
        print_table("End-to-end prefill (logits vs eager)", e2e_rows)
    if decode_rows:
        print_table("Decode: one query token, B=1", decode_rows)
    if kernel_rows:
            print_table(f"Attention forward, {str(dtype).replace('torch.', '')}, FLOPs 4*B*H*L*L*D (/2 causal)", kernel_rows)


if __name__ == "__main__":
    main()
