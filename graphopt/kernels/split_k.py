"""Single-launch split-K reduction shared by the decode kernels (fp4.py, q4.py).

Every K split of an output tile adds its fp32 partial sums into a persistent zeroed (M, N) buffer
with atomics, then takes a ticket from the tile's arrival counter; the split that arrives last
reads the sums back (atomics, so from L2 where they landed), re-zeroes them and the counter, and
stores sum + bias in the output dtype. One launch per call: no memset and no separate sum kernel.
`finish_split_tile` does this for one tile (fp4's tensor-core and integer-dot decodes, q4's "last"
reduction); fp4's FMA decode keeps up to four 1-D token rows and runs the same steps row by row
(`_finish_row` / `_drain_row`) on the same buffers.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU references work without Triton
    triton = None

# (family, device, M, N) -> (fp32 (M, N) sums, int32 arrival counters), all zero between calls.
# Allocated once per key and never replaced (CUDA graphs keep their addresses). Shared by every
# launch with that key: two such launches must not run concurrently on different streams.
BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(family: str, device: torch.device, m: int, n: int,
                  counters: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The key's buffers, `counters` arrival counters (the most output tiles any of the family's
    tilings of (m, n) has); None when they do not exist yet and a CUDA-graph capture is running
    (a zero fill recorded in the graph would not have run before the next eager call)."""
    key = (family, device, m, n)
    if key not in BUFFERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        BUFFERS[key] = (torch.zeros((m, n), dtype=torch.float32, device=device),
                        torch.zeros((counters,), dtype=torch.int32, device=device))
    return BUFFERS[key]


if triton is not None:

    @triton.jit
    def finish_split_tile(acc, sums_ptrs, out_ptrs, mask, bias_ptrs, bias_mask, counter_ptr, SPLIT_K,
                          HAS_BIAS: tl.constexpr):
        """acc: this split's fp32 partial tile; sums_ptrs / out_ptrs / mask: the same tile in the
        sums buffer and the output; bias_ptrs / bias_mask: broadcastable to the tile (read only
        when HAS_BIAS, by the last split); counter_ptr: this tile's arrival counter."""
        tl.atomic_add(sums_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds precede the counter's release
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last split of this tile: copy out, re-arm
            zero = tl.zeros_like(acc)
            total = tl.atomic_add(sums_ptrs, zero, mask=mask, sem="relaxed")
            tl.store(sums_ptrs, zero, mask=mask)
            if HAS_BIAS:
                total += tl.load(bias_ptrs, mask=bias_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr, 0)
