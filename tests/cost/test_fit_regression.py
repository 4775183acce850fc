"""Fit regressions: the fp4_linear / q4_linear / FFT-chain cost models against the measured runs
their coefficients were fitted to (graphopt/cost/data/<gpu>.json names each run). They pin the
fit; how the model does on shapes it was not fitted to is bench/validate_cost_model.py's held-out
report (tests/cost/test_validation.py).

Offline: reads the committed benchmark JSON (bench/results/{fp4,q4}_linear_h200.json: H200, torch 2.11,
triton 3.6, bf16 activations, cuBLAS bf16 baseline) and the H200 spec with the ceilings measured
on that machine. Two checks per family:
  (a) predicted faster/slower than cuBLAS agrees with the measurement on >= 90% of the rows;
  (b) the pass's own decision rule declines every (shape, tokens) whose chosen kernel was measured
      more than 5% slower than cuBLAS (a rewrite predicted faster but measured slower is a bug).
FP4 rows with an L2-cold measurement (<= 64 tokens: weights rotated through copies, as in a real
forward pass where each layer's weights come from DRAM) are judged on it; the hot number of a
4096x4096 layer (33.5 MB of bf16 weights) is largely served from the 50 MB L2.
The H200 run's FP4 decode rows (<= 64 tokens) timed other kernels than graphopt's decode kernels,
so only its 256- and 4096-token rows are used; the decode rows come from
bench/results/fp4_linear_1_64tok_h100.json (H100, graphopt's decode kernels: integer dots at 1 token,
the Gluon TMA kernel at 4-64; L2-cold)
and are judged with the H100 spec and the copy bandwidth measured in that run.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from graphopt.cost import fp4 as fp4_cost
from graphopt.cost import q4 as q4_cost
from graphopt.hardware import SPECS
from graphopt.kernels import fp4 as fp4k
from graphopt.passes import fp4_linear

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# The ceilings measured on the H200 that produced the JSON (graphopt calibrate / bench_cost_model).
H200 = dataclasses.replace(SPECS["h200"], measured_bf16_flops=690e12, measured_memory_bandwidth=4.22e12,
                           measured_launch_overhead_s=6e-6)
H100 = dataclasses.replace(SPECS["h100"], measured_memory_bandwidth=2.96e12)  # copy measured in that run
SLOWER_TOLERANCE = 0.95  # measured cuBLAS / kernel below this: "slower than cuBLAS by more than 5%"


def _shape(text: str) -> tuple[int, int]:
    k, n = text.split("->")
    return int(k), int(n)


DECODE_TOKENS = 64  # the gemv path's largest token count (fp4.MMA_BLOCK_M)


def _fp4_rows(source: str = "h200"):
    """(k, n, tokens, cuBLAS ms, {path: measured ms}) per measured linear: the H200 run's prefill
    rows (> 64 tokens) or the H100 run's decode rows (source "h100", 1-64 tokens)."""
    rows = []
    name = "fp4_linear_h200.json" if source == "h200" else "fp4_linear_1_64tok_h100.json"
    for r in json.loads((RESULTS / name).read_text())["rows"]:
        if "->" not in r["shape"] or r.get("check") != "PASS" or "cublas_ms" not in r:
            continue
        if (r["tokens"] <= DECODE_TOKENS) != (source == "h100"):
            continue
        k, n = _shape(r["shape"])
        if "fp4_cold_ms" in r:
            cublas, paths = r["cublas_cold_ms"], {r["path"]: r["fp4_cold_ms"]}
        else:
            cublas, paths = r["cublas_ms"], {r["path"]: r["fp4_ms"]}
            paths.update({p: r[f"{p}_ms"] for p in ("gemm", "dequant") if f"{p}_ms" in r})
        rows.append((k, n, r["tokens"], cublas, paths))
    return rows


