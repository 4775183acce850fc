"""Tile choices made once and kept on disk: a JSON file keyed by GPU, versions, the kernels' source,
kernel family and shape, so a new process compiles without timing tiles again, and a changed kernel
is tuned again rather than run on a tile chosen for its predecessor.

The passes tune at compile time (the kernel modules' `tune_*` functions time candidates on the GPU,
each checked first against the reference product with `computes_product`) and hand the chosen tile
to the op as a string argument (`encode` / `decode`): nothing is tuned inside a user's forward.
The file is `$GRAPHOPT_CACHE_DIR/tuning.json`, by default `~/.cache/graphopt/tuning.json`;
GRAPHOPT_CACHE_DIR=off keeps choices in memory only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import tempfile
import threading
import zlib
from pathlib import Path

import torch

_LOCK = threading.Lock()
_MEMORY: dict[str, str] = {}
_LOADED: set[str] = set()


def cache_path() -> Path | None:
    root = os.environ.get("GRAPHOPT_CACHE_DIR")
    if root == "off":
        return None
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "graphopt"
    return base / "tuning.json"


KERNELS_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def device_key(device_index: int) -> str:
    """The GPU and the software a tile choice holds for."""
    props = torch.cuda.get_device_properties(device_index)
    return f"{props.name}|sm{props.major}{props.minor}|{software_key()}"


@functools.lru_cache(maxsize=None)
def software_key() -> str:
    """torch, Triton and graphopt versions and the kernels' source fingerprint: an edited kernel
    (a source checkout between releases, say) keeps one version number but not the same timings."""
    import triton

    return (f"torch {torch.__version__}|triton {triton.__version__}|graphopt {graphopt_version()}"
            f"|kernels {kernels_fingerprint(KERNELS_DIR)}")


def kernels_fingerprint(root: Path) -> str:
    """A CRC-32 over the Python sources under `root` (each file's path relative to it and its bytes,
    in path order)."""
    crc = 0
    for path in sorted(root.rglob("*.py")):
        crc = zlib.crc32(path.relative_to(root).as_posix().encode(), crc)
        crc = zlib.crc32(path.read_bytes(), crc)
    return f"{crc:08x}"


@functools.lru_cache(maxsize=None)
def graphopt_version() -> str:
    """The installed graphopt's version (package metadata: the kernels import nothing of graphopt
    above them), or "unknown" for a source tree that was never installed."""
    try:
        return importlib.metadata.version("graphopt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _load(path: Path) -> None:
    if str(path) in _LOADED:
        return
    _LOADED.add(str(path))
    try:
        _MEMORY.update({k: v for k, v in json.loads(path.read_text()).items() if isinstance(v, str)})
    except (OSError, ValueError):
        pass  # no file yet, or an unreadable one: tune again and rewrite it


def lookup(key: str) -> str | None:
    """The choice stored under `key`, or None."""
    with _LOCK:
        path = cache_path()
        if path is not None:
            _load(path)
        return _MEMORY.get(key)


def store(key: str, value: str) -> None:
    """Keep `value` under `key`, in memory and in the file (written whole, atomically)."""
    with _LOCK:
        _MEMORY[key] = value
        path = cache_path()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            current = {}
            if path.exists():
                try:
                    current = json.loads(path.read_text())
                except ValueError:
                    current = {}
            current[key] = value
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(current, tmp, indent=0, sort_keys=True)
            os.replace(tmp.name, path)
        except OSError:
            pass  # a read-only home: the choice stays in memory


# How far a tile's output may lie from the exact product, as a fraction of the product's largest
# magnitude: fp32 sums in any order, then the rounding to the output dtype (at most 2^-8 of a value
# in bf16, 2^-11 in fp16), with room for a second rounding.
_PRODUCT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


class NoCorrectTile(RuntimeError):
    """No candidate tile of a kernel path built and computed the product for a shape (its default
    included): the caller must not run that path there."""


def computes_product(y: torch.Tensor, reference: torch.Tensor, extra_rtol: float = 0.0) -> bool:
    """Whether a tile's output `y` is the product `reference` (computed in float64 or float32):
    finite, and within fp32 summation order and the rounding to y's dtype of it everywhere, plus
    `extra_rtol` for a rounding the kernel itself states (of its activations, say); tolerances are
    fractions of the reference's largest magnitude. The tuners check every candidate tile with it
    before timing it, so the fastest tile is also a right one."""
    rtol = _PRODUCT_RTOL.get(y.dtype, _PRODUCT_RTOL[torch.bfloat16]) + extra_rtol
    scale = reference.abs().max().item() if reference.numel() else 0.0
    error = (y.double() - reference.double()).abs().max().item() if y.numel() else 0.0
    return bool(torch.isfinite(y).all()) and error <= rtol * scale + 1e-6


def encode(config) -> str:
    """A tile config (a frozen dataclass) as the string an op takes."""
    return json.dumps(dataclasses.asdict(config), separators=(",", ":"), sort_keys=True)


def candidates_tag(configs) -> str:
    """A short fingerprint of the tiles a tuner chose among, for its stored key: a choice made among
    other tiles (before one was added, say) is not reused."""
    return f"{zlib.crc32(','.join(encode(cfg) for cfg in configs).encode()):08x}"


@functools.lru_cache(maxsize=1024)
def decode(cls, text: str):
    """`encode`'s inverse for config class `cls` (cached: ops decode on every eager call)."""
    try:
        return cls(**json.loads(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a {cls.__name__} tile config: {text!r} ({exc})") from None
