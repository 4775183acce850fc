"""L2 prefetch for the decode kernels (fp4.py, q4.py): ask the memory system for the weight bytes
of a later K step without holding them in registers or shared memory.

A decode program loads one K step of its weight rows, waits, decodes, and loads the next. With few
programs per SM that leaves little of the layer in flight, so the kernels stream below the copy
bandwidth. `prefetch.global.L2` asks for the 128-byte line at an address and returns at once: no
register, no barrier, no completion to wait on. The program's own loads of that step, a few
steps later, then hit L2.

(Hopper's bulk prefetch, `cp.async.bulk.prefetch.L2`, takes one address and a length, but its
address must be warp-uniform: per-row addresses compile to a loop over the distinct rows of each
warp, about 100 instructions per 16 rows.)

A hint only: a kernel's result never depends on it. Under TRITON_INTERPRET=1 (USE_ASM False) it
does nothing.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU references work without Triton
    triton = None

LINE_BYTES = 128

if triton is not None:

    @triton.jit
    def prefetch_lines(ptrs, USE_ASM: tl.constexpr):
        """Prefetch into L2 the cache line that holds each address of the pointer tensor `ptrs`."""
        if USE_ASM:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
