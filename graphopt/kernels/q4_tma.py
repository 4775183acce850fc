"""Q4_0 x Q8_1 decode (1-16 tokens) on Hopper: TMA-fed weights, one int8 warpgroup MMA per 32-block.

The Triton decode GEMM (`q4._q4_gemm_kernel`, "swap" tiles) quantizes its activation tile to Q8_1
again in every program and K step: at 16 tokens on the H100, fp32 adds, FMAs and max (that
quantization and the per-block epilogue) were a large share of its instructions (profiled), and it
ran more instructions than the FP4 TMA kernel. Here the activations are quantized once, by a small Triton
kernel into a layout TMA can read, and a Gluon kernel streams the weights:

- `q8_1.quantize_for_tma` (Triton, with the other Q8_1 kernels): x (M, K) -> q int8 (M, Kp) and, per
  32-block b and token m,
  ds[2b, m] = d and ds[2b + 1, m] = d * sum(q), in fp32 (d the fp16-rounded Q8_1 scale, as the
  other kernels use it; both exact). Kp is the weight's padded K: its padding blocks get q = 0.
- `_q4_decode_tma_kernel`: per K step of 256 values (four block pairs), TMA brings into a ring slot
  the packed weight bytes (one 3-D box: pair, row, byte), the step's eight activation blocks (one
  3-D box: block, token, value), the weight scales d4 (blocks x rows, fp16) and the activation
  scales (2 x blocks x tokens, fp32). Each pair's bytes are read from shared memory straight into
  the MMA's register operand layout; their low and high nibbles (blocks 2p and 2p + 1, unsigned
  0..15, `q4` kernel layout) are two int8 A operands, one AND each per four bytes. Per block, an
  int8 MMA of depth 32 gives the exact integer dot, and
      acc += d4[n] * (d8[m] * dot[n, m] - 8 * s8[m])
  as in every Q4 kernel (the s term absorbs Q4_0's -8 offset). Split-K as the FP4 TMA kernel
  (fp4_tma._store_tile).

The result equals `q4.reference_q4_linear` up to fp32 summation order. Gluon runs only on a GPU
(sm_90+); the CPU tests build the kernel offline for sm_90 and run the quantize kernel in the
interpreter.
"""

from __future__ import annotations

import functools

import torch
import triton

from graphopt.kernels import fp4_tma
from graphopt.kernels.launch import launch
from graphopt.kernels.q8_1 import quantize_for_tma

gluon = fp4_tma.gluon
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from graphopt.kernels.fp4_tma import _as_boxes, _cta_barrier, _program_steps, _store_tile, _tma_load

STEP = 256  # K values per step: four block pairs (8 blocks), 128 weight bytes per row


def tiles_k(k_padded: int) -> bool:
    """Whether K steps of 256 tile the weight's padded K (Kp = K rounded up to 64 in q4's layout)."""
    return k_padded % STEP == 0


def supports(x2: torch.Tensor) -> bool:
    """Whether x2 is where the Gluon kernels run (any float activation dtype: the MMAs are int8)."""
    return fp4_tma.runs_on(x2)


@functools.lru_cache(maxsize=None)
def shared_layouts(block_n: int, block_m: int):
    """Shared layouts of one pair's (BLOCK_N, 32) weight bytes, one block's (BLOCK_M, 32) int8
    activations (the MMA's B), the 3-D TMA boxes of a step's pairs and blocks (the tiles back to
    back), and the unswizzled scale tiles (one row per block is read at a time)."""
    w_tile = gl.NVMMASharedLayout.get_default_for([block_n, 32], gl.int8)
    q_tile = gl.NVMMASharedLayout.get_default_for([block_m, 32], gl.int8)
    w_box = gl.NVMMASharedLayout(w_tile.swizzle_byte_width, 8, rank=3)
    q_box = gl.NVMMASharedLayout(q_tile.swizzle_byte_width, 8, rank=3)
    d4 = gl.NVMMASharedLayout(0, 16, rank=2)
    ds = gl.NVMMASharedLayout(0, 32, rank=2)
    return w_tile, q_tile, w_box, q_box, d4, ds


