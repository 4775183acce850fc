"""GGUF in and out: Q4_0 tensors written by the gguf package's writer read into graphopt byte for
byte and dequantize to exactly what gguf's own dequantization gives; a model graphopt writes reads
back with gguf's reader byte for byte, and loads back into a model with equal logits."""

import numpy as np
import pytest
import torch

import graphopt
from graphopt.kernels import q4 as q4k
from graphopt.quant import QuantizedLinear, load_gguf, quantized_layers, read_q4_0, save_gguf
from tests.quant.test_quantize import llama_tiny, prompt

gguf = pytest.importorskip("gguf")
Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _write(path, tensors: dict, arch: str = "test"):
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("shape", [(48, 96), (3, 8, 64)], ids=["48x96-odd-blocks", "3x8x64"])
def test_q4_0_tensor_from_the_gguf_writer_reads_byte_for_byte(shape, tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    values.reshape(-1)[7] = 0.4  # an outlier sets its block's scale
    quantized = gguf.quants.quantize(values, Q4_0)  # uint8 (..., K/32 * 18)
    _write(tmp_path / "t.gguf", {"w": (quantized, Q4_0)})

    blocks = read_q4_0(tmp_path / "t.gguf")["w"]
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (*shape[:-1], shape[-1] // 32, 18)
    assert np.array_equal(blocks.reshape(*shape[:-1], -1).numpy(), quantized)
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    (tensor,) = reader.tensors
    assert list(tensor.shape) == list(reversed(shape))  # GGUF lists ne innermost first
    expected = gguf.quants.dequantize(tensor.data, Q4_0)
    assert np.array_equal(q4k.dequantize_q4_0(blocks).numpy(), expected)  # exactly, not approximately
    # graphopt's own ggml quantizer gives the same bytes for the same floats
    assert torch.equal(q4k.quantize_q4_0(torch.from_numpy(values)), blocks)


def test_q4_0_tensor_loads_into_a_linear_layer_without_quantizing(tmp_path):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((40, 96)).astype(np.float32) * 0.05
    quantized = gguf.quants.quantize(weight, Q4_0)
    _write(tmp_path / "l.gguf", {"proj.weight": (quantized, Q4_0), "proj.bias": (np.arange(40, dtype=np.float32), None)})
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(96, 40))
    load_gguf(model, tmp_path / "l.gguf", names="state_dict")
    layer = model.proj
    assert isinstance(layer, QuantizedLinear) and layer.format == "q4_0"
    assert np.array_equal(q4k.unpack_q4_0(layer.qweight, layer.scales, 96).reshape(40, -1).numpy(), quantized)
    assert np.array_equal(layer.dequantize().numpy(), gguf.quants.dequantize(quantized, Q4_0))
    assert torch.equal(layer.bias, torch.arange(40, dtype=torch.float32))
    x = torch.randn(3, 96)
    with torch.no_grad():
        y = model(x)
    expected = x.double() @ layer.dequantize(torch.float64).T + layer.bias.double()
    assert q4k.QK == 32 and float(10 * torch.log10(expected.square().sum() / (y - expected).square().sum())) > 35


def test_model_written_by_graphopt_reads_back_byte_for_byte(tmp_path):
    model = graphopt.quantize_(llama_tiny().to(torch.bfloat16), format="q4_0")
    path = save_gguf(model, tmp_path / "m.gguf", names="state_dict")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    layers = quantized_layers(model)
    for name, layer in layers.items():
        t = tensors[f"{name}.weight"]
        assert t.tensor_type == Q4_0 and list(t.shape) == [layer.in_features, layer.out_features]
        blocks = q4k.unpack_q4_0(layer.qweight, layer.scales, layer.in_features)
        assert np.array_equal(np.asarray(t.data), blocks.reshape(layer.out_features, -1).numpy()), name
        assert np.array_equal(gguf.quants.dequantize(t.data, Q4_0), layer.dequantize().numpy())
    embed = tensors["model.embed_tokens.weight"]
    assert embed.tensor_type == gguf.GGMLQuantizationType.BF16
    assert np.array_equal(np.asarray(embed.data).reshape(-1).view(np.uint16),
                          model.model.embed_tokens.weight.view(torch.int16).numpy().reshape(-1).view(np.uint16))
    assert len(tensors) == len(layers) + 1 + 2 * 2 + 1  # layers, embedding, two norms per block, final norm


def test_llama_names_and_row_order_follow_llama_cpp_and_load_back(tmp_path):
    """names="auto" on a LLaMA writes llama.cpp's names and its per-head row order of attn_q / attn_k
    (the converter's permutation, exact on Q4_0 rows), with the hyperparameters; load_gguf undoes
    the permutation, so a fresh model gets the same bytes and the same logits."""
    model = graphopt.quantize_(llama_tiny(), format="q4_0")
    path = save_gguf(model, tmp_path / "llama.gguf")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.1.ffn_down.weight"} <= set(tensors)
    field = reader.fields["llama.attention.head_count_kv"]
    assert int(field.parts[field.data[0]][0]) == 2

    def llama_cpp_order(w, heads):  # the converter's permutation, written out
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    attn = model.model.layers[0].self_attn
    for gguf_name, layer, heads in (("blk.0.attn_q.weight", attn.q_proj, 4), ("blk.0.attn_k.weight", attn.k_proj, 2)):
        got = gguf.quants.dequantize(tensors[gguf_name].data, Q4_0)
        assert np.array_equal(got, llama_cpp_order(layer.dequantize(), heads).numpy())
    assert np.array_equal(gguf.quants.dequantize(tensors["blk.0.attn_v.weight"].data, Q4_0),
                          attn.v_proj.dequantize().numpy())

    fresh = load_gguf(llama_tiny(seed=9), path)
    for name, layer in quantized_layers(model).items():
        other = fresh.get_submodule(name)
        assert torch.equal(other.qweight, layer.qweight) and torch.equal(other.scales, layer.scales), name
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_gguf_errors_name_the_choices(tmp_path):
    with pytest.raises(ValueError, match="save_gguf writes q4_0 layers"):
        save_gguf(graphopt.quantize_(llama_tiny(), format="nvfp4"), tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="no q4_0 QuantizedLinear layers"):
        save_gguf(llama_tiny(), tmp_path / "y.gguf")
    with pytest.raises(ValueError, match="valid choices: 'auto', 'state_dict'"):
        save_gguf(graphopt.quantize_(llama_tiny(), format="q4_0"), tmp_path / "z.gguf", names="llama.cpp")
    _write(tmp_path / "q8.gguf", {"proj.weight": (gguf.quants.quantize(np.ones((8, 32), np.float32),
                                                                     gguf.GGMLQuantizationType.Q8_0),
                                                  gguf.GGMLQuantizationType.Q8_0)})
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(32, 8))
    with pytest.raises(ValueError, match="is Q8_0; graphopt reads Q4_0, F32, F16, BF16"):
        load_gguf(model, tmp_path / "q8.gguf", names="state_dict")
