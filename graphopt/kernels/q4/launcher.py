"""The Q4 launchers: check the inputs, allocate the outputs and launch the tile they are handed
(graphopt::q4_linear's kernel string: a TileConfig chosen at compile time by the tuner, tune.py), or
the untuned default for the token count (configs.default_config, a fixed table). They never time
anything. The mode (fused or separate) is the caller's: the q4_linear pass asks the cost model,
graphopt.cost.q4.
"""

from __future__ import annotations

import torch
import triton.language as tl

from graphopt.hardware import sm_count
from graphopt.kernels import q4_tma, tuning
from graphopt.kernels.q4 import decode_persistent
from graphopt.kernels.launch import INTERPRET, cdiv, launch
from graphopt.kernels.q4.configs import (_DECODE_GEMM_CONFIGS, DECODE_MAX_TOKENS, GEMV_MAX_ROWS, PROGRAMS_PER_SM,
                                         TileConfig, default_config)
from graphopt.kernels.q4.format import (Q8_1_BLOCK_BYTES, QK, SUPPORTED_ACT_DTYPES, _check_k, _check_weight,
                                        _rows_scale, static_result_dtype)
from graphopt.kernels.q4.kernels import (ACT_FUSED, ACT_PREQUANTIZED, ACT_STATIC, REDUCE_ATOMIC, REDUCE_LAST,
                                         REDUCE_NONE, REDUCE_WORKSPACE, _q4_gemm_kernel, _q4_gemv_kernel,
                                         _splitk_sum_kernel)
