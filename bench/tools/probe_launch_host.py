"""Probe (session 22): where the host time of one graphopt op call goes, layer by layer.

One-token calls with negligible GPU work, issued back to back (bench.common.host_us), so the wall
time per call is the host's. For the FP4 and Q4 linears (4096 -> 4096, one token) and the Triton
flash-attention kernel, the Triton launches are recorded on the first call, then replayed:
  - through the JIT launcher (kernel[grid](*args, **meta), what the launchers do now);
  - through the compiled kernel's own launcher (compiled[grid](*all_args), no re-specialization);
plus the layers around them: the custom op, the launcher's Python, torch.empty, the current
stream, and an empty custom op against an op defined with torch.library.Library. Also prints
CompiledKernel.__getitem__'s source (the launch API the fast path relies on) and a cProfile of
each op (the flash-attention kernel is autotuned, so only its op is timed). Writes $GRAPHOPT_BENCH_OUT/probe_launch_host.json."""
from __future__ import annotations

import cProfile
import inspect
import io
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

import graphopt.ops  # noqa: E402,F401
from bench.common import host_us as common_host_us  # noqa: E402
from graphopt.kernels import fp4, q4  # noqa: E402

CALLS, ROUNDS = 500, 7


def host_us(fn) -> float:
    for _ in range(20):
        fn()
    return common_host_us(fn, CALLS, ROUNDS)


class Recorder:
    """Stands in for a @triton.jit kernel in its module: forwards launches, keeps the last one."""

    def __init__(self, jit):
        self.jit, self.last = jit, None

    def __getattr__(self, name):
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        def run(*args, **meta):
            compiled = self.jit[grid](*args, **meta)
            self.last = (grid, args, meta, compiled)
            return compiled
        return run


def record(module, names):
    recorders = {}
    for name in names:
        recorders[name] = Recorder(getattr(module, name))
        setattr(module, name, recorders[name])
    return recorders


def replays(rec: Recorder, label: str, rows: dict) -> None:
    grid, args, meta, compiled = rec.last
    jit = rec.jit
    tail = jit.arg_names[len(args):]
    defaults = {p.name: p.default for p in inspect.signature(jit.fn).parameters.values()}
    full = tuple(args) + tuple(meta.get(n, defaults.get(n)) for n in tail)
    rows[f"{label}: JIT launch, args prebuilt"] = host_us(lambda: jit[grid](*args, **meta))
    rows[f"{label}: compiled[grid](*all_args)"] = host_us(lambda: compiled[grid](*full))
    from triton.runtime.driver import driver
    dev = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev)
    compiled._init_handles()
    g = tuple(grid) + (1,) * (3 - len(grid))
    try:
        from triton import knobs
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except ImportError:
        enter = leave = None
    rows[f"{label}: compiled.run, stream prefetched"] = host_us(
        lambda: compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, enter, leave,
                             *full))


def profile(fn, label: str, out: dict) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    out[label] = s.getvalue()


def main() -> None:
    rows: dict[str, float] = {}
    print("CompiledKernel.__getitem__ in triton", triton.__version__)
    print(inspect.getsource(CompiledKernel.__getitem__))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(64, device="cuda")
    rows["torch.add (one launch)"] = host_us(lambda: torch.add(y, 1.0))
    rows["torch.empty((1, 4096), bf16)"] = host_us(lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda"))
    rows["torch.cuda.current_stream()"] = host_us(lambda: torch.cuda.current_stream())
    from triton.runtime.driver import driver
    rows["triton driver current device + stream"] = host_us(
        lambda: driver.active.get_current_stream(driver.active.get_current_device()))

    @torch.library.custom_op("probe::empty_like", mutates_args=())
    def probe_empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)
    probe_empty.register_fake(lambda t: torch.empty_like(t))
    lib = torch.library.Library("probe_lib", "DEF")
    lib.define("empty_like(Tensor t) -> Tensor")
    lib.impl("empty_like", lambda t: torch.empty_like(t), "CompositeExplicitAutograd")
    rows["torch.empty_like"] = host_us(lambda: torch.empty_like(x))
    rows["custom_op: empty_like"] = host_us(lambda: torch.ops.probe.empty_like.default(x))
    rows["Library op: empty_like"] = host_us(lambda: torch.ops.probe_lib.empty_like.default(x))
    with torch.no_grad():
        rows["custom_op: empty_like, no_grad"] = host_us(lambda: torch.ops.probe.empty_like.default(x))
        rows["Library op: empty_like, no_grad"] = host_us(lambda: torch.ops.probe_lib.empty_like.default(x))

    profiles: dict[str, str] = {}
    # FP4, one token
    fp4_recs = record(fp4, ["_fp4_gemv_int_kernel", "_fp4_gemv_words_kernel", "_fp4_gemv_words_mma_kernel"])
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(4096, 4096, device="cuda"), "nvfp4"))
    fargs = (x, w.codes, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4")
    torch.ops.graphopt.fp4_linear(*fargs)
    with torch.no_grad():
        rows["fp4: graphopt::fp4_linear op"] = host_us(lambda: torch.ops.graphopt.fp4_linear.default(*fargs))
        rows["fp4: fp4_linear_triton"] = host_us(lambda: fp4.fp4_linear_triton(
            x, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4"))
        profile(lambda: torch.ops.graphopt.fp4_linear.default(*fargs), "fp4 op", profiles)
    for name, rec in fp4_recs.items():
        if rec.last is not None:
            replays(rec, f"fp4 {name}", rows)
    # Q4, one token
    q4_recs = record(q4, ["_q4_gemv_kernel", "_q4_gemm_kernel", "_splitk_sum_kernel"])
    qw, qs = q4.quantize_weight(torch.randn(4096, 4096, device="cuda"))
    torch.ops.graphopt.q4_linear(x, qw, qs, None, "fused")
    with torch.no_grad():
        rows["q4: graphopt::q4_linear op"] = host_us(lambda: torch.ops.graphopt.q4_linear.default(x, qw, qs, None, "fused"))
        rows["q4: q4_linear_triton"] = host_us(lambda: q4.q4_linear_triton(x, qw, qs, None, "fused"))
        profile(lambda: torch.ops.graphopt.q4_linear.default(x, qw, qs, None, "fused"), "q4 op", profiles)
    for name, rec in q4_recs.items():
        if rec.last is not None:
            replays(rec, f"q4 {name}", rows)
    # attention, Triton kernel and cuDNN
    q, k, v = (torch.randn(1, 1, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for backend in ("triton", "cudnn", "flash"):
            rows[f"attention op backend={backend}"] = host_us(
                lambda b=backend: torch.ops.graphopt.attention.default(q, k, v, None, 0.088, True, 1, b))
        rows["aten cudnn attention directly"] = host_us(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, False, 0.0, True, False, scale=0.088)[0])
        rows["aten flash attention directly"] = host_us(lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=0.088)[0])
        profile(lambda: torch.ops.graphopt.attention.default(q, k, v, None, 0.088, True, 1, "triton"), "attention triton",
                profiles)
        profile(lambda: torch.ops.graphopt.attention.default(q, k, v, None, 0.088, True, 1, "cudnn"), "attention cudnn",
                profiles)

    launch = rows["torch.add (one launch)"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"host us per call (median of {ROUNDS} x {CALLS})")
    for name, us in rows.items():
        print(f"{name:62s} {us:8.1f} {us / launch:6.1f}")
    for label, text in profiles.items():
        print(f"==== cProfile: {label} (300 calls)\n{text}")
    out = os.environ.get("GRAPHOPT_BENCH_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe_launch_host.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "host_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
