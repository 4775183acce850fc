"""The Triton kernels of the FFT chain, one section per implementation (the implementations and the
packed spectral layout are described in graphopt.kernels.fft_chain; launchers.py launches them).
Defined only where Triton is installed (HAS_TRITON)."""

from __future__ import annotations

from graphopt.kernels.launch import INTERPRET as _INTERPRET  # fixed at import, as Triton reads it

try:  # Triton is optional on CPU-only installs; the torch paths do not need it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False


# =============================================================================================
# Triton kernels
# =============================================================================================
if HAS_TRITON:

    def _configs(options: list[dict], warps: list[int], stages: list[int] | None = None) -> list:
        """Autotune configs: every option x warps x stages; an option may pin "num_warps"/"num_stages"."""
        stages = stages or [3]
        if _INTERPRET:  # the interpreter runs every config: keep one
            options, warps, stages = options[:1], warps[:1], stages[:1]
        out = []
        for o in options:
            meta = {key: v for key, v in o.items() if key not in ("num_warps", "num_stages")}
            for w in ([o["num_warps"]] if "num_warps" in o else warps):
                for st in ([o["num_stages"]] if "num_stages" in o else stages):
                    out.append(triton.Config(meta, num_warps=w, num_stages=st))
        return out

    # -----------------------------------------------------------------------------------------
    # Candidate 2: per-frequency contraction on rfft's own layout, K channels fused.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_F": 32}, {"BLOCK_T": 8, "BLOCK_N": 8, "BLOCK_F": 32},
                          {"BLOCK_T": 32, "BLOCK_N": 4, "BLOCK_F": 16}, {"BLOCK_T": 4, "BLOCK_N": 8, "BLOCK_F": 64}], [4]),
        key=["T_BUCKET", "C", "N", "F"],
    )
    @triton.jit
    def _fft_contract_kernel(
        x_ptr,  # (T, C, F, 2) fp32: view_as_real of rfft's output
        cr_ptr, ci_ptr,  # (C, N, F) fp32 planes
        y_ptr,  # (T, N, F, 2) fp32: view_as_real of irfft's input
        T, C, N, F, T_BUCKET,
        stride_xt, stride_xc, stride_yt, stride_yn,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
    ):
        pid_f, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_tf = (offs_t[:, None] < T) & (offs_f[None, :] < F)  # (BT, BF)
        mask_nf = (offs_n[:, None] < N) & (offs_f[None, :] < F)  # (BN, BF)
        acc_r = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_F), dtype=tl.float32)
        acc_i = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_F), dtype=tl.float32)
        x_base = x_ptr + offs_t[:, None] * stride_xt + offs_f[None, :] * 2
        c_base = offs_n[:, None] * F + offs_f[None, :]
        for c in range(0, C):
            xr = tl.load(x_base + c * stride_xc, mask=mask_tf, other=0.0)  # (BT, BF)
            xi = tl.load(x_base + c * stride_xc + 1, mask=mask_tf, other=0.0)
            wr = tl.load(cr_ptr + c * N * F + c_base, mask=mask_nf, other=0.0)  # (BN, BF)
            wi = tl.load(ci_ptr + c * N * F + c_base, mask=mask_nf, other=0.0)
            xr3, xi3 = xr[:, None, :], xi[:, None, :]
            wr3, wi3 = wr[None, :, :], wi[None, :, :]
            acc_r += xr3 * wr3 - xi3 * wi3
            acc_i += xr3 * wi3 + xi3 * wr3
        y_off = offs_t[:, None, None] * stride_yt + offs_n[None, :, None] * stride_yn + offs_f[None, None, :] * 2
        y_mask = (offs_t[:, None, None] < T) & (offs_n[None, :, None] < N) & (offs_f[None, None, :] < F)
        tl.store(y_ptr + y_off, acc_r, mask=y_mask)
        tl.store(y_ptr + y_off + 1, acc_i, mask=y_mask)

    # -----------------------------------------------------------------------------------------
    # Candidate 3 ("dft"): three tensor-core-friendly kernels on the packed real spectrum.
    # Packed ("halfcomplex") layout of one block's spectrum, B = 2Q reals, even B only:
    #   slot q      (0 <= q < Q): Re X_q
    #   slot Q + q  (1 <= q < Q): Im X_q
    #   slot Q               : Re X_{B/2} (the Nyquist bin, real; Im X_0 = Im X_{B/2} = 0)
    # so the forward and inverse real DFTs are square B x B matrix products with no padding.
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_P": 64, "BLOCK_N": 64}, {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_N": 64},
                          {"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_P": 128, "BLOCK_N": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_P": 256, "BLOCK_N": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "C", "B"],
    )
    @triton.jit
    def _dft_forward_kernel(
        x_ptr,  # (T, IN) input dtype
        perm_ptr,  # (K-1, IN) int64 (a dummy when K = 1)
        w_ptr,  # (B, B) operand dtype: packed forward real-DFT matrix, W[n, p]
        xs_ptr,  # (T * C, B) spectrum dtype out: row t * C + c holds channel-block c of token t
        M, IN, C, NIN, B, M_BUCKET, stride_xt,
        FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """XS = gather(x) @ W: rows (t, c = k * NIN + j), the permutation P_k and the zero padding
        applied while loading; one tensor-core GEMM (T*C, B) x (B, B), fp32 accumulation."""
        pid_p, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) flattened (t, c)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,)
        tok = offs_m // C
        ch = offs_m % C
        k = ch // NIN
        j = ch % NIN
        row_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for n0 in range(0, B, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,) time sample within the block
            pos = j[:, None] * B + offs_n[None, :]  # (BM, BN) position in the permuted, padded row
            valid = row_ok[:, None] & (pos < IN) & (offs_n[None, :] < B)
            use_perm = k[:, None] > 0  # channel 0 is the identity: no permutation row
            permuted = tl.load(perm_ptr + (k[:, None] - 1) * IN + pos, mask=valid & use_perm, other=0)
            src = tl.where(use_perm, permuted, pos)
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + src, mask=valid, other=0.0)  # (BM, BN)
            wt = tl.load(w_ptr + offs_n[:, None] * B + offs_p[None, :],
                         mask=(offs_n[:, None] < B) & (offs_p[None, :] < B), other=0.0)  # (BN, BP)
            if FP32_DOT:  # the CPU interpreter multiplies bf16 tl.dot operands wrongly (their uint16 storage)
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(xt.to(w_ptr.dtype.element_ty), wt)
        out_mask = row_ok[:, None] & (offs_p[None, :] < B)
        tl.store(xs_ptr + offs_m[:, None] * B + offs_p[None, :], acc.to(xs_ptr.dtype.element_ty), mask=out_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 4}, {"BLOCK_T": 16, "BLOCK_N": 2, "BLOCK_Q": 32, "UNROLL": 4},
                          {"BLOCK_T": 16, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 2}, {"BLOCK_T": 8, "BLOCK_N": 8, "BLOCK_Q": 32, "UNROLL": 4},
                          {"BLOCK_T": 16, "BLOCK_N": 2, "BLOCK_Q": 16, "UNROLL": 8}, {"BLOCK_T": 32, "BLOCK_N": 4, "BLOCK_Q": 32, "UNROLL": 2},
                          {"BLOCK_T": 64, "BLOCK_N": 4, "BLOCK_Q": 16, "UNROLL": 2}, {"BLOCK_T": 32, "BLOCK_N": 8, "BLOCK_Q": 32, "UNROLL": 1}], [4], [3]),
        key=["T_BUCKET", "C", "N", "Q"],
    )
    @triton.jit
    def _packed_contract_kernel(
        xs_ptr,  # (T, C, 2Q) packed spectra, spectrum dtype
        cr_ptr, ci_ptr,  # (C, N, Q + 1) fp32 coefficient planes (F = Q + 1 frequencies)
        ys_ptr,  # (T, N, 2Q) packed output spectra, spectrum dtype
        T, C, N, Q, T_BUCKET,
        UNROLL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    ):
        """YS[t, n, q] = sum_c XS[t, c, q] * C^[c, n, q] (complex, on the packed layout; K fused in c).
        Slot 0 is special: its 'real' slot is DC and its 'imaginary' slot is the real Nyquist bin,
        so both multiply by real coefficients (Re C_0 and Re C_Q)."""
        pid_q, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        F = Q + 1
        mask_tq = (offs_t[:, None] < T) & (offs_q[None, :] < Q)  # (BT, BQ)
        mask_nq = (offs_n[:, None] < N) & (offs_q[None, :] < Q)  # (BN, BQ)
        mask_ni = mask_nq & (offs_q[None, :] >= 1)  # Im C_0 is dropped (irfft ignores Im Y_0)
        q_b = tl.where(offs_q == 0, Q, offs_q)  # coefficient partnering the 'imaginary' slot: Re C_Q at q = 0
        x_re = xs_ptr + offs_t[:, None] * (C * 2 * Q) + offs_q[None, :]
        c_off = offs_n[:, None] * F  # (BN, 1)
        acc_r = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_Q), dtype=tl.float32)
        acc_i = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_Q), dtype=tl.float32)
        for c0 in range(0, C, UNROLL):
            for u in tl.static_range(UNROLL):  # independent loads in flight: the loop is latency-bound at few tokens
                c = c0 + u
                ok = ((offs_q * 0 + c) < C)[None, :]  # (1, BQ): the unrolled tail past C
                xr = tl.load(x_re + c * 2 * Q, mask=mask_tq & ok, other=0.0).to(tl.float32)  # (BT, BQ)
                xi = tl.load(x_re + c * 2 * Q + Q, mask=mask_tq & ok, other=0.0).to(tl.float32)
                base = c * N * F + c_off
                wr = tl.load(cr_ptr + base + offs_q[None, :], mask=mask_nq & ok, other=0.0)  # (BN, BQ)
                wi = tl.load(ci_ptr + base + offs_q[None, :], mask=mask_ni & ok, other=0.0)
                wb = tl.load(cr_ptr + base + q_b[None, :], mask=mask_nq & ok, other=0.0)
                xr3, xi3 = xr[:, None, :], xi[:, None, :]
                acc_r += xr3 * wr[None, :, :] - xi3 * wi[None, :, :]
                acc_i += xr3 * wi[None, :, :] + xi3 * wb[None, :, :]
        y_off = offs_t[:, None, None] * (N * 2 * Q) + offs_n[None, :, None] * (2 * Q) + offs_q[None, None, :]
        y_mask = (offs_t[:, None, None] < T) & (offs_n[None, :, None] < N) & (offs_q[None, None, :] < Q)
        tl.store(ys_ptr + y_off, acc_r.to(ys_ptr.dtype.element_ty), mask=y_mask)
        tl.store(ys_ptr + y_off + Q, acc_i.to(ys_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _inverse_dft_tile(ys_ptr, stride_ys_m, stride_ys_p, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_P: tl.constexpr):
        """The inverse-DFT GEMM tile shared by the dft and dft2 pipelines: rows (t, n) of the packed
        output spectra (element (m, p) at ys + m * stride_ys_m + p * stride_ys_p) times Winv, then
        bias, crop to OUT and cast in the epilogue. Grid (B / BLOCK_R, T*N / BLOCK_M)."""
        pid_r, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (t, n)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p0 in range(0, B, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            a = tl.load(ys_ptr + offs_m[:, None] * stride_ys_m + offs_p[None, :] * stride_ys_p,
                        mask=row_ok[:, None] & (offs_p[None, :] < B), other=0.0)
            g = tl.load(winv_ptr + offs_p[:, None] * B + offs_r[None, :], mask=(offs_p[:, None] < B) & (offs_r[None, :] < B), other=0.0)
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), g.to(tl.float32))
            else:
                acc += tl.dot(a.to(winv_ptr.dtype.element_ty), g)
        tok = offs_m // N
        cols = (offs_m % N)[:, None] * B + offs_r[None, :]  # (BM, BR) output feature
        mask = row_ok[:, None] & (offs_r[None, :] < B) & (cols < OUT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + tok[:, None] * stride_yt + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_P": 64}, {"BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_P": 64},
                          {"BLOCK_M": 64, "BLOCK_R": 128, "BLOCK_P": 64}, {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_P": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_R": 256, "BLOCK_P": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "N", "B"],
    )
    @triton.jit
    def _dft_inverse_kernel(
        ys_ptr,  # (T * N, B) packed output spectra, spectrum dtype
        winv_ptr,  # (B, B) operand dtype: packed inverse real-DFT matrix (irfft bin weights and 1/B folded in)
        bias_ptr,  # (OUT,) or a dummy
        y_ptr,  # (T, OUT) output dtype
        M, N, B, OUT, M_BUCKET, stride_yt,
        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        """y[t, n*B + r] = sum_p YS[t*N + n, p] Winv[p, r] + bias: one GEMM (T*N, B) x (B, B) whose
        epilogue adds the bias, crops the padded output columns and casts."""
        _inverse_dft_tile(ys_ptr, B, 1, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS, FP32_DOT, BLOCK_M, BLOCK_R, BLOCK_P)

    # -----------------------------------------------------------------------------------------
    # A program stores STEPS x BLOCK_W columns of one token (unrolled: every index load of the
    # program is in flight at once); the widest configs cover a whole LLaMA-sized row, so the row
    # is read once per token.
    _GATHER_OPTIONS = [{"BLOCK_W": 32, "STEPS": 2}] if _INTERPRET else [
        {"BLOCK_W": 1024, "STEPS": 4, "num_warps": 8}, {"BLOCK_W": 2048, "STEPS": 4, "num_warps": 8},
        {"BLOCK_W": 2048, "STEPS": 8, "num_warps": 16}, {"BLOCK_W": 2048, "STEPS": 16, "num_warps": 16},
        {"BLOCK_W": 4096, "STEPS": 4, "num_warps": 16}, {"BLOCK_W": 1024, "STEPS": 16, "num_warps": 8}]

    @triton.autotune(configs=_configs(_GATHER_OPTIONS, [8], [1]), key=["T_BUCKET", "IN", "W"])
    @triton.jit
    def _gather_columns_kernel(
        x_ptr,  # (T, IN)
        src_ptr,  # (W,) int16 or int32: source column of each output column, in [0, IN)
        out_ptr,  # (T, W) contiguous
        IN, W, stride_xt, T_BUCKET,
        ROW_CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_W: tl.constexpr, STEPS: tl.constexpr,
    ):
        """out[t, w] = x[t, src[w]]: the permuted input of dft2_pregather. A random permutation read
        straight from global memory costs one 32-byte sector per 2-byte element; here the token's
        row is read once per program, coalesced, in chunks of ROW_CHUNK features, and tl.gather
        picks the elements from that on-chip copy (shared memory). Each output column is stored by
        the one chunk that holds its source."""
        t = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * (STEPS * BLOCK_W)
        offs_row = tl.arange(0, ROW_CHUNK)
        for c in tl.static_range(N_CHUNKS):
            base = c * ROW_CHUNK
            row = tl.load(x_ptr + t * stride_xt + base + offs_row, mask=base + offs_row < IN, other=0.0)
            for step in tl.static_range(STEPS):
                offs_w = first + step * BLOCK_W + tl.arange(0, BLOCK_W)
                w_ok = offs_w < W
                local = tl.load(src_ptr + offs_w, mask=w_ok, other=0).to(tl.int32) - base
                here = (local >= 0) & (local < ROW_CHUNK)
                vals = tl.gather(row, tl.where(here, local, 0), 0)
                tl.store(out_ptr + t * W + offs_w, vals, mask=w_ok & here)

    # Candidate 4 ("dft2", "dft2_pregather"): the dft pipeline rebuilt for latency at few tokens.
    # Same packed real spectrum, but stored FREQUENCY-MAJOR: XS^T (B, T*C) and YS^T (B, T*N), so
    # that one frequency's spectrum over all tokens and channels is one contiguous (T, C) matrix
    # and the contraction becomes small tensor-core matmuls, per frequency:
    #   [Yr | Yi] (T, 2NP) = Xr (T, CP) @ G[q, 0] (CP, 2NP) + Xi (T, CP) @ G[q, 1] (CP, 2NP)
    # with G the coefficient planes laid out by `_dft2_coefficient_operands`. The forward GEMM
    # either gathers P_k through an int32 source table whose next tile is loaded one K step ahead
    # ("dft2", 3 launches), or reads an input pre-gathered by `_gather_columns_kernel`
    # ("dft2_pregather"; the zero padding is then a mask computed from the row, not a load).
    # -----------------------------------------------------------------------------------------
    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_P": 64, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_K": 128},
                          {"BLOCK_M": 16, "BLOCK_P": 128, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 32, "BLOCK_P": 128, "BLOCK_K": 64},
                          {"BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_K": 64, "num_stages": 4}, {"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_K": 64},
                          {"BLOCK_M": 128, "BLOCK_P": 128, "BLOCK_K": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_P": 256, "BLOCK_K": 64, "num_warps": 8},
                          # wide P tiles: each gathered x element is loaded by B / BLOCK_P programs
                          {"BLOCK_M": 16, "BLOCK_P": 256, "BLOCK_K": 64}, {"BLOCK_M": 32, "BLOCK_P": 256, "BLOCK_K": 64, "num_warps": 8},
                          {"BLOCK_M": 16, "BLOCK_P": 512, "BLOCK_K": 32, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "C", "B", "GATHER"],
    )
    @triton.jit
    def _dft2_forward_kernel(
        x_ptr,  # GATHER: (T, IN) input; else rows of B samples already in channel order: token t, channel c at t * stride_xt + c * B
        src_ptr,  # (C, B) int32: source feature of sample n of channel-block c (any valid index in the padding); GATHER only
        w_ptr,  # (B, B) operand dtype: packed forward real-DFT matrix W[n, p]
        xs_ptr,  # (B, M) spectrum dtype out, frequency-major: XS^T[p, t * C + c]
        M, IN, C, NIN, B, M_BUCKET, stride_xt,
        GATHER: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """XS^T = (P x, zero-padded, as (T*C, B) rows) @ W, stored transposed. The zero padding is
        the mask j * B + n < IN (j = c mod NIN): no load decides it."""
        pid_p, pid_m = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) flattened (t, c)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # (BP,) packed spectral slot
        offs_kk = tl.arange(0, BLOCK_K)
        tok = offs_m // C
        ch = offs_m % C
        j = ch % NIN
        row_ok = offs_m < M
        x_row = x_ptr + tok[:, None] * stride_xt  # (BM, 1)
        if GATHER:  # source indices of the first K step; each step prefetches the next one's
            idx = tl.load(src_ptr + ch[:, None] * B + offs_kk[None, :], mask=row_ok[:, None] & (offs_kk[None, :] < B), other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            offs_k = k0 + offs_kk  # (BK,) time sample within the block
            valid = row_ok[:, None] & (offs_k[None, :] < B) & (j[:, None] * B + offs_k[None, :] < IN)
            if GATHER:
                xt = tl.load(x_row + idx, mask=valid, other=0.0)  # (BM, BK)
                nxt = offs_k + BLOCK_K
                idx = tl.load(src_ptr + ch[:, None] * B + nxt[None, :], mask=row_ok[:, None] & (nxt[None, :] < B), other=0)
            else:
                xt = tl.load(x_row + ch[:, None] * B + offs_k[None, :], mask=valid, other=0.0)
            wt = tl.load(w_ptr + offs_k[:, None] * B + offs_p[None, :], mask=(offs_k[:, None] < B) & (offs_p[None, :] < B), other=0.0)
            if FP32_DOT:  # the CPU interpreter multiplies bf16 tl.dot operands wrongly
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(xt.to(w_ptr.dtype.element_ty), wt)
        out_mask = row_ok[:, None] & (offs_p[None, :] < B)
        tl.store(xs_ptr + offs_p[None, :] * M + offs_m[:, None], acc.to(xs_ptr.dtype.element_ty), mask=out_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_T": 16, "FQ": 2}, {"BLOCK_T": 16, "FQ": 1}, {"BLOCK_T": 16, "FQ": 4}, {"BLOCK_T": 32, "FQ": 2},
                          {"BLOCK_T": 64, "FQ": 1}, {"BLOCK_T": 64, "FQ": 2}, {"BLOCK_T": 128, "FQ": 1, "num_warps": 8}], [4], [1]),
        key=["T_BUCKET", "C", "N", "Q"],
    )
    @triton.jit
    def _spectral_mma_contract_kernel(
        xs_ptr,  # (B, T*C) frequency-major packed input spectra, spectrum dtype
        g_ptr,  # (Q, 2, CP, 2NP) coefficient operands (see _dft2_coefficient_operands)
        ys_ptr,  # (B, T*N) frequency-major packed output spectra, spectrum dtype
        T, C, N, Q, T_BUCKET,
        CP: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N2: tl.constexpr,
        FP32_DOT: tl.constexpr, BLOCK_T: tl.constexpr, FQ: tl.constexpr,
    ):
        """Per frequency q of this program's FQ: [Yr | Yi] = Xr @ G[q,0] + Xi @ G[q,1] on tensor
        cores (fp32 accumulation). Slot 0 (DC real, Nyquist real) needs no special case: G[0]
        holds Re C_0 and Re C_Q where those slots meet. All loads of a program are independent
        (the frequency and channel loops are unrolled), so they are in flight together."""
        pid_q, pid_n, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n2 = pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2)  # column of [Yr | Yi]
        is_imag = offs_n2 >= NP
        n = tl.where(is_imag, offs_n2 - NP, offs_n2)
        m_in = T * C
        m_out = T * N
        t_ok = offs_t < T
        for i in tl.static_range(FQ):
            q = pid_q * FQ + i
            q_ok_t = (offs_t * 0 + q) < Q  # (BT,): this frequency exists (a vector: the interpreter wants full-shape masks)
            q_ok_n = (offs_n2 * 0 + q) < Q  # (BN2,)
            acc = tl.zeros((BLOCK_T, BLOCK_N2), dtype=tl.float32)
            for c0 in tl.static_range(0, CP, BLOCK_C):
                offs_c = c0 + tl.arange(0, BLOCK_C)
                x_mask = (t_ok & q_ok_t)[:, None] & (offs_c[None, :] < C)
                x_off = offs_t[:, None] * C + offs_c[None, :]  # (BT, BC)
                xr = tl.load(xs_ptr + q * m_in + x_off, mask=x_mask, other=0.0)
                xi = tl.load(xs_ptr + (Q + q) * m_in + x_off, mask=x_mask, other=0.0)
                g_off = q * (4 * CP * NP) + offs_c[:, None] * (2 * NP) + offs_n2[None, :]  # (BC, BN2)
                g_mask = (offs_c[:, None] < CP) & (q_ok_n & (offs_n2 < 2 * NP))[None, :]
                gr = tl.load(g_ptr + g_off, mask=g_mask, other=0.0)
                gi = tl.load(g_ptr + g_off + 2 * CP * NP, mask=g_mask, other=0.0)
                if FP32_DOT:
                    acc = tl.dot(xr.to(tl.float32), gr.to(tl.float32), acc)
                    acc = tl.dot(xi.to(tl.float32), gi.to(tl.float32), acc)
                else:  # fp32 coefficients: TF32 tensor cores; bf16 coefficients: bf16 ones
                    acc = tl.dot(xr.to(g_ptr.dtype.element_ty), gr, acc)
                    acc = tl.dot(xi.to(g_ptr.dtype.element_ty), gi, acc)
            slot = tl.where(is_imag, Q + q, q)  # (BN2,)
            y_off = slot[None, :] * m_out + offs_t[:, None] * N + n[None, :]
            y_mask = t_ok[:, None] & (q_ok_n & (n < N) & (offs_n2 < 2 * NP))[None, :]
            tl.store(ys_ptr + y_off, acc.to(ys_ptr.dtype.element_ty), mask=y_mask)

    @triton.autotune(
        configs=_configs([{"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_P": 128},
                          {"BLOCK_M": 16, "BLOCK_R": 128, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 32, "BLOCK_R": 128, "BLOCK_P": 64},
                          {"BLOCK_M": 64, "BLOCK_R": 64, "BLOCK_P": 64, "num_stages": 4}, {"BLOCK_M": 64, "BLOCK_R": 128, "BLOCK_P": 64},
                          {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_P": 64, "num_warps": 8},
                          {"BLOCK_M": 128, "BLOCK_R": 256, "BLOCK_P": 64, "num_warps": 8}], [4], [3]),
        key=["M_BUCKET", "N", "B"],
    )
    @triton.jit
    def _dft2_inverse_kernel(
        ys_ptr,  # (B, T*N) frequency-major packed output spectra, spectrum dtype
        winv_ptr,  # (B, B) operand dtype: packed inverse real-DFT matrix
        bias_ptr,  # (OUT,) or a dummy
        y_ptr,  # (T, OUT) output dtype
        M, N, B, OUT, M_BUCKET, stride_yt,
        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        """y[t, n*B + r] = sum_p YS^T[p, t*N + n] Winv[p, r] + bias (GEMM (T*N, B) x (B, B) reading
        its A operand transposed), with bias, crop and cast in the epilogue."""
        _inverse_dft_tile(ys_ptr, 1, M, winv_ptr, bias_ptr, y_ptr, M, N, B, OUT, stride_yt,
                          HAS_BIAS, FP32_DOT, BLOCK_M, BLOCK_R, BLOCK_P)
