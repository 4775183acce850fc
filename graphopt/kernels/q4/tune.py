"""Compile-time tuning of the Q4 tiles: `tune_q4_linear` times the candidate tiles of a mode on the
GPU (decode sizes L2-cold, as CUDA-graph replays over distinct weight copies) and keeps the fastest
per (GPU and versions, mode, token bucket, N, K, dtype) in the tuning file (graphopt.kernels.tuning;
GRAPHOPT_Q4_AUTOTUNE=0 turns it off). Called by the q4_linear pass and the benchmarks, never inside
a user's forward."""

from __future__ import annotations

import logging
import math
import os

import torch

from graphopt.hardware import timing
from graphopt.kernels import tuning
from graphopt.kernels.launch import INTERPRET, next_power_of_2
from graphopt.kernels.q4.configs import (DECODE_MAX_TOKENS, TileConfig, candidate_configs, persistent_configs,
                                         tma_configs)
from graphopt.kernels.q4.format import _check_k, _check_weight, reference_q4_linear
from graphopt.kernels.q4.launcher import _tma_runs, persistent_runs, q4_linear_triton


def _autotune_enabled() -> bool:
    """Whether tiles may be timed now: compiled kernels on a CUDA device, no CUDA-graph capture
    running (timing would launch into it), and GRAPHOPT_Q4_AUTOTUNE not 0."""
    return (torch.cuda.is_available() and not INTERPRET and os.environ.get("GRAPHOPT_Q4_AUTOTUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def _tuning_device(qweight: torch.Tensor) -> str | None:
    """The tuning file's key for the GPU that holds `qweight` (tuning.device_key), where its tiles
    may be timed now; None where they may not (see _autotune_enabled)."""
    if not qweight.is_cuda or not _autotune_enabled():
        return None
    index = qweight.device.index
    return tuning.device_key(index if index is not None else torch.cuda.current_device())


_LOG = logging.getLogger(__name__)


def _token_bucket(m: int) -> int:
    return next_power_of_2(max(m, 1)) if m <= 4096 else 4096 * math.ceil(m / 4096)


def _time_config(run, config: TileConfig, m: int, cold_weights: list | None = None) -> float:
    """GPU time of one config. Decode sizes: with `cold_weights` (timing.cold_copies of the layer's
    (qweight, scales)), calls over the distinct copies back to back in one CUDA graph, so each
    reads its weight from HBM as a model step does (graphopt.hardware.timing.cold_graph_ms, as the
    FP4 decode tuner and the benchmarks time); else CUDA-graph replays of one call (a launch costs
    more than the kernel there, so plain do_bench would time the CPU). CUDA events otherwise."""
    from triton.testing import do_bench, do_bench_cudagraph

    run(config)  # compile outside any capture
    if m <= DECODE_MAX_TOKENS and cold_weights:
        try:
            return timing.cold_graph_ms([lambda w=w: run(config, *w) for w in cold_weights], reps=10)
        except Exception:  # capture not possible here: fall back to the hot timings below
            pass
    if m <= DECODE_MAX_TOKENS:
        try:
            return float(do_bench_cudagraph(lambda: run(config), rep=20, return_mode="median"))
        except Exception:  # capture not possible here: fall back to events
            pass
    return float(do_bench(lambda: run(config), warmup=5, rep=20, return_mode="median"))


def tune_q4_linear(x_shape: tuple[int, ...], qweight: torch.Tensor, scales: torch.Tensor, bias: bool,
                   dtype: torch.dtype, mode: str, allow_gluon: bool) -> str:
    """The kernel string of graphopt::q4_linear in `mode` on activations of `x_shape` (..., K) in
    `dtype`: the fastest tile of `mode`, timed on the weights' GPU over random activations; "" (the
    untuned default) without a CUDA device, under the interpreter, during a
    CUDA-graph capture, or with tuning off. Raises tuning.NoCorrectTile, and stores nothing, when no
    candidate (the default among them) computes the product. "fused" times candidate_configs(m, fused=True);
    "separate" the Q8_1-bytes configs (quantize launch included) and, with `allow_gluon` where
    q4_tma's decode runs, its tiles. With `allow_gluon`, either mode, up to
    PERSISTENT_MAX_OFFERED_TOKENS tokens: decode_persistent's tiles too where that kernel runs.
    `bias`: whether the layer adds one. Each choice is kept per (GPU and versions, mode and the Gluon
    tiles offered, token bucket, N, K, dtype, the candidates' fingerprint), in memory and on disk
    (tuning.lookup)."""
    if mode not in ("fused", "separate"):
        raise ValueError(f"q4_linear mode {mode!r} is not valid; valid choices: fused, separate")
    gpu = _tuning_device(qweight)
    if gpu is None:
        return ""
    m, k, n = math.prod(x_shape[:-1]), x_shape[-1], qweight.shape[0]
    _check_k(k, "tune_q4_linear")
    _check_weight(qweight, scales, k)
    if not m:
        return ""
    device = qweight.device
    x = torch.randn(m, k, device=device).to(dtype)
    tma = allow_gluon and mode == "separate" and m <= DECODE_MAX_TOKENS and _tma_runs(x, n, qweight)
    persistent = allow_gluon and persistent_runs(x) and bool(persistent_configs(m))
    candidates = (candidate_configs(m, mode == "fused") + (tma_configs(m) if tma else [])
                  + (persistent_configs(m) if persistent else []))
    gluon_tiles = ("+tma" if tma else "") + ("+persistent" if persistent else "")
    key = "|".join((gpu, "q4_linear", mode + gluon_tiles, f"m{_token_bucket(m)}", f"n{n}", f"k{k}",
                    str(dtype).removeprefix("torch."), tuning.candidates_tag(candidates)))
    cached = tuning.lookup(key)
    if cached is not None:
        return cached
    b = torch.randn(n, device=device).to(dtype) if bias else None

    def run(cfg: TileConfig, qw: torch.Tensor = qweight, sc: torch.Tensor = scales) -> torch.Tensor:
        return q4_linear_triton(x, qw, sc, b, mode, config=cfg)

    cold_weights = timing.cold_copies((qweight, scales)) if m <= DECODE_MAX_TOKENS else None
    # Every candidate is checked before it is timed: the fastest tile must also be right on this
    # GPU and shape (split-K reductions and inline-asm paths run only here, not in the interpreter).
    reference = reference_q4_linear(x, qweight, scales, b)
    best, best_ms = None, math.inf
    for config in candidates:
        try:
            if not tuning.computes_product(run(config), reference):
                _LOG.warning("q4 tile %s gives a wrong product at %dx%dx%d (%s); left out of tuning", config.name, m, n, k, mode)
                continue
            ms = _time_config(run, config, m, cold_weights)
        except Exception:  # out of shared memory / registers for this tile: skip it
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:  # the default tile is a candidate too: nothing of this mode may run here
        raise tuning.NoCorrectTile(f"no Q4 {mode} tile compiled and computed the product for M={m} N={n} K={k} "
                                   f"({str(dtype).removeprefix('torch.')})")
    kernel = tuning.encode(best)
    tuning.store(key, kernel)
    return kernel

