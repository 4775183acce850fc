"""The `all_reduce` pass: the all-reduce after a row-parallel linear as one symmetric-memory
kernel (lossless; off by default until measured in a decode loop).

A row-parallel linear (RowwiseParallel: o_proj, down_proj) leaves every rank a partial sum, and its
output hook redistributes the DTensor from Partial() to Replicate(): an all-reduce, which DTensor
runs through NCCL. At decode it moves a few KB, and NCCL's fixed cost is most of its time; PyTorch's
one-shot kernel over symmetric memory has a fraction of it (graphopt/cost/all_reduce.py prices
both). Dynamo records the redistribute as a method call (torch 2.13) or as a closure named
"prim_redistribute" (older torch); both are matched (graphopt.passes.tensor_parallel).

For every redistribute of a DTensor placed Partial() (a sum) on a 1-D mesh to Replicate():
  1. the cost model must predict the one-shot kernel faster than NCCL for its bytes and ranks,
     inside CUDA graphs (the only place it was measured: compile with mode="reduce-overhead" or
     graph_replay=True), and the tensor must fit the symmetric buffer (at most MAX_BUFFER_BYTES,
     float32 or bfloat16, whole 16-byte vectors). A CPU target, or tensors not on a GPU, decline:
     symmetric memory needs CUDA GPUs. force=True takes every match (the op then runs the
     functional all-reduce where it cannot run the one-shot kernel, as on CPU);
  2. the one-shot calls of a graph alternate between two buffers per group (slot 0, 1, 0, ...)
     and come in pairs, so that the alternation also holds across graphs (graphopt/ops/
     all_reduce.py says why); with an odd count the last one is declined and stays DTensor's;
  3. the buffers are allocated and rendezvoused here, at compile time, sized by the largest
     all-reduce of the graph (a collective: every rank compiles the same graph; a check that
     every rank planned the same calls comes first);
  4. the redistribute becomes: the local partial tensor (`to_local`, or the tensor a rewritten
     linear wrapped), one graphopt::all_reduce, then `from_local(..., (Replicate(),))` on the same
     mesh, so everything downstream is unchanged.
RowwiseParallel asks for async_op=True: that changes when DTensor waits for the result, not the
result, and the op returns it complete. Other forms are declined with the reason: other reductions
(max, avg), a row-parallel embedding's masked partial (its reduction applies the lookup's mask),
2-D meshes, a reduce-scatter (Partial -> Shard), a cast (forward_dtype), graphs that need gradients.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.cost.all_reduce import estimate_all_reduce
from graphopt.cost_model import Estimate
from graphopt.ops import all_reduce as ops  # registers graphopt::all_reduce
from graphopt.passes.base import GraphPass, PassContext
from graphopt.passes.fx_utils import erase_unused, fake, shape
from graphopt.passes.tensor_parallel import (from_local_node, is_redistribute, redistribute_arguments, same_on_all_ranks,
                                             wrapped_local)

# Largest all-reduce the symmetric buffers take. Decode's are KBs (hidden size x batch x 2 bytes);
# past a few MB NCCL's bandwidth catches up anyway, and two buffers of this size per group are
# what every rank keeps.
MAX_BUFFER_BYTES = 4 * 2**20
_OP = torch.ops.graphopt.all_reduce.default


@dataclass
class Site:
    """One Partial -> Replicate redistribute and what the pass makes of it."""

    node: fx.Node
    source: fx.Node | None = None  # the Partial DTensor
    problem: str | None = None  # why it is not rewritten, whatever the cost model says
    mesh: Any = None
    group_name: str = ""
    ranks: int = 0
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    numel: int | None = None  # None: symbolic
    before: Estimate | None = None
    after: Estimate | None = None
    slot: int = -1  # the buffer of a planned one-shot call; -1: the functional all-reduce
    rewrite: bool = False
    reason: str = ""

    @property
    def nbytes(self) -> int | None:
        return None if self.numel is None else self.numel * self.dtype.itemsize


def find_sites(ctx: PassContext) -> list[Site]:
    """Every redistribute of a DTensor with a Partial placement, in graph order, with the problem
    that keeps it as it is (None: an all-reduce the op can run)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.tensor import DTensor, Partial, Replicate

    sites = []
    for node in ctx.gm.graph.nodes:
        if not is_redistribute(node) or not node.args:
            continue
        source, value, out = node.args[0], fake(node.args[0]), fake(node)
        placements = tuple(getattr(value, "placements", ()))
        if not isinstance(value, DTensor) or not any(isinstance(p, Partial) for p in placements):
            continue
        site = Site(node, source)
        sites.append(site)
        mesh = value.device_mesh
        arguments = redistribute_arguments(node)
        args, kwargs = arguments if arguments is not None else ((), {})
        target_mesh = args[0] if args else kwargs.get("device_mesh")
        if isinstance(target_mesh, fx.Node):  # a mesh the graph takes as an input
            target_mesh = ctx.example_value(target_mesh) if target_mesh.op == "placeholder" else fake(target_mesh)
        if arguments is None:
            site.problem = "the redistribute's arguments cannot be read from its graph node"
        elif mesh.ndim != 1:
            site.problem = f"a {mesh.ndim}-D device mesh: only 1-D (tensor-parallel) meshes are rewritten"
        elif type(placements[0]) is not Partial:
            site.problem = (f"placement {placements[0]} ({type(placements[0]).__name__}) is not a plain Partial: a "
                            "masked partial (a row-parallel embedding's) applies the lookup's mask in its reduction, "
                            "which a plain sum does not")
        elif placements[0].reduce_op != "sum":
            site.problem = f"a Partial({placements[0].reduce_op!r}) reduction: only sums are rewritten"
        elif not isinstance(out, DTensor) or tuple(out.placements) != (Replicate(),):
            site.problem = (f"redistribute to {tuple(getattr(out, 'placements', ()))}: only Partial() -> Replicate() "
                            "(an all-reduce) is rewritten")
        elif target_mesh is not None and target_mesh != mesh:
            site.problem = "redistribute to another device mesh"
        elif kwargs.get("forward_dtype") is not None or kwargs.get("backward_dtype") is not None:
            site.problem = (f"the redistribute casts its tensor (forward_dtype={kwargs.get('forward_dtype')}, "
                            f"backward_dtype={kwargs.get('backward_dtype')})")
        else:
            local = value._local_tensor
            site.mesh, site.ranks = mesh, mesh.size(0)
            site.group_name = mesh.get_group(0).group_name
            site.dtype, site.device = local.dtype, local.device
            static = shape(_local_of(site))
            site.numel = None if static is None else int(torch.Size(static).numel())
    return sites


