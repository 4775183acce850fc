"""Export of a graphopt-rewritten graph to ONNX, made of standard ops where the standard has them.

`export_onnx(model, example_inputs, path, **options)` captures the model as one graph with
Dynamo (fullgraph), runs the same passes as the backend, and exports the rewritten graph with
`torch.onnx.export(..., dynamo=True)`. Each `graphopt::*` op reaches ONNX through a translation
(an onnxscript function) that its pass registers with `graphopt.onnx_registry.register_onnx_translation`
(also importable from here); some ops have
several forms (e.g. the standard FP4 `DequantizeLinear` and a form onnxruntime runs today),
chosen per op with `onnx_forms={"graphopt::fp4_linear": "runnable"}`.

The model is checked with `onnx.checker`, and its IR version is lowered to the smallest one its
opsets need, since onnxruntime (1.31) loads IR versions up to 13 while onnx 1.23 writes 14.

Shapes are those of the example inputs unless `dynamic_axes` names dims to keep symbolic, e.g.
`dynamic_axes={0: {0: "batch", 1: "seq"}, 1: {0: "batch", 1: "seq"}}` for (input_ids,
attention_mask): Dynamo then captures those dims as symbols, the passes see symbolic shapes (those
that need static ones decline, with the reason), and the ONNX inputs carry the names. The graph
inputs take the names of the model's forward parameters (`input_ids`, `attention_mask`); the
outputs follow the model's output structure and are named after it: `logits`, then
`present.N.key` and `present.N.value` for a transformers KV cache (`named_outputs`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from graphopt.config import GraphOptConfig
from graphopt.hardware import get_spec
from graphopt.onnx_registry import DEFAULT_FORM
from graphopt.onnx_registry import TRANSLATIONS as _TRANSLATIONS
from graphopt.onnx_registry import register_onnx_translation as _register

# The registry lives in graphopt.onnx_registry (passes register there without importing the
# exporter); the decorator stays importable from here.
register_onnx_translation = _register

DEFAULT_OPSET = 23  # Attention (23), DFT (20), DequantizeLinear with FLOAT4E2M1 (23)
MAX_IR_VERSION = 13  # what onnxruntime 1.31 loads


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
    """The rewritten graph, with parameters and buffers held as module state (ONNX initializers).
    Its outputs are the graph's in `output_order` (indices into the graph's outputs), named
    `output_names`: the model's own output structure (see named_outputs), not Dynamo's order."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, user_positions: dict[int, int],
                 size_sources: dict[int, tuple[int, int]] | None = None, output_order: list[int] | None = None,
                 output_names: list[str] | None = None):
        super().__init__()
        self.gm = gm
        self.user_positions = user_positions
        self.size_sources = size_sources or {}
        self.output_order = output_order
        self.output_names = output_names
        self.n_inputs = len(example_inputs)
        for i, value in enumerate(example_inputs):
            if i not in user_positions and i not in self.size_sources:
                self.register_buffer(f"state_{i}", value.detach() if isinstance(value, torch.Tensor) else value)

    def _graph_input(self, i: int, user_inputs: tuple):
        # user_positions maps a graph placeholder to the user's argument: Dynamo orders
        # placeholders by first use, not by the order of the forward's arguments. A symbolic
        # size placeholder is read off the user's tensor it came from.
        if i in self.user_positions:
            return user_inputs[self.user_positions[i]]
        if i in self.size_sources:
            position, dim = self.size_sources[i]
            return user_inputs[position].shape[dim]
        return getattr(self, f"state_{i}")

    def forward(self, *user_inputs):
        out = self.gm(*[self._graph_input(i, user_inputs) for i in range(self.n_inputs)])
        if self.output_order is not None:
            out = tuple(out[j] for j in self.output_order)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def _cache_pairs(cache: Any) -> list[tuple[Any, Any]] | None:
    """(key, value) per layer of a transformers KV cache (a Cache with .layers, or one with
    key_cache / value_cache), or of the legacy tuple of (key, value) pairs; None for anything else."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)) and all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (list, tuple)) and cache and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)
            for pair in cache):
        return [tuple(pair) for pair in cache]
    return None


def named_outputs(output: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a model's output with stable names, in the order of its structure: a
    transformers ModelOutput by field (`logits`, ...), its KV cache as `present.N.key` and
    `present.N.value`, other sequences by index (`hidden_states.0`), a bare tensor `output`."""
    if isinstance(output, torch.Tensor):
        return [(prefix or "output", output)]
    if prefix in ("past_key_values", "present_key_values") or (not isinstance(output, (Mapping, list, tuple))):
        pairs = _cache_pairs(output)
        if pairs is not None:
            return [(f"present.{i}.{kind}", t) for i, pair in enumerate(pairs) for kind, t in zip(("key", "value"), pair)]
    if isinstance(output, Mapping):  # transformers' ModelOutput is an OrderedDict of its set fields
        items = [(str(key), value) for key, value in output.items()]
    elif isinstance(output, (list, tuple)):
        items = [(str(i) if prefix else f"output_{i}", value) for i, value in enumerate(output)]
    else:
        return []
    return [named for key, value in items for named in named_outputs(value, f"{prefix}.{key}" if prefix else key)]


