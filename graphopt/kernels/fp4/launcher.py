"""The FP4 launchers: check the inputs, allocate the outputs and launch the path and tile they are
handed (graphopt::fp4_linear's kernel string, chosen at compile time by the pass: the path by the
cost model, graphopt.cost.fp4, the tile by the tuner, tune.py). A call that names neither runs
default_path with the untuned default tile (default_config). Nothing here times or prices anything.

Activations: bf16 or fp16 (fp32 is cast to bf16 for the kernel and the output cast back).
Accumulation is fp32. Bias optional. Inference only: there is no autograd formula (weights are
frozen constants).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from graphopt.kernels import fp4_tma, tuning
from graphopt.kernels.fp4 import decode_persistent
from graphopt.kernels.fp4.configs import (_DEFAULT_DECODE, DEQUANT_CONFIG, DEQUANT_TILES, FMA_BLOCK_M,
                                          INTERPRET_DECODE_CONFIG, INTERPRET_PREFILL_CONFIG, MIN_DECODE_BLOCK_N,
                                          PATHS, PREFILL_CONFIGS, KernelConfig, _candidates, _runs_here,
                                          _token_bucket, _valid_config, default_path)
from graphopt.kernels.fp4.format import (BLOCK_SIZES, KERNEL_K_MULTIPLE, Fp4KernelWeight, _check_format, _padded_k,
                                         reference_fp4_linear)
from graphopt.kernels.launch import INTERPRET, cdiv, launch
from graphopt.kernels.linear_fusion import NO_FUSION, LinearFusion
from graphopt.kernels.split_k import split_buffers

try:
    import triton
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None
if triton is not None:
    from graphopt.kernels.fp4.decode import _fp4_gemv_int_kernel, _fp4_gemv_words_kernel, _fp4_gemv_words_mma_kernel
    from graphopt.kernels.fp4.prefill import _fp4_dequantize_kernel, _fp4_gemm_kernel

# Tiles the tuner chose in this process (tune.py), keyed by _tuned_key: default_config's first choice.
_TUNED: dict[tuple, KernelConfig] = {}


def dequantize_triton(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, out_features: int,
                      in_features: int, format: str, dtype: torch.dtype = torch.bfloat16,
                      tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(N, K) weight in `dtype` from kernel-layout tensors, on the device (one Triton launch).
    tile: (rows, elements per row, warps, interleave) of one program; default DEQUANT_TILES[0]."""
    bs = _check_format(format)
    w = torch.empty((out_features, in_features), dtype=dtype, device=codes.device)
    block_n, elements, warps, interleave = tile or ((16, 64, 4, 0) if INTERPRET else DEQUANT_TILES[0])
    if elements % bs or block_n < 1:
        raise ValueError(f"dequantize tile {tile}: elements per row must be a multiple of the {format} block ({bs})")
    blocks_per_prog = elements // bs
    n_blocks = codes.shape[1] * 2 // bs
    grid = (cdiv(out_features, block_n), cdiv(n_blocks, blocks_per_prog))
    launch(
        _fp4_dequantize_kernel, grid, codes, scales, global_scale, w, out_features, in_features, n_blocks,
        codes.stride(0), scales.stride(0), w.stride(0),
        IS_NVFP4=format == "nvfp4", BLOCK_SIZE=bs, BLOCK_N=block_n, BLOCKS_PER_PROG=blocks_per_prog,
        INTERLEAVE=bool(interleave), num_warps=warps,
    )
    return w



