"""graphopt::all_reduce: the sum of a tensor over the ranks of a process group (the all_reduce pass).

    graphopt::all_reduce(Tensor x, str group_name, int slot) -> Tensor   # x's shape and dtype, contiguous

On CUDA, where the pass prepared a symmetric-memory buffer for (group, x's dtype, slot) at compile
time (`prepare_buffers`) that holds x: PyTorch's one-shot all-reduce,
`torch.ops.symm_mem.one_shot_all_reduce_copy`. One kernel copies x into this rank's buffer, meets
the other ranks at a barrier of signal pads, and sums every rank's buffer into a fresh output.
Otherwise (CPU and gloo, no symmetric memory, slot < 0, x larger than the buffer): the functional
all-reduce and its wait, which is what DTensor runs for the same redistribute.

Two buffers per group and dtype (slots 0 and 1), used alternately by consecutive one-shot calls:
the one-shot kernel has no closing barrier, so a rank that is done may start its next all-reduce,
and overwrite its buffer, while a peer still reads it. A buffer is written again only two calls
later, after the barrier of the call in between, which a peer reaches only once it has finished
reading. The pass keeps the one-shot calls of each graph even in number, so the alternation also
holds from one graph's last call to the next graph's first.

Buffers are allocated and rendezvoused at compile time (a collective: every rank compiles the
same graph in the same order) and live as long as the process: a CUDA graph that recorded a call
holds the buffer's address. A larger request gives later calls a larger pair and keeps the smaller
one for the graphs that recorded it. At call time nothing is allocated but the output, so the op
is safe under CUDA graphs. Inference only: a call that needs a gradient is refused (graphopt.ops).
"""

from __future__ import annotations

import warnings

import torch

# What the one-shot kernel takes: float32 and bfloat16, and byte counts it can move 16 bytes at a
# time (its vector width, which the local input and the buffer must share).
ONE_SHOT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
ONE_SHOT_ALIGNMENT = 16
SLOTS = (0, 1)

# (group name, dtype, slot) -> this rank's symmetric buffer, rendezvoused over the group.
_BUFFERS: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
# Buffers a larger request replaced: a recorded CUDA graph may still read them.
_REPLACED: list[torch.Tensor] = []


def one_shot_problem(dtype: torch.dtype, nbytes: int) -> str | None:
    """Why the one-shot kernel cannot take a tensor of this dtype and size, or None."""
    if dtype not in ONE_SHOT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in ONE_SHOT_DTYPES)
        return f"dtype {str(dtype).removeprefix('torch.')}: the one-shot kernel takes {names}"
    if nbytes <= 0 or nbytes % ONE_SHOT_ALIGNMENT:
        return f"{nbytes} bytes: the one-shot kernel moves multiples of {ONE_SHOT_ALIGNMENT} bytes"
    return None


def symmetric_memory_problem(device: torch.device) -> str | None:
    """Why this process cannot allocate symmetric memory on `device`, or None."""
    if device.type != "cuda":
        return f"the tensors are on {device.type}: symmetric memory needs CUDA GPUs"
    if not torch.distributed.is_available() or not torch.cuda.is_available():
        return "this torch has no CUDA or no torch.distributed: symmetric memory needs both"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is not importable ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return "this torch has no symm_mem.one_shot_all_reduce_copy"
    return None


def prepare_buffers(group_name: str, dtype: torch.dtype, numel: int, device: torch.device) -> int:
    """Both slots' buffers for (group, dtype) on `device`, holding at least `numel` elements:
    allocated and rendezvoused where the current pair is smaller. A collective: every rank of the
    group calls it with the same arguments. Returns the elements each buffer holds."""
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed on older torch; a deprecated no-op on newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    for slot in SLOTS:
        key = (group_name, dtype, slot)
        current = _BUFFERS.get(key)
        if current is not None and current.numel() >= numel and current.device == device:
            continue
        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        if current is not None:
            _REPLACED.append(current)
        _BUFFERS[key] = buffer
    return _BUFFERS[(group_name, dtype, SLOTS[0])].numel()


def buffer_for(x: torch.Tensor, group_name: str, slot: int) -> torch.Tensor | None:
    """The view of the prepared buffer a one-shot call on x uses (x's shape, from the buffer's
    start), or None where the call runs the functional all-reduce."""
    if slot < 0 or not x.is_cuda:
        return None
    buffer = _BUFFERS.get((group_name, x.dtype, slot))
    if buffer is None or buffer.device != x.device or x.numel() > buffer.numel():
        return None
    if one_shot_problem(x.dtype, x.numel() * x.element_size()) is not None:
        return None
    return buffer[: x.numel()].view(x.shape)


@torch.library.custom_op("graphopt::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str, slot: int) -> torch.Tensor:
    x = x.contiguous()
    buffer = buffer_for(x, group_name, slot)
    if buffer is not None:
        if x.data_ptr() % ONE_SHOT_ALIGNMENT:  # the kernel needs x aligned as the buffer is
            x = x.clone()
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, x, "sum", group_name)
    reduced = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


@all_reduce.register_fake
def _all_reduce_fake(x, group_name, slot):
    return x.new_empty(x.shape)


__all__ = ["ONE_SHOT_DTYPES", "SLOTS", "all_reduce", "buffer_for", "one_shot_problem", "prepare_buffers",
           "symmetric_memory_problem"]