def _local_of(site: Site) -> Any:
    """The local partial tensor: the tensor a from_local wrapped (a rewritten linear's output), or
    the DTensor's recorded local value."""
    local = wrapped_local(site.source)
    return local if local is not None else fake(site.source)._local_tensor


def one_shot_problem(site: Site, hw) -> str | None:
    """Why the one-shot kernel cannot take this all-reduce, whatever the cost model says, or None."""
    if site.numel is None:
        return "its size is symbolic: the symmetric buffers are sized at compile time"
    if not hw.is_gpu:
        return f"symmetric memory needs CUDA GPUs (target: {hw.name})"
    if (problem := ops.one_shot_problem(site.dtype, site.nbytes)) is not None:
        return problem
    if site.nbytes > MAX_BUFFER_BYTES:
        return f"{site.nbytes} bytes: larger than the {MAX_BUFFER_BYTES // 2**20} MiB symmetric buffers"
    return None


def decide(site: Site, hw, *, force: bool, graph_replay: bool) -> None:
    """Fill in whether `site` is rewritten (slot 0 pending: a planned one-shot call; -1: the
    functional all-reduce) and why."""
    blocked = one_shot_problem(site, hw)
    if blocked is not None:
        site.rewrite, site.slot = force, -1
        site.reason = (f"forced: the op runs the functional all-reduce ({blocked})" if force else blocked)
        return
    site.before = estimate_all_reduce(hw, site.nbytes, site.ranks, "nccl")
    site.after = estimate_all_reduce(hw, site.nbytes, site.ranks, "one_shot")
    times = f"{site.before.ms:.4f} -> {site.after.ms:.4f} ms"
    size = f"{site.nbytes} bytes over {site.ranks} ranks"
    device_problem = ops.symmetric_memory_problem(site.device)
    if force:
        site.rewrite, site.slot = True, 0
        site.reason = (f"forced: one-shot all-reduce of {size} through symmetric memory (predicted {times})"
                       if device_problem is None else
                       f"forced: all-reduce of {size}, run as the functional all-reduce: {device_problem} "
                       f"(predicted on {hw.name}: {times})")
    elif device_problem is not None:
        site.reason = device_problem
    elif not graph_replay:
        site.reason = (f"the one-shot all-reduce was measured inside CUDA graphs only (predicted {times} there); "
                       "without them its Python launch is not priced: compile with mode='reduce-overhead' or "
                       "graph_replay=True")
    elif site.after.ms < site.before.ms:
        site.rewrite, site.slot = True, 0
        site.reason = (f"one-shot all-reduce of {size} through symmetric memory: predicted "
                       f"{site.before.ms / site.after.ms:.2f}x faster than NCCL ({times})")
    else:
        site.reason = f"cost model predicts NCCL faster for {size} ({times})"


