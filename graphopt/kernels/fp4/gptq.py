"""GPTQ-style FP4 quantization (`quantize_fp4_gptq`) and calibration of a model's linears
(`calibrate_fp4`): the same Fp4Tensor as quantize_fp4, with the codes and block scales chosen to
lower the layer output error on calibration activations. Plain torch (no Triton)."""

from __future__ import annotations

import torch

from graphopt.kernels.fp4.format import (Fp4Tensor, _blocks, _check_format, _choose_block_scales, _finite_max,
                                         _global_scale, dequantize_fp4, e2m1_values, pack_nibbles,
                                         round_to_e2m1_codes)

# ---------------------------------------------------------------------------------------------
# Error-compensating quantization (GPTQ-style) and calibration
# ---------------------------------------------------------------------------------------------
# Minimizes the layer output error ||X W^T - X Wq^T||^2 = tr((W - Wq) H (W - Wq)^T) / 2 with
# H = 2 X^T X instead of the weight error: columns of W (along K) are quantized one at a time in
# natural order, and each column's rounding error, scaled by the row of the upper Cholesky factor
# U of H^-1 (H^-1 = U^T U), is subtracted from the columns not yet quantized, so correlated inputs
# absorb it. Block scales are chosen when the scan reaches a block's first column, from the
# block's *current* (error-updated) values, with the same rule as quantize_fp4 (amax rule, or the
# per-block scale search), except that the search weighs column j's squared error by 1 / U[j, j]^2,
# the output error that quantizing column j leaves after compensation (GPTQ's own loss); the NVFP4
# global scale comes from the original weight. Updates are applied lazily per chunk of GPTQ_CHUNK
# columns (a multiple of both block sizes; speed only, the result does not depend on it).
# The weighting is a small gain on MiniLM (bench/fp4_minilm_quality.py's measure, NVFP4, 352
# calibration texts, 2 CPU threads; embedding cosine min / mean over the 10 evaluation and the 40
# validation sentences; the thread count alone moves these by up to 0.001):
# weighted 0.9876 / 0.9923 and 0.9898 / 0.9923, unweighted 0.9892 / 0.9919 and 0.9894 / 0.9916;
# with calibrate_fp4(sequential=True) 0.9923 / 0.9948 and 0.9910 / 0.9945 against 0.9917 / 0.9946
# and 0.9909 / 0.9944. Tried there and not kept (changes within +-0.001 of the mean, or worse):
# activation order (columns by descending diag H, each block's scale chosen at its first column
# in that order, or up front from W), a finer scale search (35 factors, much slower), only the
# amax->6 / amax->4 scale pair (0.9862 / 0.9903: the search's 10 factors include both), a
# least-squares re-fit of the block scales under H with the codes fixed, a larger NVFP4 global
# scale (x1.1, x1.5: same; x0.9 and below saturate blocks and hurt), and bias correction
# b += (W - Wq) E[x] after GPTQ.
GPTQ_CHUNK = 128
# Damping: H += GPTQ_DAMP * mean(diag H) * I (also the ridge of calibrate_fp4's sequential target
# re-fit). Larger than GPTQ's usual 0.01 because FP4 over-fits an estimated Hessian: on MiniLM with
# 24 calibration sentences (~400 tokens) 0.01 / 0.1 / 1.0 gave NVFP4 embedding cosine min/mean
# 0.975/0.985, 0.983/0.989, 0.985/0.989; with 196 texts (~4,100 tokens) 0.01 to 0.1 were alike
# (0.987-0.989 / 0.992) and 1.0 worse (0.985 / 0.989); sequential calibration on those 196 texts
# gave 0.9879/0.9925, 0.9900/0.9936, 0.9908/0.9940 with 0.03 / 0.1 / 0.3 (the measure of
# bench/fp4_minilm_quality.py, unweighted scale search).
GPTQ_DAMP = 0.1


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, float64; damping grows x10 (up
    to 4 times) if H is not positive definite in float64."""
    k = hessian.shape[0]
    eye = torch.eye(k, dtype=torch.float64, device=hessian.device)
    mean_diag = hessian.diagonal().mean().clamp_min(1e-12)
    for attempt in range(5):
        chol, info = torch.linalg.cholesky_ex(hessian + (damp * 10 ** attempt) * mean_diag * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError("quantize_fp4_gptq: the Hessian is not positive definite even with damping "
                     f"{damp * 1e4:g} x mean(diag); check the calibration activations for NaN/Inf")


def quantize_fp4_gptq(w: torch.Tensor, hessian: torch.Tensor, format: str = "nvfp4", *, scale_search: bool = True,
                      damp: float = GPTQ_DAMP) -> Fp4Tensor:
    """Quantize a weight (N, K) to MXFP4 / NVFP4, compensating rounding errors through the input
    Hessian `hessian` (K, K) = 2 X^T X / tokens of calibration activations X (tokens, K).

    Same Fp4Tensor as quantize_fp4 (same packing, scales, global scale rule), so kernels, the op
    and ONNX are unchanged; only which codes / block scales are picked differs. With a diagonal
    Hessian no error is fed forward; the scale search then minimizes each block's H-weighted
    squared error, so for a multiple of the identity the result equals
    quantize_fp4(w, format, scale_search=scale_search). Input channels that calibration never
    excited (zero Hessian diagonal) are quantized as zero weights. Cost: one Python step per
    column of K (a few ms per column for N of a few thousand on CPU).
    """
    block_size = _check_format(format)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp4_gptq expects a 2-D floating-point weight (N, K), got "
                         f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))} {getattr(w, 'dtype', '')}")
    n, k = w.shape
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (k, k):
        raise ValueError(f"quantize_fp4_gptq: hessian must be a ({k}, {k}) tensor for a weight of shape {(n, k)}, "
                         f"got {tuple(getattr(hessian, 'shape', ()))}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp4_gptq: the weight contains NaN or Inf")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("quantize_fp4_gptq: the Hessian contains NaN or Inf")
    if not damp > 0:
        raise ValueError(f"quantize_fp4_gptq: damp must be > 0, got {damp}")
    blocks = _blocks(w, block_size)  # (N, B, bs), zero-padded along K
    global_scale = _global_scale(blocks.abs().amax() if blocks.numel() else blocks.new_zeros(()), format)
    finite_max = _finite_max(w)
    k_blocks = blocks.shape[1] * block_size
    weight = blocks.reshape(n, k_blocks).clone()  # (N, Kb) fp32, updated in place by the error feedback
    h = torch.eye(k_blocks, dtype=torch.float64, device=w.device)  # padded columns: identity, decoupled
    h[:k, :k] = hessian.detach().to(device=w.device, dtype=torch.float64)
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    upper = _inverse_hessian_factor(h, damp).to(torch.float32)  # (Kb, Kb)
    column_loss = upper.diagonal().square().reciprocal()  # (Kb,) output error per unit squared column error

    codes = torch.zeros(n, k_blocks, dtype=torch.uint8, device=w.device)
    stored_scales = []  # per block: (N,) uint8 e8m0 bytes / float8_e4m3fn
    decode_scale = None
    for start in range(0, k_blocks, GPTQ_CHUNK):
        end = min(start + GPTQ_CHUNK, k_blocks)
        chunk = weight[:, start:end]  # view: (N, C)
        u = upper[start:end, start:end]  # (C, C)
        errors = torch.empty_like(chunk)
        for j in range(end - start):
            if j % block_size == 0:  # the block's scale, from its error-updated values
                block = chunk[:, j:j + block_size].unsqueeze(1)  # (N, 1, bs)
                loss = column_loss[start + j:start + j + block_size]
                _, stored, decode = _choose_block_scales(block, format, global_scale, scale_search, loss / loss.mean(),
                                                         finite_max=finite_max)
                stored_scales.append(stored[:, 0])
                decode_scale = decode[:, 0]  # (N,)
            column = chunk[:, j]
            safe = torch.where(decode_scale > 0, decode_scale, torch.ones_like(decode_scale))
            code = round_to_e2m1_codes(column / safe)
            code = torch.where(decode_scale > 0, code, torch.zeros_like(code))
            codes[:, start + j] = code
            error = (column - e2m1_values(code) * decode_scale) / u[j, j]
            chunk[:, j + 1:] -= error[:, None] * u[j, j + 1:][None, :]
            errors[:, j] = error
        weight[:, end:] -= errors @ upper[start:end, end:]
    scales = torch.stack(stored_scales, dim=1)  # (N, B)
    return Fp4Tensor(pack_nibbles(codes).contiguous(), scales.contiguous(), global_scale.reshape(()), (n, k), format)


def calibrate_fp4(model: torch.nn.Module, calibration_inputs, format: str = "nvfp4", *, scale_search: bool = True,
                  damp: float = GPTQ_DAMP, sequential: bool = False) -> dict[str, Fp4Tensor]:
    """GPTQ-style FP4 weights for every nn.Linear of `model` that the calibration run reaches.

    `calibration_inputs`: an iterable of model inputs, each a Mapping (called as model(**x)), a
    tuple/list (model(*x)) or a single tensor (model(x)). Forward pre-hooks accumulate X^T X of
    each Linear's input (float64, all leading dims flattened to tokens; padding tokens count too,
    so feed unpadded sequences where it matters) while the full-precision model runs under
    no_grad; then each weight is quantized with quantize_fp4_gptq(w, 2 X^T X / tokens).

    `sequential=True` quantizes the linears in the order the model first calls them, in groups
    that read the same input tensor (attention's q, k, v), so that each group sees the inputs Xq
    the model produces with the earlier linears already quantized, and aims at the full-precision
    model's output rather than at its own: it quantizes the ridge solution of
    min ||X W^T - Xq W'^T||^2 + ||(W - W') R^1/2||^2, W' = W (X^T Xq + R) (Xq^T Xq + R)^-1 with
    R = damp * mean(diag Xq^T Xq) * I, under the Hessian 2 Xq^T Xq / tokens (GPTQ's sequential
    mode, with an asymmetric target as in GPTAQ; for R -> 0 this minimizes ||X W^T - Xq Wq^T||^2
    exactly), so later layers undo part of the earlier layers' error. The Fp4Tensor then
    approximates W' (its SQNR against W is a little lower). Cost: per group, two forwards of
    every calibration input up to that group (stopped there), one of the full-precision model and
    one with the quantized weights (torch.func.functional_call; `model` is never modified). Needs each reached nn.Linear called once per forward (else ValueError).
    On MiniLM (bench/fp4_minilm_quality.py, NVFP4, 352 texts) it lifts the embedding cosine
    min / mean from 0.988 / 0.992 to 0.993 / 0.995 on the 10 evaluation sentences (0.990 / 0.992
    to 0.990 / 0.994 on 40 validation ones), for a calibration several times as long.

    Returns {module path (as in model.named_modules()): Fp4Tensor}; write a plan for the
    fp4_linear pass with graphopt.passes.fp4_linear.save_fp4_plan.
    """
    _check_format(format)
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    if sequential:
        return _calibrate_sequential(model, list(calibration_inputs), linears, format, scale_search, damp)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook_for(name: str):
        def hook(mod, args):
            x = args[0].detach().reshape(-1, mod.in_features).to(torch.float64)  # (tokens, K)
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    handles = [mod.register_forward_pre_hook(hook_for(name)) for name, mod in linears.items()]
    try:
        with torch.no_grad():
            for item in calibration_inputs:
                _call(model, item)
    finally:
        for handle in handles:
            handle.remove()
    if not counts:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    return {name: quantize_fp4_gptq(linears[name].weight.detach(), 2.0 * sums[name] / counts[name], format,
                                    scale_search=scale_search, damp=damp)
            for name in linears if name in counts}


def _call(model: torch.nn.Module, item, parameters: dict | None = None):
    """model(**item) / model(*item) / model(item), with `parameters` ({name: tensor}) substituted
    for the model's own through torch.func.functional_call when given."""
    from collections.abc import Mapping

    args, kwargs = ((), dict(item)) if isinstance(item, Mapping) else (
        (tuple(item), {}) if isinstance(item, (tuple, list)) else ((item,), {}))
    if parameters:
        return torch.func.functional_call(model, parameters, args, kwargs)
    return model(*args, **kwargs)