from graphopt.kernels.q8_1 import _exact_mul, _quantize_q8_1_kernel
from graphopt.kernels.split_k import split_buffers

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in SUPPORTED_ACT_DTYPES:
        raise ValueError(f"{what}: activations must be float16, bfloat16 or float32, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # interpreter: a few programs are enough to exercise split-K
    return sm_count(device_index)


def _split_k(requested: int, tiles: int, num_pairs: int, step: int, device: torch.device) -> tuple[int, int]:
    """(programs along K, block pairs per program: a multiple of the K step)."""
    steps = cdiv(num_pairs, step)
    if requested == 0:
        split = cdiv(PROGRAMS_PER_SM * _sm_count(device.index if device.type == "cuda" else None), tiles)
    else:
        split = requested
    split = max(1, min(split, steps))
    pairs_per_split = step * cdiv(steps, split)
    return cdiv(num_pairs, pairs_per_split), pairs_per_split


def quantize_q8_1_triton(x: torch.Tensor, blocks_per_program: int = 8) -> torch.Tensor:
    """Triton Q8_1 quantization: x [..., K] -> block_q8_1 bytes uint8 [..., K/32, 36]."""
    k = x.shape[-1]
    _check_k(k, "quantize_q8_1")
    x2 = _rows(x, "quantize_q8_1")
    m, nb = x2.shape[0], k // QK
    out = torch.empty(m, nb, Q8_1_BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    if m:
        grid = (m, cdiv(nb, blocks_per_program))
        launch(_quantize_q8_1_kernel, grid, x2, out, m, nb, x2.stride(0), out.stride(0),
               BLOCKS=blocks_per_program, EXACT=_exact_mul())
    return out.reshape(*x.shape[:-1], nb, Q8_1_BLOCK_BYTES)


def _gemv_rows(m) -> int:
    """Token rows per gemv program when the config leaves it open: the next power of two of m, at
    most GEMV_MAX_ROWS (comparisons only: m is symbolic in a graph traced with dynamic shapes)."""
    return next(rows for rows in (1, 2, 4, GEMV_MAX_ROWS) if m <= rows or rows == GEMV_MAX_ROWS)


def _launch(act_mode: int, a: torch.Tensor, ad: torch.Tensor, stride_am: int, stride_adm: int, m: int, k: int,
            qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: TileConfig, quot_dtype=tl.float32, qmin: int = -128, qmax: int = 127) -> None:
    """Run `config` on (M=m, K=k) activations into `out` (M, N): the main kernel, plus, with
    split-K, the fp32 buffers it reduces into (allocated here, zeroed) and the small kernel that
    sums them into `out` (none with reduce="last": the kernel's last split per tile writes `out`)."""
    n = qweight.shape[0]
    num_pairs = cdiv(k, 64)
    if config.kernel in ("gemv", "dp4a"):
        if act_mode != ACT_FUSED and not (act_mode == ACT_PREQUANTIZED and config.kernel == "dp4a"):
            raise ValueError("the decode kernels take unquantized activations (the fused path); of them, only "
                             "'dp4a' also reads Q8_1 blocks (the separate path)")
        rows = config.block_m or _gemv_rows(m)
        tiles_m = cdiv(m, rows)
    else:
        tiles_m = cdiv(m, config.block_m)
    tiles_n = cdiv(n, config.block_n)
    split, pairs_per_split = _split_k(config.split_k, tiles_m * tiles_n, num_pairs, config.pairs, out.device)
    reduce = REDUCE_NONE if split == 1 else {"atomic": REDUCE_ATOMIC, "workspace": REDUCE_WORKSPACE,
                                              "last": REDUCE_LAST}[config.reduce]
    has_bias = bias is not None
    acc_buf = counters = out  # placeholders, read only under REDUCE_LAST
    if reduce == REDUCE_LAST:
        acc_buf, counters = split_buffers(out.device, m, n, tiles_m * tiles_n)
    if reduce in (REDUCE_NONE, REDUCE_LAST):
        dest = out
    elif reduce == REDUCE_ATOMIC:
        direct = out.dtype == torch.float32 and not has_bias and out.is_contiguous()
        dest = out.zero_() if direct else torch.zeros(m, n, dtype=torch.float32, device=out.device)
    else:
        dest = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    stride_os = m * n if reduce == REDUCE_WORKSPACE else 0
    stride_om = dest.stride(-2)
    bias_arg = bias if has_bias else dest
    if config.kernel in ("gemv", "dp4a"):
        dp4a = config.kernel == "dp4a"
        launch(
            _q4_gemv_kernel, (tiles_n, split, tiles_m),
            a, qweight, scales, bias_arg, dest, acc_buf, counters, m, n, k, pairs_per_split,
            stride_am, qweight.stride(0) // 4 if dp4a else qweight.stride(0), scales.stride(0), stride_os, stride_om,
            HAS_BIAS=has_bias, REDUCE=reduce, EXACT=_exact_mul(), USE_DP4A=dp4a, USE_ASM=dp4a and not INTERPRET,
            PREQUANTIZED=act_mode == ACT_PREQUANTIZED, ROWS=rows, BLOCK_N=config.block_n, CHUNK=config.pairs, num_warps=config.num_warps,
            num_stages=config.num_stages)
    else:
        launch(
            _q4_gemm_kernel, (tiles_m, tiles_n, split),
            a, ad, qweight, scales, bias_arg, dest, acc_buf, counters, m, n, k, pairs_per_split,
            stride_am, stride_adm, qweight.stride(0), scales.stride(0), stride_os, stride_om,
            ACT_MODE=act_mode, QUOT_DTYPE=quot_dtype, QMIN=qmin, QMAX=qmax, HAS_BIAS=has_bias, REDUCE=reduce,
            EXACT=_exact_mul(), BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAIRS=config.pairs,
            SWAP_AB=config.kernel == "swap", USE_ASM=not INTERPRET,
            num_warps=config.num_warps, num_stages=config.num_stages)
    if dest is not out:
        splits = split if reduce == REDUCE_WORKSPACE else 1
        block = 1024
        launch(
            _splitk_sum_kernel, (m, cdiv(n, block)),
            dest, bias_arg, out, n, splits, stride_os, dest.stride(-2), out.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4)


def kernel_config(kernel: str) -> TileConfig | None:
    """The tile an op's kernel string selects (tuning.encode of a TileConfig), None for ""."""
    return tuning.decode(TileConfig, kernel) if kernel else None


def _check_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return bias.contiguous()


def q4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                     mode: str = "fused", config: TileConfig | None = None) -> torch.Tensor:
    """y = Q8_1(x) @ Q4_0(W).T (+ bias) for x [..., K] -> [..., N] in x's dtype, with `config` or
    the untuned default. mode "fused": one kernel (the decode GEMV or the tiled GEMM, both
    quantizing in registers; plus the split-K sum where the config splits K); "separate":
    quantize_q8_1_triton, then the GEMM on the Q8_1 bytes, or with a "tma" config q4_tma's decode."""
    if mode not in ("fused", "separate"):
        raise ValueError(f"q4_linear mode {mode!r} is not valid; valid choices: fused, separate")
    k = x.shape[-1]
    _check_k(k, "q4_linear")
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    if config is not None and config.kernel == "persistent":  # either mode: it quantizes x itself
        return persistent_linear(_rows(x, "q4_linear"), qweight, scales, bias, config).reshape(*x.shape[:-1], n)
    if config is not None and config.kernel == "tma":
        if mode != "separate":
            raise ValueError("tma configs run the separate path (mode='separate'): a quantize launch, then the "
                             "Gluon decode")
        return tma_linear(_rows(x, "q4_linear"), qweight, scales, bias, config).reshape(*x.shape[:-1], n)
    if mode == "separate":
        return q4_q8_gemm_triton(quantize_q8_1_triton(x), qweight, scales, bias, x.dtype, config=config)
    x2 = _rows(x, "q4_linear")
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _launch(ACT_FUSED, x2, x2, x2.stride(0), 0, m, k, qweight, scales, bias, out, config or default_config(m, True))
    return out.reshape(*x.shape[:-1], n)


def _tma_runs(x2: torch.Tensor, n: int, qweight: torch.Tensor) -> bool:
    """Whether q4_tma's decode can run this call: Gluon, an sm_90+ GPU (never the interpreter), K
    steps of 256 over the padded K, and fp16 scale rows 16-byte aligned (N a multiple of 8)."""
    return not INTERPRET and n % 8 == 0 and q4_tma.tiles_k(qweight.shape[1] * 2) and q4_tma.supports(x2)


def tma_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               config: TileConfig) -> torch.Tensor:
    """q4_tma's separate decode of x2 (M, K): (M, N) in x2's dtype. Gluon kernels are not Triton JIT
    functions that Inductor can launch, so graphopt::q4_gluon_linear, an opaque op, calls this."""
    m, n = x2.shape[0], qweight.shape[0]
    bias = _check_bias(bias, n)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if not m:
        return out
    if not _tma_runs(x2, n, qweight):
        raise ValueError("a tma config needs an sm_90+ GPU (not the interpreter), Triton's Gluon, "
                         "K padded to a multiple of 256 and out_features a multiple of 8")
    steps = qweight.shape[1] * 2 // q4_tma.STEP
    split = max(1, min(config.split_k, steps))
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    buffers = split_buffers(out.device, m, n, tiles) if split > 1 else (out, out)
    q4_tma.launch_decode(x2, qweight, scales, bias, out, *buffers, split, config)
    return out