Q4_RUNS = {"h200": ("q4_linear_h200.json",),  # six shapes, 1-4096 tokens
           # the two shapes, decode and prefill (the operand-swapped decode GEMM at 4-16
           # tokens, scale tiles prefetched in the int8 GEMM)
           "h100": ("q4_linear_decode_dp4a_h100.json", "q4_linear_prefill_h100.json")}


def _q4_rows(source: str = "h200"):
    """(k, n, tokens, {variant: measured ms}) per measured linear (cublas_bf16, fused, separate, ...)."""
    by_key: dict = {}
    for name in Q4_RUNS[source]:
        for r in json.loads((RESULTS / name).read_text())["rows"]:
            if "->" in r["shape"] and not r.get("tile_sweep"):
                by_key.setdefault((r["shape"], r["tokens"]), {})[r["variant"]] = r["ms"]
    return [(*_shape(shape), tokens, v) for (shape, tokens), v in by_key.items()]


def test_recorded_rows_cover_decode_and_prefill():
    fp4_rows, q4_rows = _fp4_rows() + _fp4_rows("h100"), _q4_rows()
    assert len(fp4_rows) == 42 and len(q4_rows) == 36  # 6 LLaMA shapes x 7 (FP4) or 6 (Q4) token counts
    assert {t for *_, t, _, _ in fp4_rows} == {1, 4, 16, 32, 64, 256, 4096}
    assert {t for *_, t, _ in q4_rows} == {1, 4, 16, 64, 256, 4096}


def test_fit_regression_fp4_predicted_faster_or_slower_agrees_with_h200():
    agree, disagreements = 0, []
    for k, n, tokens, cublas_ms, paths in _fp4_rows():
        before, after = fp4_linear.predict(H200, tokens, k, n, "nvfp4")
        measured_faster = min(paths.values()) < cublas_ms
        predicted_faster = after.ms < before.ms
        agree += measured_faster == predicted_faster
        if measured_faster != predicted_faster:
            disagreements.append((k, n, tokens, round(cublas_ms / min(paths.values()), 2), round(before.ms / after.ms, 2)))
    rows = len(_fp4_rows())
    assert agree >= 0.9 * rows, f"{agree}/{rows} agree; (k, n, tokens, measured x, predicted x): {disagreements}"


@pytest.mark.parametrize("source,hw", [("h200", H200), ("h100", H100)])
def test_fit_regression_fp4_pass_declines_every_linear_measured_slower_than_cublas(source, hw):
    for k, n, tokens, cublas_ms, paths in _fp4_rows(source):
        before, after = fp4_linear.predict(hw, tokens, k, n, "nvfp4")
        if not (after.ms < before.ms and fp4_linear.worth_rewriting(before, after)):
            continue  # declined
        path = fp4_cost.choose_fp4_path(hw, tokens, k, n, "nvfp4")
        assert path in paths, f"{k}->{n} at {tokens} tokens rewritten to the unmeasured path {path}"
        assert cublas_ms / paths[path] >= SLOWER_TOLERANCE, (
            f"{k}->{n} at {tokens} tokens: predicted {before.ms / after.ms:.2f}x, measured "
            f"{cublas_ms / paths[path]:.2f}x of cuBLAS on path {path}")


