"""`graphopt calibrate`: measure this GPU's ceilings and store them for the cost model.

Three numbers, each the median of many runs with CUDA events:
- copy bandwidth: a 1 GiB device-to-device copy, counting bytes read plus bytes written;
- bf16 matrix rate: an 8192^3 bf16 matmul (cuBLAS) on random data (zeros run faster);
- launch overhead: the host-visible time per launch of an empty-ish kernel in a long stream of
  launches (what a chain of small kernels pays per kernel).
They are stored as JSON in the user cache directory (graphopt.hardware.calibration_path()), keyed
by device name, and `HardwareSpec` uses them as ceilings from then on.
"""

from __future__ import annotations

import time

import torch

from graphopt.hardware import save_calibration


def measure_copy_bandwidth(nbytes: int = 2**30, device: str = "cuda") -> float:
    """Bytes/s of a device-to-device copy of random data, counting bytes read plus written."""
    from graphopt.hardware.timing import median_ms

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup_ms=50, rep_ms=300, device=device)
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_rate(n: int = 8192) -> float:
    from triton.testing import do_bench

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def measure_launch_overhead(launches: int = 2000) -> float:
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / launches)
    return best


class NoDeviceError(RuntimeError):
    """The command measures a GPU and none is present (the CLI prints it without a traceback)."""


def calibrate(*, attention: bool = True) -> dict:
    """Measure the present GPU and store the result; returns the stored dict."""
    if not torch.cuda.is_available():
        raise NoDeviceError("graphopt calibrate measures a CUDA GPU and none is present; "
                           "on CPU the cost model uses the generic 'cpu' spec (target='cpu')")
    name = torch.cuda.get_device_name()
    result = {
        "memory_bandwidth": measure_copy_bandwidth(),
        "bf16_flops": measure_matmul_rate(),
        "launch_overhead_s": measure_launch_overhead(),
        "torch": torch.__version__,
    }
    path = save_calibration(name, result)
    result["path"] = str(path)
    if attention:
        try:
            from graphopt.passes.attention import calibrate_attention_table

            result["attention_shapes"] = len(calibrate_attention_table())
        except (ImportError, AttributeError) as exc:
            result["attention_shapes"] = f"skipped: {exc}"
    return result