@functools.lru_cache(maxsize=None)
def d4_layout(block_n: int, num_warps: int):
    """(1, BLOCK_N) layout of one block's weight scales in which each thread holds the rows of its
    warpgroup-MMA accumulator (rows r and r + 8 of its warp's 16, lanes 4 apart sharing them): read
    from shared memory this way, they broadcast over the accumulator with no data movement."""
    reg = [[0, 8]] + [[0, r] for r in fp4_tma._powers(16 * num_warps, block_n)]
    lane = [[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]]
    warp = [[0, 16 * (1 << i)] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [1, block_n])


if gluon is not None:

    @gluon.jit
    def _nibbles(wb, HIGH: gl.constexpr):
        """Weight bytes -> their low (or HIGH) nibbles as int8 0..15: one AND (and a shift) per four
        bytes of a register."""
        if HIGH:
            return gl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                             "=r,r", [wb], dtype=gl.int8, is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [wb], dtype=gl.int8,
                                             is_pure=True, pack=4)

    @gluon.jit
    def _add_block(acc, dot, d4_tile, ds_tile, B: gl.constexpr, D4_LAYOUT: gl.constexpr):
        """acc + d4[n] * (d8[m] * dot - 8 * s8[m]) for block B of the step (dot: its int32 MMA)."""
        layout: gl.constexpr = acc.type.layout
        d4_row = d4_tile.slice(B, 1, 0).load(D4_LAYOUT)  # (1, BLOCK_N): each thread its accumulator rows
        d4 = gl.convert_layout(gl.reshape(d4_row, (acc.shape[0],)), gl.SliceLayout(1, layout)).to(gl.float32)
        d4 = gl.expand_dims(d4, 1)
        d8 = ds_tile.slice(2 * B, 1, 0).load(layout)  # (1, BLOCK_M)
        s8 = ds_tile.slice(2 * B + 1, 1, 0).load(layout)
        dot_f = (dot + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0  # exact: |dot| < 2^22
        return acc + d4 * (d8 * dot_f - 8.0 * s8)

    @gluon.jit
    def _issue_step(w_desc, q_desc, d4_desc, ds_desc, bar, w_buf, q_buf, d4_buf, ds_buf, row0, token0, it, pred):
        """TMA loads of K step `it` into one ring slot, all signalling `bar`."""
        mbarrier.expect(bar, w_desc.block_type.nbytes + q_desc.block_type.nbytes + d4_desc.block_type.nbytes
                        + ds_desc.block_type.nbytes, pred=pred)
        _tma_load(w_desc, [it * 4, row0, 0], bar, w_buf, pred=pred)
        _tma_load(q_desc, [it * 8, token0, 0], bar, q_buf, pred=pred)
        _tma_load(d4_desc, [it * 8, row0], bar, d4_buf, pred=pred)
        _tma_load(ds_desc, [it * 16, token0], bar, ds_buf, pred=pred)

    @gluon.jit
    def _q4_decode_tma_kernel(
        w_desc, q_desc, d4_desc, ds_desc, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K_PADDED, stride_om,
        HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
        STAGES: gl.constexpr, W_TILE_LAYOUT: gl.constexpr, Q_TILE_LAYOUT: gl.constexpr, D4_LAYOUT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 32])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        row0, token0, it_start, n_local = _program_steps(K_PADDED // 256, BLOCK_N, BLOCK_M, SPLIT_K)

        w_smem = gl.allocate_shared_memory(gl.int8, [STAGES * 4, BLOCK_N, 32], W_TILE_LAYOUT)
        q_smem = gl.allocate_shared_memory(gl.int8, [STAGES * 8, BLOCK_M, 32], Q_TILE_LAYOUT)
        w_boxes = _as_boxes(w_smem, w_desc, STAGES)
        q_boxes = _as_boxes(q_smem, q_desc, STAGES)
        d4_smem = gl.allocate_shared_memory(gl.float16, [STAGES, 8, BLOCK_N], d4_desc.layout)
        ds_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 16, BLOCK_M], ds_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES):
            _issue_step(w_desc, q_desc, d4_desc, ds_desc, bars.index(s), w_boxes.index(s), q_boxes.index(s),
                        d4_smem.index(s), ds_smem.index(s), row0, token0, it_start + s, s < n_local)

        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        zero = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.int32, layout=mma_layout)
        for i in range(n_local):
            stage = i % STAGES
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            for p in gl.static_range(4):
                wb = w_smem.index(stage * 4 + p).load(a_layout)
                dot_lo = warpgroup_mma(_nibbles(wb, False), q_smem.index(stage * 8 + 2 * p).permute((1, 0)), zero,
                                       is_async=True)
                dot_hi = warpgroup_mma(_nibbles(wb, True), q_smem.index(stage * 8 + 2 * p + 1).permute((1, 0)), zero,
                                       is_async=True)
                dot_lo, dot_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dot_lo, dot_hi))
                acc = _add_block(acc, dot_lo, d4_smem.index(stage), ds_smem.index(stage), 2 * p, D4_LAYOUT)
                acc = _add_block(acc, dot_hi, d4_smem.index(stage), ds_smem.index(stage), 2 * p + 1, D4_LAYOUT)
            _cta_barrier()  # every warp has read this slot before TMA refills it
            fence_async_shared()
            nxt = i + STAGES
            _issue_step(w_desc, q_desc, d4_desc, ds_desc, bars.index(stage), w_boxes.index(stage),
                        q_boxes.index(stage), d4_smem.index(stage), ds_smem.index(stage), row0, token0,
                        it_start + nxt, nxt < n_local)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        _store_tile(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, row0, token0, M, N, stride_om, HAS_BIAS, SPLIT_K)


