"""NVFP4 decode (1-64 tokens) on Hopper: TMA-fed weight words, decoded in the tensor cores' register layout.

The Triton decode kernel (`fp4._fp4_gemv_words_mma_kernel`) loads its weight words with plain loads
and cannot be software-pipelined: Triton's pipeliner would send the decoded tile through shared
memory. Each program then waits on one K step's loads at a time, and on an H100 the 4-16-token
decode read its weights far below the rate a pure read reaches (bench/RESULTS.md section 4).
This kernel is written in Gluon, where layouts and shared memory are explicit:

- the packed words, the (pre-permuted) activations and the block scales (one byte per 16 weights)
  of up to STAGES K steps of 256 are fetched by TMA into a ring of shared-memory buffers, all
  issued up front, so a program's whole K range can be in flight at once, at no register cost;
- each step's words are read from shared memory straight into the layout whose decode (two codes
  per 32-bit register, `fp4._e2m1_pair_bits`) is the warpgroup MMA's register operand A; the
  activations stay in shared memory as its operand B; each thread reads the scale bytes of its
  own words (`word_pair_layout`). (Scales gathered from global memory one step ahead leave the
  loads' latency exposed, and were slower.)

The math is the Triton kernel's (NVFP4, bf16 activations, DIRECT_BF16): codes times block scale
in one bf16x2 multiply, exact, fp32 accumulation, split-K with the same single-launch reduction
(`split_k.finish_split_tile`'s steps). Reference: `fp4.reference_fp4_linear`. Gluon runs only on a GPU
(sm_90+): on the CPU and under TRITON_INTERPRET=1 the launcher is never chosen, and the kernel is
built offline for sm_90 by the tests instead.
"""

from __future__ import annotations

import functools

import torch

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import launch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - no Gluon in this Triton
    gluon = None
else:  # Triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 only async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # renamed after 3.6
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: _reinterpret


@functools.lru_cache(maxsize=None)
def word_layout(block_n: int, words: int, num_warps: int):
    """The (BLOCK_N, W) distributed layout of the packed words whose two-codes-per-register decode,
    joined along K, is exactly the warpgroup MMA's A operand (DotOperandLayout k_width 2, warps
    along M): per thread, rows r and r + 8 of a 16-row slab, words 4 apart along K; lanes cover 4
    consecutive words of 8 rows."""
    reg = [[8, 0]] + [[0, c] for c in _powers(4, words)] + [[r, 0] for r in _powers(16 * num_warps, block_n)]
    lane = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warp = [[16 * (1 << i), 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, words])