def persistent_runs(x2: torch.Tensor) -> bool:
    """Whether decode_persistent's kernel can run this call: 1-8 tokens, bf16 or fp16, an sm_80+ GPU
    (never the interpreter)."""
    return not INTERPRET and 1 <= x2.shape[0] <= decode_persistent.MAX_TOKENS and decode_persistent.supports(x2)


def persistent_linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      config: TileConfig) -> torch.Tensor:
    """decode_persistent's decode of x2 (M, K), M <= 8, with a "persistent" tile: (M, N) in x2's
    dtype. A Gluon kernel, so graphopt::q4_gluon_linear, an opaque op, calls this in a graph."""
    if not persistent_runs(x2):
        raise ValueError(f"a persistent config needs 1-{decode_persistent.MAX_TOKENS} tokens ({x2.shape[0]} here), "
                         "bf16 or fp16 activations and an sm_80+ GPU (not the interpreter)")
    return decode_persistent.q4_gemv_persistent(x2, qweight, scales, _check_bias(bias, qweight.shape[0]),
                                                rows=config.block_n // config.num_warps, num_warps=config.num_warps,
                                                programs_per_sm=config.programs_per_sm, depth=config.num_stages)


def q4_q8_gemm_triton(xq: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, config: TileConfig | None = None) -> torch.Tensor:
    """Pre-quantized activations (block_q8_1 bytes [..., K/32, 36]) x Q4_0 -> [..., N] in out_dtype,
    with `config` ("gemm", "swap" or "dp4a") or the untuned default."""
    if xq.dtype != torch.uint8 or xq.shape[-1] != Q8_1_BLOCK_BYTES:
        raise ValueError(f"q4_q8_gemm expects block_q8_1 bytes uint8 [..., K/32, 36], got {xq.dtype} {tuple(xq.shape)}")
    if config is not None and config.kernel in ("gemv", "tma", "persistent"):
        raise ValueError("q4_q8_gemm takes Q8_1 bytes: only 'gemm', 'swap' and 'dp4a' configs apply (the fp32 gemv "
                         "and persistent kernels quantize themselves; tma tiles run q4_linear's separate mode)")
    k = xq.shape[-2] * QK
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    x3 = xq.reshape(-1, xq.shape[-2], Q8_1_BLOCK_BYTES).contiguous()
    m = x3.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m:
        config = config or default_config(m, False)
        if config.kernel == "dp4a":  # the decode kernel reads whole blocks as int32 words
            aligned = x3 if x3.storage_offset() % 4 == 0 else x3.clone()
            words = aligned.view(torch.int32).reshape(m, -1)
            _launch(ACT_PREQUANTIZED, words, words, words.stride(0), 0, m, k, qweight, scales, bias, out, config)
        else:
            q_view = x3.view(torch.int8)[:, :, 4:]
            d_view = x3.view(torch.float16)
            _launch(ACT_PREQUANTIZED, q_view, d_view, x3.stride(0), d_view.stride(0), m, k, qweight, scales, bias, out,
                    config)
    return out.reshape(*xq.shape[:-2], n)