def _output_order(result: Any, graph_outputs: Sequence) -> tuple[list[int], list[str]] | None:
    """(graph output indices, names) in the order of the model's output structure, matching each
    named tensor to the graph output that is the same object; None when the graph's outputs are
    not exactly the model's tensors (the export then keeps the graph's order and the exporter's names)."""
    index = {id(t): j for j, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    order, names = [], []
    for name, tensor in named_outputs(result):
        j = index.get(id(tensor))
        if j is not None and j not in order:
            order.append(j)
            names.append(name)
    if sorted(order) != list(range(len(graph_outputs))):
        return None
    return order, names


def _check_writable(path: Path) -> None:
    """ValueError, before any work, for an output path that cannot become a file."""
    if path.is_dir():
        raise ValueError(f"the ONNX output path {str(path)!r} is a directory; give a file path, e.g. {str(path / 'model.onnx')!r}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"the ONNX output path {str(path)!r} cannot be created: {str(parent)!r} is a file")
            break


def _check_dynamic_axes(dynamic_axes, example_inputs: tuple) -> dict[int, dict[int, str]]:
    """{input position: {dim: name}} from a mapping or a sequence aligned with the inputs."""
    if dynamic_axes is None:
        return {}
    if isinstance(dynamic_axes, Mapping):
        items = dict(dynamic_axes)
    elif isinstance(dynamic_axes, Sequence) and not isinstance(dynamic_axes, str):
        items = {i: axes for i, axes in enumerate(dynamic_axes) if axes}
    else:
        raise ValueError("dynamic_axes must map input positions to {dim: name}, e.g. {0: {0: 'batch', 1: 'seq'}}, "
                         f"or be a sequence of such dicts aligned with the inputs; got {dynamic_axes!r}")
    checked: dict[int, dict[int, str]] = {}
    sizes: dict[str, tuple[int, int, int]] = {}  # name -> (size, input position, dim) where first given
    for position, axes in items.items():
        if not isinstance(position, int) or not 0 <= position < len(example_inputs) \
                or not isinstance(example_inputs[position], torch.Tensor):
            tensors = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)]
            raise ValueError(f"dynamic_axes: {position!r} is not the position of a tensor input; "
                             f"valid choices: {', '.join(map(str, tensors))}")
        example = example_inputs[position]
        if not isinstance(axes, Mapping):
            raise ValueError(f"dynamic_axes[{position}] must map dims to names, e.g. {{0: 'batch'}}; got {axes!r}")
        for dim, name in axes.items():
            if not isinstance(dim, int) or not -example.dim() <= dim < example.dim():
                raise ValueError(f"dynamic_axes[{position}]: dim {dim!r} is not a dim of input {position} "
                                 f"(shape {tuple(example.shape)}); valid choices: {', '.join(map(str, range(example.dim())))}")
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"dynamic_axes[{position}][{dim}]: the name {name!r} must be a Python identifier, "
                                 "e.g. 'batch'")
            if example.shape[dim] < 2:
                raise ValueError(f"dynamic_axes[{position}][{dim}] ({name!r}): the example input has size "
                                 f"{example.shape[dim]} there; Dynamo fixes sizes 0 and 1, so give an example of size >= 2")
            size, first_position, first_dim = sizes.setdefault(name, (example.shape[dim], position, dim))
            if size != example.shape[dim]:
                raise ValueError(f"dynamic_axes: the name {name!r} is given to dim {first_dim} of input {first_position} "
                                 f"(size {size}) and dim {dim} of input {position} (size {example.shape[dim]}); equal "
                                 "names are one size: give these dims different names or examples of one size")
        checked[position] = {dim % example.dim(): name for dim, name in axes.items()}
    return checked


