"""What the target GPU can do: datasheet peaks, measured ceilings, and device detection.

A `HardwareSpec` holds vendor peak rates (dense, i.e. without 2:4 sparsity). Kernels never reach
a datasheet peak, so the cost model works from *ceilings*: the rates `graphopt calibrate`
measured on this device (a large device-to-device copy, a large bf16 matmul, an empty-kernel
launch), stored as JSON in the user cache directory and keyed by device name. Where no
measurement exists, a ceiling is the peak times a typical achievable fraction
(`DEFAULT_MATRIX_FRACTION`, `DEFAULT_MEMORY_FRACTION`), taken from our H100 reference points
(756 of 989 TFLOP/s for an 8192^3 bf16 matmul; 2.97 of 3.35 TB/s for a copy).

`target=` in the config overrides detection, so the cost model can answer "what would happen on
an RTX 3060" from any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("graphopt")

DEFAULT_MATRIX_FRACTION = 0.76  # 756 / 989 TFLOP/s, H100 bf16 8192^3 (shared/DESIGN.md)
DEFAULT_MEMORY_FRACTION = 0.89  # 2.97 / 3.35 TB/s, H100 device-to-device copy (shared/DESIGN.md)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    bf16_flops: float  # dense tensor-core bf16/fp16 with fp32 accumulate, FLOP/s
    int8_ops: float  # dense tensor-core int8, OP/s
    fp32_flops: float  # plain (non-tensor) fp32, FLOP/s
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    sm_count: int
    shared_memory_per_sm: int  # bytes
    launch_overhead_s: float  # per kernel launch, seconds (host + device), typical
    is_gpu: bool = True
    # (major, minor) CUDA compute capability; None where unknown (the CPU). The attention families
    # were fitted on Hopper (9.0), whose TMA and wgmma our Triton kernels use: see
    # cost_model.HOPPER_FITTED_FAMILIES.
    compute_capability: tuple[int, int] | None = None
    # Host time of one call of a one-kernel torch op (torch.add) called back to back: the unit the
    # cost model prices graphopt ops' host paths in (cost_model.host_paced). Measured on the H100
    # hosts: 11.8 us and 19.5 us; a kernel launch seen from the GPU side
    # (launch_overhead_s) is shorter. `graphopt calibrate` measures it (its launch figure is this).
    host_op_s: float = 12e-6
    # Measured ceilings (None = not calibrated): filled from the calibration cache.
    measured_bf16_flops: float | None = None
    measured_memory_bandwidth: float | None = None
    measured_launch_overhead_s: float | None = None
    # The SPECS entry ("h100"); "" for a GPU that has none. The cost model reads its fitted
    # coefficients by this key (graphopt.cost.coefficients).
    key: str = ""

    @property
    def matrix_ceiling(self) -> float:
        return self.measured_bf16_flops or self.bf16_flops * DEFAULT_MATRIX_FRACTION

    @property
    def int8_ceiling(self) -> float:
        # int8 rate scales with the measured bf16 rate where calibrated (same tensor cores).
        return self.int8_ops * (self.matrix_ceiling / self.bf16_flops)

    @property
    def memory_ceiling(self) -> float:
        return self.measured_memory_bandwidth or self.memory_bandwidth * DEFAULT_MEMORY_FRACTION

    @property
    def launch_overhead(self) -> float:
        return self.measured_launch_overhead_s or self.launch_overhead_s

    @property
    def host_op_overhead(self) -> float:
        return self.measured_launch_overhead_s or self.host_op_s

    @property
    def calibrated(self) -> bool:
        return self.measured_bf16_flops is not None


# Sources (dense, no sparsity):
#  H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 989 TFLOPS (1979 with sparsity),
#    INT8 1979 TOPS, FP32 67 TFLOPS, HBM3 3.35 TB/s; H100 whitepaper: 132 SMs, 50 MB L2,
#    228 KB shared memory per SM.
#  H200 SXM 141GB: NVIDIA H200 datasheet: same compute as H100 SXM, HBM3e 4.8 TB/s; GH100 die:
#    132 SMs, 50 MB L2, 228 KB shared memory per SM.
#  A100 SXM4 80GB: NVIDIA A100 datasheet: BF16 312 TFLOPS, INT8 624 TOPS, FP32 19.5 TFLOPS,
#    HBM2e 2,039 GB/s; A100 whitepaper: 108 SMs, 40 MB L2, 164 KB shared memory per SM.
#  RTX 3060 12GB: NVIDIA Ampere GA102 whitepaper (GeForce rates: FP16 tensor with FP32 accumulate
#    is half the FP16-accumulate rate), scaled to GA106's 28 SMs at 1.777 GHz boost: ~25.4 TFLOPS
#    bf16/fp32-acc, ~102 TOPS INT8, 12.7 TFLOPS FP32; 360 GB/s GDDR6; 3 MB L2; 100 KB shared/SM.
#  RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, Appendix A: FP16/BF16 tensor with FP32
#    accumulate 165.2 TFLOPS, INT8 660.6 TOPS, FP32 82.6 TFLOPS, 1008 GB/s GDDR6X, 72 MB L2,
#    128 SMs, 100 KB shared memory per SM.
# Launch overhead is not a datasheet figure: ~4 us is typical for a CUDA launch from PyTorch on
# Linux; `graphopt calibrate` replaces it with a measurement.
# The generic CPU is a rough 2-core, AVX2 machine like our CI; it exists so that the cost model
# gives CPU answers (no Triton kernels, little to gain from quantized weights) rather than none.
SPECS: dict[str, HardwareSpec] = {
    "h100": HardwareSpec("NVIDIA H100 SXM5 80GB", 989e12, 1979e12, 67e12, 3.35e12, 50 * 2**20, 132, 228 * 1024, 4e-6,
                         compute_capability=(9, 0), key="h100"),
    "h100_pcie": HardwareSpec("NVIDIA H100 PCIe 80GB", 756e12, 1513e12, 51e12, 2.0e12, 50 * 2**20, 114, 228 * 1024,
                              4e-6, compute_capability=(9, 0), key="h100_pcie"),
    "h200": HardwareSpec("NVIDIA H200 SXM 141GB", 989e12, 1979e12, 67e12, 4.8e12, 50 * 2**20, 132, 228 * 1024, 4e-6,
                         compute_capability=(9, 0), key="h200"),
    "a100": HardwareSpec("NVIDIA A100 SXM4 80GB", 312e12, 624e12, 19.5e12, 2.039e12, 40 * 2**20, 108, 164 * 1024, 4e-6,
                         compute_capability=(8, 0), key="a100"),
    "rtx3060": HardwareSpec("NVIDIA GeForce RTX 3060 12GB", 25.4e12, 101.6e12, 12.7e12, 360e9, 3 * 2**20, 28, 100 * 1024,
                            4e-6, compute_capability=(8, 6), key="rtx3060"),
    "rtx4090": HardwareSpec("NVIDIA GeForce RTX 4090", 165.2e12, 660.6e12, 82.6e12, 1008e9, 72 * 2**20, 128, 100 * 1024,
                            4e-6, compute_capability=(8, 9), key="rtx4090"),
    "cpu": HardwareSpec("generic CPU", 0.2e12, 0.2e12, 0.2e12, 40e9, 32 * 2**20, 2, 0, 5e-6, is_gpu=False, key="cpu"),
}

# Substrings of torch.cuda.get_device_name() -> spec key. Order matters (H200 before H100).
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    ("H200", "h200"),
    ("H100 PCIe", "h100_pcie"),
    ("H100", "h100"),
    ("A100", "a100"),
    ("3060", "rtx3060"),
    ("4090", "rtx4090"),
)


def cache_dir() -> Path:
    """Where calibration and measured tables live: $GRAPHOPT_CACHE_DIR, else the XDG cache."""
    explicit = os.environ.get("GRAPHOPT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphopt"


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(device_name: str) -> dict | None:
    path = calibration_path()
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable, or not JSON
        table = None
    entry = table.get(device_name) if isinstance(table, dict) else None
    if entry is None:
        return None
    # Only finite positive numbers count: a hand-edited or damaged file must not break a compile.
    measured = {key: entry.get(key) for key in _CALIBRATED_KEYS} if isinstance(entry, dict) else {}
    valid = {key: float(value) for key, value in measured.items()
             if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0}
    dropped = sorted(set(_CALIBRATED_KEYS) - set(valid))
    if dropped:
        _warn_once(f"calibration file {path}: entry for {device_name!r} has no valid (finite, positive) "
                   f"{', '.join(dropped)}; datasheet-based ceilings are used for those (rerun graphopt calibrate)")
    return valid or None


_CALIBRATED_KEYS = ("bf16_flops", "memory_bandwidth", "launch_overhead_s")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)


def save_calibration(device_name: str, measurement: dict) -> Path:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict):  # a damaged file: start a new table
            table = {}
    table[device_name] = measurement
    path.write_text(json.dumps(table, indent=2, sort_keys=True))
    device_spec.cache_clear()  # the next launch sees the new ceilings
    return path


def _with_calibration(spec: HardwareSpec, device_name: str) -> HardwareSpec:
    measured = load_calibration(device_name)
    if not measured:
        return spec
    return dataclasses.replace(
        spec,
        measured_bf16_flops=measured.get("bf16_flops"),
        measured_memory_bandwidth=measured.get("memory_bandwidth"),
        measured_launch_overhead_s=measured.get("launch_overhead_s"),
    )


def spec_for_device_name(device_name: str) -> HardwareSpec | None:
    for pattern, key in _NAME_PATTERNS:
        if pattern in device_name:
            return SPECS[key]
    return None


@functools.lru_cache(maxsize=None)
def compute_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached: kernel launchers check it on every call, and torch's
    own query costs microseconds each time."""
    import torch

    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, cached for the launchers that size persistent
    grids by it."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def detect(device: "str | None" = None) -> HardwareSpec:
    """Spec of the present CUDA device (with its measured ceilings), or the generic CPU."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
        spec = spec_for_device_name(props.name)
        if spec is None:
            # Unknown GPU: read what the driver tells us; rates come only from calibration. Until
            # then the rates are placeholders, and the spec's name (which decision reasons quote)
            # says so.
            spec = HardwareSpec(
                props.name, 100e12, 200e12, 20e12, 1e12, getattr(props, "L2_cache_size", 0),
                props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 0), 4e-6,
                compute_capability=(props.major, props.minor),
            )
            spec = _with_calibration(spec, props.name)
            if not spec.calibrated:
                _warn_once(f"graphopt has no datasheet rates for {props.name!r}: its cost model uses placeholder "
                           f"ceilings (100 TFLOP/s bf16, 1 TB/s) until `graphopt calibrate` measures this GPU, "
                           f"or target= names a known one ({', '.join(k for k in SPECS if k != 'cpu')})")
                spec = dataclasses.replace(spec, name=f"{props.name} (placeholder rates: run graphopt calibrate)")
            return spec
        return _with_calibration(spec, props.name)
    return SPECS["cpu"]


@functools.lru_cache(maxsize=None)
def device_spec(device_index: int) -> HardwareSpec:
    """detect() for one CUDA device, cached for the kernel launchers (detect() reads the device
    properties and the calibration file each time). save_calibration clears it."""
    return detect(f"cuda:{device_index}")


def get_spec(target: str = "auto", inputs=None) -> HardwareSpec:
    """Spec for a config `target`: "auto" detects, anything else names a table entry. With the
    graph's example `inputs`, "auto" is the device they live on: the generic CPU for a model run
    on the CPU of a GPU host, the right GPU of several."""
    if target == "auto":
        import torch

        devices = {t.device for t in inputs or () if isinstance(t, torch.Tensor)}
        cuda = sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index or 0)
        if cuda:
            return detect(f"cuda:{cuda[0].index or 0}")
        if devices and all(d.type == "cpu" for d in devices):
            return SPECS["cpu"]
        return detect()
    if target not in SPECS:
        raise ValueError(f"unknown target {target!r}; valid choices: auto, {', '.join(SPECS)}")
    spec = SPECS[target]
    # A named target that is also the present device gets its measured ceilings.
    try:
        import torch

        if spec.is_gpu and torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            if spec_for_device_name(name) is spec:
                return _with_calibration(spec, name)
    except Exception:  # detection must never break a compile
        pass
    return spec