def assign_slots(sites: list[Site]) -> None:
    """Slots of the planned one-shot calls, per group in graph order: 0, 1, 0, 1, ... An odd last
    one is declined (it stays DTensor's NCCL all-reduce), so that every graph's one-shot calls start
    on slot 0 and end on slot 1, and consecutive calls never share a buffer, within a graph or from
    one graph to the next."""
    groups: dict[str, list[Site]] = {}
    for site in sites:
        if site.rewrite and site.slot >= 0:
            groups.setdefault(site.group_name, []).append(site)
    for planned in groups.values():
        if len(planned) % 2:
            last = planned.pop()
            last.rewrite, last.slot = False, -1
            last.reason = ("the one-shot all-reduces of a graph come in pairs (they alternate between two buffers, "
                           f"and the next graph starts on the first): this graph has {len(planned) + 1}, so its last "
                           "stays DTensor's all-reduce")
        for index, site in enumerate(planned):
            site.slot = ops.SLOTS[index % len(ops.SLOTS)]


class AllReducePass(GraphPass):
    name = "all_reduce"
    lossless = True

    def run(self, ctx: PassContext) -> None:
        sites = find_sites(ctx)
        if not sites:
            return
        whole_graph = ctx.differentiated_reason() or (
            "ONNX export: graphopt::all_reduce has no ONNX form" if ctx.for_export else None)
        for site in sites:
            if site.problem is None and whole_graph is None:
                decide(site, ctx.hardware, force=ctx.config.force, graph_replay=not ctx.config.prices_host_path)
            else:
                site.reason = site.problem or whole_graph
        assign_slots(sites)
        self._prepare_buffers(sites)
        for site in sites:
            details = dict(bytes=site.nbytes, ranks=site.ranks, slot=site.slot, group=site.group_name)
            implementation = None
            if site.rewrite:
                self._rewrite(ctx, site)
                one_shot = site.slot >= 0 and ops.symmetric_memory_problem(site.device) is None
                implementation = "one_shot" if one_shot else "functional"
                implementation += f" (slot {site.slot})" if site.slot >= 0 else ""
            ctx.record(self.name, site.rewrite, site.reason, node=site.node, before=site.before, after=site.after,
                       implementation=implementation, **details)

    def _prepare_buffers(self, sites: list[Site]) -> None:
        """Symmetric buffers for the planned one-shot calls on GPUs, per group and dtype: two, each
        holding the largest call. Every rank must have planned the same calls; where one did not,
        no call is rewritten (a mismatch would leave ranks waiting on each other)."""
        planned = [s for s in sites if s.rewrite and s.slot >= 0]
        if not planned:
            return
        first = planned[0]
        digest = zlib.crc32(repr([(s.group_name, str(s.dtype), s.numel, s.slot) for s in sites if s.rewrite]).encode())
        group = first.mesh.get_group(0)
        device = first.device if first.device.type == "cuda" else torch.device("cpu")
        if not same_on_all_ranks(group, device, digest):
            for site in sites:
                if site.rewrite:
                    site.rewrite, site.slot = False, -1
                    site.reason = "the ranks planned different all-reduces for this graph; all stay DTensor's"
            return
        sizes: dict[tuple, tuple[int, torch.device]] = {}
        for site in planned:
            if ops.symmetric_memory_problem(site.device) is None:
                key = (site.group_name, site.dtype)
                sizes[key] = (max(sizes.get(key, (0, site.device))[0], site.numel), site.device)
        for (group_name, dtype), (numel, buffer_device) in sizes.items():
            ops.prepare_buffers(group_name, dtype, numel, buffer_device)

    def _rewrite(self, ctx: PassContext, site: Site) -> None:
        """to_local (or the tensor a rewritten linear wrapped) -> graphopt::all_reduce -> from_local
        as Replicate() on the same mesh, in place of the redistribute."""
        from torch.distributed.tensor import Replicate

        graph = ctx.gm.graph
        local = wrapped_local(site.source)
        with graph.inserting_before(site.node):
            if local is None:
                local = graph.call_method("to_local", (site.source,))
                local.meta["example_value"] = fake(site.source)._local_tensor
            reduced = graph.call_function(_OP, (local, site.group_name, site.slot))
        example = fake(local)
        if isinstance(example, torch.Tensor):
            reduced.meta["example_value"] = example.new_empty(example.shape)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in site.node.meta:
                reduced.meta[key] = site.node.meta[key]
        wrapped = from_local_node(graph, reduced, site.mesh, (Replicate(),), site.node)
        site.node.replace_all_uses_with(wrapped)
        erase_unused([site.node, site.source], graph)


PASS = AllReducePass()

__all__ = ["AllReducePass", "MAX_BUFFER_BYTES", "PASS", "Site", "assign_slots", "decide", "find_sites"]
