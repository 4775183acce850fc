"""Launchers of the FFT chain: input checks, the operand tables they build once, one launcher per
implementation (`_LAUNCHERS`), and `fft_chain_linear`, which runs the implementation it is given.
Which implementation a call site runs is the fft_linear pass's choice (graphopt.cost.fft_chain);
`impl="auto"` at call time runs the fixed rule of `default_implementation`."""

from __future__ import annotations

import functools
import math
import weakref

import torch

from graphopt.kernels.fft_chain.layer import _compute_dtype, _permuted_blocks, fft_chain_spectral_reference
from graphopt.kernels.fft_chain.triton_kernels import HAS_TRITON
from graphopt.kernels.launch import INTERPRET as _INTERPRET  # fixed at import, as Triton reads it

if HAS_TRITON:
    import triton

    from graphopt.kernels.fft_chain.triton_kernels import (
        _dft2_forward_kernel,
        _dft2_inverse_kernel,
        _dft_forward_kernel,
        _dft_inverse_kernel,
        _fft_contract_kernel,
        _gather_columns_kernel,
        _packed_contract_kernel,
        _spectral_mma_contract_kernel,
    )

IMPLEMENTATIONS: tuple[str, ...] = ("torch", "triton", "dft", "dft2", "dft2_pregather")
IMPL_CHOICES: tuple[str, ...] = ("auto", *IMPLEMENTATIONS)


def available_implementations(device_type: str, block_size: int | None = None) -> tuple[str, ...]:
    """Implementations that run on a device type ("cuda" needs Triton for the Triton ones; the
    dft paths need an even block size)."""
    if device_type == "cuda":
        if not HAS_TRITON:
            return ("torch",)
        if block_size is not None and block_size % 2:
            return ("torch", "triton")
        return IMPLEMENTATIONS
    return ("torch",)


def default_implementation(x: torch.Tensor, block_size: int) -> str:
    """What `impl="auto"` runs at call time, where no pass chose (eager calls, a graph compiled
    without the fft_linear pass or with a symbolic token count): a fixed rule, no cost model.
    dft2_pregather for fp16, bf16 and fp32 CUDA inputs where it runs (Triton, an even block size),
    the implementation the cost model picks most often on the H100 and H200 tables; else the
    cuFFT torch path (float64 keeps its precision there)."""
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and "dft2_pregather" in available_implementations("cuda", block_size)):
        return "dft2_pregather"
    return "torch"


# =============================================================================================
# Launchers
# =============================================================================================
def _t_bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


