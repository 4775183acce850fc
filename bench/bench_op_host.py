"""Host time of one graphopt op inside a compiled graph, without CUDA graphs.

Method. A module chains `layers` identical blocks; each block is one operation that a graphopt pass
rewrites into one graphopt op (a one-token bf16 linear for fp4_linear and q4_linear; a one-query
GQA attention over a static-cache-style bool mask for the attention pass's decode kernel). Each
variant compiles the module twice, with `--layers` blocks (default 4 and 24), mode=None (no CUDA
graphs), and times calls issued back to back without a sync (bench.common.host_us): the GPU work
of a block is a few microseconds, shorter than the host's, so the wall time per call is the host's
launch path. The difference between the two depths divided by the difference in blocks is the host
time of one block: the per-call costs (the compiled module's prologue) cancel, but a block's
parameter does not (Dynamo guards every parameter, and the compiled wrapper passes each one on).
The `parameter_only` row measures that share: a block holding a parameter whose work Inductor
fuses into one kernel for the whole chain; a block's slope minus it is the operation's own host
time. The two depths are timed in alternation, ROUNDS times, and the median of the rounds' slopes
is reported with their spread: host speed drifts between whole runs by more than the differences
measured here. `rewritten` counts the graphopt rewrites in the deep module (it must equal its
depth). The same is measured with Inductor on the unrewritten module (its own kernels or extern
calls for the same work), the baseline a user would otherwise have. `launches_per_block`: kernel
launches per block, from the profiler.

    python bench/bench_op_host.py          # writes op_host.json to $OUT, else bench/out/
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import host_us, print_table, write_json  # noqa: E402

CALLS = 300
ROUNDS = 9


class LinearChain(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ScaleChain(nn.Module):
    """`layers` elementwise scalings, each by its own parameter: Inductor fuses them into one
    kernel, so the slope over depth is what a block's parameter costs the call (Dynamo's guard on it,
    its pass through the compiled wrapper) with no operation of its own to launch."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(width) + 0.5) for _ in range(layers))

    def forward(self, x):
        for scale in self.scales:
            x = x * scale
        return x


class DecodeAttentionChain(nn.Module):
    """`layers` one-query attention calls over the same static cache (GQA 32/8, D 128), each
    output feeding the next call's query, as a decode step's layers do."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers

    def forward(self, q, k, v, mask):
        for _ in range(self.layers):
            q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return q


class CausalAttentionChain(nn.Module):
    """`layers` hand-written causal attentions (the form the attention pass lowers), each output the
    next one's query."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers

    def forward(self, q, k, v):
        length = q.shape[-2]
        mask = torch.full((length, length), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        for _ in range(self.layers):
            q = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask, -1) @ v
        return q


def workloads(width: int, cache: int):
    """name -> (module factory(layers), inputs, graphopt options)."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, 1, width, device=dev, dtype=dt)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=dt)
    k, v = (torch.randn(1, 8, cache, 128, device=dev, dtype=dt) for _ in range(2))
    mask = torch.zeros(1, 1, 1, cache, device=dev, dtype=torch.bool)
    mask[..., : cache // 2] = True
    linear = lambda n: LinearChain(n, width).to(dev, dt)  # noqa: E731
    return {
        "parameter_only": (lambda n: ScaleChain(n, width).to(dev, dt), (x,), {}),
        "fp4_linear": (linear, (x,), dict(passes={"fp4_linear": True}, force=True)),
        "q4_linear": (linear, (x,), dict(passes={"q4_linear": True}, force=True)),
        "decode_attention": (DecodeAttentionChain, (q, k, v, mask), dict(attention_backend="triton_decode")),
        "attention_cudnn": (CausalAttentionChain, tuple(torch.randn(1, 8, 64, 128, device=dev, dtype=dt) for _ in range(3)),
                            dict(attention_backend="cudnn")),
    }


def launches_per_call(fn) -> float:
    """Kernel launches the host makes in one call (the profiler's runtime launch events)."""
    from torch.profiler import ProfilerActivity, profile

    calls = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    return sum(e.count for e in prof.key_averages() if e.key in names) / calls


def compiled_call(module: nn.Module, inputs, backend, inductor_patches: dict):
    """The compiled module's call on `inputs`, warmed up; `inductor_patches` are Inductor config
    values in force while it compiles (the first calls)."""
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad(), torch._inductor.config.patch(inductor_patches):
        for _ in range(3):
            compiled(*inputs)

    def run():
        with torch.no_grad():
            return compiled(*inputs)
    return run


def slope_us(shallow_run, deep_run, blocks: int) -> tuple[float, float, float, float]:
    """(median host us per block, its min and max over the rounds, the deep call's median us): the
    two depths timed in alternation, one slope per round."""
    slopes, deep_us = [], []
    for _ in range(ROUNDS):
        t0, t1 = host_us(shallow_run, CALLS, repeats=1), host_us(deep_run, CALLS, repeats=1)
        slopes.append((t1 - t0) / blocks)
        deep_us.append(t1)
    return statistics.median(slopes), min(slopes), max(slopes), statistics.median(deep_us)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,24", help="the two chain depths, comma separated")
    parser.add_argument("--width", type=int, default=1024, help="linear layers' width")
    parser.add_argument("--cache", type=int, default=640, help="attention's key length")
    parser.add_argument("--blocks", default=None, help="comma list of the blocks to time (default all)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_op_host.py measures CUDA launches and needs a GPU; none is visible here.")
        return 0
    import graphopt

    shallow, deep = (int(n) for n in opts.layers.split(","))
    rows = []
    blocks = workloads(opts.width, opts.cache)
    chosen = opts.blocks.split(",") if opts.blocks else list(blocks)
    unknown = sorted(set(chosen) - set(blocks))
    if unknown:
        parser.error(f"unknown blocks {unknown}; valid choices: {', '.join(blocks)}")
    for name in chosen:
        factory, inputs, options = blocks[name]
        # graphopt compiles with static_launch_user_defined_triton_kernels (Inductor's own launcher
        # for its triton_ops' kernels, where this torch has it)
        variants = [("inductor", "inductor", {}), ("graphopt", graphopt.backend(**options), {})]
        for label, backend, patches in variants:
            torch._dynamo.reset()
            shallow_run, deep_run = (compiled_call(factory(n), inputs, backend, patches) for n in (shallow, deep))
            per_block, lo, hi, deep_us = slope_us(shallow_run, deep_run, deep - shallow)
            launches = (launches_per_call(deep_run) - launches_per_call(shallow_run)) / (deep - shallow)
            rewritten = (sum(graphopt.explain(factory(deep), *inputs, **options).counts.values())
                         if label != "inductor" else None)
            rows.append({"block": name, "backend": label, "rewritten": rewritten, f"call_us_{deep}": deep_us,
                         "per_block_us": per_block, "per_block_min_us": lo, "per_block_max_us": hi,
                         "launches_per_block": launches})
            print(rows[-1], flush=True)
    print_table("Host time per block inside a compiled graph, mode=None (slope of call time over depth)", rows)
    print(f"wrote {write_json('op_host', rows, options=vars(opts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