def test_fit_regression_fp4_at_32_to_256_tokens_on_h100():
    """Past 16 tokens on the H100, all six shapes: 32 and 64 tokens from
    bench/results/fp4_linear_1_64tok_h100.json (the TMA decode kernel; CUDA-graph replays, the chosen
    path also L2-cold), 256 tokens from fp4_linear_1_256tok_h100.json (interleaved eager timing).
    At 64 and 256 tokens, where every path was timed, the model's path is within 1.15x of the
    fastest; a layer the pass rewrites is measured no more than 5% slower than cuBLAS, and one it
    declines at most 1.2x faster (the decode estimates themselves: the test below)."""
    def rows_of(name, token_counts):
        return [r for r in json.loads((RESULTS / name).read_text())["rows"]
                if r.get("check") == "PASS" and r["tokens"] in token_counts]

    rows = rows_of("fp4_linear_1_64tok_h100.json", (32, 64)) + rows_of("fp4_linear_1_256tok_h100.json", (256,))
    assert len(rows) == 18
    for r in rows:
        k, n = _shape(r["shape"])
        tokens = r["tokens"]
        if tokens >= 64:
            measured = {p: r[f"{p}_ms"] for p in fp4k.PATHS}
            chosen = fp4_cost.choose_fp4_path(H100, tokens, k, n, "nvfp4")
            assert measured[chosen] <= 1.15 * min(measured.values()), (k, n, tokens, chosen, measured)
        speedup = r.get("cold_speedup", r["speedup"])
        before, after = fp4_linear.predict(H100, tokens, k, n, "nvfp4")
        if fp4_linear.worth_rewriting(before, after):
            assert speedup >= SLOWER_TOLERANCE, (k, n, tokens, speedup)
        else:
            assert speedup <= 1.2, (k, n, tokens, speedup)


def test_fit_regression_fp4_decode_rewritten_where_measured_clearly_faster_on_h100():
    """The decode kernels on the H100 (1-64 tokens): every row measured >= 1.25x cuBLAS
    (1 token 2.37-2.70x, 4-16 tokens 1.49-2.17x, most 32- and 64-token rows) is rewritten, and the
    predicted time is within 35% of the measured one on every row."""
    clear_wins = 0
    for k, n, tokens, cublas_ms, paths in _fp4_rows("h100"):
        before, after = fp4_linear.predict(H100, tokens, k, n, "nvfp4")
        assert 0.65 <= after.ms / paths["gemv"] <= 1.35, (k, n, tokens, after.ms, paths)
        if cublas_ms / paths["gemv"] >= 1.25:
            clear_wins += 1
            assert after.ms < before.ms and fp4_linear.worth_rewriting(before, after), (k, n, tokens)
    assert clear_wins >= 26  # of 30 rows (measured 28)


def test_fit_regression_q4_predicted_faster_or_slower_agrees_with_h200():
    """Prefill rows only: the H200 decode rows (1-16 tokens) timed other decode kernels than the
    chained-dp4a and operand-swapped ones the model predicts; the H100 test below checks decode
    against graphopt's kernels."""
    agree, total, disagreements = 0, 0, []
    for k, n, tokens, ms in _q4_rows():
        if tokens < 64:
            continue
        before, _, _, fused, separate = q4_cost.predict_linear(H200, tokens, k, n)
        for variant, est in (("fused", fused), ("separate", separate)):
            measured_faster, predicted_faster = ms[variant] < ms["cublas_bf16"], est.ms < before.ms
            agree += measured_faster == predicted_faster
            total += 1
            if measured_faster != predicted_faster:
                disagreements.append((k, n, tokens, variant))
    assert total == 36 and agree >= 0.9 * total, f"{agree}/{total} agree; wrong: {disagreements}"


def test_fit_regression_q4_pass_declines_every_linear_measured_slower_than_cublas():
    """H200 (q4_linear_h200.json). Its 4- and 16-token rows timed other decode kernels than the
    chained-dp4a and operand-swapped ones the model predicts (on the H100 those measure 1.65-1.74x
    cuBLAS at 4 tokens and 1.30-1.54x at 16), so the rows are left out here (the H100 test checks
    graphopt's kernels)."""
    applied = []
    for k, n, tokens, ms in _q4_rows():
        if tokens in (4, 16):
            continue
        before, after, mode, _, _ = q4_cost.predict_linear(H200, tokens, k, n)
        if not after.ms < before.ms:  # Q4LinearPass.accept: rewrite when predicted faster
            continue
        ratio = ms["cublas_bf16"] / ms[mode]
        assert ratio >= SLOWER_TOLERANCE, f"{k}->{n} at {tokens} tokens: {mode} measured {ratio:.2f}x of cuBLAS"
        applied.append((k, n, tokens))
    # Where the measurement says Q4 wins (the 1-token fused gemv, 1.02-1.17x), the pass does rewrite.
    assert sorted(applied) == sorted((k, n, 1) for k, n, t, _ in _q4_rows() if t == 1)