def _size_sources(gm: fx.GraphModule, positions: dict[int, int]) -> dict[int, tuple[int, int]]:
    """For each symbolic-size placeholder of a dynamic capture, the (user input, dim) it is the
    size of (Dynamo passes free size symbols as graph inputs of their own)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if i in positions and isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(str(size.node.expr), (positions[i], dim))
    sources = {}
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            if str(value.node.expr) not in dims:
                raise ValueError(f"dynamic export: graph input {node.name} ({value}) is not the size of a dim of "
                                 "an input, so the exported model could not compute it")
            sources[i] = dims[str(value.node.expr)]
    return sources


def _fixes_a_dynamic_size(exc: BaseException) -> bool:
    """Whether Dynamo failed because the model's code fixed a size marked dynamic (a constraint
    violation, possibly wrapped by the compile call)."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConstraintViolationError) or str(exc).startswith("Constraints violated"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def capture_rewritten(model: torch.nn.Module, example_inputs: tuple, *, dynamic_axes=None,
                      **options) -> tuple[_RewrittenModule, list]:
    """Capture `model` as one graph, run graphopt's passes, and return it as a plain module.
    dynamic_axes: {input position: {dim: name}}, the dims captured as symbols (see the module
    docstring)."""
    config = GraphOptConfig.from_options(options)
    hardware = get_spec(config.target, example_inputs)
    axes = _check_dynamic_axes(dynamic_axes, example_inputs)
    captured: dict[str, Any] = {}

    def capture(gm: fx.GraphModule, inputs: list, **_):
        from graphopt.passes import run_passes

        ctx = run_passes(gm, inputs, config, hardware, for_export=True)
        captured.update(gm=gm, inputs=list(inputs), decisions=ctx.decisions)

        def run(*args):
            out = gm(*args)
            captured["outputs"] = list(out) if isinstance(out, (tuple, list)) else [out]
            return out

        return run

    # aliases carry the dynamic marks, so the caller's tensors are left as they were
    inputs = tuple(t.detach() if isinstance(t, torch.Tensor) and i in axes else t for i, t in enumerate(example_inputs))
    for position, dims in axes.items():
        torch._dynamo.mark_dynamic(inputs[position], list(dims))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            result = torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    except Exception as exc:
        if axes and _fixes_a_dynamic_size(exc):
            raise ValueError(f"dynamic_axes {axes}: one of these sizes was fixed during capture (typically the "
                             f"model's code branches on it or checks it), so it cannot stay symbolic: {exc}") from exc
        raise
    finally:
        torch._dynamo.reset()
    user_index = {id(t): j for j, t in enumerate(inputs)}
    positions = {i: user_index[id(t)] for i, t in enumerate(captured["inputs"]) if id(t) in user_index}
    sources = _size_sources(captured["gm"], positions) if axes else {}
    order, names = _output_order(result, captured.get("outputs", [])) or (None, None)
    module = _RewrittenModule(captured["gm"], captured["inputs"], positions, sources, order, names)
    return module.eval(), captured["decisions"]


def _input_names(model: torch.nn.Module, count: int) -> list[str] | None:
    """The names of the model's first `count` forward parameters, or None (e.g. *args)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params[:count] if p.kind in positional]
    return names if len(names) == count else None


def export_onnx(
    model: torch.nn.Module,
    example_inputs: tuple | torch.Tensor,
    path: str | os.PathLike,
    *,
    onnx_forms: dict[str, str] | None = None,
    opset: int = DEFAULT_OPSET,
    dynamic_axes: Mapping[int, Mapping[int, str]] | Sequence | None = None,
    **options,
) -> Path:
    """Run graphopt's passes on `model` and write the rewritten graph to `path` as ONNX.
    dynamic_axes: {input position: {dim: name}} to keep symbolic (see the module docstring);
    equal names are one size."""
    import onnx

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    # The exported graph runs in an ONNX runtime, not through graphopt's ops: their Python launch
    # path is not paid, so the cost model prices GPU time only (unless the caller says otherwise).
    options.setdefault("graph_replay", True)
    axes = _check_dynamic_axes(dynamic_axes, example_inputs)
    path = Path(path)
    _check_writable(path)
    rewritten, _ = capture_rewritten(model, example_inputs, dynamic_axes=axes, **options)
    table = translation_table(onnx_forms)
    dynamic_shapes = None
    if axes:
        from torch.export import Dim

        dims = {name: Dim(name) for per_input in axes.values() for name in per_input.values()}
        # one entry for forward's *user_inputs: a {dim: Dim} per input (None: static)
        dynamic_shapes = (tuple({d: dims[n] for d, n in axes[i].items()} if i in axes else None
                                for i in range(len(example_inputs))),)
    with warnings.catch_warnings():
        # Two inputs sharing an axis name (batch of ids and mask) make the exporter say the name
        # "will not be used"; the ONNX dims carry it all the same (tests/test_onnx_export.py).
        warnings.filterwarnings("ignore", message=r".*The axis name: \w+ will not be used")
        program = torch.onnx.export(
            rewritten, example_inputs, dynamo=True, opset_version=opset, input_names=_input_names(model, len(example_inputs)),
            output_names=rewritten.output_names,
            custom_translation_table=table, external_data=False, optimize=not axes, dynamic_shapes=dynamic_shapes,
        )
    if axes:
        # Constant folding and clean-up only: onnxscript 0.7's opset-23 fusions rewrite a rotary
        # embedding into a RotaryEmbedding whose cos/sin caches keep batch 1 under a symbolic
        # batch, which onnxruntime (1.32) rejects at run time.
        import onnxscript.optimizer

        clean_up = getattr(onnxscript.optimizer, "optimize_ir", None)
        if clean_up is not None:
            clean_up(program.model)
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
