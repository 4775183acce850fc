"""Host time of one graphopt op inside a compiled graph, without CUDA graphs.

Method. A module chains `layers` identical blocks; each block is one operation that a graphopt pass
rewrites into one graphopt op (a one-token bf16 linear for fp4_linear and q4_linear; a one-query
GQA attention over a static-cache-style bool mask for the attention pass's decode kernel). Each
variant compiles the module twice, with `--layers` blocks (default 4 and 24), mode=None (no CUDA
graphs), and times calls issued back to back without a sync (`timed_us`): the GPU work
of a block is a few microseconds, shorter than the host's, so the wall time per call is the host's
launch path. The difference between the two depths divided by the difference in blocks is the host
time of one block: the per-call costs (the compiled module's prologue) cancel, but a block's
parameter does not (Dynamo guards every parameter, and the compiled wrapper passes each one on).
The `parameter_only` row measures that share: a block holding a parameter whose work Inductor
fuses into one kernel for the whole chain; a block's slope minus it is the operation's own host
time. The two depths are timed in alternation, ROUNDS times, and the median of the rounds' slopes
is reported with their spread: host speed drifts between whole runs by more than the differences
measured here. Each depth compiles a forward with a code object of its own (`with_own_code`), so
neither pays the other's Dynamo guards, and the objects the compiles left are frozen out of the
garbage collector's passes (gc.freeze) before a row is timed, so no row pays for the ones compiled
before it. Every slope is given in wall time and in the calling
thread's CPU time (`_cpu_us` columns): where the two agree, the host was not kept from the thread
and the time is the launch path's own work. `rewritten` counts the graphopt rewrites in the deep
module (it must equal its depth). The same is measured with Inductor on the unrewritten module
(its own kernels or extern calls for the same work), the baseline a user would otherwise have.
`launches_per_block`: kernel launches per block, from the profiler. The `eager_launch` row is this
host's floor: a block of it is one eager `add_` (the dispatcher and one kernel launch), timed the
same way. `--wrappers python,cpp` also compiles each variant with Inductor's C++ wrapper
(`torch._inductor.config.cpp_wrapper`): the generated code that calls the kernels is C++, which
launches each kernel with one driver call and no Python (the `wrapper` column).

    python bench/bench_op_host.py          # writes op_host.json to $OUT, else bench/out/
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import types

# graphopt sets this before its first compile (graphopt.compiler.STATIC_LAUNCH_ENV), for Inductor's
# compile workers, which read it when they start; here the Inductor rows compile first and start them.
os.environ.setdefault("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402

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


def with_own_code(module: nn.Module) -> nn.Module:
    """`module` with a forward whose code object is its own. Dynamo keeps its compiled entries per
    code object and checks the newest entry's guards first: two depths of one class sharing
    `forward` would make every call of the older one fail the newer one's guards first, which
    lowers the slope over depth by that failure's cost."""
    fn = type(module).forward
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    module.forward = types.MethodType(own, module)
    return module


def compiled_call(module: nn.Module, inputs, backend, inductor_patches: dict):
    """The compiled module's call on `inputs`, warmed up; `inductor_patches` are Inductor config
    values in force while it compiles (the first calls)."""
    compiled = torch.compile(with_own_code(module), backend=backend, fullgraph=True)
    with torch.no_grad(), torch._inductor.config.patch(inductor_patches):
        for _ in range(3):
            compiled(*inputs)

    def run():
        with torch.no_grad():
            return compiled(*inputs)
    return run


def timed_us(fn, calls: int) -> tuple[float, float]:
    """(wall us, calling thread's CPU us) per call of `calls` calls issued back to back without a
    sync (one call and a sync before them)."""
    fn()
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    torch.cuda.synchronize()
    return wall / calls * 1e6, cpu / calls * 1e6


def slope_us(shallow_run, deep_run, blocks: int) -> dict[str, float]:
    """Host us per block (median over the rounds, its min and max; wall and thread CPU time) and the
    deep call's median wall us: the two depths timed in alternation, one slope per round. The
    collector's older objects are frozen for the rounds (and thawed after)."""
    walls, cpus, deep_us = [], [], []
    # the collector's passes over everything the earlier compiles left would fall on later rows
    gc.collect()
    gc.freeze()
    try:
        for _ in range(ROUNDS):
            (w0, c0), (w1, c1) = timed_us(shallow_run, CALLS), timed_us(deep_run, CALLS)
            walls.append((w1 - w0) / blocks)
            cpus.append((c1 - c0) / blocks)
            deep_us.append(w1)
    finally:
        gc.unfreeze()
    return {"call_us_deep": statistics.median(deep_us), "per_block_us": statistics.median(walls),
            "per_block_min_us": min(walls), "per_block_max_us": max(walls),
            "per_block_cpu_us": statistics.median(cpus), "per_block_cpu_min_us": min(cpus)}


def eager_launch_row(shallow: int, deep: int) -> dict:
    """The host's floor: eager add_ calls (the dispatcher and one kernel launch each), `shallow` and
    `deep` of them a call, timed like a block."""
    x = torch.randn(1024, device="cuda")

    def adds(n: int):
        def run():
            for _ in range(n):
                x.add_(1.0)
        return run
    return {"block": "eager_launch", "backend": "eager", "wrapper": None, "rewritten": None,
            **slope_us(adds(shallow), adds(deep), deep - shallow), "launches_per_block": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,24", help="the two chain depths, comma separated")
    parser.add_argument("--width", type=int, default=1024, help="linear layers' width")
    parser.add_argument("--cache", type=int, default=640, help="attention's key length")
    parser.add_argument("--blocks", default=None, help="comma list of the blocks to time (default all)")
    parser.add_argument("--wrappers", default="python", help="comma list of Inductor wrapper codegens: python, cpp")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_op_host.py measures CUDA launches and needs a GPU; none is visible here.")
        return 0
    import graphopt

    shallow, deep = (int(n) for n in opts.layers.split(","))
    rows = [eager_launch_row(shallow, deep)]
    print(rows[-1], flush=True)
    blocks = workloads(opts.width, opts.cache)
    chosen = opts.blocks.split(",") if opts.blocks else list(blocks)
    unknown = sorted(set(chosen) - set(blocks))
    if unknown:
        parser.error(f"unknown blocks {unknown}; valid choices: {', '.join(blocks)}")
    wrappers = opts.wrappers.split(",")
    if not wrappers or set(wrappers) - {"python", "cpp"}:
        parser.error(f"--wrappers {opts.wrappers}: valid choices are python, cpp")
    for name, wrapper in ((name, wrapper) for name in chosen for wrapper in wrappers):
        factory, inputs, options = blocks[name]
        patches = {"cpp_wrapper": wrapper == "cpp"}
        for label, backend in (("inductor", "inductor"), ("graphopt", graphopt.backend(**options))):
            torch._dynamo.reset()
            shallow_run, deep_run = (compiled_call(factory(n), inputs, backend, patches) for n in (shallow, deep))
            slopes = slope_us(shallow_run, deep_run, deep - shallow)
            launches = (launches_per_call(deep_run) - launches_per_call(shallow_run)) / (deep - shallow)
            rewritten = (sum(graphopt.explain(factory(deep), *inputs, **options).counts.values())
                         if label != "inductor" else None)
            rows.append({"block": name, "backend": label, "wrapper": wrapper, "rewritten": rewritten, **slopes,
                         "launches_per_block": launches})
            print(rows[-1], flush=True)
    print_table("Host time per block inside a compiled graph, mode=None (slope of call time over depth)", rows)
    print(f"wrote {write_json('op_host', rows, options=vars(opts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
