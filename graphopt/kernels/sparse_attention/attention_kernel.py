"""The block-sparse flash-attention kernel: its autotune configs and their pruning, the checks of
what the tensor-descriptor (TMA) paths need, and the Triton kernel (`_sparse_attention_kernel`,
autotuned as `_sparse_attention_kernel_tuned`), which visits the kept key blocks of each query
block's list. `block_sparse_attention` (api.py) launches it."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None
    tl = None

from graphopt.hardware import compute_capability
from graphopt.kernels.launch import INTERPRET

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None

if triton is not None:
    from graphopt.kernels.tile_order import query_block_order



def _attention_configs():
    """Hopper-oriented search space (BLOCK_M x BLOCK_N are fixed: they are the predictor's blocks).

    PREFETCH_INDEX=1 reads the next kept block index one iteration ahead (the K/V addresses of a
    tile then never wait on a LUT load); 0 leaves the indirect load to Triton's pipeliner. Which
    one pipelines better depends on the Triton version, so both are tuned. PAIR_BLOCKS=1 runs the
    unmasked kept blocks two per step (see _attend_pairs)."""
    configs = [triton.Config({"PREFETCH_INDEX": p, "USE_TMA": 0, "PAIR_BLOCKS": 0}, num_warps=8, num_stages=s)
               for p in (1, 0) for s in (3, 4, 2)]
    configs += [triton.Config({"PREFETCH_INDEX": p, "USE_TMA": 0, "PAIR_BLOCKS": 0}, num_warps=4, num_stages=s)
                for p in (1, 0) for s in (3, 2)]
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0}, num_warps=w, num_stages=s)
                for w, s in ((8, 2), (8, 3), (8, 4), (4, 3))]
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": t, "PAIR_BLOCKS": 1}, num_warps=8, num_stages=s)
                for t in (1,) for s in (2, 3)]  # with pointer loads the pair spills (sm_90, 8 warps)
    # one loop over the whole list in one warp group (252 registers at D=128 on sm_90, no spills);
    # at 2 stages with the masked suffix merged into it (MERGED_SUFFIX), at 3 in a loop of its own
    configs += [triton.Config({"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0, "SINGLE_LOOP": 1,
                               "MERGED_SUFFIX": int(s == 2)}, num_warps=4, num_stages=s) for s in (2, 3)]
    return configs


def _prune_attention_configs(configs, named_args, **kwargs):
    """The autotuner's pruning: the launch's tensors decide what loads they allow, then
    _kept_configs."""
    def arg(name, default=None):
        return kwargs.get(name, named_args.get(name, default))

    head_dim = arg("HEAD_DIM", 128)
    q, k, v, o = (named_args[n] for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr"))
    return _kept_configs(configs, head_dim, arg("DOT_PRECISION"), tma_kv=tma_loads_supported(k, v),
                         single_loop=single_loop_supported(q, k, v, o, head_dim, bool(arg("PV_SKIP", False))))


def _kept_configs(configs, head_dim: int, dot_precision: str | None, *, tma_kv: bool, single_loop: bool) -> list:
    """A 128 x 128 fp32 accumulator in 4 warps is 128 registers per thread before anything else:
    head dims >= 128 use 8 warps (or the lean single loop in 4), head dims <= 32 use 4 (too little
    work for 8), 64 tries both. tma_kv: K and V allow tensor descriptors; single_loop: the single
    loop's conditions hold (descriptors for all four tensors, no PV skipping). From head dim 128
    the single loop runs at 2 stages only. fp32 inputs (dot_precision "ieee") build one config
    (_fma_dot_config)."""
    if dot_precision == "ieee":
        return _fma_dot_config(configs, head_dim)
    if head_dim >= 128:
        # the 3-stage single loop: on the H100 (D=128, 8k and 16k, 32 heads, 25-100% density)
        # slower than the 2-stage one on every row but one (a tie), yet the tuner, timing at the
        # first call's density, picked it in some runs
        configs = [c for c in configs if not (c.kwargs.get("SINGLE_LOOP") and c.num_stages > 2)]
    if not tma_kv:
        configs = [c for c in configs if not c.kwargs.get("USE_TMA")]
    if not single_loop:
        configs = [c for c in configs if not c.kwargs.get("SINGLE_LOOP")]
    if head_dim >= 128:
        kept = [c for c in configs if c.num_warps == 8 or c.kwargs.get("SINGLE_LOOP")]
    elif head_dim <= 32:
        kept = [c for c in configs if c.num_warps == 4]
    else:
        kept = list(configs)
    return kept or configs


def _fma_dot_config(configs, head_dim: int) -> list:
    """The one config for fp32 inputs: pointer loads, 2 stages, 4 warps up to head dim 32 and 8
    above. IEEE fp32 dots have no tensor-core form, so each tile's two dots unroll into FMA code
    many times the size of the bf16 builds', and ptxas takes as many times longer: tuning the whole
    space at head dims 48-96 held the first call for minutes. The dropped variants only change how
    tiles are loaded (descriptors, index prefetch, deeper pipelines) in a kernel bound by its FMAs,
    and they spill more; pointer loads also need no alignment (`bench/offline_sm90.py
    sparse-configs` reports each config's build time, registers and spills)."""
    warps = 4 if head_dim <= 32 else 8
    kept = [c for c in configs if c.num_warps == warps and c.num_stages == 2
            and c.kwargs == {"PREFETCH_INDEX": 1, "USE_TMA": 0, "PAIR_BLOCKS": 0}]
    return kept or configs[:1]


def tma_loads_supported(*tensors: torch.Tensor) -> bool:
    """Whether tiles of these (B, H, L, D) tensors can move through tensor descriptors (TMA): a
    Hopper or newer GPU, a Triton with tl.make_tensor_descriptor, 16-byte aligned rows and base
    addresses. Called on every launch, so it stays cheap (the capability is cached)."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    first = tensors[0]
    if not INTERPRET and not (first.is_cuda and compute_capability(first.device.index)[0] >= 9):
        return False
    for t in tensors:
        b, h, m, d = t.stride()
        size = t.element_size()
        if d != 1 or t.data_ptr() % 16 or (b * size) % 16 or (h * size) % 16 or (m * size) % 16:
            return False
    return True


def _single_loop_body_supported(head_dim: int, pv_skip: bool) -> bool:
    """The single loop's own limits: descriptor tiles as wide as the head dim (a power of two),
    and no PV skipping."""
    return not pv_skip and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def single_loop_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, head_dim: int,
                          pv_skip: bool) -> bool:
    """The single-loop body reads Q, K, V and writes O through descriptors whose tile width is the
    head dim (a power of two), and has no PV skipping."""
    return _single_loop_body_supported(head_dim, pv_skip) and tma_loads_supported(q, k, v, out)


def host_descriptors_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                               block_m: int, block_n: int) -> bool:
    """Whether the single loop can take descriptors built on the host over all heads' rows,
    (B*H*L, D) views: each tensor's (B, H, L) dims collapse into one row dim, and whole blocks
    tile every head (a partial block would read, and for O write, the next head's rows). Row
    coordinates are int32 in the kernel and in TMA."""
    if _TensorDescriptor is None or q.shape[2] % block_m or k.shape[2] % block_n:
        return False
    if max(t.shape[0] * t.shape[1] * t.shape[2] for t in (q, k)) >= 2**31:
        return False
    for t in (q, k, v, out):
        stride_b, stride_h, stride_m, _ = t.stride()
        _, heads, length, _ = t.shape
        if stride_h != length * stride_m or stride_b != heads * stride_h:
            return False
    return True


def _host_descriptors(q, k, v, out, block_m: int, block_n: int) -> tuple:
    """Descriptors over each tensor's (B*H*L, D) rows; built directly from shapes and strides
    (host_descriptors_supported checked that the rows collapse), one per launch."""
    def rows(t, block_rows):
        B, H, L, D = t.shape
        return _TensorDescriptor(t, [B * H * L, D], [t.stride(2), 1], [block_rows, D])
    return rows(q, block_m), rows(k, block_n), rows(v, block_n), rows(out, block_m)


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need a small global scratch per launch; give Triton a torch
    allocator unless the program already installed one."""
    from triton.runtime import _allocation

    current = _allocation._allocator.get() if hasattr(_allocation._allocator, "get") else _allocation._allocator
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


if triton is not None:

    # ------------------------------------------------------------------------ attention kernel
    @triton.jit
    def _load_kv_tile(ptrs, desc, start_n, keys, offs_d, Lk, stride_n, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
                      MASKED: tl.constexpr, TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr, desc_row0=0):
        """One K or V tile of BLOCK_N keys from `start_n`: (BLOCK_D, BLOCK_N) K^T when TRANSPOSED,
        else (BLOCK_N, BLOCK_D). USE_TMA: through the tensor descriptor (zero fill past Lk and
        HEAD_DIM in hardware), whose row of key 0 is desc_row0; else pointer loads, masked only
        where MASKED / PAD_D need it."""
        if USE_TMA:
            tile = desc.load([desc_row0 + start_n, 0])  # (BLOCK_N, BLOCK_D)
            if TRANSPOSED:
                tile = tl.trans(tile)
        else:
            ptrs = ptrs + start_n * stride_n
            if TRANSPOSED:
                key_ok = keys[None, :] < Lk
                d_ok = offs_d[:, None] < HEAD_DIM
            else:
                key_ok = keys[:, None] < Lk
                d_ok = offs_d[None, :] < HEAD_DIM
            if MASKED:
                if PAD_D:
                    tile = tl.load(ptrs, mask=key_ok & d_ok, other=0.0)
                else:
                    tile = tl.load(ptrs, mask=key_ok, other=0.0)
            else:
                if PAD_D:
                    tile = tl.load(ptrs, mask=d_ok, other=0.0)
                else:
                    tile = tl.load(ptrs)
        return tile

    @triton.jit
    def _attend_tile(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, start_n, desc_row0, offs_m, offs_n, offs_d, neg_pv_thresh,
        stride_kn, stride_vn, Lq, Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    ):
        """One (BLOCK_M x BLOCK_N) tile of online softmax (log2 domain): QK^T, token masks only when
        MASKED (a diagonal or a partial last block), optional PV skip, then P.V into `acc`.
        desc_row0: the head's first row in the K/V descriptors (0 for per-head descriptors built
        on the device; head * Lk for the host's descriptors over all heads' rows)."""
        keys = start_n + offs_n  # (BLOCK_N,)
        kt = _load_kv_tile(kt_ptrs, k_desc, start_n, keys, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D, MASKED, True, USE_TMA,
                           desc_row0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) raw products, fp32
        if MASKED:
            # One compare and one select per element; the scale stays in the FMA below. Causal
            # attention has Lq == Lk (checked on the host), so key <= row also keeps every key of a
            # stored row below Lk (rows past Lq are computed from zero-filled keys, never stored).
            if IS_CAUSAL:
                valid = keys[None, :] <= offs_m[:, None]
            else:
                valid = keys[None, :] < Lk
            qk = tl.where(valid, qk, float("-inf"))
        # max of the raw products, then scaled (qk_scale > 0, so this is the max of the scaled ones)
        tile_max = tl.max(qk, 1) * qk_scale
        if PV_SKIP:
            # Skip only if every valid row's tile max is below its running max - pvthreshd.
            gap = tl.where(offs_m < Lq, tile_max - m_i, float("-inf"))
            run = tl.max(gap, 0) >= neg_pv_thresh
        else:
            run = True
        if run:
            m_new = tl.maximum(m_i, tile_max)
            if MASKED:
                # A row may have seen only masked keys so far: shift by 0 instead of -inf (no NaN).
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_shift = m_new
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
            alpha = tl.math.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_kv_tile(v_ptrs, v_desc, start_n, keys, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D, MASKED, False,
                              USE_TMA, desc_row0)
            # P.V accumulates into the rescaled accumulator inside the MMA (no separate add).
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attend_tile_branch(acc, l_i, m_i, q, k_desc, v_desc, start_n, desc_row0, offs_m, offs_n, masked, Lk, qk_scale,
                            IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """_attend_tile through tensor descriptors with the token mask under a uniform runtime
        branch (`masked`), so masked and unmasked tiles share one pipelined loop."""
        keys = start_n + offs_n
        kt = tl.trans(k_desc.load([desc_row0 + start_n, 0]))
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if masked:
            if IS_CAUSAL:
                qk = tl.where(keys[None, :] <= offs_m[:, None], qk, float("-inf"))
            else:
                qk = tl.where(keys[None, :] < Lk, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([desc_row0 + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _attend_list(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, lo, hi, next_index, offs_m, offs_n, offs_d,
        neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH_INDEX: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Tiles lut_row[lo:hi]. PREFETCH_INDEX: `next_index` holds lut_row[lo] on entry and the
        entry after hi - 1 (clamped to the list) on exit."""
        for it in range(lo, hi):
            if PREFETCH_INDEX:
                block_index = next_index
                next_index = tl.load(lut_row + tl.minimum(it + 1, hi - 1), eviction_policy="evict_last")
            else:
                block_index = tl.load(lut_row + it, eviction_policy="evict_last")
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, block_index * BLOCK_N, 0, offs_m, offs_n, offs_d,
                neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, PAD_D, MASKED, IS_CAUSAL, PV_SKIP,
                DOT_PRECISION, USE_TMA)
        return acc, l_i, m_i, next_index

    @triton.jit
    def _attend_pairs(
        acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, lo, hi, offs_n, offs_d, stride_kn, stride_vn,
        Lk, qk_scale,
        HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Unmasked tiles lut_row[lo:hi] (hi - lo even) two per step: two QK^T tiles share one
        running-max update and one rescale of the (BLOCK_M, D) accumulator, which is what a
        2 * BLOCK_N key tile costs in a dense kernel, though the two blocks need not be adjacent.
        The pair's indices are read one step ahead."""
        next0 = tl.load(lut_row + lo, mask=hi > lo, other=0)
        next1 = tl.load(lut_row + lo + 1, mask=hi > lo, other=0)
        for it in range(lo, hi, 2):
            start0 = next0 * BLOCK_N
            start1 = next1 * BLOCK_N
            ahead = tl.minimum(it + 2, hi - 2)
            next0 = tl.load(lut_row + ahead, eviction_policy="evict_last")
            next1 = tl.load(lut_row + ahead + 1, eviction_policy="evict_last")
            kt0 = _load_kv_tile(kt_ptrs, k_desc, start0, start0 + offs_n, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D,
                                False, True, USE_TMA)
            kt1 = _load_kv_tile(kt_ptrs, k_desc, start1, start1 + offs_n, offs_d, Lk, stride_kn, HEAD_DIM, PAD_D,
                                False, True, USE_TMA)
            qk0 = tl.dot(q, kt0, input_precision=DOT_PRECISION)
            qk1 = tl.dot(q, kt1, input_precision=DOT_PRECISION)
            m_new = tl.maximum(m_i, tl.maximum(tl.max(qk0, 1), tl.max(qk1, 1)) * qk_scale)
            p0 = tl.math.exp2(qk0 * qk_scale - m_new[:, None])
            p1 = tl.math.exp2(qk1 * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + (tl.sum(p0, 1) + tl.sum(p1, 1))
            v0 = _load_kv_tile(v_ptrs, v_desc, start0, start0 + offs_n, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D,
                               False, False, USE_TMA)
            v1 = _load_kv_tile(v_ptrs, v_desc, start1, start1 + offs_n, offs_d, Lk, stride_vn, HEAD_DIM, PAD_D,
                               False, False, USE_TMA)
            acc = tl.dot(p0.to(v0.dtype), v0, acc * alpha[:, None], input_precision=DOT_PRECISION)
            acc = tl.dot(p1.to(v1.dtype), v1, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL: tl.constexpr):
        """(query block, batch * head, batch, head, kv head) of this program of the 1-D grid, in
        tile_order's launch order (under causality the heaviest query blocks of a group of heads
        first)."""
        pid_m, pid_bh = query_block_order(N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        b = pid_bh // H
        h = pid_bh % H
        return pid_m, pid_bh, b, h, h // KV_GROUP

    @triton.jit
    def _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """(length, first block) of the blocks needing a token mask. Kept blocks are ascending, so
        these are a suffix of the list, consecutive blocks known without it: under causality the
        blocks the diagonal crosses (which the list must hold), else a partial last block."""
        if IS_CAUSAL:
            first_masked = (pid_m * BLOCK_M + 1) // BLOCK_N
            last_allowed = (tl.minimum((pid_m + 1) * BLOCK_M, Lq) - 1) // BLOCK_N
            n_masked = last_allowed - first_masked + 1
        else:
            first_masked = N_K_BLOCKS - 1
            last_block = tl.load(lut_row + tl.maximum(count - 1, 0))
            n_masked = ((Lk % BLOCK_N != 0) & (last_block == first_masked) & (count > 0)).to(tl.int32)
        return n_masked, first_masked

    @triton.jit
    def _head_descriptor(ptr, b, h, stride_b, stride_h, stride_row, rows, HEAD_DIM: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr):
        """A device-side descriptor over one head's (rows, HEAD_DIM) matrix."""
        return tl.make_tensor_descriptor(ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h,
                                         shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_ROWS, HEAD_DIM])

    @triton.jit
    def _attend_single_loop(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, q_hdesc, k_hdesc, v_hdesc, o_hdesc,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PARTIAL_KEYS: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
        MERGED_SUFFIX: tl.constexpr = False,
    ):
        """The row's unmasked blocks in one branch-free loop, in one warp group, after its masked
        suffix (diagonal or partial blocks, at most BLOCK_M // BLOCK_N + 1) in a short loop of its
        own: less live state than the default body's three loops, so a 128 x 128 fp32 accumulator
        fits 4 warps (the default body spills hundreds of bytes there; this one 40 at 2 stages, in
        triton 3.9's sm_90 build). Q, K, V and O all go through tensor descriptors (HEAD_DIM is a
        power of two; the launcher checks alignment).

        HOST_DESCRIPTORS: the launcher built the four descriptors (q_hdesc ...) over all heads'
        rows, (B*H*L, D), when whole blocks tile every head; else each program builds its own on
        the device, four global writes and a proxy fence before its first load. On the H100 at 8k
        tokens that was a sizeable part of a program's fixed cost (bench/results/sparse_fixed_cost_h100.json).

        MERGED_SUFFIX (causal or a partial last key block): the masked suffix joins the main loop
        instead, its mask under a branch (_attend_tile_branch). Only at 2 stages: at 3 the merged
        loop spills 120 bytes (sm_90, triton 3.9) and ran slower on the H100."""
        pid_m, pid_bh, b, h, kv_h = _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        if HOST_DESCRIPTORS:
            q_desc, k_desc, v_desc, o_desc = q_hdesc, k_hdesc, v_hdesc, o_hdesc
            q_row0 = pid_bh * Lq  # this head's first row in the (B*H*Lq, D) views
            kv_row0 = (b * (H // KV_GROUP) + kv_h) * Lk
        else:
            q_desc = _head_descriptor(q_ptr, b, h, stride_qb, stride_qh, stride_qm, Lq, HEAD_DIM, BLOCK_M)
            k_desc = _head_descriptor(k_ptr, b, kv_h, stride_kb, stride_kh, stride_kn, Lk, HEAD_DIM, BLOCK_N)
            v_desc = _head_descriptor(v_ptr, b, kv_h, stride_vb, stride_vh, stride_vn, Lk, HEAD_DIM, BLOCK_N)
            o_desc = _head_descriptor(o_ptr, b, h, stride_ob, stride_oh, stride_om, Lq, HEAD_DIM, BLOCK_M)
            q_row0 = 0
            kv_row0 = 0
        row = pid_bh * N_Q_BLOCKS + pid_m
        lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
        count = tl.load(count_ptr + row)
        # The list's first entry, read before Q's load, which waits in place: the first K/V loads
        # wait on the pipeliner's own read of this entry, issued after Q arrives, and that read
        # then hits L1 instead of making a trip to memory of its own. (The select keeps the read:
        # entries are never negative.)
        first_entry = tl.load(lut_row)
        count = tl.where(first_entry < 0, 0, count)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = q_desc.load([q_row0 + pid_m * BLOCK_M, 0])  # zero rows past Lq
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if IS_CAUSAL or PARTIAL_KEYS:
            n_masked, first_masked = _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M, BLOCK_N,
                                                    IS_CAUSAL)
        else:
            n_masked = 0  # whole key blocks, no causal mask: nothing to mask, and no read of the list's end
        # n_plain before the suffix loop: computed after it, the causal build spilled 8 more bytes
        # (sm_90, triton 3.9)
        n_plain = tl.maximum(count - n_masked, 0)
        if (IS_CAUSAL or PARTIAL_KEYS) and MERGED_SUFFIX:
            # The whole list in one pipelined loop, the masked suffix (its last n_masked entries) last,
            # its token mask under a uniform branch: a loop of the suffix's own (below) fills a
            # pipeline of its own, one more memory latency before the main loop. On the H100 (causal,
            # 8k and 16k, 32 heads) faster at 10-25% density, either way at 50%, slightly slower at
            # 100%. No row sees only masked keys, so the max needs no -inf guard: the list holds
            # every block the diagonal crosses (the launcher's precondition), and the first of them
            # starts at the query block's first token; a partial last key block starts below Lk.
            for it in range(0, count):
                start_n = tl.load(lut_row + it, eviction_policy="evict_last") * BLOCK_N
                acc, l_i, m_i = _attend_tile_branch(
                    acc, l_i, m_i, q, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, it >= n_plain, Lk, qk_scale,
                    IS_CAUSAL, DOT_PRECISION)
        else:
            if IS_CAUSAL or PARTIAL_KEYS:
                # The masked suffix first, in a loop of its own (at most BLOCK_M // BLOCK_N + 1 tiles):
                # pipelined, so a tile's K and V loads are in flight together and the next tile's load
                # overlaps this one. As straight-line code each load would wait on its own, K then V,
                # tile after tile (slower on the H100's causal rows). Its blocks come from
                # _masked_suffix, not the list, so its first loads wait on Q only.
                for j in tl.range(0, n_masked, num_stages=2):
                    start_n = (first_masked + j) * BLOCK_N
                    acc, l_i, m_i = _attend_tile(
                        acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, offs_d, 0.0,
                        stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, False, True, IS_CAUSAL, False,
                        DOT_PRECISION, True)
            for it in range(0, n_plain):
                start_n = tl.load(lut_row + it, eviction_policy="evict_last") * BLOCK_N
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, offs_d, 0.0,
                    stride_kn, stride_vn, Lq, Lk, qk_scale, HEAD_DIM, False, False, IS_CAUSAL, False,
                    DOT_PRECISION, True)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty row (count 0) gives 0
        o_desc.store([q_row0 + pid_m * BLOCK_M, 0], out.to(o_desc.dtype))  # rows past Lq are clipped

    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, SEQ_BUCKET, HEAD_GROUP,
        q_hdesc, k_hdesc, v_hdesc, o_hdesc,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, PV_PER_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PREFETCH_INDEX: tl.constexpr, USE_TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
        SINGLE_LOOP: tl.constexpr = False, PARTIAL_KEYS: tl.constexpr = False, HOST_DESCRIPTORS: tl.constexpr = False,
        TMA_ELIGIBLE: tl.constexpr = 0, MERGED_SUFFIX: tl.constexpr = False,
    ):
        """1-D grid of nQ * B*H programs (order: tile_order.query_block_order): one query block of one
        head; visits the kept key blocks of its LUT row.
        PAIR_BLOCKS (without PV skipping): unmasked blocks two per step (_attend_pairs).
        USE_TMA: K/V tiles through device-side tensor descriptors (Hopper TMA; the launcher
        checks alignment), else pointer loads.
        SINGLE_LOOP: the masked suffix, then the unmasked blocks in one loop (_attend_single_loop;
        MERGED_SUFFIX: both in one loop);
        PARTIAL_KEYS: Lk is not a multiple of BLOCK_N (the single loop's masked suffix).
        HOST_DESCRIPTORS: q_hdesc ... o_hdesc are the launcher's descriptors for the single loop
        (None otherwise; the default body never reads them).
        TMA_ELIGIBLE (not read; an autotuning key): 0 no descriptors possible, 1 for K/V, 2 for all four
        tensors and the single loop. The autotuner prunes USE_TMA / SINGLE_LOOP configs by alignment
        only when it tunes a key, so alignment must be part of the key: else a config chosen for
        aligned tensors would run on misaligned ones.
        The last dimension of q, k, v, o is contiguous (the launcher guarantees it). SEQ_BUCKET is
        only an autotuning key (the sequence length's power-of-two bucket)."""
        if SINGLE_LOOP:
            _attend_single_loop(
                q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, KV_GROUP, Lq, Lk,
                N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, q_hdesc, k_hdesc, v_hdesc, o_hdesc, HEAD_DIM, BLOCK_M,
                BLOCK_N, IS_CAUSAL, DOT_PRECISION, PARTIAL_KEYS, HOST_DESCRIPTORS, MERGED_SUFFIX)
        else:
            _attend_block_lists(
                q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh, stride_qb, stride_qh,
                stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh,
                stride_om, H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP, HEAD_DIM, BLOCK_D, BLOCK_M,
                BLOCK_N, IS_CAUSAL, PV_SKIP, PV_PER_HEAD, DOT_PRECISION, PREFETCH_INDEX, USE_TMA, PAIR_BLOCKS)

    @triton.jit
    def _attend_block_lists(
        q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, pv_thresh_ptr, pv_thresh,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale, HEAD_GROUP,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, PV_PER_HEAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        PREFETCH_INDEX: tl.constexpr, USE_TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    ):
        """The kernel's default body: pairs of unmasked blocks, then single unmasked blocks, then the
        masked suffix (diagonal or partial blocks), each its own loop."""
        PAD_D: tl.constexpr = HEAD_DIM != BLOCK_D
        pid_m, pid_bh, b, h, kv_h = _program_row(H, KV_GROUP, N_Q_BLOCKS, HEAD_GROUP, IS_CAUSAL)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
        if PAD_D:
            q = tl.load(q_ptrs, mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < Lq, other=0.0)  # (BLOCK_M, BLOCK_D)
        kt_ptrs = k_ptr + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_ptr + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
        if USE_TMA:
            k_desc = tl.make_tensor_descriptor(k_ptr + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh,
                                               shape=[Lk, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(v_ptr + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh,
                                               shape=[Lk, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
        else:
            k_desc = k_ptr  # unused
            v_desc = v_ptr
        row = pid_bh * N_Q_BLOCKS + pid_m
        lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
        count = tl.load(count_ptr + row)
        neg_pv_thresh = 0.0
        if PV_SKIP:
            if PV_PER_HEAD:
                neg_pv_thresh = -tl.load(pv_thresh_ptr + h)
            else:
                neg_pv_thresh = -pv_thresh
        n_masked, _ = _masked_suffix(pid_m, lut_row, count, Lq, Lk, N_K_BLOCKS, BLOCK_M, BLOCK_N, IS_CAUSAL)
        n_plain = tl.maximum(count - n_masked, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        single_lo = 0
        if PAIR_BLOCKS and not PV_SKIP:
            single_lo = n_plain - n_plain % 2
            acc, l_i, m_i = _attend_pairs(
                acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, 0, single_lo, offs_n, offs_d,
                stride_kn, stride_vn, Lk, qk_scale, HEAD_DIM, PAD_D, BLOCK_N, DOT_PRECISION, USE_TMA)
        next_index = tl.load(lut_row + tl.minimum(single_lo, tl.maximum(count - 1, 0)), mask=count > 0, other=0)
        acc, l_i, m_i, next_index = _attend_list(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, single_lo, n_plain, next_index, offs_m, offs_n, offs_d,
            neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
            HEAD_DIM, PAD_D, BLOCK_N, False, IS_CAUSAL, PV_SKIP, DOT_PRECISION, PREFETCH_INDEX, USE_TMA)
        if PREFETCH_INDEX:
            next_index = tl.load(lut_row + tl.minimum(n_plain, tl.maximum(count - 1, 0)))
        acc, l_i, m_i, next_index = _attend_list(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, k_desc, v_desc, lut_row, n_plain, count, next_index, offs_m, offs_n,
            offs_d, neg_pv_thresh, stride_kn, stride_vn, Lq, Lk, qk_scale,
            HEAD_DIM, PAD_D, BLOCK_N, True, IS_CAUSAL, PV_SKIP, DOT_PRECISION, PREFETCH_INDEX, USE_TMA)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty row (count 0) gives 0
        o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
        if PAD_D:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Lq)

    _sparse_attention_kernel_tuned = triton.autotune(
        configs=_attention_configs(),
        key=["HEAD_DIM", "IS_CAUSAL", "PV_SKIP", "DOT_PRECISION", "SEQ_BUCKET", "PARTIAL_KEYS", "HOST_DESCRIPTORS",
             "TMA_ELIGIBLE"],
        prune_configs_by={"early_config_prune": _prune_attention_configs},
    )(_sparse_attention_kernel)
