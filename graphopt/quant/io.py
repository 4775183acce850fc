"""Save and load quantized models: one safetensors file, no quantization when loading.

    graphopt.save_quantized(model, "model.safetensors")
    model = graphopt.load_quantized(config, "model.safetensors", device="cuda")   # or a model to fill

The file holds the model's state_dict (packed buffers of every QuantizedLinear, the dense tensors
of everything else) plus its non-persistent buffers (rotary frequencies and the like, which a model
built on the meta device lacks), and in its metadata under "graphopt" a JSON record: the format and
shape of every quantized layer, the plan it was quantized with, names that alias one tensor (tied
weights), the non-persistent buffer names.

Loading builds the model skeleton on the meta device (no random init, no dense copy of the linear
weights), replaces the recorded layers by empty QuantizedLinear modules, and assigns the file's
tensors, read straight to the target device, in their place. Nothing is quantized or calibrated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from graphopt.quant.linear import QuantizedLinear
from graphopt.quant.quantize import quantized_layers

FILE_VERSION = 1
METADATA_KEY = "graphopt"


def save_quantized(model: nn.Module, path, *, plan=None) -> Path:
    """Write a quantized model (graphopt.quantize_) to `path` (safetensors). plan: the plan it was
    quantized with, recorded in the metadata (the file does not need it to load)."""
    from safetensors.torch import save_file

    layers = quantized_layers(model)
    if not layers:
        raise ValueError("save_quantized: the model has no graphopt QuantizedLinear layers; call graphopt.quantize_ "
                         "first (torch.save or safetensors save a dense model)")
    state = model.state_dict()
    persistent = set(state)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    non_persistent = [name for name in buffers if name not in persistent]
    state.update({name: buffers[name] for name in non_persistent})
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:  # tied weights: one copy in the file
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = tensor.detach().contiguous()
    record = {
        "version": FILE_VERSION,
        "layers": {name: {"format": m.format, "in_features": m.in_features, "out_features": m.out_features,
                          "bias": m.bias is not None} for name, m in layers.items()},
        "formats": sorted({m.format for m in layers.values()}),
        "plan": None if plan is None else str(plan),
        "aliases": aliases,
        "non_persistent": non_persistent,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(record)})
    return path


def read_metadata(path) -> dict:
    """The graphopt record of a file written by save_quantized."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"load_quantized: {str(path)!r} is not a file")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if METADATA_KEY not in metadata:
        raise ValueError(f"load_quantized: {str(path)!r} has no graphopt metadata; it was not written by "
                         "graphopt.save_quantized")
    record = json.loads(metadata[METADATA_KEY])
    if record.get("version") != FILE_VERSION:
        raise ValueError(f"load_quantized: {str(path)!r} has file version {record.get('version')!r}; this graphopt "
                         f"reads version {FILE_VERSION}")
    return record


def load_quantized(model_or_config, path, *, device=None) -> nn.Module:
    """A quantized model from a file written by save_quantized. model_or_config: a transformers
    config (the model is built from it with AutoModelForCausalLM.from_config on the meta device) or
    the model to fill (its recorded linear layers are replaced; tensors it holds are replaced by
    the file's). device: where the tensors go (default: the given model's device, else "cpu").
    Returns the model in eval mode."""
    from safetensors.torch import load_file

    record = read_metadata(path)
    model = _skeleton(model_or_config)
    device = torch.device(device) if device is not None else _device_of(model)
    for name, spec in record["layers"].items():
        _install_layer(model, name, spec)
    tensors = load_file(str(path), device=str(device))
    non_persistent = {name: tensors.pop(name) for name in record["non_persistent"] if name in tensors}
    for alias, name in record["aliases"].items():
        (non_persistent if alias in record["non_persistent"] else tensors)[alias] = \
            non_persistent.get(name, tensors.get(name))
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"load_quantized: {str(path)!r} does not fit this model: {exc}") from None
    for name, tensor in non_persistent.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = tensor
    for alias, name in record["aliases"].items():  # tied parameters: one Parameter again, as the model had
        owner, _, attr = alias.rpartition(".")
        if attr in model.get_submodule(owner)._parameters:
            setattr(model.get_submodule(owner), attr, model.get_parameter(name))
    left = [name for name, t in (*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)) if t.is_meta]
    if left:
        raise ValueError(f"load_quantized: {len(left)} tensor(s) of the model are not in {str(path)!r} and were never "
                         f"materialized: {', '.join(left[:8])}{' ...' if len(left) > 8 else ''}")
    return model.eval()


def _skeleton(model_or_config) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    try:
        from transformers import AutoModelForCausalLM, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency
        PretrainedConfig = ()
    if not isinstance(model_or_config, PretrainedConfig):
        raise TypeError(f"load_quantized takes a model (nn.Module) or a transformers config, got "
                        f"{type(model_or_config).__name__}")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_or_config)


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def _install_layer(model: nn.Module, name: str, spec: dict) -> None:
    """Put an empty QuantizedLinear (meta device: the file's tensors are assigned to it) at `name`."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
        current = getattr(parent, child)
    except AttributeError:
        raise ValueError(f"load_quantized: the file has a quantized layer {name!r}, which this model lacks") from None
    shape = (spec["in_features"], spec["out_features"])
    if isinstance(current, (nn.Linear, QuantizedLinear)):
        if (current.in_features, current.out_features) != shape:
            raise ValueError(f"load_quantized: layer {name!r} is {current.in_features}->{current.out_features} in the "
                             f"model, {shape[0]}->{shape[1]} in the file")
    else:
        raise ValueError(f"load_quantized: {name!r} is a {type(current).__name__} in the model, not a linear layer")
    setattr(parent, child, QuantizedLinear(*shape, spec["format"], spec["bias"], device="meta"))
