"""Compile-time tuning of the FP4 tiles: `tune_config` times the candidate tiles of a path on the GPU
(decode tiles L2-cold, over distinct weight copies replayed from a CUDA graph) and keeps the fastest
in memory and in the tuning file (graphopt.kernels.tuning); `tune_fp4_linear` turns the choice into
graphopt::fp4_linear's kernel string. Called by the fp4_linear pass and the benchmarks, never inside
a user's forward."""

from __future__ import annotations

import logging
import math

import torch

from graphopt.hardware import timing
from graphopt.kernels import tuning
from graphopt.kernels.fp4.configs import PATHS, KernelConfig, _candidates, _token_bucket
from graphopt.kernels.fp4.format import reference_fp4_linear
from graphopt.kernels.fp4.launcher import (_TUNED, _activation_rows, _launch, _tuned_key, default_config,
                                           fusion_in_kernel, kernel_string)
from graphopt.kernels.launch import INTERPRET
from graphopt.kernels.linear_fusion import NO_FUSION, LinearFusion, example_fusion
from graphopt.kernels.tuning import NoCorrectTile

_LOG = logging.getLogger(__name__)
# Error an integer-dot tile may add to the product, as a fraction of its largest magnitude: each
# activation is off by up to 2^-16 of its K tile's largest (about 3e-5 of the product on random
# activations), beyond what an fp32 output allows.
INT16_ACTIVATION_RTOL = 2**-12


def _call(path: str, cfg: KernelConfig, args: tuple, fusion: LinearFusion = NO_FUSION) -> torch.Tensor:
    """One launch of the tile, with the neighbours of `fusion` around it as the op runs them: inside
    the persistent one-token kernel, in torch around the other paths."""
    if fusion.active and not fusion_in_kernel(path, cfg, args[0].shape[0], fusion):
        return fusion.epilogue(_launch(path, cfg, fusion.prologue(args[0]), *args[1:]))
    return _launch(path, cfg, *args, fusion=fusion)


def _cold_decode_timer(args: tuple, fusion: LinearFusion = NO_FUSION):
    """A decode tile's time as a model step sees it: calls over distinct copies of the weight,
    back to back in one CUDA graph, so each reads from HBM (graphopt.hardware.timing.cold_graph_ms, the
    benchmark's L2-cold timing). do_bench's L2 flush leaves the cache full of dirty lines, and its
    host-launched calls can be launch-bound; tiles picked that way ran slower cold than the ones
    this timer picks (compared on 5120->13824 at 1 token, H100). None when the copies do not fit
    (the caller falls back to do_bench)."""
    x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype = args
    weights = timing.cold_copies((codes, scales))
    if weights is None:
        return None

    def time_config(cfg: KernelConfig) -> float:
        calls = [lambda c=c, s=s: _call("gemv", cfg, (x2, c, s, global_scale, bias, out_features, in_features, format,
                                                     out_dtype), fusion) for c, s in weights]
        return timing.cold_graph_ms(calls, reps=10)
    return time_config


def tune_config(path: str, args: tuple, *, allow_gluon: bool = True, fusion: LinearFusion = NO_FUSION,
                fused: tuple[str, ...] = ()) -> KernelConfig:
    """The fastest valid candidate for this shape, timed on the GPU (kept in memory and in the tuning
    file, graphopt.kernels.tuning). For compile time and benchmarks, never for a call inside a
    user's forward: inside a CUDA-graph capture, or without a GPU, it times nothing and returns
    `default_config`. allow_gluon: also time the Gluon decodes (fp4_tma's, decode_persistent's). Only
    candidates that compute the product are timed (_fastest_right). `fusion`: the neighbours the op
    took in (their kinds `fused`, part of the key), timed with each tile (a tile that cannot take them,
    e.g. a gate on one row per warp, runs them in torch around its kernel, as the op would); fp4_tma's
    tiles are not offered then."""
    x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype = args
    if path == "dequant" or INTERPRET or not x2.is_cuda or torch.cuda.is_current_stream_capturing():
        return default_config(path, args)
    key = _tuned_key(path, args, allow_gluon, fused)
    if key in _TUNED:
        return _TUNED[key]
    candidates = [cfg for cfg in _candidates(path, args, allow_gluon) if not (fused and cfg.tma)]
    disk_key = (f"fp4|{tuning.device_key(x2.device.index or 0)}|{key[:-2]}|gluon={allow_gluon}"
                f"|{tuning.candidates_tag(candidates)}")
    if (stored := tuning.lookup(disk_key)) is not None:
        _TUNED[key] = tuning.decode(KernelConfig, stored)
        return _TUNED[key]
    time_config = _cold_decode_timer(args, fusion) if path == "gemv" else None
    if time_config is None:
        from triton.testing import do_bench

        def time_config(cfg):
            return do_bench(lambda: _call(path, cfg, args, fusion), warmup=5, rep=20, return_mode="median")
    best = _fastest_right(path, args, candidates, time_config, fusion)
    if best is None:
        raise NoCorrectTile(f"no FP4 {path} kernel configuration compiled and computed the product for "
                           f"M={x2.shape[0]} N={out_features} K={in_features}")
    _TUNED[key] = best
    tuning.store(disk_key, tuning.encode(best))
    return best


