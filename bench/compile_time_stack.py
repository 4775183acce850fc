"""Compile time of quantized linears: a stack of --layers bf16 nn.Linear(4096, 4096) + ReLU, one
token, compiled and called once, per variant:

- bf16 under Inductor (the reference);
- graphopt.quantize_ NVFP4, then Inductor (every layer a graphopt::fp4_linear triton_op);
- the same under backend=graphopt.backend();
- graphopt.quantize_ Q4_0, then Inductor;
- bf16 under graphopt.backend(passes={"fp4_linear": True}, force=True) (quantized by the pass).

Each is seconds from torch.compile to the first output (Dynamo, the passes, Inductor, tile tuning
where the tuning file lacks a tile) after torch._dynamo.reset(), and ms per layer. The quantized
NVFP4 stack's compiled output is checked equal to its eager output. --no-ttir-cache unwraps
graphopt.ops.ttir_cache, so Inductor generates the TTIR of every kernel call site, as torch does
by itself.

    python bench/compile_time_stack.py --out $OUT/compile_time_stack_h200.json   # one GPU, ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphopt  # noqa: E402
from bench.common import environment, print_table  # noqa: E402


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4096, 4096, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def compile_seconds(model: nn.Module, backend, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    with torch.no_grad():
        out = compiled(x)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--no-ttir-cache", action="store_true", help="torch's own generate_ttir at every call site")
    parser.add_argument("--out", default=None, help="JSON path")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compile_time_stack.py needs a CUDA GPU (the quantized ops compile to Triton kernels there)")
    graphopt.backend()  # registers graphopt's ops, which installs the TTIR cache
    if opts.no_ttir_cache:
        from torch._higher_order_ops import triton_kernel_wrap

        triton_kernel_wrap.generate_ttir = getattr(triton_kernel_wrap.generate_ttir, "wrapped",
                                                   triton_kernel_wrap.generate_ttir)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def stack(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        with torch.device("cuda"):
            return Stack(opts.layers).to(torch.bfloat16).eval()

    rows = []

    def row(variant: str, model: nn.Module, backend) -> torch.Tensor:
        seconds, out = compile_seconds(model, backend, x)
        rows.append({"variant": variant, "compile_s": seconds, "ms_per_layer": seconds / opts.layers * 1e3})
        print(f"{variant}: {seconds:.2f} s for {opts.layers} layers ({rows[-1]['ms_per_layer']:.0f} ms per layer)", flush=True)
        return out

    row("bf16, Inductor", stack(0), "inductor")
    nvfp4 = graphopt.quantize_(stack(1), format="nvfp4")
    compiled = row("quantize_ nvfp4, Inductor", nvfp4, "inductor")
    with torch.no_grad():
        eager = nvfp4(x)
    rows[-1]["equals_eager"] = bool(torch.equal(compiled, eager))
    print(f"compiled == eager: {rows[-1]['equals_eager']} {(compiled.float() - eager.float()).abs().max().item()}")
    row("quantize_ nvfp4, graphopt", nvfp4, graphopt.backend())
    row("quantize_ q4_0, Inductor", graphopt.quantize_(stack(2), format="q4_0"), "inductor")
    row("bf16 with the fp4_linear pass, graphopt", stack(3), graphopt.backend(passes={"fp4_linear": True}, force=True))
    print_table(f"compile time, {opts.layers} quantized 4096x4096 linears, one token"
                + (", no TTIR cache" if opts.no_ttir_cache else ""), rows)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"environment": environment(), "options": vars(opts), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
