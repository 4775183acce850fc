"""The predictor's Triton kernels: pooling of Q and K blocks with their self-similarity
(`_pool_blocks_kernel`), and the selection of kept blocks into compact lists, in one launch (v2:
`_predict_lut_kernel_v2`) or two (v3: `_pooled_scores_kernel`, then `_select_blocks_kernel`).
predictor.py launches them."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def _mask_tile(pid_r, pid_c, pid_bh, H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS: tl.constexpr,
                   COLS: tl.constexpr):
        """The (ROWS query blocks x COLS key blocks) tile of one head's block mask that a predictor
        program owns: its head h; query block indices `rows` and key block indices `cols` with
        their bounds masks; and their int64 rows in pooled_q / sim_q (`q_rows`, B*H*nQ of them) and
        pooled_k / sim_k (`k_rows`, B*HKV*nK, the head's KV group)."""
        h = pid_bh % H
        kv_bh = (pid_bh // H) * (H // KV_GROUP) + h // KV_GROUP
        rows = pid_r * ROWS + tl.arange(0, ROWS)
        cols = pid_c * COLS + tl.arange(0, COLS)
        q_rows = (pid_bh * N_Q_BLOCKS + rows).to(tl.int64)
        k_rows = (kv_bh * N_K_BLOCKS + cols).to(tl.int64)
        return h, rows, rows < N_Q_BLOCKS, cols, cols < N_K_BLOCKS, q_rows, k_rows

    @triton.jit
    def _store_block_lists(keep, best, cols, q_rows, row_ok, lut_ptr, count_ptr, N_K_BLOCKS):
        """Rows of the (ROWS, N_K_POW2) keep mask -> lut[row, :count] (ascending kept block
        indices) and count[row]. A row that kept nothing keeps `best`, its allowed block with the
        highest pooled score."""
        none_kept = (tl.sum(keep, 1) == 0).to(tl.int32)
        keep = keep | (none_kept[:, None] & (cols[None, :] == best[:, None]).to(tl.int32))
        position = tl.cumsum(keep, 1) - 1
        lut_rows = lut_ptr + q_rows[:, None] * N_K_BLOCKS
        tl.store(lut_rows + position, cols[None, :] + tl.zeros_like(keep), mask=(keep != 0) & row_ok[:, None])
        tl.store(count_ptr + q_rows, tl.sum(keep, 1), mask=row_ok)

    # Predictor "v2" (its pooling is also v3's): one program per block with all its loads in flight
    # at once (40-50 registers at D=128, so ~5 programs per SM stream Q and K), and a LUT kernel
    # whose masks are rebuilt rather than kept live (no spills up to nK = 512), with a 3-pivot
    # threshold search (16 steps instead of 31) where the rows are short.
    @triton.jit
    def _pool_slice_sums(x_base, stride_l, stride_d, L, first, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SUB: tl.constexpr):
        """Sums of x and of x / |x| over the SUB tokens from `first` (those < L): two (BLOCK_D,) fp32."""
        offs_l = first + tl.arange(0, SUB)
        ptrs = x_base + offs_l[:, None] * stride_l + offs_d[None, :] * stride_d
        if BLOCK_D == HEAD_DIM:  # no mask along D: vectorized loads
            x = tl.load(ptrs, mask=offs_l[:, None] < L, other=0.0).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=(offs_l[:, None] < L) & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        inv_norm = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-12)  # (SUB,): one division per token
        return tl.sum(x, 0), tl.sum(x * inv_norm[:, None], 0)  # padded tokens add 0

    @triton.jit
    def _pool_block_sums(
        x_base, stride_l, stride_d, L, start,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
        LOOP_STAGES: tl.constexpr,
    ):
        """Sums of x and of x / |x| over the tokens [start, min(start + BLOCK, L)): two (BLOCK_D,)
        fp32 vectors, read in SUB-token slices, each reduced over its tokens at once (within the
        warp, at one warp per program) into (BLOCK_D,) accumulators: few registers, so many
        programs fit an SM.
        LOOP_STAGES 0: the slice loop is unrolled (the compiler may hoist loads); n >= 1: a loop
        pipelined over n stages."""
        offs_d = tl.arange(0, BLOCK_D)
        x_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        unit_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if LOOP_STAGES == 0:
            for s in tl.static_range(0, BLOCK, SUB):
                x_sum, unit_sum = _pool_slice_sums(x_base, stride_l, stride_d, L, start + s, offs_d, HEAD_DIM, BLOCK_D, SUB)
                x_acc += x_sum
                unit_acc += unit_sum
        else:
            for s in tl.range(0, BLOCK, SUB, num_stages=LOOP_STAGES):
                x_sum, unit_sum = _pool_slice_sums(x_base, stride_l, stride_d, L, start + s, offs_d, HEAD_DIM, BLOCK_D, SUB)
                x_acc += x_sum
                unit_acc += unit_sum
        return x_acc, unit_acc

    @triton.jit
    def _pool_blocks_kernel(
        q_ptr, k_ptr, work_ptr,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        H, HKV, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, N_Q_PROGRAMS,
        off_sim_q, off_pooled_k, off_sim_k,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SUB_M: tl.constexpr, SUB_N: tl.constexpr, LOOP_STAGES: tl.constexpr,
    ):
        """1-D grid, one program per block: programs [0, B*H*nQ) pool query block `pid` (it is row
        pid of pooled_q / sim_q), the next B*HKV*nK key block `pid - B*H*nQ`, into one fp32 workspace
        laid out as pooled_q (B*H, nQ, D) | sim_q (B*H, nQ) | pooled_k (B*HKV, nK, D) | sim_k (B*HKV, nK)."""
        pid = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_D)
        if pid < N_Q_PROGRAMS:
            bh = pid // N_Q_BLOCKS
            start = (pid % N_Q_BLOCKS) * BLOCK_M
            base = q_ptr + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
            x_sum, unit_sum = _pool_block_sums(base, stride_ql, stride_qd, Lq, start, HEAD_DIM, BLOCK_D, BLOCK_M, SUB_M,
                                               LOOP_STAGES)
            count = tl.minimum(Lq - start, BLOCK_M).to(tl.float32)
            tl.store(work_ptr + pid.to(tl.int64) * HEAD_DIM + offs_d, x_sum / count, mask=offs_d < HEAD_DIM)
            tl.store(work_ptr + off_sim_q + pid, tl.sum(unit_sum * unit_sum, 0) / (count * count))
        else:
            row = pid - N_Q_PROGRAMS
            bh = row // N_K_BLOCKS
            start = (row % N_K_BLOCKS) * BLOCK_N
            base = k_ptr + (bh // HKV).to(tl.int64) * stride_kb + (bh % HKV).to(tl.int64) * stride_kh
            x_sum, unit_sum = _pool_block_sums(base, stride_kl, stride_kd, Lk, start, HEAD_DIM, BLOCK_D, BLOCK_N, SUB_N,
                                               LOOP_STAGES)
            count = tl.minimum(Lk - start, BLOCK_N).to(tl.float32)
            tl.store(work_ptr + off_pooled_k + row.to(tl.int64) * HEAD_DIM + offs_d, x_sum / count, mask=offs_d < HEAD_DIM)
            tl.store(work_ptr + off_sim_k + row, tl.sum(unit_sum * unit_sum, 0) / (count * count))

    @triton.jit
    def _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                        N_K_POW2: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """int32 0/1 (ROWS, N_K_POW2): existing key blocks with a (query, key) pair at/below the diagonal."""
        allowed = col_ok.to(tl.int32)[None, :] + tl.zeros([ROWS, N_K_POW2], dtype=tl.int32)
        if IS_CAUSAL:
            last_query = tl.minimum((rows + 1) * BLOCK_M, Lq) - 1  # (ROWS,)
            allowed = allowed & (cols[None, :] * BLOCK_N <= last_query[:, None]).to(tl.int32)
        return allowed

    @triton.jit
    def _mass_above(probs, bits):
        """F(t) per row: the mass of the probabilities strictly above t, t given by its fp32 bits (ROWS,)."""
        t = bits.to(tl.float32, bitcast=True)
        return tl.sum(tl.where(probs > t[:, None], probs, 0.0), 1)

    @triton.jit
    def _pooled_scores(pooled_q_ptr, pooled_k_ptr, q_rows, row_ok, k_rows, col_ok, HEAD_DIM: tl.constexpr,
                       D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       PRECISION: tl.constexpr):
        """Unscaled pooled scores (ROWS, COLS) = pooled_q[q_rows] (ROWS, D) @ pooled_k[k_rows]^T, in
        D chunks chained through the accumulator: with "ieee", one fp32 FMA chain over D per
        score whatever the chunking (v2 and v3)."""
        scores = tl.zeros([ROWS, COLS], dtype=tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, D_CHUNK):
            offs_d = d0 + tl.arange(0, D_CHUNK)
            pq = tl.load(pooled_q_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :],
                         mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            pkt = tl.load(pooled_k_ptr + k_rows[None, :] * HEAD_DIM + offs_d[:, None],
                          mask=col_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
            scores = tl.dot(pq, pkt, scores, input_precision=PRECISION)
        return scores

    @triton.jit
    def _select_blocks(
        scores, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
        sim_q_ptr, sim_k_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        Lq, Lk, N_K_BLOCKS,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """From scaled pooled scores (ROWS, N_K_POW2) of one head to lut[row, :count] and counts:
        masked row softmax, top-cdf threshold search, forced blocks, compaction (v2 and v3)."""
        if PER_HEAD:
            sim_thresh = tl.load(sim_thresh_ptr + h)
            cdf_thresh = tl.load(cdf_thresh_ptr + h)
        cdf_thresh = cdf_thresh + tl.zeros([ROWS], dtype=tl.float32)  # (ROWS,): a tensor in every mode
        # Boolean algebra in int32 (0/1): the interpreter and the compiler agree on it. The (ROWS,
        # N_K_POW2) masks are cheap to rebuild, so they are rebuilt where needed, not kept live.
        q_similar = (tl.load(sim_q_ptr + q_rows, mask=row_ok, other=0.0) > sim_thresh).to(tl.int32)
        k_similar = (tl.load(sim_k_ptr + k_rows, mask=col_ok, other=0.0) > sim_thresh).to(tl.int32)
        allowed = _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL)
        # at least one block per row: the allowed block with the highest pooled score (taken here:
        # the scores are dead after the softmax)
        best = tl.argmax(tl.where(allowed != 0, scores, float("-inf")), 1)  # (ROWS,)
        candidates = allowed & k_similar[None, :]
        logits = tl.where(candidates != 0, scores, float("-inf"))
        row_max = tl.max(logits, 1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        weights = tl.where(candidates != 0, tl.exp(logits - row_max[:, None]), 0.0)
        probs = weights / tl.maximum(tl.sum(weights, 1), 1e-30)[:, None]
        # Top-cdf: sorted descending, a block is kept iff the mass sorted before it is < cdf; for
        # the first of equal values that mass is F(p) = sum of the probs > p, non-increasing in p,
        # so the kept blocks are exactly probs >= t*, t* = the smallest fp32 t >= 0 with F(t) < cdf.
        # Non-negative fp32 values are ordered like their bit patterns: t* is searched (F as
        # computed is monotone, so t* does not depend on how it is searched) over bit patterns in
        # (lo, hi] with F(lo) >= cdf (lo = -1: below 0) and
        # F(hi) < cdf: hi starts at the row's largest probability (F = 0 there, < cdf if cdf > 0;
        # <= 1.0 + 2 ulp, so 31 halvings or 16 quarterings reach hi = lo + 1). PIVOTS = 3 quarters
        # (lo, hi] per step with three independent row sums; a pivot equal to lo is not evaluated.
        lo = tl.full([ROWS], -1, dtype=tl.int32)
        hi = tl.max(probs, 1).to(tl.int32, bitcast=True)
        for _ in range(SEARCH_STEPS):
            if PIVOTS == 3:
                mid2 = lo + (hi - lo) // 2
                mid1 = lo + (mid2 - lo) // 2
                mid3 = mid2 + (hi - mid2) // 2
                below1 = (mid1 > lo) & (_mass_above(probs, mid1) < cdf_thresh)
                below2 = (mid2 > lo) & (_mass_above(probs, mid2) < cdf_thresh)
                below3 = (mid3 > lo) & (_mass_above(probs, mid3) < cdf_thresh)
                new_hi = tl.where(below1, mid1, tl.where(below2, mid2, tl.where(below3, mid3, hi)))
                lo = tl.where(below1, lo, tl.where(below2, mid1, tl.where(below3, mid2, mid3)))
                hi = new_hi
            else:
                mid = lo + (hi - lo) // 2
                below = (mid > lo) & (_mass_above(probs, mid) < cdf_thresh)
                hi = tl.where(below, mid, hi)
                lo = tl.where(below, lo, mid)
        top = ((probs >= hi.to(tl.float32, bitcast=True)[:, None]) & (cdf_thresh > 0.0)[:, None]).to(tl.int32)
        allowed = _allowed_blocks(rows, cols, col_ok, Lq, BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL)
        keep_whole_row = (q_similar == 0).to(tl.int32) | (cdf_thresh >= 1.0).to(tl.int32)  # (ROWS,)
        keep = (top & k_similar[None, :]) | (k_similar == 0).to(tl.int32)[None, :] | keep_whole_row[:, None]
        if IS_CAUSAL:  # the blocks the diagonal crosses
            last_key = tl.minimum((cols + 1) * BLOCK_N, Lk) - 1  # (N_K_POW2,)
            keep = keep | (last_key[None, :] > rows[:, None] * BLOCK_M).to(tl.int32)
        keep = keep & allowed
        _store_block_lists(keep, best, cols, q_rows, row_ok, lut_ptr, count_ptr, N_K_BLOCKS)

    @triton.jit
    def _predict_lut_kernel_v2(
        pooled_q_ptr, sim_q_ptr, pooled_k_ptr, sim_k_ptr,
        sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, scale,
        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), B*H): ROWS rows of the block mask, from the pooled scores to the
        compact ascending lists lut[row, :count] the attention kernel reads, in registers."""
        h, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), 0, tl.program_id(1), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, N_K_POW2)
        scores = _pooled_scores(pooled_q_ptr, pooled_k_ptr, q_rows, row_ok, k_rows, col_ok,
                                HEAD_DIM, D_CHUNK, BLOCK_D, ROWS, N_K_POW2, "ieee")
        _select_blocks(scores * scale, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
                       sim_q_ptr, sim_k_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
                       Lq, Lk, N_K_BLOCKS,
                       BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL, PER_HEAD, PIVOTS, SEARCH_STEPS)

    # v3 (the default): v2's LUT launch split in two. v2 runs one program per 16 query blocks (the
    # fp32 dot needs 16 rows), so at 8k (64 rows per head) only 64 programs run its serial 16-step
    # search, with cross-warp row sums. v3 computes the pooled scores as a small tiled GEMM on the
    # tensor cores (3xTF32), then selects in one-warp programs of one row (`V3_SHAPE`): the row
    # sums are warp shuffles with no barrier, and there are 16 times more programs.
    @triton.jit
    def _pooled_scores_kernel(
        pooled_q_ptr, pooled_k_ptr, scores_ptr, H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, scale,
        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), cdiv(nK, COLS), B*H): scores[q_row, col] = scale * pooled_q . pooled_k,
        into scores (B*H*nQ, nK). PRECISION "ieee": one fp32 FMA chain over D per score, as
        in v2; "tf32x3": three TF32 tensor-core products (about fp32 accuracy, other rounding)."""
        _, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), tl.program_id(1), tl.program_id(2), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, COLS)
        scores = _pooled_scores(pooled_q_ptr, pooled_k_ptr, q_rows, row_ok, k_rows, col_ok,
                                HEAD_DIM, D_CHUNK, BLOCK_D, ROWS, COLS, PRECISION)
        tl.store(scores_ptr + q_rows[:, None] * N_K_BLOCKS + cols[None, :], scores * scale,
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _select_blocks_kernel(
        scores_ptr, sim_q_ptr, sim_k_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
        H, KV_GROUP, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, N_K_POW2: tl.constexpr,
        IS_CAUSAL: tl.constexpr, PER_HEAD: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """Grid (cdiv(nQ, ROWS), B*H), launched with one warp: the scores written by
        `_pooled_scores_kernel` -> `_select_blocks`. (With more warps Triton splits a row's
        columns across warps, and every row sum of the search then crosses shared memory.)"""
        h, rows, row_ok, cols, col_ok, q_rows, k_rows = _mask_tile(
            tl.program_id(0), 0, tl.program_id(1), H, KV_GROUP, N_Q_BLOCKS, N_K_BLOCKS, ROWS, N_K_POW2)
        scores = tl.load(scores_ptr + q_rows[:, None] * N_K_BLOCKS + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        _select_blocks(scores, rows, row_ok, cols, col_ok, q_rows, k_rows, h,
                       sim_q_ptr, sim_k_ptr, sim_thresh_ptr, cdf_thresh_ptr, sim_thresh, cdf_thresh, lut_ptr, count_ptr,
                       Lq, Lk, N_K_BLOCKS,
                       BLOCK_M, BLOCK_N, ROWS, N_K_POW2, IS_CAUSAL, PER_HEAD, PIVOTS, SEARCH_STEPS)
