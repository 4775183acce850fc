"""transformers' from_pretrained with graphopt's quantization config: the loaded model's linears are
quantize_'s QuantizedLinear layers (dense weights gone), the same bytes and logits as quantize_ on
the plainly loaded model, modules_to_not_convert kept dense, HF's save refused with the way out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphopt
from graphopt.quant import QuantizedLinear

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      num_hidden_layers=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("format", ["nvfp4", "q4_0"])
def test_from_pretrained_quantizes_like_quantize_(checkpoint, format):
    config = graphopt.hf_quantization_config(format, modules_to_not_convert=["lm_head"])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config).eval()
    plain = graphopt.quantize_(transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval(), format=format,
                               filter_fn=lambda module, name: name != "lm_head")
    linears = {name: type(m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear))}
    assert linears.pop("lm_head") is nn.Linear
    assert set(linears.values()) == {QuantizedLinear} and len(linears) == 14  # 7 per layer
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())  # dense weights released
    plain_state = plain.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, plain_state[name]), name
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
        dense = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()(ids).logits
        cosine = torch.nn.functional.cosine_similarity(model(ids).logits.flatten(), dense.flatten(), dim=0)
    assert cosine > 0.98  # 4-bit weights on a random model: close to the dense logits, not equal
    assert model.hf_quantizer.is_compileable


def test_save_pretrained_is_refused_and_bad_formats_are_named(checkpoint, tmp_path):
    config = graphopt.hf_quantization_config("mxfp4")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config)
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="nvfp4"):
        graphopt.hf_quantization_config("int3")