def _q4_decode_rows_h100():
    """(k, n, tokens, cuBLAS ms, best fused ms, best separate ms) per row of
    bench/results/q4_decode_kernels_h100.json (H100, L2-cold CUDA graphs; every decode kernel's
    best tile, fused and separate, q4_tma's decode on the separate path)."""
    by_key: dict = {}
    for r in json.loads((RESULTS / "q4_decode_kernels_h100.json").read_text())["rows"]:
        by_key.setdefault((r["shape"], r["tokens"]), {})[r["kernel"]] = r["ms"]
    rows = []
    for (shape, tokens), ms in by_key.items():
        fused = min(v for kind, v in ms.items() if kind in ("dp4a", "gemm", "gemv", "swap"))
        separate = min(v for kind, v in ms.items() if kind.endswith(" separate"))
        rows.append((*_shape(shape), tokens, ms["cuBLAS bf16"], fused, separate))
    return rows


def test_fit_regression_q4_h100_rewrites_the_measured_wins_and_declines_the_losses():
    """H100, the issue's two shapes. Decode (q4_decode_kernels_h100.json): the pass takes
    every layer (1 token 2.50-2.52x cuBLAS on the fused dp4a kernel, 4-16 tokens 1.75-2.31x on the
    separate path's q4_tma decode), picks the mode measured faster, and predicts its time within
    0.8-1.25x. Prefill (q4_linear_prefill_h100.json): it declines every row (0.10-0.55x fused or
    separate)."""
    decode = _q4_decode_rows_h100()
    assert len(decode) == 6
    for k, n, tokens, cublas_ms, fused_ms, separate_ms in decode:
        before, after, mode, _, _ = q4_cost.predict_linear(H100, tokens, k, n)
        measured = {"fused": fused_ms, "separate": separate_ms}
        assert after.ms < before.ms and cublas_ms / measured[mode] >= 1.25, (k, n, tokens, mode, measured)
        assert measured[mode] == min(measured.values()), (k, n, tokens, mode, measured)
        assert 0.8 <= after.ms / measured[mode] <= 1.25, (k, n, tokens, after.ms, measured)
    prefill = [row for row in _q4_rows("h100") if row[2] > 16]
    assert len(prefill) == 6
    for k, n, tokens, ms in prefill:
        before, after, _, _, _ = q4_cost.predict_linear(H100, tokens, k, n)
        assert not after.ms < before.ms, (k, n, tokens, after.ms, before.ms)


@pytest.mark.parametrize("source,hw", [("h200", H200), ("h100", H100)])
def test_fit_regression_q4_fused_or_separate_choice_matches_the_measurement_at_64_tokens_and_more(source, hw):
    """Fusing the Q8_1 quantization into the GEMM measured faster than the separate quantize +
    GEMM at 64-4096 tokens on every row of both runs (H200 1.02-4.22x, H100 1.12-2.24x); the
    model's mode is the measured faster one on each."""
    checked = 0
    for k, n, tokens, ms in _q4_rows(source):
        if tokens < 64:
            continue
        _, _, mode, _, _ = q4_cost.predict_linear(hw, tokens, k, n)
        assert mode == ("fused" if ms["fused"] < ms["separate"] else "separate"), (k, n, tokens, ms)
        checked += 1
    assert checked == (18 if source == "h200" else 6)


@pytest.mark.parametrize("tokens", [256, 4096])
def test_fit_regression_fp4_not_rewritten_on_h200_at_any_measured_token_count(tokens):
    """The H200 measurement has no prefill (shape, tokens) where FP4 is >5% faster than cuBLAS (its
    64-token rows timed other decode kernels than graphopt's; its TMA kernel is measured on the H100)."""
    before, after = fp4_linear.predict(H200, tokens, 4096, 11008, "nvfp4")
    assert not fp4_linear.worth_rewriting(before, after)


