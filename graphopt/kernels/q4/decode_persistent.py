"""Q4_0 x Q8_1 decode of 1-8 tokens, persistent, each warp owning whole rows (Gluon, sm_80+).

The FP4 one-token kernel of the same design (fp4/decode_persistent.py) applied to the Q4_0 kernel
layout (format.py): one launch per layer (no split-K buffers to zero, no quantize launch, no sum
kernel), its tiling, ring of chunks loaded ahead and persistent grid shared with that kernel.

- a program quantizes each token's activation row once, into shared memory: each 32 consecutive K
  positions to Q8_1 with ggml's float32 steps (d = max / 127, q = roundf(x / d) through an exactly
  rounded multiply, d kept as its fp16 value), as int8 words in the lane order of the weight words;
- the weight words of a block pair (32 bytes: the low nibbles are block 2p, the high ones block
  2p + 1) are read by two lanes, 16 bytes each; a lane's nibbles, masked out once per chunk, meet
  every token's activation words in two dp4a per word (unsigned nibbles against signed int8), and
  each lane scales its own half-block sums: d4 * (d8 * dot - 8 * d8 * sum(q8)), the sum of q8 over
  the same 16 K positions, so no lane exchange is needed before each row's final warp reduction;
- the scales (fp16, [K/32, N], coalesced along N) of a group's rows are read per chunk and lane.

Numbers equal the other q4_linear paths (same Q8_1 integers and fp16 d) up to fp32 summation
order. The Q4 tuner times it for 1-4 tokens (configs.PERSISTENT_MAX_OFFERED_TOKENS; past that
q4_tma's tiles won) where Gluon tiles are allowed (TileConfig kernel "persistent"; under CUDA
graphs), and graphopt::q4_gluon_linear launches it: Inductor cannot emit a Gluon kernel from its
generated code. On the CPU the tests build it offline for sm_90.
"""

from __future__ import annotations

import torch

from graphopt.kernels.fp4.decode_persistent import (CHUNK_WORDS, DEPTH_CHOICES, MAX_ROWS_IN_FLIGHT, ROWS_CHOICES,
                                                    WARPS_CHOICES, check_tile, chunks, gluon, persistent_grid, supports,
                                                    tile_problem)
from graphopt.kernels.launch import launch, next_power_of_2

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from graphopt.kernels.fp4.decode_persistent import _add, _chunk_tile, _larger, _word_slots
    from graphopt.kernels.fp4_tma import _cta_barrier

__all__ = ["CHUNK_WORDS", "DEPTH_CHOICES", "MAX_ROWS_IN_FLIGHT", "MAX_TOKENS", "ROWS_CHOICES", "WARPS_CHOICES",
           "chunks", "q4_gemv_persistent", "shared_memory_bytes", "supports", "tile_problem"]


