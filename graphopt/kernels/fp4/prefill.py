"""FP4 prefill kernels on the kernel layout (format.py):
  * `_fp4_gemm_kernel`, prefill (fused): tiles of the weight are dequantized to bf16/fp16 in
    registers and fed to tl.dot (weight tile as the left operand), grouped tile order for L2.
  * `_fp4_dequantize_kernel` + cuBLAS (path `dequant`), prefill for many tokens: W is decoded
    once to the activation dtype (2 bytes/weight written, transient) and multiplied by cuBLAS,
    as vLLM does for AWQ at >= 256 tokens; at 4096 tokens the decode costs a few % of the GEMM.
Activations: bf16 or fp16. Accumulation is fp32. Bias optional.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU reference works without Triton
    triton = None

if triton is not None:
    from graphopt.kernels.fp4.common import (_block_scales, _decode_multiplier, _decode_power,
                                             _e2m1_times_2_pow_minus_14, _mma, _scale_bytes)

    @triton.jit
    def _fp4_dequantize_kernel(
        codes_ptr, scales_ptr, global_scale_ptr, out_ptr, N, K, N_BLOCKS,
        stride_cn, stride_sn, stride_on,
        IS_NVFP4: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr,
        INTERLEAVE: tl.constexpr,
    ):
        """W (N, K) in out's dtype from the kernel layout, for the prefill path (then cuBLAS).
        Grid: (N / BLOCK_N, N_BLOCKS / BLOCKS_PER_PROG); N_BLOCKS = scale blocks per row (padded).
        Each program decodes a (BLOCK_N, BLOCKS_PER_PROG blocks) tile: byte j of a block ->
        elements j and j + BS/2. INTERLEAVE: the two nibbles are interleaved in registers (join +
        permute), so every row of the tile is ONE contiguous run of BLOCKS_PER_PROG * BLOCK_SIZE
        elements (full-width vector stores); else two runs of BS/2 elements per block."""
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_g = pid_k * BLOCKS_PER_PROG + tl.arange(0, BLOCKS_PER_PROG)
        offs_j = tl.arange(0, HALF)
        tile_ok = (offs_n[:, None] < N) & (offs_g[None, :] < N_BLOCKS)  # (BN, G)
        codes = tl.load(codes_ptr + offs_n[:, None, None] * stride_cn + offs_g[None, :, None] * HALF + offs_j[None, None, :],
                        mask=tile_ok[:, :, None], other=0)  # (BN, G, HALF) uint8
        scale_bytes = tl.load(_scale_bytes(scales_ptr) + offs_n[:, None] * stride_sn + offs_g[None, :], mask=tile_ok, other=0)
        scale = (_block_scales(scale_bytes, IS_NVFP4) * _decode_multiplier(global_scale_ptr, IS_NVFP4))[:, :, None]
        w_lo = (_e2m1_times_2_pow_minus_14(codes & 15) * scale).to(out_ptr.dtype.element_ty)
        w_hi = (_e2m1_times_2_pow_minus_14(codes >> 4) * scale).to(out_ptr.dtype.element_ty)
        if INTERLEAVE:
            w = tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2))  # (BN, G, 2, HALF): block order
            w = tl.reshape(w, (BLOCK_N, BLOCKS_PER_PROG * BLOCK_SIZE))
            offs_k = pid_k * (BLOCKS_PER_PROG * BLOCK_SIZE) + tl.arange(0, BLOCKS_PER_PROG * BLOCK_SIZE)
            tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w,
                     mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))
        else:
            k_lo = offs_g[None, :, None] * BLOCK_SIZE + offs_j[None, None, :]  # (1, G, HALF)
            out_rows = out_ptr + offs_n[:, None, None] * stride_on
            row_ok = (offs_n < N)[:, None, None]
            tl.store(out_rows + k_lo, w_lo, mask=row_ok & (k_lo < K))
            tl.store(out_rows + k_lo + HALF, w_hi, mask=row_ok & (k_lo + HALF < K))

    @triton.jit
    def _fp4_gemm_kernel(
        x_ptr, codes_ptr, scales_ptr, global_scale_ptr, bias_ptr, out_ptr,
        M, N, K, K_PADDED,
        stride_xm, stride_cn, stride_sn, stride_om,
        IS_NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, GROUP_M: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """out[M, N] = x[M, K] @ W[N, K]^T for many tokens; 1-D grid over (M / BLOCK_M) * (N / BLOCK_N)
        tiles in groups of GROUP_M token tiles, so neighbouring programs share weight tiles in L2."""
        HALF: tl.constexpr = BLOCK_SIZE // 2
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        tiles_per_group = GROUP_M * num_n
        group = pid // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % tiles_per_group) % group_size
        pid_n = (pid % tiles_per_group) // group_size

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        offs_g = tl.arange(0, BLOCKS_PER_ITER)
        offs_j = tl.arange(0, HALF)
        # In the loop, weights are code * block scale only: exact in bf16 / fp16 (<= 6 significant
        # bits, |w| in [2^-10, 2688] for NVFP4). NVFP4's fp32 global scale multiplies the sums once
        # after the loop; folded into each weight before its cast it would round the weight.
        power = _decode_power(IS_NVFP4)

        code_ptrs = codes_ptr + offs_n[:, None, None] * stride_cn + offs_g[None, :, None] * HALF + offs_j[None, None, :]  # (BN, G, HALF)
        scale_ptrs = _scale_bytes(scales_ptr) + offs_n[:, None] * stride_sn + offs_g[None, :]  # (BN, G)
        k_in_iter = offs_g[:, None] * BLOCK_SIZE + offs_j[None, :]  # (G, HALF)
        x_base = x_ptr + offs_m[:, None, None] * stride_xm  # (BM, 1, 1)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(0, K_PADDED // (BLOCK_SIZE * BLOCKS_PER_ITER)):
            block0 = it * BLOCKS_PER_ITER
            codes = tl.load(code_ptrs + block0 * HALF, mask=n_mask[:, None, None], other=0)
            scale = _block_scales(tl.load(scale_ptrs + block0, mask=n_mask[:, None], other=0), IS_NVFP4) * power
            w_lo = _e2m1_times_2_pow_minus_14(codes & 15) * scale[:, :, None]
            w_hi = _e2m1_times_2_pow_minus_14(codes >> 4) * scale[:, :, None]
            w_lo = tl.reshape(w_lo.to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCKS_PER_ITER * HALF))
            w_hi = tl.reshape(w_hi.to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCKS_PER_ITER * HALF))
            k_lo = block0 * BLOCK_SIZE + k_in_iter
            x_lo = tl.load(x_base + k_lo[None, :, :], mask=m_mask[:, None, None] & (k_lo[None, :, :] < K), other=0.0)
            x_hi = tl.load(x_base + k_lo[None, :, :] + HALF, mask=m_mask[:, None, None] & (k_lo[None, :, :] + HALF < K), other=0.0)
            x_lo = tl.reshape(x_lo, (BLOCK_M, BLOCKS_PER_ITER * HALF))
            x_hi = tl.reshape(x_hi, (BLOCK_M, BLOCKS_PER_ITER * HALF))
            acc = _mma(w_lo, x_lo, acc, UPCAST_DOT)  # (BN, BM)
            acc = _mma(w_hi, x_hi, acc, UPCAST_DOT)

        if IS_NVFP4:
            acc = acc * tl.load(global_scale_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

