"""Launch order of the attention kernels' query-block programs (flash_attention/, sparse_attention/).

Under causality query block i visits i + 1 key blocks, so programs differ up to n-fold in work.
The GPU dispatches programs roughly in launch order. With the query block varying fastest and the
heads one after another, the heaviest block of the last head starts when nearly all other work is
done, and the SMs idle while it finishes: about 27% over the ideal time at 8k tokens and 16 heads
in a list-scheduling model, 11% at 16k. Launching the heaviest blocks of every head first removes
that tail, but then the programs running at once read the keys and values of every head, which
may not fit in L2.

So heads are taken in groups whose keys and values fit a share of L2 (as FlashAttention-3's
scheduler does); inside a group the programs go heaviest query block first, the group's heads
fastest. Without causality every block does the same work and the order stays as it was: query
blocks fastest, one head after another (group size 1, no reversal).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU references work without Triton
    triton = None

# Keys and values of one group of heads must fit this many bytes (H100 / H200 L2: 50 / 60 MB).
L2_BUDGET_BYTES = 32 * 1024 * 1024


def causal_head_group(batch_heads: int, kv_group: int, len_k: int, head_dim: int, elem_bytes: int) -> int:
    """How many (batch, head) rows share one heaviest-first sweep: as many as keep their keys and
    values within L2_BUDGET_BYTES, whole GQA groups at a time, at least one group."""
    kv_bytes = 2 * len_k * head_dim * elem_bytes  # keys and values of one KV head
    kv_heads = max(1, L2_BUDGET_BYTES // max(kv_bytes, 1))
    return max(1, min(batch_heads, kv_heads * kv_group))


if triton is not None:

    @triton.jit
    def query_block_order(n_q_blocks, head_group, IS_CAUSAL: tl.constexpr):
        """(query block, batch * head) of this program of a 1-D grid of n_q_blocks * (batch * heads)
        programs."""
        pid = tl.program_id(0)
        n_bh = tl.num_programs(0) // n_q_blocks
        if IS_CAUSAL:
            span = head_group * n_q_blocks  # programs of one full group
            group = pid // span
            first_bh = group * head_group
            size = tl.minimum(head_group, n_bh - first_bh)  # the last group may be smaller
            rank = pid - group * span
            pid_m = n_q_blocks - 1 - rank // size
            pid_bh = first_bh + rank % size
        else:
            pid_bh = pid // n_q_blocks
            pid_m = pid % n_q_blocks
        return pid_m, pid_bh
