"""graphopt: a torch.compile backend that rewrites transformer subgraphs into fast kernels.

    model = torch.compile(model, backend="graphopt")            # no import of graphopt needed
    report = graphopt.explain(model, *inputs)                    # what was rewritten, and why
    graphopt.export_onnx(model, inputs, "model.onnx")            # the rewritten graph as ONNX
"""

from graphopt import ops  # noqa: F401  (registers the graphopt::* custom ops)
from graphopt.config import GraphOptConfig
from graphopt.explain import Report, explain
from graphopt.onnx_export import export_onnx
from graphopt.passes.base import Decision

__version__ = "0.1.0"
__all__ = ["GraphOptConfig", "Report", "Decision", "explain", "export_onnx", "__version__"]
