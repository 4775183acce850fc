"""GGUF files (llama.cpp's format, through the `gguf` package) in and out of graphopt, byte for byte.

A GGUF Q4_0 tensor is ggml's block_q4_0 rows: for a weight of torch shape (N, K) the file lists the
dimensions innermost first, ne = [K, N], and holds N rows of K/32 blocks of 18 bytes (fp16 d, 16
bytes of nibbles) -- exactly graphopt.kernels.q4's quantize_q4_0 layout [N, K/32, 18]. Reading
packs those bytes into the kernel layout (pack_q4_0, lossless) and writing unpacks them
(unpack_q4_0, its exact inverse): nothing is quantized either way.

    read_q4_0(path)                       {tensor name: uint8 [*rows, K/32, 18]} of every Q4_0 tensor
    graphopt.quant.save_gguf(model, path)  every q4_0 QuantizedLinear as Q4_0, other float tensors as
                                          F32 / F16 / BF16 (as they are in the model)
    graphopt.quant.load_gguf(model, path)  Q4_0 tensors -> q4_0 QuantizedLinear layers of the model,
                                          F32 / F16 / BF16 tensors copied into its parameters

Names (`names=`): "auto" uses llama.cpp's tensor names where the `gguf` package knows the model's
architecture (config.model_type, e.g. "llama": blk.0.attn_q.weight, token_embd.weight, output.weight),
else the state-dict names; "state_dict" keeps the state-dict names; a dict maps state-dict names
(a quantized layer's as "<module path>.weight") to file names. For LLaMA, llama.cpp orders the rows
of attn_q / attn_k per head differently from transformers (its converter permutes them for its
rotary embedding); Q4_0 blocks are per row, so save_gguf / load_gguf permute the block rows
exactly, as that converter does. The architecture's hyperparameters are written too; a file
llama.cpp runs also needs the tokenizer's metadata, which a transformers model does not carry.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from graphopt.kernels import q4 as q4k
from graphopt.quant.linear import QuantizedLinear

log = logging.getLogger("graphopt")

DENSE_TYPES = ("F32", "F16", "BF16")  # what load_gguf copies into dense parameters besides Q4_0


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a declared dependency
        raise ImportError("GGUF files need the gguf package: pip install 'gguf>=0.10'") from None
    return gguf


def read_q4_0(path) -> dict[str, torch.Tensor]:
    """Every Q4_0 tensor of a GGUF file as ggml block_q4_0 bytes, uint8 [*rows, K/32, 18] in torch
    dimension order (the reverse of GGUF's ne)."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path))
    return {t.name: _blocks(t) for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_0}


def _blocks(tensor) -> torch.Tensor:
    """A reader tensor of type Q4_0 -> uint8 [*rows, K/32, 18]."""
    dims = [int(d) for d in reversed(tensor.shape.tolist())]  # torch order: (..., K)
    data = np.array(tensor.data, dtype=np.uint8, copy=True)  # out of the read-only memory map
    return torch.from_numpy(data).reshape(*dims[:-1], dims[-1] // q4k.QK, q4k.Q4_0_BLOCK_BYTES)


def _name_map(model: nn.Module, names) -> tuple[dict[str, str], str | None]:
    """({state-dict name: file name}, the gguf architecture name or None)."""
    keys = list(_tensors(model))
    if isinstance(names, dict):
        return {k: names.get(k, k) for k in keys}, None
    if names not in ("auto", "state_dict"):
        raise ValueError(f"names={names!r} is not valid; valid choices: 'auto', 'state_dict', or a dict of "
                         "state-dict name -> GGUF tensor name")
    arch = _architecture(model) if names == "auto" else None
    if arch is None:
        return {k: k for k in keys}, None
    gguf = _gguf()
    blocks = int(getattr(model.config, "num_hidden_layers", 0))
    table = gguf.get_tensor_name_map(arch, blocks)
    mapped = {}
    for key in keys:
        name = table.get_name(key, try_suffixes=(".weight", ".bias"))
        mapped[key] = name if name is not None else key
    return mapped, gguf.MODEL_ARCH_NAMES[arch]


def _architecture(model: nn.Module):
    """The gguf MODEL_ARCH of a transformers model whose model_type the package knows, else None."""
    gguf = _gguf()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for arch, name in gguf.MODEL_ARCH_NAMES.items():
        if name == model_type:
            return arch
    return None


def _tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{state-dict name: (owner, what)}: a q4_0 QuantizedLinear as "<path>.weight" (what "q4_0"),
    every other parameter or persistent buffer by its own name (what: the attribute)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, QuantizedLinear):
            if module.format == "q4_0":
                out[f"{prefix}weight"] = (module, "q4_0")
            if module.bias is not None:
                out[f"{prefix}bias"] = (module, "bias")
            continue
        for attr, tensor in list(module._parameters.items()) + [
                (a, b) for a, b in module._buffers.items() if a not in module._non_persistent_buffers_set]:
            if tensor is not None and f"{prefix}{attr}" not in out:
                out[f"{prefix}{attr}"] = (module, attr)
    return out


def _rope_permutation(model: nn.Module, key: str, arch_name: str | None) -> int | None:
    """The head count llama.cpp's converter permutes this tensor's rows with (LLaMA q/k), else None."""
    if arch_name != "llama":
        return None
    config = model.config
    if key.endswith("self_attn.q_proj.weight"):
        return int(config.num_attention_heads)
    if key.endswith("self_attn.k_proj.weight"):
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None


def _permute_rows(rows: torch.Tensor, heads: int, *, inverse: bool = False) -> torch.Tensor:
    """transformers' per-head row order (halves) -> llama.cpp's (interleaved pairs), or back."""
    n = rows.shape[0]
    if inverse:
        return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def save_gguf(model: nn.Module, path, *, names="auto", include_dense: bool = True) -> Path:
    """Write the model's q4_0 layers as GGUF Q4_0 tensors (their bytes exactly, no requantization)
    and, with include_dense, its other parameters and persistent buffers as F32 / F16 / BF16. FP4
    layers have no GGUF form here: a model holding any is refused."""
    gguf = _gguf()
    fp4 = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and m.format != "q4_0"]
    if fp4:
        raise ValueError(f"save_gguf writes q4_0 layers; {len(fp4)} layer(s) are FP4 ({fp4[0]}, ...): quantize with "
                         "format='q4_0'")
    mapping, arch_name = _name_map(model, names)
    writer = gguf.GGUFWriter(str(path), arch_name or "graphopt")
    if arch_name == "llama":
        _write_llama_hparams(writer, model.config)
    written = 0
    for key, (owner, what) in _tensors(model).items():
        if what == "q4_0":
            blocks = q4k.unpack_q4_0(owner.qweight.detach().cpu(), owner.scales.detach().cpu(), owner.in_features)
            heads = _rope_permutation(model, key, arch_name)
            if heads is not None:
                blocks = _permute_rows(blocks, heads)
            rows = blocks.reshape(blocks.shape[0], -1).numpy()  # (N, K/32 * 18)
            writer.add_tensor(mapping[key], rows, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            written += 1
        elif include_dense:
            tensor = getattr(owner, what).detach().cpu()
            if not tensor.is_floating_point():
                continue
            array, raw_dtype = _dense_array(tensor, gguf)
            writer.add_tensor(mapping[key], array, raw_dtype=raw_dtype)
    if not written:
        raise ValueError("save_gguf: the model has no q4_0 QuantizedLinear layers; call graphopt.quantize_(model, "
                         "format='q4_0') first")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _dense_array(tensor: torch.Tensor, gguf) -> tuple:
    """(numpy array, raw_dtype) of a dense tensor in its own precision."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if tensor.dtype == torch.float16:
        return tensor.contiguous().numpy(), None
    return tensor.to(torch.float32).contiguous().numpy(), None


def _write_llama_hparams(writer, config) -> None:
    heads = int(config.num_attention_heads)
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(int(getattr(config, "head_dim", None) or config.hidden_size // heads))
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(int(config.vocab_size))


def load_gguf(model: nn.Module, path, *, names="auto") -> nn.Module:
    """Fill `model` from a GGUF file: each Q4_0 tensor becomes a q4_0 QuantizedLinear at its layer
    (replacing the nn.Linear there; its bytes as they are), each F32 / F16 / BF16 tensor is copied
    into the parameter or buffer of that name. Returns the model."""
    gguf = _gguf()
    mapping, arch_name = _name_map(model, names)
    by_file_name = {v: k for k, v in mapping.items()}
    # Linear layers may not be q4_0 yet: their file names come from "<path>.weight" as for dense weights.
    targets = _tensors(model)
    reader = gguf.GGUFReader(str(path))
    Q4_0 = gguf.GGMLQuantizationType.Q4_0
    dense_types = {getattr(gguf.GGMLQuantizationType, t): t for t in DENSE_TYPES}
    unknown = []
    for tensor in reader.tensors:
        key = by_file_name.get(tensor.name)
        if key is None:
            unknown.append(tensor.name)
            continue
        owner, what = targets[key]
        if tensor.tensor_type == Q4_0:
            if not key.endswith(".weight") or not isinstance(owner, (nn.Linear, QuantizedLinear)):
                raise ValueError(f"load_gguf: Q4_0 tensor {tensor.name!r} maps to {key!r}, which is not a linear "
                                 "layer's weight")
            blocks = _blocks(tensor)
            heads = _rope_permutation(model, key, arch_name)
            if heads is not None:
                blocks = _permute_rows(blocks, heads, inverse=True)
            _install_q4_0(model, key[: -len(".weight")], owner, blocks)
        elif tensor.tensor_type in dense_types:
            _copy_dense(owner, what, key, tensor)
        else:
            raise ValueError(f"load_gguf: tensor {tensor.name!r} is {tensor.tensor_type.name}; graphopt reads Q4_0, "
                             f"{', '.join(DENSE_TYPES)}")
    if unknown:
        log.warning("graphopt load_gguf: %d tensor(s) of %s have no place in the model and were not read: %s",
                    len(unknown), path, ", ".join(unknown[:8]))
    return model


def _install_q4_0(model: nn.Module, path: str, owner: nn.Module, blocks: torch.Tensor) -> None:
    n, k = blocks.shape[0], blocks.shape[1] * q4k.QK
    if (owner.out_features, owner.in_features) != (n, k):
        raise ValueError(f"load_gguf: layer {path!r} is {owner.in_features}->{owner.out_features}, the file's Q4_0 "
                         f"tensor {k}->{n}")
    bias = owner.bias
    device = bias.device if bias is not None else next(
        (t.device for t in (*owner.parameters(), *owner.buffers()) if not t.is_meta), torch.device("cpu"))
    layer = QuantizedLinear(k, n, "q4_0", bias is not None, device="meta")
    qweight, scales = q4k.pack_q4_0(blocks)
    layer._buffers["qweight"], layer._buffers["scales"] = qweight.to(device), scales.to(device)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    parent_name, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)


def _copy_dense(owner: nn.Module, what: str, key: str, tensor) -> None:
    dims = [int(d) for d in reversed(tensor.shape.tolist())]
    raw = torch.from_numpy(np.array(tensor.data, copy=True).reshape(-1).view(np.uint8))  # the bytes, writable
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[tensor.tensor_type.name]
    value = raw.view(dtype).reshape(dims)
    current = getattr(owner, what)
    if tuple(current.shape) != tuple(value.shape):
        raise ValueError(f"load_gguf: {key!r} has shape {tuple(current.shape)} in the model, {tuple(value.shape)} in the file")
    with torch.no_grad():
        current.copy_(value)
