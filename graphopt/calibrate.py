"""`graphopt calibrate`: measure this GPU's ceilings and store them for the cost model.

Three numbers, each the median of many runs with CUDA events:
- copy bandwidth: a 1 GiB device-to-device copy, counting bytes read plus bytes written;
- bf16 matrix rate: an 8192^3 bf16 matmul (cuBLAS) on random data (zeros run faster);
- launch overhead: the host-visible time per launch of an empty-ish kernel in a long stream of
  launches (what a chain of small kernels pays per kernel).
They are stored as JSON in the user cache directory (graphopt.hardware.calibration_path()), keyed
by device name, and `HardwareSpec` uses them as ceilings from then on. Then, unless
`attention=False`, the measured attention table (`calibrate_attention_table`): every attention
implementation timed on a few shapes, which the attention pass prefers to its estimates there.
"""

from __future__ import annotations

import logging
import time

import torch

from graphopt.hardware import save_calibration

log = logging.getLogger("graphopt")


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


# ---------------------------------------------------------------------------------------------
# The measured attention table, which the attention pass reads at compile time
# ---------------------------------------------------------------------------------------------
DEFAULT_CALIBRATION_SHAPES: tuple[tuple[int, int, int, int, int, bool, str], ...] = (
    # (B, H, Hkv, L, D, causal, dtype)
    (1, 32, 32, 1024, 128, True, "bfloat16"),
    (1, 32, 32, 4096, 128, True, "bfloat16"),
    (1, 32, 8, 4096, 128, True, "bfloat16"),
    (2, 32, 32, 4096, 128, False, "bfloat16"),
    (1, 32, 32, 8192, 128, True, "bfloat16"),
    (4, 12, 12, 512, 64, False, "bfloat16"),
)


def _time_ms(fn) -> float:
    try:
        from graphopt.hardware.timing import median_ms

        return float(median_ms(fn))
    except ImportError:
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))


def calibrate_attention_table(shapes=None) -> dict:
    """Time every candidate (naive, triton, SDPA cudnn/flash/efficient) on the present GPU for
    `shapes` ((B, H, Hkv, L, D, causal, dtype) tuples; default DEFAULT_CALIBRATION_SHAPES, no bias)
    and store them with cost_model.record_measured; returns {key: {implementation: ms}}."""
    from graphopt import cost_model
    from graphopt.cost.attention import attention_key
    from graphopt.passes.attention.choose import _SDPA_CANDIDATES, sdpa_applicable

    if not torch.cuda.is_available():
        raise RuntimeError("calibrate_attention_table needs a CUDA device")
    device_name = torch.cuda.get_device_name()
    results: dict[str, dict[str, float]] = {}
    for b, h, hkv, length, d, causal, dtype_name in shapes or DEFAULT_CALIBRATION_SHAPES:
        dt = getattr(torch, dtype_name) if isinstance(dtype_name, str) else dtype_name
        q = torch.randn(b, h, length, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, length, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, length, d, device="cuda", dtype=dt)
        groups = h // hkv
        scale = d ** -0.5
        timings: dict[str, float] = {}

        def naive():
            kk = k.repeat_interleave(groups, 1) if groups > 1 else k
            vv = v.repeat_interleave(groups, 1) if groups > 1 else v
            s = (q @ kk.transpose(-2, -1)) * scale
            if causal:
                s = s.masked_fill(~torch.ones(length, length, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            return s.float().softmax(-1).to(dt) @ vv

        candidates = {"naive": naive}
        for backend in ("triton", *_SDPA_CANDIDATES):
            if backend != "triton" and not sdpa_applicable(backend, dt, d, d, False)[0]:
                continue
            candidates[backend] = (lambda be=backend: torch.ops.graphopt.attention(q, k, v, None, scale, causal, groups, be))
        for name, fn in candidates.items():
            try:
                fn()
                torch.cuda.synchronize()
                timings[name] = _time_ms(fn)
            except Exception as exc:  # one failing candidate must not stop the table
                log.warning("calibrate attention %s at %s failed: %s", name, (b, h, hkv, length, d, causal), exc)
        key = attention_key(b, h, hkv, length, length, d, dt, causal, "none")
        cost_model.record_measured("attention", device_name, key, timings)
        results[key] = timings
    return results


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
            result["attention_shapes"] = len(calibrate_attention_table())
        except (ImportError, AttributeError) as exc:
            result["attention_shapes"] = f"skipped: {exc}"
    return result