@functools.lru_cache(maxsize=32)
def _dft_tables(block_size: int, device: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed real-DFT matrices (the packed layout of triton_kernels.py), built in float64, stored in `dtype`:
    forward W (B, B) with XS = x @ W, inverse Winv (B, B) with x = XS @ Winv (irfft of the packed
    spectrum: bin weights 1 (DC, Nyquist) or 2, and 1/B, folded in). Even B only."""
    if block_size % 2:
        raise ValueError(f"the packed real DFT needs an even block_size, got {block_size}")
    q_len = block_size // 2
    n = torch.arange(block_size, dtype=torch.float64)
    q = torch.arange(q_len, dtype=torch.float64)
    angle = 2 * math.pi * torch.outer(n, q) / block_size  # (B, Q)
    alternating = torch.cos(math.pi * n)  # (-1)^n: the Nyquist bin
    fwd = torch.zeros(block_size, block_size, dtype=torch.float64)
    fwd[:, :q_len] = torch.cos(angle)
    fwd[:, q_len + 1:] = -torch.sin(angle[:, 1:])
    fwd[:, q_len] = alternating
    weight = torch.full((q_len,), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    inv = torch.zeros(block_size, block_size, dtype=torch.float64)
    inv[:q_len] = weight[:, None] * torch.cos(angle.T) / block_size
    inv[q_len + 1:] = -2.0 * torch.sin(angle.T[1:]) / block_size
    inv[q_len] = alternating / block_size
    return fwd.to(device=device, dtype=dtype).contiguous(), inv.to(device=device, dtype=dtype).contiguous()


def _dft_dtypes(x_dtype: torch.dtype) -> torch.dtype:
    """Operand and spectrum storage dtype of the dft path: bf16 for 16-bit inputs (tensor cores at
    full rate; ~2x the output-rounding error, see graphopt.kernels.fft_chain; fp16 inputs too, because a
    spectrum bin can reach B * max|x| and overflow fp16), fp32 (TF32 GEMMs) otherwise."""
    return torch.bfloat16 if x_dtype in (torch.float16, torch.bfloat16) else torch.float32


def _check_inputs(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl):
    if impl not in IMPL_CHOICES:
        raise ValueError(f"unknown fft_chain impl {impl!r}; valid choices: {', '.join(IMPL_CHOICES)}")
    if coeff_real.shape != coeff_imag.shape or coeff_real.dim() != 3:
        raise ValueError(f"coeff_real/coeff_imag must both be (C, N, F); got {tuple(coeff_real.shape)} and {tuple(coeff_imag.shape)}")
    c_len, n_out, freqs = coeff_real.shape
    if freqs != block_size // 2 + 1:
        raise ValueError(f"coefficients have {freqs} frequencies; block_size {block_size} needs {block_size // 2 + 1}")
    in_features = x.shape[-1]
    k = perms.shape[0] + 1
    if perms.dim() != 2 or (perms.shape[0] and perms.shape[1] != in_features):
        raise ValueError(f"perms must be (K-1, in_features={in_features}) int64, got {tuple(perms.shape)}")
    if c_len != k * (-(-in_features // block_size)):
        raise ValueError(f"coefficients have C={c_len} but K={k} channels x ceil({in_features}/{block_size}) blocks = {k * -(-in_features // block_size)}")
    if n_out * block_size < out_features or (n_out - 1) * block_size >= out_features:
        raise ValueError(f"coefficients have {n_out} output blocks of {block_size}; out_features {out_features} needs {-(-out_features // block_size)}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be ({out_features},), got {tuple(bias.shape)}")


def fft_chain_torch(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 1: rfft -> per-frequency complex bmm (K in the contraction) -> irfft."""
    t, c_len, n_out = x2d.shape[0], coeff_real.shape[0], coeff_real.shape[1]
    dt = _compute_dtype(x2d)
    xk = _permuted_blocks(x2d.to(dt), perms, block_size, c_len // (perms.shape[0] + 1))
    xs = torch.fft.rfft(xk.reshape(t, c_len, block_size), dim=-1)  # (T, C, F)
    cs = torch.complex(coeff_real.to(dt), coeff_imag.to(dt)).permute(2, 0, 1)  # (F, C, N)
    ys = torch.bmm(xs.permute(2, 0, 1), cs)  # (F, T, N)
    y = torch.fft.irfft(ys.permute(1, 2, 0), n=block_size, dim=-1).reshape(t, n_out * block_size)[:, :out_features]
    y = y + bias.to(dt) if bias is not None else y
    return y.to(x2d.dtype)


def fft_chain_triton(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 2: rfft -> Triton contraction on rfft's layout (no permutes) -> irfft."""
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' needs Triton; valid choices without it: torch")
    t, (c_len, n_out, freqs) = x2d.shape[0], coeff_real.shape
    xk = _permuted_blocks(x2d.float(), perms, block_size, c_len // (perms.shape[0] + 1))
    xs = torch.view_as_real(torch.fft.rfft(xk.reshape(t, c_len, block_size), dim=-1))  # (T, C, F, 2)
    ys = torch.empty(t, n_out, freqs, 2, device=x2d.device, dtype=torch.float32)  # (T, N, F, 2)
    cr, ci = coeff_real.float().contiguous(), coeff_imag.float().contiguous()

    def grid(meta):
        return (triton.cdiv(freqs, meta["BLOCK_F"]), triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(t, meta["BLOCK_T"]))

    _fft_contract_kernel[grid](xs, cr, ci, ys, t, c_len, n_out, freqs, _t_bucket(t),
                               xs.stride(0), xs.stride(1), ys.stride(0), ys.stride(1))
    y = torch.fft.irfft(torch.view_as_complex(ys), n=block_size, dim=-1).reshape(t, n_out * block_size)[:, :out_features]
    y = y + bias.float() if bias is not None else y
    return y.to(x2d.dtype)


def fft_chain_dft(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 3: gather + forward DFT GEMM -> packed contraction -> inverse DFT GEMM + bias (3 launches)."""
    if not HAS_TRITON:
        raise RuntimeError("impl='dft' needs Triton; valid choices without it: torch")
    if block_size % 2:
        raise ValueError(f"impl='dft' needs an even block_size (packed real spectrum), got {block_size}; valid choices for odd block sizes: torch, triton")
    out_dtype = x2d.dtype
    op_dtype = _dft_dtypes(x2d.dtype)
    x2d = (x2d if x2d.dtype in (torch.float16, torch.bfloat16, torch.float32) else x2d.float()).contiguous()
    t, in_features = x2d.shape
    c_len, n_out, _ = coeff_real.shape
    n_in = c_len // (perms.shape[0] + 1)
    q_len = block_size // 2
    fwd, inv = _dft_tables(block_size, str(x2d.device), op_dtype)
    perm_arg = perms.contiguous() if perms.shape[0] else torch.zeros(1, dtype=torch.int64, device=x2d.device)
    xs = torch.empty(t * c_len, block_size, device=x2d.device, dtype=op_dtype)  # (T*C, B) packed spectra
    m_fwd = t * c_len
    _dft_forward_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_P"]), triton.cdiv(m_fwd, meta["BLOCK_M"]))](
        x2d, perm_arg, fwd, xs, m_fwd, in_features, c_len, n_in, block_size, _t_bucket(m_fwd), x2d.stride(0), FP32_DOT=_INTERPRET)
    ys = torch.empty(t * n_out, block_size, device=x2d.device, dtype=op_dtype)  # (T*N, B) packed output spectra
    cr, ci = coeff_real.float().contiguous(), coeff_imag.float().contiguous()
    _packed_contract_kernel[lambda meta: (triton.cdiv(q_len, meta["BLOCK_Q"]), triton.cdiv(n_out, meta["BLOCK_N"]), triton.cdiv(t, meta["BLOCK_T"]))](
        xs, cr, ci, ys, t, c_len, n_out, q_len, _t_bucket(t))
    y = torch.empty(t, out_features, device=x2d.device, dtype=x2d.dtype)
    bias_arg = bias.contiguous() if bias is not None else cr
    m_inv = t * n_out
    _dft_inverse_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_R"]), triton.cdiv(m_inv, meta["BLOCK_M"]))](
        ys, inv, bias_arg, y, m_inv, n_out, block_size, out_features, _t_bucket(m_inv), y.stride(0), HAS_BIAS=bias is not None, FP32_DOT=_INTERPRET)
    return y.to(out_dtype)


# Operand tables of the dft2 launchers, built once per (tensor, version) and reused: the fft_linear
# pass folds the coefficient spectrum into constants, so every call sees the same tensor objects
# (and a CUDA-graph capture after a first eager call launches no table-building ops). Keyed on the
# tensors' ids, validated by weak references and their version counters (an in-place update
# rebuilds); an entry is dropped when its tensor dies, and the oldest goes first past 64 entries.
# Caveat: a trainable FFTChainLinear recomputes its spectrum every forward, so on CUDA with dft2
# each call rebuilds G (a few small torch ops). Inference tensors (made under
# torch.inference_mode) have no version counter: an in-place write to one, which only inference
# mode allows, is not seen, and the old operands stay in use until clear_operand_cache().
_OPERAND_CACHE: dict = {}
_OPERAND_CACHE_SIZE = 64


def clear_operand_cache() -> None:
    """Forget every cached dft2 operand table (needed only after an in-place write to an inference tensor)."""
    _OPERAND_CACHE.clear()


def _tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (see the caveat above)
        return -1


def _cached_operand(tensors: tuple, tag: tuple, build):
    # A view (e.g. `layer.perms[1:]`, a new object per call) is identified by its base tensor and
    # its position in it; views share the base's version counter.
    anchors = tuple(t if t._base is None else t._base for t in tensors)
    key = (*((id(a), t.data_ptr(), tuple(t.shape), t.stride()) for a, t in zip(anchors, tensors)), *tag)
    hit = _OPERAND_CACHE.get(key)
    versions = tuple(_tensor_version(t) for t in tensors)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], anchors)) and hit[1] == versions:
        return hit[2]
    value = build()
    while len(_OPERAND_CACHE) >= _OPERAND_CACHE_SIZE:
        _OPERAND_CACHE.pop(next(iter(_OPERAND_CACHE)), None)

    def drop(_ref, key=key):  # a source tensor died (e.g. per-step coefficients in training): free its operands
        entry = _OPERAND_CACHE.get(key)
        if entry is not None and any(r is _ref for r in entry[0]):
            _OPERAND_CACHE.pop(key, None)

    _OPERAND_CACHE[key] = (tuple(weakref.ref(a, drop) for a in anchors), versions, value)
    return value


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _dft2_source_table(perms: torch.Tensor, in_features: int, block_size: int, n_in: int) -> torch.Tensor:
    """(C, B) int32: src[k * n_in + j, n] = the input feature that sample n of block j of channel k
    reads (perm_k[j * B + n]; channel 0 the identity); 0 in the zero padding, which the kernels
    mask by position (j * B + n >= in_features), never by this table."""
    ident = torch.arange(in_features, device=perms.device, dtype=torch.int64)[None]
    rows = torch.cat([ident, perms.to(torch.int64)]) if perms.shape[0] else ident  # (K, in)
    rows = torch.nn.functional.pad(rows, (0, n_in * block_size - in_features))
    return rows.reshape(-1, block_size).to(torch.int32).contiguous()


def _dft2_coefficient_operands(coeff_real: torch.Tensor, coeff_imag: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(C, N, F) spectral planes -> G (Q, 2, CP, 2NP), frequency-major, zero-padded to CP = pow2 >= 16
    channels and NP = pow2 >= 8 outputs, such that for every packed slot pair q:
        [Yr_q | Yi_q] (T, 2NP) = Xr_q (T, CP) @ G[q, 0] + Xi_q (T, CP) @ G[q, 1]
    i.e. G[q, 0] = [Re C_q | Im C_q], G[q, 1] = [-Im C_q | Re C_q]. At q = 0 the 'real' slot is
    DC and the 'imaginary' slot the Nyquist bin, both real: G[0, 0] = [Re C_0 | 0],
    G[0, 1] = [0 | Re C_Q] (irfft ignores Im Y_0 and Im Y_Q)."""
    c_len, n_out, freqs = coeff_real.shape
    q_len = freqs - 1
    cp, np_ = _pow2_at_least(c_len, 16), _pow2_at_least(n_out, 8)
    cr, ci = coeff_real.detach().float(), coeff_imag.detach().float()
    crq, ciq = cr[:, :, :q_len].permute(2, 0, 1), ci[:, :, :q_len].permute(2, 0, 1)  # (Q, C, N)
    g = torch.zeros(q_len, 2, cp, 2 * np_, device=coeff_real.device, dtype=torch.float32)
    g[:, 0, :c_len, :n_out] = crq
    g[:, 0, :c_len, np_:np_ + n_out] = ciq
    g[:, 1, :c_len, :n_out] = -ciq
    g[:, 1, :c_len, np_:np_ + n_out] = crq
    g[0, 0, :c_len, np_:np_ + n_out] = 0.0
    g[0, 1, :c_len, :n_out] = 0.0
    g[0, 1, :c_len, np_:np_ + n_out] = cr[:, :, q_len]
    return g.to(dtype).contiguous()


# Coefficient operand dtype of the dft2 contraction: fp32 planes run the tensor-core dots as TF32
# (10-bit mantissa, below the bf16 rounding of the stored spectra); torch.bfloat16 would halve the
# coefficient bytes at ~4x the coefficient rounding error.
DFT2_COEFF_DTYPE = torch.float32


# Staged gather: one program keeps a row chunk of at most GATHER_ROW_CHUNK features on chip
# (32 KiB of bf16 in shared memory); the column tiling is autotuned (`_GATHER_OPTIONS`).
GATHER_ROW_CHUNK = 16384


def _launch_gather_columns(x2d: torch.Tensor, src: torch.Tensor, out: torch.Tensor) -> None:
    """out (T, W) = x2d[:, src] (src int16/int32, flattened) with `_gather_columns_kernel`."""
    t, in_features = x2d.shape
    width = out.shape[1]
    row_chunk = min(_pow2_at_least(in_features, 16), 64 if _INTERPRET else GATHER_ROW_CHUNK)
    _gather_columns_kernel[lambda meta: (t, triton.cdiv(width, meta["BLOCK_W"] * meta["STEPS"]))](
        x2d, src, out, in_features, width, x2d.stride(0), _t_bucket(t),
        ROW_CHUNK=row_chunk, N_CHUNKS=triton.cdiv(in_features, row_chunk))


def _narrow_source_table(src: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (C, B) int32 source table flattened, as int16 where the features fit (half the index
    bytes that every token's gather reads)."""
    flat = src.reshape(-1)
    return flat.to(torch.int16) if in_features <= 2**15 else flat


def _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, *, pregather: bool):
    name = "dft2_pregather" if pregather else "dft2"
    if not HAS_TRITON:
        raise RuntimeError(f"impl={name!r} needs Triton; valid choices without it: torch")
    if block_size % 2:
        raise ValueError(f"impl={name!r} needs an even block_size (packed real spectrum), got {block_size}; valid choices for odd block sizes: torch, triton")
    out_dtype = x2d.dtype
    op_dtype = _dft_dtypes(x2d.dtype)
    x2d = (x2d if x2d.dtype in (torch.float16, torch.bfloat16, torch.float32) else x2d.float()).contiguous()
    t, in_features = x2d.shape
    c_len, n_out, _ = coeff_real.shape
    k = perms.shape[0] + 1
    n_in = c_len // k
    q_len = block_size // 2
    dev = x2d.device
    fwd, inv = _dft_tables(block_size, str(dev), op_dtype)
    # 1. forward DFT GEMM -> XS^T (B, T*C), frequency-major
    m_fwd = t * c_len
    src = _cached_operand((perms,), ("dft2_src", in_features, block_size, n_in), lambda: _dft2_source_table(perms, in_features, block_size, n_in))
    if k == 1:  # the identity: channel-block j of token t starts at t * stride + j * B
        source, stride, gather = x2d, x2d.stride(0), False
    elif pregather:  # one gather launch materializes (T, C*B) in channel order
        width = c_len * block_size
        source = torch.empty(t, width, device=dev, dtype=x2d.dtype)
        gather_src = _cached_operand((perms,), ("gather_src", in_features, block_size, n_in),
                                     lambda: _narrow_source_table(src, in_features))
        _launch_gather_columns(x2d, gather_src, source)
        stride, gather = source.stride(0), False
    else:
        source, stride, gather = x2d, x2d.stride(0), True
    xs = torch.empty(block_size, m_fwd, device=dev, dtype=op_dtype)
    _dft2_forward_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_P"]), triton.cdiv(m_fwd, meta["BLOCK_M"]))](
        source, src, fwd, xs, m_fwd, in_features, c_len, n_in, block_size, _t_bucket(m_fwd), stride,
        GATHER=gather, FP32_DOT=_INTERPRET)
    # 2. per-frequency contraction on tensor cores -> YS^T (B, T*N)
    g = _cached_operand((coeff_real, coeff_imag), ("dft2_g", DFT2_COEFF_DTYPE), lambda: _dft2_coefficient_operands(coeff_real, coeff_imag, DFT2_COEFF_DTYPE))
    cp, np2 = g.shape[2], g.shape[3]
    block_c, block_n2 = min(cp, 64), min(np2, 128)
    ys = torch.empty(block_size, t * n_out, device=dev, dtype=op_dtype)
    _spectral_mma_contract_kernel[lambda meta: (triton.cdiv(q_len, meta["FQ"]), triton.cdiv(np2, block_n2), triton.cdiv(t, meta["BLOCK_T"]))](
        xs, g, ys, t, c_len, n_out, q_len, _t_bucket(t),
        CP=cp, NP=np2 // 2, BLOCK_C=block_c, BLOCK_N2=block_n2, FP32_DOT=_INTERPRET)
    # 3. inverse DFT GEMM + bias + crop + cast
    y = torch.empty(t, out_features, device=dev, dtype=x2d.dtype)
    bias_arg = bias.contiguous() if bias is not None else fwd
    m_inv = t * n_out
    _dft2_inverse_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_R"]), triton.cdiv(m_inv, meta["BLOCK_M"]))](
        ys, inv, bias_arg, y, m_inv, n_out, block_size, out_features, _t_bucket(m_inv), y.stride(0),
        HAS_BIAS=bias is not None, FP32_DOT=_INTERPRET)
    return y.to(out_dtype)


def fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 4: forward DFT GEMM with the permutation gathered in-kernel (source-index tile
    prefetched one K step ahead) -> tensor-core per-frequency contraction -> inverse DFT GEMM +
    bias. 3 launches, spectra frequency-major."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=False)


def fft_chain_dft2_pregather(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features):
    """Candidate 5: as dft2, but P_k x is gathered once first (`_gather_columns_kernel`, one extra
    launch when K > 1) and the forward kernel is a plain GEMM with no dependent loads."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=True)


_LAUNCHERS = {"torch": fft_chain_torch, "triton": fft_chain_triton, "dft": fft_chain_dft,
              "dft2": fft_chain_dft2, "dft2_pregather": fft_chain_dft2_pregather}


def fft_chain_linear(x, coeff_real, coeff_imag, perms, bias, block_size: int, out_features: int, impl: str = "auto"):
    """Run the layer with one implementation ("auto": `default_implementation`).
    x (..., in) -> (..., out_features). On CPU every implementation name runs the torch path."""
    _check_inputs(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl)
    if x.numel() == 0 and x.shape[-1] > 0:  # no tokens (MKL's FFT refuses an empty batch)
        return x.new_empty(*x.shape[:-1], out_features)
    # .contiguous(): the paths crop (..., n_out * B) to out_features, a strided view the op's fake
    # (and Inductor's stride assertions) take for contiguous
    if not x.is_cuda:  # CPU: the torch reference (the Triton launchers are tested directly)
        return fft_chain_spectral_reference(x, coeff_real, coeff_imag, perms, bias, block_size, out_features).contiguous()
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, in_features)
    if impl == "auto":
        impl = default_implementation(x, block_size)
    y = _LAUNCHERS[impl](x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features)
    return y.reshape(*lead, out_features).contiguous()