@functools.lru_cache(maxsize=None)
def word_pair_layout(block_n: int, words: int, num_warps: int):
    """word_layout with the words split into (scale byte, word of its two): the (BLOCK_N, W/2, 2)
    layout of the same registers. Its slice along the last dim is where each thread holds the
    block-scale bytes of its own words, once per pair of words (the lane that holds the pair's
    other word has the same bytes)."""
    reg = ([[8, 0, 0]] + [[0, c // 2, 0] for c in _powers(4, words)]
           + [[r, 0, 0] for r in _powers(16 * num_warps, block_n)])
    lane = [[0, 0, 1], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16 * (1 << i), 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, words // 2, 2])


@functools.lru_cache(maxsize=None)
def scale_shared_layout(block_n: int, words: int):
    """Shared layout of a K step's (BLOCK_N, W/2) block-scale bytes, one TMA box."""
    return gl.NVMMASharedLayout.get_default_for([block_n, words // 2], gl.uint8)


@functools.lru_cache(maxsize=None)
def shared_layouts(block_n: int, block_m: int, words: int):
    """Shared layouts of the (BLOCK_N, W) words tile, of one (BLOCK_M, 2W) activation operand tile
    (the MMA's B) and of the 3-D TMA box of a step's four operands: the box has the tile's swizzle,
    so it is the four tiles back to back."""
    tile = gl.NVMMASharedLayout.get_default_for([block_m, 2 * words], gl.bfloat16)
    box = gl.NVMMASharedLayout(tile.swizzle_byte_width, 16, rank=3)
    return gl.NVMMASharedLayout.get_default_for([block_n, words], gl.int32), tile, box


def _powers(start: int, stop: int) -> list[int]:
    out, v = [], start
    while v < stop:
        out.append(v)
        v *= 2
    return out


if gluon is not None:

    @gluon.jit
    def _pair_bits(words, SHIFT: gl.constexpr):
        """fp4._e2m1_pair_bits at bf16 placement: the codes at bits SHIFT and SHIFT + 16 as
        sign << 15 | magnitude << 6 in each 16-bit half (value * 2^-126, exact)."""
        if SHIFT <= 6:
            magnitude = words << (6 - SHIFT)
        else:
            magnitude = words >> (SHIFT - 6)
        if SHIFT == 12:
            sign = words
        else:
            sign = words << (12 - SHIFT)
        return (magnitude & 29360576) | (sign & -2147450880)  # 0x01C001C0, 0x80008000

    @gluon.jit
    def _scale_pairs(scale_bytes):
        """e4m3 block-scale bytes -> int32 with the bf16 of e4m3 value * 2^119 in both halves
        (fp4._block_scales then fp4._bf16_scale_pair)."""
        # sm_89+ converts e4m3 in hardware (subnormals and zero included); the product with 2^119
        # (0f7B000000) has at most 4 significant bits, so its top half is the bf16, exactly
        return gl.inline_asm_elementwise(
            "{ .reg .b16 e, h, unused; .reg .b32 h2, f; .reg .f32 v; cvt.u16.u32 e, $1; "
            "cvt.rn.f16x2.e4m3x2 h2, e; mov.b32 {h, unused}, h2; cvt.f32.f16 v, h; "
            "mul.rn.f32 v, v, 0f7B000000; mov.b32 f, v; prmt.b32 $0, f, f, 0x3232; }",
            "=r,r", [scale_bytes.to(gl.int32)], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _operand(words, SHIFT: gl.constexpr, scale_pair, A_LAYOUT: gl.constexpr, PAIR_LAYOUT: gl.constexpr):
        """The MMA's A operand for one shift of the words: (BN, 2W) bf16, codes * scale * 2^-7.
        scale_pair: (BN, W/2), one per two words, in PAIR_LAYOUT's slice; the words are seen in
        PAIR_LAYOUT (the same registers) so that it broadcasts over each pair in registers."""
        bits = gl.convert_layout(gl.reshape(_pair_bits(words, SHIFT), (words.shape[0], words.shape[1] // 2, 2)),
                                 PAIR_LAYOUT)
        bits, scale_pair = gl.broadcast(bits, gl.expand_dims(scale_pair, 2))
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r", [bits, scale_pair], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
            pack=1)
        joined = gl.reshape(gl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))
        return gl.convert_layout(joined, A_LAYOUT)

    @gluon.jit
    def _issue_step(w_desc, x_desc, s_desc, bar, w_buf, x_buf, s_buf, row0, token0, it, W: gl.constexpr, pred):
        """TMA loads of K step `it` into one ring slot: the words tile, the step's four activation
        operands (one 3-D box: operand, token, element) and its block-scale bytes, all signalling `bar`."""
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes + s_desc.block_type.nbytes,
                        pred=pred)
        _tma_load(w_desc, [row0, it * W], bar, w_buf, pred=pred)
        _tma_load(x_desc, [it * 4, token0, 0], bar, x_buf, pred=pred)
        _tma_load(s_desc, [row0, it * (W // 2)], bar, s_buf, pred=pred)

    @gluon.jit
    def _program_steps(n_iters, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr):
        """(first weight row, first token, first K step, number of K steps) of this program, on the
        decode grid (row tiles, K splits, token tiles) over n_iters K steps. Also used by q4_tma."""
        per_split = gl.cdiv(n_iters, SPLIT_K)
        it_start = gl.program_id(1) * per_split
        return (gl.program_id(0) * BLOCK_N, gl.program_id(2) * BLOCK_M, it_start,
                gl.minimum(per_split, n_iters - it_start))

    @gluon.jit
    def _as_boxes(tiles, desc, STAGES: gl.constexpr):
        """(STAGES * n, rows, cols) shared tiles seen as STAGES 3-D TMA boxes of n tiles each (`desc`'s
        box): one TMA copy fills n consecutive tiles. Also used by q4_tma."""
        shape: gl.constexpr = [STAGES] + desc.block_type.shape
        if _PUBLIC_REINTERPRET:
            return tiles.reinterpret(tiles.dtype, shape, desc.layout)
        else:
            return tiles._reinterpret(tiles.dtype, shape, desc.layout)

    @gluon.jit
    def _fp4_decode_tma_kernel(
        x_desc, w_desc, s_desc, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
        M, N, K_PADDED, stride_om,
        HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr,
        SPLIT_K: gl.constexpr, STAGES: gl.constexpr, WORD_LAYOUT: gl.constexpr, X_TILE_LAYOUT: gl.constexpr,
        PAIR_LAYOUT: gl.constexpr, num_warps: gl.constexpr,
    ):
        WPB: gl.constexpr = 2  # NVFP4: 16-element scale blocks, two words each
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        row0, token0, it_start, n_local = _program_steps(K_PADDED // (8 * W), BLOCK_N, BLOCK_M, SPLIT_K)

        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W], w_desc.layout)
        # four (BLOCK_M, 2W) operand tiles per slot; TMA fills a slot's four as one 3-D box
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, BLOCK_M, 2 * W], X_TILE_LAYOUT)
        x_boxes = _as_boxes(x_smem, x_desc, STAGES)
        s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, W // WPB], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES):
            _issue_step(w_desc, x_desc, s_desc, bars.index(s), w_smem.index(s), x_boxes.index(s), s_smem.index(s),
                        row0, token0, it_start + s, W, s < n_local)

        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        for i in range(n_local):
            stage = i % STAGES
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            words = w_smem.index(stage).load(WORD_LAYOUT)
            # each thread reads the scale bytes of its own words, once per pair of words
            scale_pair = _scale_pairs(s_smem.index(stage).load(gl.SliceLayout(2, PAIR_LAYOUT)))
            for j in gl.static_range(4):
                a = _operand(words, 4 * j, scale_pair, a_layout, PAIR_LAYOUT)
                acc = warpgroup_mma(a, x_smem.index(stage * 4 + j).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _cta_barrier()  # every warp has read this slot before TMA refills it
            fence_async_shared()  # (those reads were generic-proxy, TMA writes are async-proxy)
            nxt = i + STAGES
            _issue_step(w_desc, x_desc, s_desc, bars.index(stage), w_smem.index(stage), x_boxes.index(stage),
                        s_smem.index(stage), row0, token0, it_start + nxt, W, nxt < n_local)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        acc = acc * (gl.load(global_scale_ptr) * 128.0)  # undo the decode's 2^-7
        _store_tile(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, row0, token0, M, N, stride_om, HAS_BIAS, SPLIT_K)

    @gluon.jit
    def _store_tile(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, row0, token0, M, N, stride_om,
                    HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr):
        """Write a program's (weight rows, tokens) fp32 tile of out (M, N) (+ bias). Split along K
        (grid axis 1), the splits add into the fp32 sums ws (M, N) and the last to arrive at the
        tile's counter writes out and re-arms both: split_k.finish_split_tile's steps. (A Gluon
        kernel cannot call that @triton.jit function: without a GPU the tests run those in the
        interpreter, and Gluon's build rejects them.) Shared by the FP4 and Q4 TMA decodes."""
        layout: gl.constexpr = acc.type.layout
        offs_n = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
        offs_m = token0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        n_mask = offs_n < N
        mask = n_mask[:, None] & (offs_m < M)[None, :]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            sums_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
            # split_k.split_buffers' int32 counters (any zeroed 32-bit words would do)
            counter = (counter_ptr.to(gl.pointer_type(gl.int32))
                       + gl.program_id(2) * gl.num_programs(0) + gl.program_id(0))
            gl.atomic_add(sums_ptrs, acc, mask=mask, sem="relaxed")
            _cta_barrier()  # every thread's adds precede the counter's release
            arrived = gl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last split of this tile: copy out, re-arm
                zero = gl.zeros_like(acc)
                total = gl.atomic_add(sums_ptrs, zero, mask=mask, sem="relaxed")
                gl.store(sums_ptrs, zero, mask=mask)
                if HAS_BIAS:
                    total += gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)[:, None]
                gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(counter, 0)


def runs_on(x: torch.Tensor) -> bool:
    """Whether this Triton has Gluon and x is on an sm_90+ GPU: where the Gluon TMA decodes (this
    module's and q4_tma's) can run."""
    return gluon is not None and x.is_cuda and compute_capability(x.get_device())[0] >= 9


def runs_on_spec(hw) -> bool:
    """runs_on for a hardware spec (graphopt.hardware.HardwareSpec): the cost models' side."""
    cc = hw.compute_capability
    return gluon is not None and hw.is_gpu and cc is not None and cc >= (9, 0)


def tma_aligned(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors, each copied where its base is not 16-byte aligned, as TMA needs (a weight that is
    a view at an odd offset)."""
    return tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in tensors)


def supports(x2: torch.Tensor) -> bool:
    """Whether x2 is bf16 where the Gluon kernels run (the kernel's tile and K rules are `tiles_k`
    and fp4._valid_config's)."""
    return x2.dtype == torch.bfloat16 and runs_on(x2)


def tiles_k(k_padded: int, block_k: int) -> bool:
    """K steps of 256 elements that tile the padded K: a step's scale bytes (16 per row) are then one
    TMA box row, and the scales' row stride (K / 16 bytes) a multiple of 16 bytes, as TMA needs."""
    return block_k == 256 and k_padded % 256 == 0


def launch_decode(x_perm: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  bias: torch.Tensor | None, out: torch.Tensor, ws: torch.Tensor, counters: torch.Tensor, split_k: int,
                  cfg) -> None:
    """out (M, N) bf16 = x @ W^T (+ bias) for a kernel-layout NVFP4 weight, from fp4._launch: x_perm is
    fp4.permuted_activations(x, K_padded, BLOCK_K / 8, 16) in bf16; ws / counters / split_k its
    split-K buffers and split; cfg an fp4.KernelConfig with tma=True (num_stages = ring slots).
    Callers check `supports` and `tiles_k` first."""
    m, n, k_padded = x_perm.shape[0], out.shape[1], codes.shape[1] * 2
    codes, scales = tma_aligned(codes, scales.view(torch.uint8))
    w = cfg.block_k // 8
    w_layout, x_tile_layout, x_box_layout = shared_layouts(cfg.block_n, cfg.block_m, w)
    # x_perm (M, k_padded) seen as (operand chunk, token, element): each K step's four operands
    # are four consecutive 2W-element chunks
    x_desc = TensorDescriptor(x_perm, [k_padded // (2 * w), m, 2 * w], [2 * w, k_padded, 1], [4, cfg.block_m, 2 * w],
                              x_box_layout)
    w_desc = TensorDescriptor(codes.view(torch.int32), [n, k_padded // 8], [k_padded // 8, 1], [cfg.block_n, w],
                              w_layout)
    s_desc = TensorDescriptor(scales, [n, k_padded // 16], [scales.stride(0), 1], [cfg.block_n, w // 2],
                              scale_shared_layout(cfg.block_n, w))
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.block_m))
    launch(
        _fp4_decode_tma_kernel, grid, x_desc, w_desc, s_desc, global_scale, bias if bias is not None else out, out, ws, counters,
        m, n, k_padded, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, W=w, SPLIT_K=split_k,
        STAGES=cfg.num_stages, WORD_LAYOUT=word_layout(cfg.block_n, w, cfg.num_warps), X_TILE_LAYOUT=x_tile_layout,
        PAIR_LAYOUT=word_pair_layout(cfg.block_n, w, cfg.num_warps), num_warps=cfg.num_warps)