def descriptors(q: torch.Tensor, ds: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_n: int,
                block_m: int):
    """The four TMA descriptors: weight bytes as (pair, row, byte), activations as (block, token,
    value), d4 (block, row) fp16, ds (2 x block, token) fp32."""
    n, k_padded = qweight.shape[0], qweight.shape[1] * 2
    m = q.shape[0]
    w_tile, q_tile, w_box, q_box, d4_layout, ds_layout = shared_layouts(block_n, block_m)
    w_desc = TensorDescriptor(qweight.view(torch.int8), [k_padded // 64, n, 32], [32, k_padded // 2, 1],
                              [4, block_n, 32], w_box)
    q_desc = TensorDescriptor(q, [k_padded // 32, m, 32], [32, k_padded, 1], [8, block_m, 32], q_box)
    d4_desc = TensorDescriptor(scales, [k_padded // 32, n], [scales.stride(0), 1], [8, block_n], d4_layout)
    ds_desc = TensorDescriptor(ds, [ds.shape[0], m], [ds.stride(0), 1], [16, block_m], ds_layout)
    return w_desc, q_desc, d4_desc, ds_desc


def launch_decode(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, ws: torch.Tensor, counters: torch.Tensor, split_k: int, cfg) -> None:
    """out (M, N) = Q8_1(x2) @ Q4_0(W)^T (+ bias) for q4's kernel layout (qweight (N, Kp/2) uint8,
    scales (Kp/32, N) fp16): the quantize kernel, then the Gluon kernel. ws / counters: q4's split-K
    buffers (split_k.split_buffers), used when split_k > 1; cfg a q4.TileConfig of kernel "tma"
    (block_m tokens, block_n rows, num_stages ring slots). Callers check `supports` and `tiles_k`."""
    m, n, k_padded = x2.shape[0], qweight.shape[0], qweight.shape[1] * 2
    q, ds = quantize_for_tma(x2, k_padded)
    qweight, scales = fp4_tma.tma_aligned(qweight, scales)
    w_desc, q_desc, d4_desc, ds_desc = descriptors(q, ds, qweight, scales, cfg.block_n, cfg.block_m)
    w_tile, q_tile, *_ = shared_layouts(cfg.block_n, cfg.block_m)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))
    launch(
        _q4_decode_tma_kernel, grid, w_desc, q_desc, d4_desc, ds_desc, bias if bias is not None else out, out, ws, counters,
        m, n, k_padded, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, SPLIT_K=split_k,
        STAGES=cfg.num_stages, W_TILE_LAYOUT=w_tile, Q_TILE_LAYOUT=q_tile,
        D4_LAYOUT=d4_layout(cfg.block_n, cfg.num_warps), num_warps=cfg.num_warps)