class _InputCaptured(Exception):
    """Raised by a forward pre-hook to end a calibration forward once it holds the input it wanted."""


def _linear_groups(model: torch.nn.Module, item, linears: dict) -> list[list[str]]:
    """Names of the linears one forward of `item` reaches, in first-call order, grouped where
    consecutive linears read the same input tensor."""
    calls: list[tuple[str, torch.Tensor]] = []
    handles = [mod.register_forward_pre_hook(lambda mod, args, name=name: calls.append((name, args[0])))
               for name, mod in linears.items()]
    try:
        with torch.no_grad():
            _call(model, item)
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, _ in calls]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"calibrate_fp4(sequential=True) needs each nn.Linear called once per forward; "
                         f"{', '.join(repeated)} called more often; use sequential=False")
    groups: list[list[str]] = []
    for i, (name, x) in enumerate(calls):
        if i and x is calls[i - 1][1]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _captured_input(model: torch.nn.Module, item, module: torch.nn.Module, parameters: dict | None) -> torch.Tensor:
    """The input (tokens, K) float64 that `module` receives when the model runs `item`; the
    forward stops there."""
    captured = []

    def hook(mod, args):
        captured.append(args[0].detach().reshape(-1, mod.in_features).to(torch.float64))
        raise _InputCaptured

    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            _call(model, item, parameters)
    except _InputCaptured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError("calibrate_fp4(sequential=True): a calibration input did not reach a linear that the first "
                         "one reached; the linears' order must not depend on the input")
    return captured[0]