def q4_linear_static_triton(x: torch.Tensor, act_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None, qmin: int = -128, qmax: int = 127,
                            config: TileConfig | None = None) -> torch.Tensor:
    """The fake-quant idiom fused: (round(x / s).clamp(qmin, qmax) * s) @ W_q4.T, integer dots."""
    k = x.shape[-1]
    _check_k(k, "q4_linear_static")
    n = _check_weight(qweight, scales, k)
    bias = _check_bias(bias, n)
    if not (-128 <= qmin <= qmax <= 127):
        raise ValueError(f"clamp bounds must lie in the int8 range [-128, 127], got ({qmin}, {qmax})")
    if config is not None and config.kernel not in ("gemm", "swap"):
        raise ValueError("q4_linear_static runs the tensor-core kernel: only 'gemm' and 'swap' configs apply")
    out_dtype = static_result_dtype(x, act_scale)
    if out_dtype not in _TL_DTYPES:
        raise ValueError(f"q4_linear_static: x / act_scale is {out_dtype}; the kernel takes "
                         f"{', '.join(str(d) for d in _TL_DTYPES)}")
    x2 = _rows(x, "q4_linear_static")
    m = x2.shape[0]
    s = _rows_scale(act_scale, x)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        quot = _TL_DTYPES[out_dtype]
        cfg = config or (default_config(m, False) if m > DECODE_MAX_TOKENS else _DECODE_GEMM_CONFIGS[0])
        _launch(ACT_STATIC, x2, s, x2.stride(0), 1, m, k, qweight, scales, bias, out, cfg, quot, qmin, qmax)
    return out.reshape(*x.shape[:-1], n)
