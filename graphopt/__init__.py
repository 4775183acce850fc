"""graphopt: a torch.compile backend that rewrites transformer subgraphs into fast kernels.

    model = torch.compile(model, backend="graphopt")            # no import of graphopt needed
    model = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}), mode="reduce-overhead")
    report = graphopt.explain(model, *inputs)                    # what was rewritten, and why
    graphopt.export_onnx(model, inputs, "model.onnx")            # the rewritten graph as ONNX
    graphopt.quantize_(model, format="nvfp4")                    # 4-bit weights in place; save_quantized / load_quantized

The public names load on first use, so that `graphopt --help` does not import torch. `import graphopt`
registers the graphopt::* custom ops when torch is already loaded; otherwise the first use of a
public name or of the backend does (`import graphopt.ops` registers them explicitly).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING

# A library's logger: the application's logging configuration decides what is shown.
logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from graphopt.compiler import GraphOptBackend

__version__ = "0.1.0"
__all__ = ["GraphOptConfig", "GraphOptBackend", "backend", "Report", "Decision", "explain", "export_onnx", "tune", "explore_fft",
           "quantize_", "save_quantized", "load_quantized", "QuantizedLinear", "hf_quantization_config", "__version__"]

# Public names and the modules that define them.
_LAZY: dict[str, str] = {
    "GraphOptBackend": "graphopt.compiler",
    "GraphOptConfig": "graphopt.config",
    "Report": "graphopt.explain",
    "explain": "graphopt.explain",
    "export_onnx": "graphopt.onnx_export",
    "Decision": "graphopt.passes.base",
    "quantize_": "graphopt.quant",
    "save_quantized": "graphopt.quant",
    "load_quantized": "graphopt.quant",
    "QuantizedLinear": "graphopt.quant",
    "hf_quantization_config": "graphopt.quant",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'graphopt' has no attribute {name!r}")
    importlib.import_module("graphopt.ops")  # the public API compiles to graphopt::* ops
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Loading a submodule binds it on its package: the graphopt.explain module would hide the
        # explain function for good. The module stays reachable through sys.modules.
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if "torch" in sys.modules:  # code that already uses torch may call torch.ops.graphopt.* right after import
    from graphopt import ops  # noqa: F401,E402


def backend(**options) -> GraphOptBackend:
    """A torch.compile backend carrying graphopt's options (the GraphOptConfig field names):
    torch.compile(model, backend=graphopt.backend(...), mode="reduce-overhead"), or
    transformers.CompileConfig(backend=graphopt.backend(...)). mode="reduce-overhead" means CUDA graphs."""
    from graphopt.compiler import GraphOptBackend

    return GraphOptBackend(**options)


def tune(*args, **kwargs):
    """Per-head sparse-attention thresholds under an L1 budget (see graphopt.sparse_tuning.tune)."""
    from graphopt.sparse_tuning import tune as _tune

    return _tune(*args, **kwargs)


def explore_fft(*args, **kwargs):
    """Where FFT-chain layers beat dense GEMMs, measured beside the cost model (graphopt.fft_explorer)."""
    from graphopt.fft_explorer import explore_fft as _explore

    return _explore(*args, **kwargs)