def _calibrate_sequential(model, inputs: list, linears: dict, format: str, scale_search: bool, damp: float
                          ) -> dict[str, Fp4Tensor]:
    """calibrate_fp4(sequential=True): see its docstring."""
    if not inputs:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    groups = _linear_groups(model, inputs[0], linears)
    if not groups:
        raise ValueError("calibrate_fp4: the calibration inputs reached no nn.Linear (empty inputs?)")
    params = dict(model.named_parameters(remove_duplicate=False))
    quantized: dict[str, Fp4Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}  # parameter name -> dequantized weight of the linears done
    for group in groups:
        first = linears[group[0]]
        xq_xq = x_xq = 0  # (K, K) float64: Xq^T Xq and X^T Xq, tokens paired between the two runs
        tokens = 0
        for item in inputs:
            x = _captured_input(model, item, first, None)
            xq = _captured_input(model, item, first, dequantized)
            xq_xq = xq_xq + xq.t() @ xq
            x_xq = x_xq + x.t() @ xq
            tokens += xq.shape[0]
        ridge = damp * xq_xq.diagonal().mean().clamp_min(1e-12) * torch.eye(xq_xq.shape[0], dtype=torch.float64,
                                                                             device=xq_xq.device)
        # W' = W M, M = (X^T Xq + R)(Xq^T Xq + R)^-1 (the second factor symmetric): the full-precision
        # output from the quantized inputs, shrunk toward W where the calibration data say little.
        target_map = torch.linalg.solve(xq_xq + ridge, (x_xq + ridge).t()).t()
        for name in group:
            weight = linears[name].weight.detach()
            target = (weight.to(torch.float64) @ target_map.to(weight.device)).to(torch.float32)
            quantized[name] = quantize_fp4_gptq(target, 2.0 * xq_xq / tokens, format, scale_search=scale_search, damp=damp)
            deq = dequantize_fp4(quantized[name], weight.dtype)
            dequantized.update({pname: deq for pname, p in params.items() if p is linears[name].weight})
    return quantized

