"""Single-launch split-K reduction shared by the decode kernels (fp4/, q4/).

Every K split of an output tile adds its fp32 partial sums into a zeroed (M, N) buffer with
atomics, then takes a ticket from the tile's arrival counter; the split that arrives last reads the
sums back (atomics, so from L2 where they landed) and stores sum + bias in the output dtype: no
separate sum kernel. `finish_split_tile` does this for one tile (fp4's tensor-core and integer-dot
decodes, q4's "last" reduction); fp4's FMA decode keeps up to four 1-D token rows and runs the same
steps row by row (`_finish_row` / `_drain_row`) on the same buffers. The buffers are allocated
zeroed for each call (`split_buffers`), so nothing outlives a call and a CUDA graph owns its own.
Sums and counters are two allocations, not views of one: a triton_op passes both to a kernel that
writes both, and torch's functionalization of a user-defined Triton kernel rebuilds two mutated
views of one base through an as_strided of one of them, which Inductor then reads past that
view's own buffer: the counters would not start at zero, and a compiled graph's split-K outputs
would be wrong.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU references work without Triton
    triton = None


def split_buffers(device: torch.device, m: int, n: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed buffers for one split-K call: fp32 (m, n) sums and `counters` int32 arrival counters
    (the most output tiles any tiling of (m, n) has), each its own allocation (module docstring)."""
    return (torch.zeros((m, n), dtype=torch.float32, device=device),
            torch.zeros((counters,), dtype=torch.int32, device=device))


if triton is not None:

    @triton.jit
    def arrival_counters(counter_ptr):
        """The arrival counters as int32 (split_buffers allocates them so; the cast keeps a kernel that
        is also handed its output as an unused counter argument compiling)."""
        return counter_ptr.to(tl.pointer_type(tl.int32))

    @triton.jit
    def finish_split_tile(acc, sums_ptrs, out_ptrs, mask, bias_ptrs, bias_mask, counter_ptr, SPLIT_K,
                          HAS_BIAS: tl.constexpr):
        """acc: this split's fp32 partial tile; sums_ptrs / out_ptrs / mask: the same tile in the
        sums buffer and the output; bias_ptrs / bias_mask: broadcastable to the tile (read only
        when HAS_BIAS, by the last split); counter_ptr: this tile's arrival counter."""
        tl.atomic_add(sums_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds precede the counter's release
        arrived = tl.atomic_add(arrival_counters(counter_ptr), 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last split of this tile: copy out
            total = tl.atomic_add(sums_ptrs, tl.zeros_like(acc), mask=mask, sem="relaxed")
            if HAS_BIAS:
                total += tl.load(bias_ptrs, mask=bias_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