def fusion_in_kernel(path: str | None, cfg: KernelConfig | None, rows: int, fusion: LinearFusion) -> bool:
    """Whether a call of `rows` rows on this path and tile takes linear_fusion's neighbours inside its
    kernel (the persistent one-token kernel; a gated epilogue on its tiles of an even number of rows
    per warp); every other call runs them in torch around the product."""
    return (path == "gemv" and cfg is not None and bool(cfg.programs_per_sm) and rows == 1
            and not (fusion.gated and (cfg.block_n // cfg.num_warps) % 2))


def _launch(path: str, cfg: KernelConfig, x2, codes, scales, global_scale, bias, out_features: int, in_features: int,
            format: str, out_dtype: torch.dtype, fusion: LinearFusion = NO_FUSION, dependent: bool = False) -> torch.Tensor:
    """One launch of `path` on tile `cfg`; `fusion` and `dependent` only on the persistent one-token kernel."""
    m = x2.shape[0]
    n, k_padded = out_features, codes.shape[1] * 2
    bs = BLOCK_SIZES[format]
    bias_arg = bias if bias is not None else global_scale  # never read when HAS_BIAS is False
    if path == "dequant":  # prefill for many tokens: decode W once (bf16/fp16), then cuBLAS
        # fp32 callers get an fp32 product of the bf16-rounded activations, as on the other paths.
        # bf16 / fp16 callers get W rounded once to their dtype (NVFP4's global scale is folded into
        # it; scaling cuBLAS's output instead would cost one more pass over it), as their own model's
        # weights are; the decode and tiled-GEMM paths keep W exact.
        compute_dtype = torch.float32 if out_dtype == torch.float32 else x2.dtype
        w = dequantize_triton(codes, scales, global_scale, n, in_features, format, compute_dtype)
        out = F.linear(x2.to(compute_dtype), w, None if bias is None else bias.to(compute_dtype))
        return out.to(out_dtype) if out.dtype != out_dtype else out
    if path == "gemv" and cfg.programs_per_sm:  # one token on the persistent Gluon kernel (_runs_here)
        return decode_persistent.fp4_gemv_persistent(
            x2, codes, scales, global_scale, bias, n, in_features, format, rows=cfg.block_n // cfg.num_warps,
            num_warps=cfg.num_warps, programs_per_sm=cfg.programs_per_sm, depth=cfg.num_stages, fusion=fusion,
            max_registers=cfg.max_registers, dependent=dependent)
    if path == "gemv":  # decode: CUDA cores (BLOCK_M 1-4), tensor cores (BLOCK_M 16-64) or fp4_tma's kernel
        # permute_x (tensor-core tiles only, _valid_config) and tma: x's tiles rearranged once per
        # call, read by every program as they are
        x_arg = permuted_activations(x2, k_padded, cfg.block_k // 8, bs) if cfg.permute_x or cfg.tma else x2
        n_iters = k_padded // cfg.block_k
        split_k = cdiv(n_iters, cdiv(n_iters, cfg.split_k))  # every split owns >= 1 tile
        out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
        ws, counters = split_buffers(x2.device, m, n, m * cdiv(n, MIN_DECODE_BLOCK_N)) if split_k > 1 else (out, out)
        if cfg.tma:  # the Gluon kernel (NVFP4, bf16 in and out: _runs_here)
            fp4_tma.launch_decode(x_arg, codes, scales, global_scale, bias, out, ws, counters, split_k, cfg)
            return out
        grid = (cdiv(n, cfg.block_n), split_k, cdiv(m, cfg.block_m))
        args = (x_arg, codes, scales, global_scale, bias_arg, out, ws, counters, m, n, in_features,
                k_padded, x_arg.stride(0), k_padded // 8, scales.stride(0), out.stride(0))
        common = dict(IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, BLOCK_SIZE=bs, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, WORDS_PER_ITER=cfg.block_k // 8, SPLIT_K=split_k,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.int_dots:
            launch(_fp4_gemv_int_kernel, grid, *args, USE_ASM=not INTERPRET, **common)
        elif cfg.block_m in FMA_BLOCK_M:
            launch(_fp4_gemv_words_kernel, grid, *args, USE_ASM=not INTERPRET, **common)
        else:
            launch(_fp4_gemv_words_mma_kernel, grid, *args, UPCAST_DOT=INTERPRET, USE_ASM=not INTERPRET,
                   DIRECT_BF16=format == "nvfp4" and x2.dtype == torch.bfloat16, X_PERMUTED=cfg.permute_x, **common)
        return out
    common = dict(IS_NVFP4=format == "nvfp4", HAS_BIAS=bias is not None, BLOCK_SIZE=bs,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_ITER=cfg.block_k // bs,
                  UPCAST_DOT=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    launch(
        _fp4_gemm_kernel, grid, x2, codes, scales, global_scale, bias_arg, out, m, n, in_features, k_padded,
        x2.stride(0), codes.stride(0), scales.stride(0), out.stride(0), GROUP_M=cfg.group_m, **common,
    )
    return out


def permuted_activations(x2: torch.Tensor, k_padded: int, words_per_iter: int, block_size: int) -> torch.Tensor:
    """x (M, K) -> (M, k_padded), zero-padded, each K tile of 8 * words_per_iter elements
    rearranged for _fp4_gemv_words_mma_kernel's X_PERMUTED: the tile's four MMA operands (one per
    shift s = 0, 4, 8, 12 of the code words) one after another, each 2 * words_per_iter long, with
    column 2w + j the element that word w's code at bit s + 16 j multiplies. In a scale block,
    element h * BS/2 + 4q + 2 r1 + r0 sits at bit 8 r0 + 4 h + 16 r1 of word q (the kernel
    layout), so the operand of shift 8 r0 + 4 h holds (block, q, r1) in that order."""
    m, k = x2.shape
    if k_padded > k:
        x2 = F.pad(x2, (0, k_padded - k))
    wpb = block_size // 8
    tiles, blocks = k_padded // (8 * words_per_iter), 8 * words_per_iter // block_size
    # (m, tile, block, h, q, r1, r0) -> (m, tile, r0, h, block, q, r1)
    return x2.reshape(m, tiles, blocks, 2, wpb, 2, 2).permute(0, 1, 6, 3, 2, 4, 5).reshape(m, k_padded)


def _tuned_key(path: str, args: tuple, allow_gluon: bool = True, fused: tuple[str, ...] = ()) -> tuple:
    """The tuned tile's key; `fused`, the neighbours a call took in (linear_fusion), only when there are
    some (the unfused keys of existing tuning files stay valid)."""
    x2, codes, _, _, bias, out_features, _, format, _ = args
    return (path, _token_bucket(x2.shape[0]), out_features, codes.shape[1] * 2, format, x2.dtype, bias is not None,
            *((tuple(fused),) if fused else ()), x2.device.index, allow_gluon)


def default_config(path: str, args: tuple) -> KernelConfig:
    """The tile a call runs without a tuned choice: the tuner's memory for this shape if it has
    one, else a fixed per-bucket tile (the interpreter's small tiles under TRITON_INTERPRET=1).
    Never times anything."""
    x2, codes, _, _, _, out_features, _, format, _ = args
    m, k_padded, bs = x2.shape[0], codes.shape[1] * 2, BLOCK_SIZES[format]
    if path == "dequant":
        return DEQUANT_CONFIG
    if INTERPRET or not x2.is_cuda:
        if path == "gemm":
            return INTERPRET_PREFILL_CONFIG
        cfg = INTERPRET_DECODE_CONFIG
        if m <= 4 or k_padded % cfg.block_k:  # the CUDA-core kernel (any K: BLOCK_K 64)
            cfg = dataclasses.replace(cfg, block_m=_token_bucket(m) if m <= 4 else 4, block_k=KERNEL_K_MULTIPLE)
        return dataclasses.replace(cfg, split_k=min(cfg.split_k, k_padded // cfg.block_k))
    tuned = _TUNED.get(_tuned_key(path, args, False))
    if tuned is not None:
        return tuned
    preferred = _DEFAULT_DECODE.get(_token_bucket(m)) if path == "gemv" else PREFILL_CONFIGS[0]
    if preferred is not None and _valid_config(preferred, path, m, out_features, k_padded, bs):
        return preferred
    candidates = _candidates(path, args, allow_gluon=False)
    if not candidates:
        raise ValueError(f"no FP4 {path} tile fits M={m} N={out_features} K_padded={k_padded}")
    return candidates[0]


@functools.lru_cache(maxsize=256)
def _parse_kernel(kernel: str) -> tuple[tuple[int, int | None, str, KernelConfig | None], ...]:
    entries = []
    for entry in filter(None, kernel.split(";")):
        try:
            span, path, cfg = entry.split("=", 2)
            lo_text, hi_text = span.split("-")
            lo, hi = int(lo_text), (int(hi_text) if hi_text else None)
        except ValueError:
            raise ValueError(f"graphopt::fp4_linear: kernel {entry!r} is not 'lo-hi=path=<tile json>' (hi may be "
                             f"empty: no upper bound; the tile may be empty: the path's default tile)") from None
        if path not in PATHS:
            raise ValueError(f"graphopt::fp4_linear: unknown path {path!r} in kernel; valid choices: {', '.join(PATHS)}")
        entries.append((lo, hi, path, tuning.decode(KernelConfig, cfg) if cfg else None))
    return tuple(entries)


def kernel_choice(kernel: str, tokens) -> tuple[str | None, KernelConfig | None]:
    """(path, tile) for a call of `tokens` rows: the compile-time choice in `kernel` whose token
    range holds it (tile None: the path's default tile), else (None, None) (default_path and its
    default tile). `tokens` may be symbolic: the comparisons then guard on its range."""
    for lo, hi, path, cfg in _parse_kernel(kernel):
        if lo <= tokens and (hi is None or tokens <= hi):
            return path, cfg
    return None, None


def kernel_string(entries) -> str:
    """The `kernel` argument of graphopt::fp4_linear for `entries` (lo, hi, path, tile or None): calls
    of lo..hi tokens (hi None: lo and more) run `path` on `tile` (None: the path's default tile).
    kernel_choice's inverse."""
    return ";".join(f"{lo}-{'' if hi is None else hi}={path}={'' if cfg is None else tuning.encode(cfg)}"
                    for lo, hi, path, cfg in entries)


def fp4_linear_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_features: int, in_features: int, format: str, *,
                      path: str | None = None, config: KernelConfig | None = None,
                      fusion: LinearFusion = NO_FUSION, dependent: bool = False) -> torch.Tensor:
    """y = x @ W^T + bias with W in the kernel layout (to_kernel_layout). x: (..., K) bf16/fp16
    (fp32 is computed from a bf16 copy, output fp32). `path`: gemv | gemm | dequant | None
    (default_path of the token bucket: the cost model's choice comes from the caller, e.g. the pass's
    kernel string); `config`: the tile (None: default_config; nothing is timed here, see tune.py).
    `fusion`: neighbours taken in (linear_fusion): by the persistent one-token kernel, in torch around
    the other paths. `dependent`: x comes from another one-token kernel (decode_persistent)."""
    if triton is None:
        raise RuntimeError("fp4_linear_triton needs Triton; use reference_fp4_linear on CPU")
    if fusion.active:
        fusion.check(x, in_features, out_features)
        if not fusion_in_kernel(path, config, x.numel() // x.shape[-1], fusion):
            y = fp4_linear_triton(fusion.prologue(x), codes, scales, global_scale, bias, out_features,
                                  in_features, format, path=path, config=config)
            return fusion.epilogue(y)
    bs = _check_format(format)
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown FP4 kernel path {path!r}; valid choices: {', '.join(PATHS)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp4_linear: activations must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"fp4_linear: x has {x.shape[-1]} features, the weight expects {in_features}")
    k_padded = _padded_k(in_features)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (out_features, k_padded // 2):
        raise ValueError(f"fp4_linear: codes must be uint8 ({out_features}, {k_padded // 2}) in the kernel layout "
                         f"(to_kernel_layout), got {codes.dtype} {tuple(codes.shape)}")
    if tuple(scales.shape) != (out_features, k_padded // bs):
        raise ValueError(f"fp4_linear: {format} scales must be ({out_features}, {k_padded // bs}), got {tuple(scales.shape)}")
    if scales.element_size() != 1:  # the kernels read the scale bytes as they are
        raise ValueError(f"fp4_linear: {format} scales must be one byte each (uint8 e8m0 for mxfp4, float8_e4m3fn "
                         f"for nvfp4), got {scales.dtype}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"fp4_linear: bias must be ({out_features},), got {tuple(bias.shape)}")
    for name, t in (("codes", codes), ("scales", scales), ("global_scale", global_scale)) + ((("bias", bias),) if bias is not None else ()):
        if t.device != x.device:
            raise ValueError(f"fp4_linear: {name} is on {t.device} but x is on {x.device}")
        if name != "bias" and not t.is_contiguous():
            raise ValueError(f"fp4_linear: {name} must be contiguous")
    if bias is not None:
        bias = bias.contiguous()  # a strided view of a bias vector is fine: copied (N values) here
    x2, out_dtype = _activation_rows(x, in_features)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], fusion.output_width(out_features)))
    if path is None:
        path = default_path(_token_bucket(m))
    args = (x2, codes, scales, global_scale, bias, out_features, in_features, format, out_dtype)
    cfg = config or default_config(path, args)
    if cfg.tma and not _runs_here(cfg, x2, out_dtype):
        raise ValueError(f"fp4_linear: a tma config needs an sm_90+ GPU (not the interpreter) and bfloat16 activations "
                         f"and output; this call has {x2.device.type} {x.dtype}")
    if not _valid_config(cfg, path, m, out_features, k_padded, bs):
        raise ValueError(f"fp4_linear: config {cfg} is not valid for path {path} with M={m}, K_padded={k_padded}, "
                         f"block {bs} (BLOCK_N and BLOCK_K powers of two; BLOCK_K must divide K_padded, be a multiple "
                         f"of the block and give MMA K >= 16; 1 <= SPLIT_K <= K_padded / BLOCK_K; decode BLOCK_M is 1, 2, "
                         f"4, 16, 32 or 64 with BLOCK_N >= {MIN_DECODE_BLOCK_N} (>= 16, and BLOCK_K >= 128, for BLOCK_M >= 16), and 1, 2 or 4 for "
                         f"int_dots configs; permute_x only on the tensor-core tiles (BLOCK_M 16, 32 or 64); tma tiles: NVFP4, "
                         f"BLOCK_M 16, 32 or 64, BLOCK_K 256, K_padded a multiple of 256, "
                         f"BLOCK_N a multiple of 16 x num_warps; prefill tiles >= 16 without split)")
    out = _launch(path, cfg, *args, fusion=fusion, dependent=dependent)
    return out.reshape(*x.shape[:-1], fusion.output_width(out_features))


def _activation_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.dtype]:
    """x (..., K) as the kernels' (M, K) rows with unit last stride (fp32 through a bf16 copy), and
    the output dtype."""
    x2 = x.reshape(-1, in_features)
    if x2.dtype == torch.float32:
        x2 = x2.to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x.dtype


def fp4_linear(x: torch.Tensor, weight: Fp4KernelWeight, bias: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Convenience: the Triton kernel on CUDA (or under the interpreter), else the torch reference."""
    args = (x, weight.codes, weight.scales, weight.global_scale, bias, weight.out_features, weight.in_features, weight.format)
    if x.is_cuda or INTERPRET:
        return fp4_linear_triton(*args, **kwargs)
    return reference_fp4_linear(*args)
