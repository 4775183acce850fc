"""The ONNX translations of graphopt's ops: one onnxscript function per (op, form).

Each pass registers the translation of the op it emits here, at import; `graphopt.onnx_export`
reads the table when it exports a rewritten graph. This module imports nothing from graphopt, so
a pass can register without importing the exporter (which runs the passes).
"""

from __future__ import annotations

from typing import Any, Callable

# (op overload, form) -> onnxscript function
TRANSLATIONS: dict[tuple[Any, str], Callable] = {}
DEFAULT_FORM = "standard"


def register_onnx_translation(op: Any, form: str = DEFAULT_FORM) -> Callable[[Callable], Callable]:
    """Decorator: `fn` translates `op` (a torch.ops.graphopt.* overload) in the given form."""

    def decorate(fn: Callable) -> Callable:
        TRANSLATIONS[(op, form)] = fn
        return fn

    return decorate


__all__ = ["DEFAULT_FORM", "TRANSLATIONS", "register_onnx_translation"]
