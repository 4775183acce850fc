"""graphopt: a torch.compile backend that rewrites transformer subgraphs into fast kernels.

    model = torch.compile(model, backend="graphopt")            # no import of graphopt needed
    model = torch.compile(model, backend=graphopt.backend(passes={"fp4_linear": True}), mode="reduce-overhead")
    report = graphopt.explain(model, *inputs)                    # what was rewritten, and why
    graphopt.export_onnx(model, inputs, "model.onnx")            # the rewritten graph as ONNX
"""

from graphopt import ops  # noqa: F401  (registers the graphopt::* custom ops)
from graphopt.compiler import GraphOptBackend
from graphopt.config import GraphOptConfig
from graphopt.explain import Report, explain
from graphopt.onnx_export import export_onnx
from graphopt.passes.base import Decision

__version__ = "0.1.0"
__all__ = ["GraphOptConfig", "GraphOptBackend", "backend", "Report", "Decision", "explain", "export_onnx", "tune", "explore_fft", "__version__"]


def backend(**options) -> GraphOptBackend:
    """A torch.compile backend carrying graphopt's options (the GraphOptConfig field names):
    torch.compile(model, backend=graphopt.backend(...), mode="reduce-overhead"), or
    transformers.CompileConfig(backend=graphopt.backend(...)). mode="reduce-overhead" means CUDA graphs."""
    return GraphOptBackend(**options)


def tune(*args, **kwargs):
    """Per-head sparse-attention thresholds under an L1 budget (see graphopt.sparse_tuning.tune)."""
    from graphopt.sparse_tuning import tune as _tune

    return _tune(*args, **kwargs)


def explore_fft(*args, **kwargs):
    """Where FFT-chain layers beat dense GEMMs, measured beside the cost model (graphopt.fft_explorer)."""
    from graphopt.fft_explorer import explore_fft as _explore

    return _explore(*args, **kwargs)