if gluon is not None:

    @gluon.jit
    def _asm_f32(a, b, ASM: gl.constexpr):
        return gl.inline_asm_elementwise(ASM, "=f,f,f", [a, b], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _rint(v):
        return gl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=f,f", [v], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _dp4a_nibbles(nibbles, q8, c):
        """c + the dot of four unsigned bytes (nibbles 0..15) with four signed int8."""
        return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [nibbles, q8, c],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pack_bytes(q, THREADS: gl.constexpr):
        """(1, THREADS, 8, 4) int32 in int8 range -> (1, THREADS, 8) words, byte j = element j."""
        even, odd = gl.split(gl.reshape(q, [1, THREADS, 8, 2, 2]))  # by j % 2: (j0, j2), (j1, j3)
        b0, b2 = gl.split(even)
        b1, b3 = gl.split(odd)
        return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)

    @gluon.jit
    def _by_lane(v, WARPS: gl.constexpr):
        """(1, 32 x WARPS, 2) per-block values, [..., e] for half e of the block, block b = 2p + h of
        chunk t // 32 -> per h, (WARPS, 32): lane 2p + e of each chunk."""
        v = gl.permute(gl.reshape(v, [WARPS, 16, 2, 2]), [0, 1, 3, 2])  # (chunk, p, e, h)
        # h is a lane bit of the quantizing threads: gather it into registers before the split
        HL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])
        return gl.split(gl.convert_layout(gl.reshape(v, [WARPS, 32, 2]), HL))

    @gluon.jit
    def _quantize_q8_1(x_ptr, K, WARPS: gl.constexpr):
        """32 x WARPS blocks of 32 K positions from x_ptr, one per thread (WARPS chunks: block t of
        chunk t // 32), as Q8_1: the int8 words in the weight words' lane order (lo: blocks 2p,
        hi: blocks 2p + 1; each (WARPS, 128), lane 2p + e's four words at 4 (2p + e)), and per lane
        d8 and 8 * d8 * (its 16 q8's sum), each (WARPS, 32) for the lo and the hi block."""
        THREADS: gl.constexpr = 32 * WARPS
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
        t = gl.arange(0, THREADS, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        k = t[None, :, None] * 32 + e[None, None, :]
        x = gl.load(x_ptr + k, mask=k < K, other=0.0).to(gl.float32)  # (1, THREADS, 32)
        amax = gl.reduce(gl.abs(x), 2, _larger)
        d = _asm_f32(amax, gl.full(amax.shape, 127.0, gl.float32, amax.type.layout), "div.rn.f32 $0, $1, $2;")
        nonzero = d != 0.0
        inv = gl.where(nonzero, _asm_f32(gl.full(d.shape, 1.0, gl.float32, d.type.layout), gl.where(nonzero, d, 1.0),
                                         "div.rn.f32 $0, $1, $2;"), 0.0)
        v = _asm_f32(x, gl.broadcast(inv[:, :, None], x)[0], "mul.rn.f32 $0, $1, $2;")  # never contracted
        r = _rint(v)
        diff = r - v  # exact; ties go away from zero (roundf), not to even
        r = gl.where((diff == -0.5) & (v > 0.0), r + 1.0, gl.where((diff == 0.5) & (v < 0.0), r - 1.0, r))
        q = r.to(gl.int32)
        d8 = d.to(gl.float16).to(gl.float32)
        first, second = gl.split(gl.permute(gl.reshape(q, [1, THREADS, 2, 16]), [0, 1, 3, 2]))  # halves of a block
        first_offset = gl.convert_layout(gl.reduce(first, 2, _add), d8.type.layout).to(gl.float32) * (8.0 * d8)
        second_offset = gl.convert_layout(gl.reduce(second, 2, _add), d8.type.layout).to(gl.float32) * (8.0 * d8)
        words = _pack_bytes(gl.reshape(q, [1, THREADS, 8, 4]), THREADS)  # (1, THREADS, 8): word j = q[4j .. 4j + 3]
        words = gl.permute(gl.reshape(words, [WARPS, 16, 2, 8]), [0, 1, 3, 2])  # (chunk, p, j, h)
        HL: gl.constexpr = gl.BlockedLayout([1, 4, 2], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])
        lo_words, hi_words = gl.split(gl.convert_layout(gl.reshape(words, [WARPS, 128, 2]), HL))
        lo_d, hi_d = _by_lane(gl.join(d8, d8), WARPS)
        lo_offset, hi_offset = _by_lane(gl.join(first_offset, second_offset), WARPS)
        return lo_words, hi_words, lo_d, hi_d, lo_offset, hi_offset

    @gluon.jit
    def _scale_tile(scales_ptr, rows, lanes, row0, chunk, half, stride_sb, N, KB, live):
        """(rows, 32) fp32 d4 of block 32 chunk + 2 (lane // 2) + half, rows row0 + rows (0 past N or KB)."""
        block = chunk * 32 + 2 * (lanes // 2) + half
        mask = (rows[:, None] + row0 < N) & (block[None, :] < KB) & live
        return gl.load(scales_ptr + block[None, :] * stride_sb + (rows[:, None] + row0), mask=mask, other=0.0)

    @gluon.jit
    def _ring_entry(word_ptrs, scales_ptr, r_w, w_w, r_b, b_b, row, chunk, stride_wn, stride_sb, N, K_WORDS, KB,
                    CW: gl.constexpr):
        """Chunk `chunk` of the group at row `row`: its words and the d4 of its lo and hi blocks."""
        live = row < N
        return (_chunk_tile(word_ptrs, r_w, w_w, row, chunk * CW, stride_wn, N, K_WORDS, live, False),
                _scale_tile(scales_ptr, r_b, b_b, row, chunk, 0, stride_sb, N, KB, live),
                _scale_tile(scales_ptr, r_b, b_b, row, chunk, 1, stride_sb, N, KB, live))

    @gluon.jit
    def _nibbles(entry):
        """A ring entry's words as unsigned nibble bytes (the lo blocks', the hi blocks') and its d4 in fp32."""
        words, lo_scale, hi_scale = entry
        return (words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F, lo_scale.to(gl.float32), hi_scale.to(gl.float32))

    @gluon.jit
    def _token_sums(nibbles, lo_words, hi_words, lo_d, hi_d, lo_offset, hi_offset, BL: gl.constexpr):
        """(GROUP, 32) fp32 per-lane sums of one chunk for one token: `nibbles` from _nibbles, the
        token's activation words (1, CW) and per-lane d8 / offsets (1, 32) in the tiles' layouts."""
        lo_nibbles, hi_nibbles, lo_scale, hi_scale = nibbles
        lo_words, _ = gl.broadcast(lo_words, lo_nibbles)
        hi_words, _ = gl.broadcast(hi_words, lo_nibbles)
        # a lane's four words in one dp4a chain each: no sum of per-word dots after
        lo_n, hi_n = _word_slots(lo_nibbles, 32, 4), _word_slots(hi_nibbles, 32, 4)
        lo_a, hi_a = _word_slots(lo_words, 32, 4), _word_slots(hi_words, 32, 4)
        lo_dot = gl.full(lo_n[0].shape, 0, gl.int32, lo_n[0].type.layout)
        hi_dot = gl.full(lo_n[0].shape, 0, gl.int32, lo_n[0].type.layout)
        for j in gl.static_range(4):
            lo_dot = _dp4a_nibbles(lo_n[j], lo_a[j], lo_dot)
            hi_dot = _dp4a_nibbles(hi_n[j], hi_a[j], hi_dot)
        lo_dot = gl.convert_layout(lo_dot, BL).to(gl.float32)
        hi_dot = gl.convert_layout(hi_dot, BL).to(gl.float32)
        return lo_scale * (lo_d * lo_dot - lo_offset) + hi_scale * (hi_d * hi_dot - hi_offset)

    @gluon.jit
    def _q4_gemv_persistent_kernel(
        x_ptr, words_ptr, scales_ptr, bias_ptr, out_ptr,
        M, N, K, K_WORDS, KB, stride_xm, stride_om, stride_wn, stride_sb,
        HAS_BIAS: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
        K_CHUNKS: gl.constexpr, CHUNKS_PAD: gl.constexpr, DEPTH: gl.constexpr, TOKENS: gl.constexpr,
    ):
        """out[m, n] = Q8_1(x[m, :]) . Q4_0(W[n, :]) (+ bias) for the M <= TOKENS tokens (TOKENS a power of
        two: the shared-memory tables' shapes; tokens past M read zeros and store nothing). Groups, chunks
        and ring as in the FP4 kernel; a chunk's nibbles are decoded once and meet every token's
        activations; KB: scale blocks per row (K padded to 64, over 32)."""
        CW: gl.constexpr = 128  # code words per chunk (CHUNK_WORDS): 32 lanes x 4
        CP: gl.constexpr = CHUNKS_PAD
        GROUP: gl.constexpr = ROWS * WARPS
        WL: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [WARPS, 1], [1, 0])
        BL: gl.constexpr = gl.BlockedLayout([ROWS, 1], [1, 32], [WARPS, 1], [1, 0])
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        # per token: its lo chunks, then its hi chunks
        words_smem = gl.allocate_shared_memory(gl.int32, [2 * TOKENS * CP, CW], PLAIN)
        # per token: lo d8, hi d8, lo offsets, hi offsets, CP chunks each
        lanes_smem = gl.allocate_shared_memory(gl.float32, [4 * TOKENS * CP, 32], PLAIN)
        r_w = gl.arange(0, GROUP, layout=gl.SliceLayout(1, WL))
        w_w = gl.arange(0, CW, layout=gl.SliceLayout(0, WL))
        r_b = gl.arange(0, GROUP, layout=gl.SliceLayout(1, BL))
        b_b = gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
        word_ptrs = words_ptr.to(gl.pointer_type(gl.int32)) + r_w[:, None] * stride_wn + w_w[None, :]
        groups = gl.cdiv(N, GROUP)
        programs = gl.num_programs(0)
        first = gl.program_id(0)  # the grid has at most `groups` programs
        ring = ()  # the first DEPTH chunks, requested before the activations are quantized
        for t in gl.static_range(DEPTH):
            ring = ring + (_ring_entry(word_ptrs, scales_ptr, r_w, w_w, r_b, b_b,
                                       (first + t // K_CHUNKS * programs) * GROUP, t % K_CHUNKS, stride_wn,
                                       stride_sb, N, K_WORDS, KB, CW),)
        for tok in gl.static_range(TOKENS):
            for s in gl.static_range(CP // WARPS):
                limit = gl.where(tok < M, K - s * WARPS * CW * 8, 0)  # a token past M reads nothing
                lo_w, hi_w, lo_d, hi_d, lo_o, hi_o = _quantize_q8_1(x_ptr + tok * stride_xm + s * WARPS * CW * 8,
                                                                     limit, WARPS)
                words_smem.slice((2 * tok) * CP + s * WARPS, WARPS).store(lo_w)
                words_smem.slice((2 * tok + 1) * CP + s * WARPS, WARPS).store(hi_w)
                lanes_smem.slice((4 * tok) * CP + s * WARPS, WARPS).store(lo_d)
                lanes_smem.slice((4 * tok + 1) * CP + s * WARPS, WARPS).store(hi_d)
                lanes_smem.slice((4 * tok + 2) * CP + s * WARPS, WARPS).store(lo_o)
                lanes_smem.slice((4 * tok + 3) * CP + s * WARPS, WARPS).store(hi_o)
        _cta_barrier()
        for g in range(first, groups, programs):
            accs = ()
            for tok in gl.static_range(TOKENS):
                accs = accs + (gl.full([GROUP, 32], 0.0, gl.float32, BL),)
            for c in gl.static_range(K_CHUNKS):
                ahead = _ring_entry(word_ptrs, scales_ptr, r_w, w_w, r_b, b_b,
                                    (g + (c + DEPTH) // K_CHUNKS * programs) * GROUP, (c + DEPTH) % K_CHUNKS,
                                    stride_wn, stride_sb, N, K_WORDS, KB, CW)
                nibbles = _nibbles(ring[0])
                for tok in gl.static_range(TOKENS):
                    sums = _token_sums(nibbles, words_smem.slice((2 * tok) * CP + c, 1).load(WL),
                                       words_smem.slice((2 * tok + 1) * CP + c, 1).load(WL),
                                       lanes_smem.slice((4 * tok) * CP + c, 1).load(BL),
                                       lanes_smem.slice((4 * tok + 1) * CP + c, 1).load(BL),
                                       lanes_smem.slice((4 * tok + 2) * CP + c, 1).load(BL),
                                       lanes_smem.slice((4 * tok + 3) * CP + c, 1).load(BL), BL)
                    accs = accs[:tok] + (accs[tok] + sums,) + accs[tok + 1:]
                ring = ring[1:] + (ahead,)
            offs_n = g * GROUP + r_b
            if HAS_BIAS:
                bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            for tok in gl.static_range(TOKENS):
                total = gl.reduce(accs[tok], 1, _add)
                if HAS_BIAS:
                    total += bias
                gl.store(out_ptr + tok * stride_om + offs_n, total.to(out_ptr.dtype.element_ty),
                         mask=(offs_n < N) & (tok < M))


MAX_TOKENS = 8  # token rows one launch takes: each token's activations sit in shared memory


def shared_memory_bytes(tokens: int, chunks_pad: int) -> int:
    """The activations' shared memory of one program: per token (their count padded to a power of
    two, as the launch does: Gluon's shared-memory shapes are powers of two) and chunk, 2 x 128 int8
    words and 4 x 32 fp32 lane values."""
    return next_power_of_2(tokens) * chunks_pad * (2 * CHUNK_WORDS * 4 + 4 * 32 * 4)


def q4_gemv_persistent(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                       rows: int = 2, num_warps: int = 8, programs_per_sm: int = 2, depth: int = 1,
                       max_registers: int = 0) -> torch.Tensor:
    """(M, K) x, M <= MAX_TOKENS -> (M, N) in x's dtype for Q4_0 weights in the kernel layout (qweight
    uint8 [N, Kp/2], scales fp16 [Kp/32, N]): each warp owns `rows` rows, min(N / (rows x num_warps),
    SMs x programs_per_sm) programs; `depth`: chunks loaded ahead of the one decoded. `max_registers`
    > 0: ptxas's register cap per thread (so that programs_per_sm programs fit a multiprocessor)."""
    if max_registers and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers {max_registers}: expected 0 (no cap) or 24..255")
    n, k = qweight.shape[0], x.shape[-1]
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"x of shape {tuple(x.shape)}: expected (M, K) with 1 <= M <= {MAX_TOKENS} tokens")
    if k % 32 or qweight.shape[1] * 2 < k or scales.shape != (qweight.shape[1] // 16, n) or qweight.shape[1] % 32:
        raise ValueError(f"x (M, {k}), qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}: expected K a "
                         "multiple of 32, qweight (N, Kp / 2) uint8 with Kp = K padded to 64 and scales (Kp / 32, N)")
    check_tile(x, rows, num_warps, depth, programs_per_sm)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    m = x.shape[0]
    k_words = qweight.shape[1] // 4
    k_chunks, chunks_pad = chunks(qweight.shape[1] * 2, num_warps)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch(_q4_gemv_persistent_kernel, persistent_grid(x.get_device(), n, rows, num_warps, programs_per_sm),
           x, qweight, scales, bias if bias is not None else out, out,
           m, n, k, k_words, scales.shape[0], x.stride(0), out.stride(0), qweight.stride(0) // 4, scales.stride(0),
           HAS_BIAS=bias is not None, ROWS=rows, WARPS=num_warps, K_CHUNKS=k_chunks, CHUNKS_PAD=chunks_pad,
           DEPTH=depth, TOKENS=next_power_of_2(m), num_warps=num_warps,
           **({"maxnreg": max_registers} if max_registers else {}))
    return out
