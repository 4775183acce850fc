"""The cost model's fitted coefficients, one data file per measured GPU.

`graphopt/cost/data/<gpu>.json` holds every coefficient the estimates read (kernel-family
efficiencies, per-weight op counts, latencies, host-path units), each with the run it came from:
the GPU it was measured on, the result file under bench/results/, the command that wrote it and
what it was fitted to. The estimates ask `value(hw, name)`; the file is chosen by the spec's key
(`HardwareSpec.key`). A target with no file of its own (never measured: A100, RTX 3060, RTX 4090,
H100 PCIe, the generic CPU, an unknown GPU) reads FALLBACK_GPU's file and is *unvalidated*:
`describe(hw)` says so, and explain prints it.

An entry measured on another GPU than its file's holds that GPU's value unchanged (in h200.json
its `not_refit` says why no run of this GPU refits it); `describe` counts them.

`with_values` gives a spec whose estimates read other values (a refit, or another GPU's file):
the fitting and validation scripts in bench/ use it; a compile never does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DATA_DIR = Path(__file__).resolve().parent / "data"
FALLBACK_GPU = "h100"  # the GPU with the most fitted runs
VALIDATION_FILE = "bench/results/cost_model_validation.json"
_ENTRY_FIELDS = ("value", "measured_on", "source", "command", "fit")


@dataclass(frozen=True)
class Coefficients:
    """One GPU's coefficients: `values[name]` (a float, or a (compute, memory) pair) and the
    provenance entry of each (`entries[name]`: measured_on, source, command, fit)."""

    gpu: str
    path: str
    values: Mapping[str, Any]
    entries: Mapping[str, Mapping[str, Any]]

    def __getitem__(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"{self.path} has no cost-model coefficient {name!r}; it has: "
                           f"{', '.join(sorted(self.values))}") from None

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.values if n.startswith(prefix))


def measured_gpus() -> tuple[str, ...]:
    """GPUs with a data file of their own (their coefficients were measured there)."""
    return _measured_gpus()


@functools.lru_cache(maxsize=None)
def _measured_gpus() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in DATA_DIR.glob("*.json")))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@functools.lru_cache(maxsize=None)
def load(gpu: str) -> Coefficients:
    """The data file of `gpu` (one of measured_gpus()), checked: every entry has a finite value (a
    number or a pair of numbers) and names its run."""
    if gpu not in measured_gpus():
        raise ValueError(f"no cost-model data file for {gpu!r}; valid choices: {', '.join(measured_gpus())}")
    path = DATA_DIR / f"{gpu}.json"
    doc = json.loads(path.read_text())
    values, entries = {}, {}
    for name, entry in doc["coefficients"].items():
        missing = [f for f in _ENTRY_FIELDS if f not in entry]
        if missing:
            raise ValueError(f"{path}: coefficient {name!r} lacks {', '.join(missing)}")
        value = entry["value"]
        if isinstance(value, list) and len(value) == 2 and all(_number(v) for v in value):
            value = (float(value[0]), float(value[1]))
        elif _number(value):
            value = float(value)
        else:
            raise ValueError(f"{path}: coefficient {name!r} has value {value!r}; expected a finite number or a "
                             f"pair of them")
        values[name], entries[name] = value, entry
    return Coefficients(gpu, str(path), values, entries)


# Specs made by with_values: their key -> the coefficients their estimates read.
_DERIVED: dict[str, Coefficients] = {}
_DERIVED_IDS = itertools.count(1)


def data_gpu(hw) -> str:
    """Which GPU's data file the estimates for `hw` read."""
    return hw.key if hw.key in measured_gpus() else FALLBACK_GPU


def for_hardware(hw) -> Coefficients:
    derived = _DERIVED.get(hw.key)
    return derived if derived is not None else load(data_gpu(hw))


def value(hw, name: str):
    """The coefficient `name` the estimates for `hw` use."""
    return for_hardware(hw)[name]


def validated(hw) -> bool:
    """Whether graphopt's cost model was fitted and checked on this hardware (it has a data file)."""
    return hw.key.split("+")[0] in measured_gpus()


def describe(hw) -> str:
    """One line on the coefficients behind the estimates for `hw`, and whether they are validated."""
    if hw.key in _DERIVED:
        return f"cost model for {hw.name}: coefficients {_DERIVED[hw.key].path}"
    gpu = data_gpu(hw)
    path = f"graphopt/cost/data/{gpu}.json"
    if validated(hw):
        entries = load(gpu).entries.values()
        runs = " and ".join(sorted({e["measured_on"].upper() for e in entries}))
        carried = sum(e["measured_on"] != gpu for e in entries)
        other = f", {carried} of {len(entries)} from another GPU's runs" if carried else ""
        return (f"cost model for {hw.name}: coefficients fitted to {runs} runs{other} ({path}; agreement on "
                f"held-out shapes: {VALIDATION_FILE})")
    if not hw.is_gpu:
        return f"cost model for {hw.name}: unvalidated: the rates of a rough 2-core machine, fitted to no measurement"
    return (f"cost model for {hw.name}: unvalidated (graphopt was never measured on it): its estimates use "
            f"{gpu.upper()}-fitted coefficients ({path}) with this target's own rates")


def with_values(hw, values: Mapping[str, Any], label: str):
    """A copy of spec `hw` whose estimates read `values` in place of their data file's (names not in
    `values` keep it). For fitting and validation tools: `label` names the variant."""
    base = for_hardware(hw)
    unknown = sorted(set(values) - set(base.values))
    if unknown:
        raise KeyError(f"unknown cost-model coefficient(s) {', '.join(unknown)}; valid choices: "
                       f"{', '.join(sorted(base.values))}")
    merged = dict(base.values)
    merged.update({n: tuple(v) if isinstance(v, list) else v for n, v in values.items()})
    key = f"{hw.key or 'gpu'}+{label}#{next(_DERIVED_IDS)}"  # each call its own variant
    _DERIVED[key] = Coefficients(base.gpu, f"{base.path} with {label}", merged, base.entries)
    return dataclasses.replace(hw, key=key)


__all__ = ["Coefficients", "DATA_DIR", "FALLBACK_GPU", "data_gpu", "describe", "for_hardware", "load",
           "measured_gpus", "validated", "value", "with_values"]
