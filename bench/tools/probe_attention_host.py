"""Host time per attention call on the GPU machine, for the cost model's
host-aware choice between a plain SDPA call and a pinned graphopt::attention op.

Each variant is called back to back on a problem with negligible GPU work (B=1, H=1, L=64,
D=128, bf16), so the wall time per call is the host's. Rows: a one-kernel torch op (the launch
overhead unit), F.scaled_dot_product_attention as dispatched, the same call under
sdpa_kernel([backend]), the backend's aten op called directly, and graphopt::attention for each
backend, and graphopt's Triton forward launcher called directly. Prints a table and writes JSON to $GRAPHOPT_BENCH_OUT/probe_attention_host.json."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import graphopt.ops  # noqa: E402,F401
from graphopt.kernels.flash_attention import flash_attention_forward  # noqa: E402
from bench.common import host_us as common_host_us  # noqa: E402

CALLS, ROUNDS = 1000, 7


def host_us(fn) -> float:
    for _ in range(50):  # warm caches and autotuning first
        fn()
    return common_host_us(fn, CALLS, ROUNDS)


def main() -> None:
    q, k, v = (torch.randn(1, 1, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x = torch.randn(64, device="cuda")
    scale = 128 ** -0.5
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    aten = {
        "flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0],
        "cudnn": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False,
                                                                             scale=scale)[0],
        "efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.0, True,
                                                                                     scale=scale)[0],
    }
    rows = {"torch.add (one launch)": host_us(lambda: torch.add(x, 1.0)),
            "F.sdpa as dispatched": host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))}
    for name, backend in backends.items():
        def pinned(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        rows[f"F.sdpa under sdpa_kernel([{name}])"] = host_us(pinned)
        rows[f"aten op ({name}) directly"] = host_us(aten[name])
    for name in ("cudnn", "flash", "efficient", "triton"):
        rows[f"graphopt::attention backend={name}"] = host_us(
            lambda name=name: torch.ops.graphopt.attention(q, k, v, None, scale, True, 1, name))
    with torch.no_grad():
        for name in ("cudnn", "flash", "efficient", "triton"):
            rows[f"graphopt::attention backend={name}, no_grad"] = host_us(
                lambda name=name: torch.ops.graphopt.attention(q, k, v, None, scale, True, 1, name))
        rows["F.sdpa as dispatched, no_grad"] = host_us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
        rows["flash_attention_forward (Triton), no_grad"] = host_us(
            lambda: flash_attention_forward(q, k, v, scale=scale, is_causal=True))
    launch = rows["torch.add (one launch)"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call (median of {ROUNDS} x {CALLS})")
    print(f"{'variant':48s} {'us':>8s} {'launches':>9s}")
    for name, us in rows.items():
        print(f"{name:48s} {us:8.1f} {us / launch:9.1f}")
    out = os.environ.get("GRAPHOPT_BENCH_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe_attention_host.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
