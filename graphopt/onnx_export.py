"""Export of a graphopt-rewritten graph to ONNX, made of standard ops where the standard has them.

`export_onnx(model, example_inputs, path, **options)` captures the model as one graph with
Dynamo (fullgraph), runs the same passes as the backend, and exports the rewritten graph with
`torch.onnx.export(..., dynamo=True)`. Each `graphopt::*` op reaches ONNX through a translation
(an onnxscript function) that its pass registers with `register_onnx_translation`; some ops have
several forms (e.g. the standard FP4 `DequantizeLinear` and a form onnxruntime runs today),
chosen per op with `onnx_forms={"graphopt::fp4_linear": "runnable"}`.

The model is checked with `onnx.checker`, and its IR version is lowered to the smallest one its
opsets need, since onnxruntime (1.31) loads IR versions up to 13 while onnx 1.23 writes 14.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from graphopt.config import GraphOptConfig
from graphopt.hardware import get_spec

# (op overload, form) -> onnxscript function
_TRANSLATIONS: dict[tuple[Any, str], Callable] = {}
DEFAULT_FORM = "standard"
DEFAULT_OPSET = 23  # Attention (23), DFT (20), DequantizeLinear with FLOAT4E2M1 (23)
MAX_IR_VERSION = 13  # what onnxruntime 1.31 loads


def register_onnx_translation(op: Any, form: str = DEFAULT_FORM) -> Callable[[Callable], Callable]:
    """Decorator: `fn` translates `op` (a torch.ops.graphopt.* overload) in the given form."""

    def decorate(fn: Callable) -> Callable:
        _TRANSLATIONS[(op, form)] = fn
        return fn

    return decorate


def translation_table(forms: dict[str, str] | None = None) -> dict[Any, Callable]:
    """{op overload: function} with the requested form per op (by op name) or the standard one."""
    _load_pass_modules()
    forms = forms or {}
    table: dict[Any, Callable] = {}
    for (op, form), fn in _TRANSLATIONS.items():
        wanted = forms.get(_op_name(op), DEFAULT_FORM)
        if form == wanted:
            table[op] = fn
    for op_name, form in forms.items():
        if not any(_op_name(op) == op_name and f == form for op, f in _TRANSLATIONS):
            valid = sorted({f"{_op_name(op)}={f}" for op, f in _TRANSLATIONS})
            raise ValueError(f"no ONNX form {form!r} for {op_name}; valid choices: {', '.join(valid)}")
    return table


def _op_name(op: Any) -> str:
    name = getattr(op, "_name", None) or str(op)
    return name.split(".")[0]


def _load_pass_modules() -> None:
    """Pass modules register their translations at import."""
    from graphopt.passes import REGISTRY

    for target in REGISTRY.values():
        try:
            importlib.import_module(target.split(":")[0])
        except Exception:  # a broken pass must not break export of the others
            pass


class _RewrittenModule(torch.nn.Module):
    """The rewritten graph, with parameters and buffers held as module state (ONNX initializers)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, user_positions: dict[int, int]):
        super().__init__()
        self.gm = gm
        self.user_positions = user_positions
        self.n_inputs = len(example_inputs)
        for i, value in enumerate(example_inputs):
            if i not in user_positions:
                self.register_buffer(f"state_{i}", value.detach() if isinstance(value, torch.Tensor) else value)

    def forward(self, *user_inputs):
        # user_positions maps a graph placeholder to the user's argument: Dynamo orders
        # placeholders by first use, not by the order of the forward's arguments.
        args = [user_inputs[self.user_positions[i]] if i in self.user_positions else getattr(self, f"state_{i}")
                for i in range(self.n_inputs)]
        out = self.gm(*args)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def capture_rewritten(model: torch.nn.Module, example_inputs: tuple, **options) -> tuple[_RewrittenModule, list]:
    """Capture `model` as one graph, run graphopt's passes, and return it as a plain module."""
    config = GraphOptConfig.from_options(options)
    hardware = get_spec(config.target, example_inputs)
    captured: dict[str, Any] = {}

    def capture(gm: fx.GraphModule, inputs: list, **_):
        from graphopt.passes import run_passes

        ctx = run_passes(gm, inputs, config, hardware)
        captured.update(gm=gm, inputs=list(inputs), decisions=ctx.decisions)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(*example_inputs)
    torch._dynamo.reset()
    user_index = {id(t): j for j, t in enumerate(example_inputs)}
    positions = {i: user_index[id(t)] for i, t in enumerate(captured["inputs"]) if id(t) in user_index}
    return _RewrittenModule(captured["gm"], captured["inputs"], positions).eval(), captured["decisions"]


def export_onnx(
    model: torch.nn.Module,
    example_inputs: tuple | torch.Tensor,
    path: str | os.PathLike,
    *,
    onnx_forms: dict[str, str] | None = None,
    opset: int = DEFAULT_OPSET,
    **options,
) -> Path:
    """Run graphopt's passes on `model` and write the rewritten graph to `path` as ONNX."""
    import onnx

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    # The exported graph runs in an ONNX runtime, not through graphopt's ops: their Python launch
    # path is not paid, so the cost model prices GPU time only (unless the caller says otherwise).
    options.setdefault("graph_replay", True)
    rewritten, _ = capture_rewritten(model, tuple(example_inputs), **options)
    table = translation_table(onnx_forms)
    path = Path(path)
    program = torch.onnx.export(
        rewritten, tuple(example_inputs), dynamo=True, opset_version=opset,
        custom_translation_table=table, external_data=False, optimize=True,
    )
    proto = program.model_proto
    needed = onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    proto.ir_version = max(min(proto.ir_version, MAX_IR_VERSION), needed)
    onnx.checker.check_model(proto, full_check=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return path


def run_onnxruntime(path: str | os.PathLike, *inputs: torch.Tensor) -> list:
    """Run an exported model on onnxruntime's CPU provider; returns numpy outputs."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)
