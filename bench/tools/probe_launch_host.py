"""Probe (session 22): where the host time of one graphopt op call goes, layer by layer.

One-token calls with negligible GPU work, issued back to back (bench.common.host_us), so the wall
time per call is the host's. Rows:
  - the layers around a kernel: one torch launch, torch.empty, the current stream;
  - dispatch alone, on a do-nothing op with fp4_linear's 9-argument schema: torch.library.custom_op,
    a torch.library.Library op, and a Library op with a (raising) autograd formula, as graphopt's
    inference ops are defined now;
  - graphopt::fp4_linear and graphopt::q4_linear (4096 -> 4096, one token), through the op and
    through the launcher, with graphopt.kernels.launch's direct launch on and off;
  - each of their Triton launches, recorded on a call and replayed: through the JIT
    (kernel[grid](*args, **meta)), through graphopt.kernels.launch.launch, and through the compiled
    kernel's launcher alone;
  - graphopt::attention on each backend, and the aten SDPA ops called directly;
plus CompiledKernel.__getitem__'s source (the launch API the direct launch relies on) and a
cProfile of each op. Writes probe_launch_host.json (bench.common.write_json)."""
from __future__ import annotations

import cProfile
import inspect
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

import graphopt.ops  # noqa: E402,F401
from bench.common import host_us as common_host_us, write_json  # noqa: E402
from graphopt.kernels import fp4, q4  # noqa: E402
from graphopt.kernels import launch as launch_module  # noqa: E402

CALLS, ROUNDS = 500, 7
ROWS: dict[str, float] = {}


def row(name: str, fn) -> None:
    for _ in range(20):
        fn()
    ROWS[name] = common_host_us(fn, CALLS, ROUNDS)
    print(f"{name:66s} {ROWS[name]:8.1f}", flush=True)


def record_launches(module) -> list:
    """Wrap module.launch; returns the list the launches (kernel, grid, args, meta) go to."""
    calls, real = [], module.launch

    def recording(kernel, grid, *args, **meta):
        calls.append((kernel, grid, args, meta))
        return real(kernel, grid, *args, **meta)
    module.launch = recording
    return calls


def replay(label: str, kernel, grid, args, meta) -> None:
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    row(f"{label}: JIT kernel[grid](*args, **meta)", lambda: kernel[grid3](*args, **meta))
    row(f"{label}: graphopt launch()", lambda: launch_module.launch(kernel, grid3, *args, **meta))
    compiled = kernel[grid3](*args, **meta)
    full = tuple(args) + launch_module._trailing_values(kernel, len(args), meta)
    row(f"{label}: compiled[grid](*all_args)", lambda: compiled[grid3](*full))


def profile(fn, label: str, out: dict) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    out[label] = s.getvalue()


def dispatch_rows(x: torch.Tensor) -> None:
    schema = ("(Tensor x, Tensor codes, Tensor codes_fp4, Tensor scales, Tensor global_scale, Tensor? bias, "
              "int out_features, int in_features, str format) -> Tensor")
    out = torch.empty_like(x)

    def body(x, codes, codes_fp4, scales, global_scale, bias, out_features, in_features, format):
        return out

    @torch.library.custom_op("probe::custom", mutates_args=())
    def custom(x: torch.Tensor, codes: torch.Tensor, codes_fp4: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int,
               format: str) -> torch.Tensor:
        return out.clone()
    lib = torch.library.Library("probe_lib", "DEF")
    lib.define("plain" + schema)
    lib.impl("plain", body, "CompositeExplicitAutograd")
    lib.define("autograd" + schema)
    lib.impl("autograd", body, "CompositeExplicitAutograd")
    torch.library.register_autograd("probe_lib::autograd", lambda ctx, g: None,
                                    setup_context=lambda ctx, inputs, output: None, lib=lib)
    args = (x, x, x, x, x, None, 16, 64, "nvfp4")
    with torch.no_grad():
        row("dispatch, 9 args: custom_op (+ clone)", lambda: torch.ops.probe.custom.default(*args))
        row("dispatch, 9 args: Library op", lambda: torch.ops.probe_lib.plain.default(*args))
        row("dispatch, 9 args: Library op + register_autograd", lambda: torch.ops.probe_lib.autograd.default(*args))
        row("torch.empty_like (the clone above)", lambda: torch.empty_like(x))


def main() -> None:
    print("CompiledKernel.__getitem__ in triton", triton.__version__)
    print(inspect.getsource(CompiledKernel.__getitem__))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"host us per call (median of {ROUNDS} x {CALLS})")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(64, device="cuda")
    row("torch.add (one launch)", lambda: torch.add(y, 1.0))
    row("torch.empty((1, 4096), bf16)", lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda"))
    from triton.runtime.driver import driver
    row("triton driver: current device + stream", lambda: driver.active.get_current_stream(driver.active.get_current_device()))
    dispatch_rows(x)

    profiles: dict[str, str] = {}
    fp4_calls = record_launches(fp4)
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(4096, 4096, device="cuda"), "nvfp4"))
    fargs = (x, w.codes, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4")
    q4_calls = record_launches(q4)
    qw, qs = q4.quantize_weight(torch.randn(4096, 4096, device="cuda"))
    torch.ops.graphopt.fp4_linear(*fargs)
    torch.ops.graphopt.q4_linear(x, qw, qs, None, "fused")
    with torch.no_grad():
        for direct in (True, False):
            launch_module.DIRECT = direct
            tag = "direct launch" if direct else "JIT launch"
            row(f"fp4: graphopt::fp4_linear op, {tag}", lambda: torch.ops.graphopt.fp4_linear.default(*fargs))
            row(f"fp4: fp4_linear_triton, {tag}", lambda: fp4.fp4_linear_triton(
                x, w.codes, w.scales, w.global_scale, None, 4096, 4096, "nvfp4"))
            row(f"q4: graphopt::q4_linear op, {tag}", lambda: torch.ops.graphopt.q4_linear.default(x, qw, qs, None, "fused"))
            row(f"q4: q4_linear_triton, {tag}", lambda: q4.q4_linear_triton(x, qw, qs, None, "fused"))
        launch_module.DIRECT = True
        profile(lambda: torch.ops.graphopt.fp4_linear.default(*fargs), "fp4 op", profiles)
        profile(lambda: torch.ops.graphopt.q4_linear.default(x, qw, qs, None, "fused"), "q4 op", profiles)
    seen = set()
    for family, calls in (("fp4", fp4_calls), ("q4", q4_calls)):
        for kernel, grid, args, meta in reversed(calls):  # the last call of each kernel: the tuned config
            if kernel.fn.__name__ not in seen:
                seen.add(kernel.fn.__name__)
                replay(f"{family} {kernel.fn.__name__}", kernel, grid, args, meta)
    q, k, v = (torch.randn(1, 1, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for backend in ("triton", "cudnn", "flash"):
            row(f"attention op backend={backend}",
                lambda b=backend: torch.ops.graphopt.attention.default(q, k, v, None, 0.088, True, 1, b))
        row("aten cudnn attention directly", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, False, 0.0, True, False, scale=0.088)[0])
        row("aten flash attention directly", lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=0.088)[0])
        profile(lambda: torch.ops.graphopt.attention.default(q, k, v, None, 0.088, True, 1, "cudnn"), "attention cudnn",
                profiles)
    for label, text in profiles.items():
        print(f"==== cProfile: {label} (300 calls)\n{text}")
    print(f"wrote {write_json('probe_launch_host', [{'call': name, 'host_us': us} for name, us in ROWS.items()])}")


if __name__ == "__main__":
    main()
