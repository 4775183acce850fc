"""Launchers of the FFT chain: input checks, the operand tables of the DFT implementations
(`operand_tables`), one launcher per implementation (`_LAUNCHERS`), and `fft_chain_linear`, which
runs the implementation it is given. Which implementation a call site runs is the fft_linear
pass's choice (graphopt.cost.fft_chain), and the pass builds that implementation's tables at
compile time (graph constants); a table not given is built for the call and freed with it, so no
tensor outlives a call but the output. `impl="auto"` at call time runs the fixed rule of
`default_implementation`."""

from __future__ import annotations

import math

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
# Shared by the launchers: token buckets, the DFT matrices, dtypes, input checks
# =============================================================================================
def _t_bucket(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


def _dft_tables(block_size: int, device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed real-DFT matrices (the packed layout of triton_kernels.py), built in float64 on
    `device` (no host-to-device copy, so a CUDA-graph capture can record it), stored in `dtype`:
    forward W (B, B) with XS = x @ W, inverse Winv (B, B) with x = XS @ Winv (irfft of the packed
    spectrum: bin weights 1 (DC, Nyquist) or 2, and 1/B, folded in). Even B only."""
    if block_size % 2:
        raise ValueError(f"the packed real DFT needs an even block_size, got {block_size}")
    q_len = block_size // 2
    f64 = {"device": device, "dtype": torch.float64}
    n = torch.arange(block_size, **f64)
    q = torch.arange(q_len, **f64)
    angle = 2 * math.pi * torch.outer(n, q) / block_size  # (B, Q)
    alternating = 1.0 - 2.0 * torch.remainder(n, 2)  # (-1)^n: the Nyquist bin
    fwd = torch.zeros(block_size, block_size, **f64)
    fwd[:, :q_len] = torch.cos(angle)
    fwd[:, q_len + 1:] = -torch.sin(angle[:, 1:])
    fwd[:, q_len] = alternating
    weight = torch.full((q_len,), 2.0, **f64)
    weight[0] = 1.0
    inv = torch.zeros(block_size, block_size, **f64)
    inv[:q_len] = weight[:, None] * torch.cos(angle.T) / block_size
    inv[q_len + 1:] = -2.0 * torch.sin(angle.T[1:]) / block_size
    inv[q_len] = alternating / block_size
    return fwd.to(dtype).contiguous(), inv.to(dtype).contiguous()


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


# =============================================================================================
# Operand tables of the DFT implementations
# =============================================================================================
# Besides x, the dft paths read constant tables: the packed DFT matrices (dft, dft2,
# dft2_pregather), and for dft2 / dft2_pregather the source index of the permutation gather and
# the coefficient operand G. They depend only on the block size, x's dtype, perms and the
# coefficients, so the fft_linear pass builds them at compile time (`operand_tables`) and hands
# them to the op as graph constants. A launcher not given a table builds it for the call (a
# trainable layer's spectrum changes every step; an eager call) and drops it on return: no tensor
# a call allocates outlives it but its output, which CUDA-graph trees require.
TABLE_NAMES: tuple[str, ...] = ("dft_forward", "dft_inverse", "source_index", "coeff_operand")


def tables_read(impl: str, k: int) -> tuple[str, ...]:
    """The operand tables (TABLE_NAMES) that implementation `impl` reads with K channels; the
    source index only where it gathers a permutation (K > 1)."""
    if impl == "dft":
        return ("dft_forward", "dft_inverse")
    if impl in ("dft2", "dft2_pregather"):
        return ("dft_forward", "dft_inverse", "coeff_operand", *(("source_index",) if k > 1 else ()))
    return ()


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


def _narrow_source_table(src: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (C, B) int32 source table flattened, as int16 where the features fit (half the index
    bytes that every token's gather reads)."""
    flat = src.reshape(-1)
    return flat.to(torch.int16) if in_features <= 2**15 else flat


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


def _source_index(impl: str, perms: torch.Tensor, in_features: int, block_size: int) -> torch.Tensor:
    """dft2: the (C, B) int32 source table; dft2_pregather: the same flattened and narrowed, the
    index list of the gather launch."""
    n_in = -(-in_features // block_size)
    src = _dft2_source_table(perms, in_features, block_size, n_in)
    return _narrow_source_table(src, in_features) if impl == "dft2_pregather" else src


def _table_specs(impl: str, x_dtype: torch.dtype, block_size: int, in_features: int, c_len: int, n_out: int) -> dict:
    """name -> (shape, dtype) of every table `impl` may read."""
    op_dtype = _dft_dtypes(x_dtype)
    specs = {"dft_forward": ((block_size, block_size), op_dtype), "dft_inverse": ((block_size, block_size), op_dtype)}
    if impl == "dft2":
        specs["source_index"] = ((c_len, block_size), torch.int32)
    elif impl == "dft2_pregather":
        specs["source_index"] = ((c_len * block_size,), torch.int16 if in_features <= 2**15 else torch.int32)
    cp, np_ = _pow2_at_least(c_len, 16), _pow2_at_least(n_out, 8)
    specs["coeff_operand"] = ((block_size // 2, 2, cp, 2 * np_), DFT2_COEFF_DTYPE)
    return specs


def operand_tables(impl: str, x_dtype: torch.dtype, block_size: int, in_features: int, device, *,
                   perms: torch.Tensor | None = None, coeff_real: torch.Tensor | None = None,
                   coeff_imag: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tables `impl` reads (see `tables_read`) for inputs of `x_dtype` on `device`, built from
    what is given: the DFT matrices always, the source index when `perms` (K-1, in) is given, G
    when both coefficient planes are. A table left out is built by the launcher at each call.
    Pass the result to the op or a launcher as keyword arguments."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown fft_chain impl {impl!r}; valid choices: {', '.join(IMPLEMENTATIONS)}")
    k = perms.shape[0] + 1 if perms is not None else None
    wanted = tables_read(impl, k if k is not None else 2)
    tables: dict[str, torch.Tensor] = {}
    if "dft_forward" in wanted:
        tables["dft_forward"], tables["dft_inverse"] = _dft_tables(block_size, device, _dft_dtypes(x_dtype))
    if "source_index" in wanted and perms is not None:
        tables["source_index"] = _source_index(impl, perms.to(device), in_features, block_size)
    if "coeff_operand" in wanted and coeff_real is not None and coeff_imag is not None:
        tables["coeff_operand"] = _dft2_coefficient_operands(coeff_real.to(device), coeff_imag.to(device), DFT2_COEFF_DTYPE)
    return tables


def _given_table(name: str, table: torch.Tensor, spec: tuple, device: torch.device, impl: str) -> torch.Tensor:
    shape, dtype = spec
    if tuple(table.shape) != shape or table.dtype != dtype or table.device != device or not table.is_contiguous():
        raise ValueError(f"{name} for impl={impl!r} must be a contiguous {shape} {dtype} tensor on {device} (as "
                         f"operand_tables builds it), got {tuple(table.shape)} {table.dtype} on {table.device}")
    return table


def _dft_operands(block_size, device, op_dtype, dft_forward, dft_inverse, specs, impl):
    """The DFT matrices, as given (checked) or built for this call."""
    if dft_forward is None or dft_inverse is None:
        fwd, inv = _dft_tables(block_size, device, op_dtype)
        dft_forward = fwd if dft_forward is None else dft_forward
        dft_inverse = inv if dft_inverse is None else dft_inverse
    return (_given_table("dft_forward", dft_forward, specs["dft_forward"], device, impl),
            _given_table("dft_inverse", dft_inverse, specs["dft_inverse"], device, impl))


# =============================================================================================
# Launchers
# =============================================================================================
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


def fft_chain_dft(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, *, dft_forward=None, dft_inverse=None):
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
    specs = _table_specs("dft", x2d.dtype, block_size, in_features, c_len, n_out)
    fwd, inv = _dft_operands(block_size, x2d.device, op_dtype, dft_forward, dft_inverse, specs, "dft")
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


def _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, *, pregather: bool,
                    dft_forward=None, dft_inverse=None, source_index=None, coeff_operand=None):
    name = "dft2_pregather" if pregather else "dft2"
    if not HAS_TRITON:
        raise RuntimeError(f"impl={name!r} needs Triton; valid choices without it: torch")
    if block_size % 2:
        raise ValueError(f"impl={name!r} needs an even block_size (packed real spectrum), got {block_size}; valid choices for odd block sizes: torch, triton")
    out_dtype = x2d.dtype
    op_dtype = _dft_dtypes(x2d.dtype)
    specs = _table_specs(name, x2d.dtype, block_size, x2d.shape[1], coeff_real.shape[0], coeff_real.shape[1])
    x2d = (x2d if x2d.dtype in (torch.float16, torch.bfloat16, torch.float32) else x2d.float()).contiguous()
    t, in_features = x2d.shape
    c_len, n_out, _ = coeff_real.shape
    k = perms.shape[0] + 1
    n_in = c_len // k
    q_len = block_size // 2
    dev = x2d.device
    fwd, inv = _dft_operands(block_size, dev, op_dtype, dft_forward, dft_inverse, specs, name)
    if k > 1:
        if source_index is None:
            source_index = _source_index(name, perms, in_features, block_size)
        source_index = _given_table("source_index", source_index, specs["source_index"], dev, name)
    if coeff_operand is None:
        coeff_operand = _dft2_coefficient_operands(coeff_real, coeff_imag, DFT2_COEFF_DTYPE)
    g = _given_table("coeff_operand", coeff_operand, specs["coeff_operand"], dev, name)
    # 1. forward DFT GEMM -> XS^T (B, T*C), frequency-major
    m_fwd = t * c_len
    if k == 1:  # the identity: channel-block j of token t starts at t * stride + j * B
        source, stride, gather = x2d, x2d.stride(0), False
    elif pregather:  # one gather launch materializes (T, C*B) in channel order
        source = torch.empty(t, c_len * block_size, device=dev, dtype=x2d.dtype)
        _launch_gather_columns(x2d, source_index, source)
        stride, gather = source.stride(0), False
    else:
        source, stride, gather = x2d, x2d.stride(0), True
    xs = torch.empty(block_size, m_fwd, device=dev, dtype=op_dtype)
    _dft2_forward_kernel[lambda meta: (triton.cdiv(block_size, meta["BLOCK_P"]), triton.cdiv(m_fwd, meta["BLOCK_M"]))](
        source, source_index if gather else fwd, fwd, xs, m_fwd, in_features, c_len, n_in, block_size, _t_bucket(m_fwd), stride,
        GATHER=gather, FP32_DOT=_INTERPRET)
    # 2. per-frequency contraction on tensor cores -> YS^T (B, T*N)
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


def fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, **tables):
    """Candidate 4: forward DFT GEMM with the permutation gathered in-kernel (source-index tile
    prefetched one K step ahead) -> tensor-core per-frequency contraction -> inverse DFT GEMM +
    bias. 3 launches, spectra frequency-major. `tables`: any of TABLE_NAMES (`operand_tables`)."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=False, **tables)


def fft_chain_dft2_pregather(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, **tables):
    """Candidate 5: as dft2, but P_k x is gathered once first (`_gather_columns_kernel`, one extra
    launch when K > 1) and the forward kernel is a plain GEMM with no dependent loads."""
    return _fft_chain_dft2(x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, pregather=True, **tables)


_LAUNCHERS = {"torch": fft_chain_torch, "triton": fft_chain_triton, "dft": fft_chain_dft,
              "dft2": fft_chain_dft2, "dft2_pregather": fft_chain_dft2_pregather}


def fft_chain_linear(x, coeff_real, coeff_imag, perms, bias, block_size: int, out_features: int, impl: str = "auto",
                     dft_forward=None, dft_inverse=None, source_index=None, coeff_operand=None):
    """Run the layer with one implementation ("auto": `default_implementation`).
    x (..., in) -> (..., out_features). On CPU every implementation name runs the torch path.
    The tables (`operand_tables`) are those of `impl`; the implementation run uses the ones it
    reads (`tables_read`), builds for this call those it reads and is not given, and ignores the rest."""
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
    given = {"dft_forward": dft_forward, "dft_inverse": dft_inverse, "source_index": source_index, "coeff_operand": coeff_operand}
    tables = {name: given[name] for name in tables_read(impl, perms.shape[0] + 1) if given[name] is not None}
    y = _LAUNCHERS[impl](x2d, coeff_real, coeff_imag, perms, bias, block_size, out_features, **tables)
    return y.reshape(*lead, out_features).contiguous()