def _fastest_right(path: str, args: tuple, candidates: list[KernelConfig], time_config,
                   fusion: LinearFusion = NO_FUSION) -> KernelConfig | None:
    """The fastest candidate by `time_config` among those that compute the product: each tile's
    output is checked against the float64 reference (reference_fp4_linear) before it is timed, and
    a wrong one is left out with a warning (split-K reductions and inline-asm decodes run only on
    the GPU, so a miscompiled tile can be the fastest). None when no tile runs and agrees."""
    x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype = args
    reference = fusion.epilogue(reference_fp4_linear(fusion.prologue(x2.double()), codes, scales,
                                                     global_scale, bias, out_features, in_features, format))
    best, best_ms = None, math.inf
    for cfg in candidates:
        try:
            # integer-dot kernels round the activations to int16 steps of the largest in a K tile (or in 32
            # K positions: the persistent kernel)
            extra_rtol = INT16_ACTIVATION_RTOL if cfg.int_dots or cfg.programs_per_sm else 0.0
            if fusion.gated:  # gate and up rounded to the output dtype before their product (the torch form)
                extra_rtol += 2 * torch.finfo(out_dtype).eps
            if not tuning.computes_product(_call(path, cfg, args, fusion), reference, extra_rtol):
                _LOG.warning("fp4 %s tile %s gives a wrong product at %dx%dx%d (%s); left out of tuning", path, cfg,
                             x2.shape[0], out_features, in_features, format)
                continue
            ms = time_config(cfg)
        except Exception:  # e.g. out of shared memory for this tile on this GPU
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


def _bucket_range(m: int) -> tuple[int, int]:
    """The token counts that share m's tuned tile: (bucket / 2, bucket]."""
    bucket = _token_bucket(m)
    return (1 if bucket == 1 else bucket // 2 + 1), bucket

def tune_fp4_linear(tokens: int, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_features: int, in_features: int, format: str,
                    act_dtype: torch.dtype, *, allow_gluon: bool, path: str, fused: tuple[str, ...] = ()) -> str:
    """The `kernel` argument of graphopt::fp4_linear for calls of `tokens` rows on `path` (the cost
    model's choice, graphopt.cost.fp4), its tile chosen now (compile time): "lo-hi=path=<tile>" for
    the token counts lo..hi, or "" where nothing can be timed here (no GPU, the interpreter, a
    CUDA-graph capture running). Timed on random activations, with the neighbours the op took in
    (`fused`: linear_fusion.FUSIONS names) on random operands."""
    if INTERPRET or not codes.is_cuda or torch.cuda.is_current_stream_capturing() or tokens < 1:
        return ""
    if path not in PATHS:
        raise ValueError(f"unknown FP4 kernel path {path!r}; valid choices: {', '.join(PATHS)}")
    fusion = example_fusion(fused, tokens, in_features, out_features, act_dtype, codes.device)
    x2, out_dtype = _activation_rows(torch.randn(tokens, in_features, device=codes.device, dtype=act_dtype),
                                     in_features)
    args = (x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype)
    cfg = tune_config(path, args, allow_gluon=allow_gluon, fusion=fusion, fused=tuple(fused))
    lo, hi = _bucket_range(tokens)
    return kernel_string([(lo, hi, path, cfg)])