def test_fit_regression_fft_chain_dft2_model_against_the_h100_sweep():
    """The FFT-chain cost model (dft2 constants fitted to this sweep) against every implementation
    timed at the explorer's --quick configurations on an H100: each dft2 / dft2_pregather time
    is predicted within 0.5-2x, and the model's own pick agrees on faster/slower than cuBLAS for
    >= 85% of the configurations (the sweep's gather is the first, slower staged kernel)."""
    from bench.fit_fft_cost_model import evaluate

    rows = json.loads((RESULTS / "fft_fit_sweep_h100.json").read_text())["rows"]
    res = evaluate(SPECS["h100"], rows)
    assert res["total"] >= 40
    assert res["agree"] / res["total"] >= 0.85, res["misses"]
    for impl in ("dft2", "dft2_pregather"):
        ratios = [math.exp(e) for e in res["errors"][impl]]
        assert 0.5 <= min(ratios) and max(ratios) <= 2.0, (impl, min(ratios), max(ratios))


def test_fit_regression_fft_chain_explorer_agreement_on_the_h100_run():
    """The explorer's faster/slower call (predicted FFT chain vs predicted cuBLAS) recomputed with
    the current model for the measured --quick rows of the H100 run (16, 256, 4096 tokens; each
    row ran the implementation the model picked): >= 90%, as that run reported (315/336)."""
    from graphopt.fft_explorer import predicted_speedup

    hw = SPECS["h100"]
    rows = [r for t in (16, 256, 4096)
            for r in json.loads((RESULTS / "explore_fft_h100" / f"explore_fft_quick_{t}tok.json").read_text())["rows"]]
    assert len(rows) == 336
    agree = 0
    for r in rows:
        impl, predicted = predicted_speedup(hw, r["tokens"], r["in_features"], r["out_features"], r["block_size"], r["k"])
        assert impl == r["impl"]
        agree += (predicted > 1.0) == (r["dense_ms"] / r["fft_ms"] > 1.0)
    assert agree / len(rows) >= 0.9, agree


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_fit_regression_sdpa_decode_against_the_measured_decode_calls(gpu):
    """One query token, GQA 32/8 written as K/V repeated, a bool mask, batch 1 and 8, 640-32768 cache
    slots (bench/results/decode_attention_<gpu>.json, CUDA-graph replays): SDPA's cuDNN and efficient
    backends, the repeat included, are predicted within 0.85-1.15x on every row (the fit used 640 and
    8192 slots), and the split-key kernel at its chosen chunk count is predicted faster than both,
    as measured on every row (2-30x)."""
    from bench.validate_cost_model import DECODE_RUNS

    from graphopt import cost_model as cm

    hw = DECODE_RUNS[gpu]
    rows = json.loads((RESULTS / f"decode_attention_{gpu}.json").read_text())["rows"]
    sdpa = [r for r in rows if r["variant"].startswith("sdpa-") and "us" in r]
    chosen = {(r["batch"], r["lk"]): r for r in rows if r["variant"].startswith("decode (s")}
    assert len(sdpa) == 16 and len(chosen) == 8
    for r in sdpa:
        predicted = cm.sdpa(hw, r["batch"], 32, 1, r["lk"], 128, backend=r["variant"][5:], has_mask=True, kv_heads=32,
                            repeated_from=8).ms * 1e3
        assert 0.85 <= predicted / r["us"] <= 1.15, (r["batch"], r["lk"], r["variant"], predicted, r["us"])
        kernel = chosen[r["batch"], r["lk"]]
        assert kernel["us"] < r["us"]
        assert cm.decode_attention(hw, r["batch"], 32, 1, r["lk"], 128, kv_heads=8, has_mask=True,
                                   splits=kernel["splits"]).ms * 1e3 < predicted
