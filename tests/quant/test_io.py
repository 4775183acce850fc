"""save_quantized / load_quantized: a quantized model's safetensors file, loaded in a fresh process
where every quantization function raises, gives bit-identical packed weights and equal logits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt.quant import QuantizedLinear, read_metadata
from tests.quant.test_quantize import llama_tiny, prompt

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: every function that quantizes or calibrates raises, then the file is
# loaded from the config alone and the logits and buffers are written for the test to compare.
_LOADER = r"""
import sys, torch
import graphopt
import graphopt.kernels.fp4 as fp4k, graphopt.kernels.fp4.format as fp4f, graphopt.kernels.fp4.gptq as gptq
import graphopt.kernels.q4 as q4k, graphopt.kernels.q4.format as q4f
import graphopt.quant.quantize as qz
from graphopt.quant import QuantizedLinear

def forbidden(*args, **kwargs):
    raise AssertionError("a quantization function ran during the load")

for module, names in ((fp4k, ("quantize_fp4", "quantize_fp4_gptq", "calibrate_fp4")), (fp4f, ("quantize_fp4",)),
                      (gptq, ("quantize_fp4_gptq", "calibrate_fp4")), (q4k, ("quantize_q4_0", "quantize_weight")),
                      (q4f, ("quantize_q4_0", "quantize_weight")), (qz, ("quantize_",)), (graphopt, ("quantize_",))):
    for name in names:
        setattr(module, name, forbidden)
QuantizedLinear.from_linear = classmethod(lambda cls, *a, **k: forbidden())

from transformers import LlamaConfig
config = LlamaConfig.from_json_file(sys.argv[2])
model = graphopt.load_quantized(config, sys.argv[1])
ids = torch.load(sys.argv[3])
with torch.no_grad():
    logits = model(ids).logits
state = {k: v for k, v in model.state_dict().items()}
torch.save({"logits": logits, "state": state, "tied": model.lm_head.weight is model.model.embed_tokens.weight
            if isinstance(model.lm_head, torch.nn.Linear) else None}, sys.argv[4])
"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt,head,tie", [("nvfp4", True, False), ("mxfp4", True, False), ("q4_0", False, True)],
                         ids=["nvfp4", "mxfp4", "q4_0-dense-tied-head"])
@pytest.mark.slow
def test_saved_model_loads_in_a_fresh_process_without_quantizing(fmt, head, tie, tmp_path):
    model = llama_tiny(tie_word_embeddings=tie).to(torch.bfloat16)
    graphopt.quantize_(model, format=fmt, filter_fn=None if head else (lambda m, name: name != "lm_head"))
    path = graphopt.save_quantized(model, tmp_path / "model.safetensors")
    model.config.to_json_file(tmp_path / "config.json")
    ids = prompt()
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _LOADER, str(path), str(tmp_path / "config.json"), str(tmp_path / "ids.pt"),
                          str(tmp_path / "out.pt")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.equal(loaded["logits"], expected)
    state = model.state_dict()
    assert set(loaded["state"]) == set(state)
    for name, tensor in state.items():
        got = loaded["state"][name]
        assert got.dtype == tensor.dtype and torch.equal(_bits(got), _bits(tensor)), name
    if not head:
        assert loaded["tied"] is tie  # tied dense lm_head comes back as one Parameter

    record = read_metadata(path)
    assert record["formats"] == [fmt] and len(record["layers"]) == (15 if head else 14)
    assert record["non_persistent"] and all("rotary_emb" in n for n in record["non_persistent"])
    if tie and not head:
        assert record["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_load_into_an_existing_model_replaces_its_linears(tmp_path):
    model = graphopt.quantize_(llama_tiny(), format="nvfp4")
    path = graphopt.save_quantized(model, tmp_path / "m.safetensors")
    target = llama_tiny(seed=7)  # other random weights: all of them come from the file
    graphopt.load_quantized(target, path)
    assert isinstance(target.lm_head, QuantizedLinear) and not target.training
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(target(ids).logits, model(ids).logits)


def test_load_errors_name_the_problem(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="no graphopt QuantizedLinear layers; call graphopt.quantize_ first"):
        graphopt.save_quantized(llama_tiny(), tmp_path / "dense.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not written by graphopt.save_quantized"):
        graphopt.load_quantized(llama_tiny(), tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="is not a file"):
        graphopt.load_quantized(llama_tiny(), tmp_path / "missing.safetensors")
    path = graphopt.save_quantized(graphopt.quantize_(llama_tiny(), format="q4_0"), tmp_path / "q.safetensors")
    with pytest.raises(ValueError, match="gate_proj' is 64->64 in the model, 64->96 in the file"):
        graphopt.load_quantized(llama_tiny(intermediate_size=64), path)
    with pytest.raises(ValueError, match="which this model lacks"):
        graphopt.load_quantized(llama_tiny(num_hidden_layers=1), path)
    with pytest.raises(TypeError, match="a model \\(nn.Module\\) or a transformers config"):
        graphopt.load_quantized({"hidden_size": 64}, path)


@pytest.mark.slow
def test_recipe_load_compile_generate_matches_eager(tmp_path):
    """The README's recipe on CPU: quantize, save, load from the config, then HF generate (static
    cache) compiled with graphopt and the fp4_linear pass: the greedy tokens equal the eager ones."""
    import transformers

    from graphopt.compiler import recording_decisions

    model = graphopt.quantize_(llama_tiny(), format="nvfp4")
    path = graphopt.save_quantized(model, tmp_path / "m.safetensors")
    loaded = graphopt.load_quantized(model.config, path)
    ids = prompt(length=12)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    config = transformers.CompileConfig(backend=graphopt.backend(passes={"fp4_linear": True}), mode="default")
    config._compile_all_devices = True  # transformers compiles generate's decode step on CUDA only, unless told
    with torch.no_grad(), recording_decisions() as decisions:
        eager = model.generate(ids, disable_compile=True, **kwargs)
        compiled = loaded.generate(ids, compile_config=config, **kwargs)
    assert torch.equal(compiled, eager)
    kept = [d for d in decisions if d.pass_name == "fp4_linear"]
    assert len(kept) == 15 and all(d.details["quantized_in_place"] and not d.applied for d in kept)


def test_bench_script_imports_and_checks_its_rows():
    from bench import bench_quantized

    def options(rows):
        return bench_quantized.argparse.Namespace(device="cpu", shape=None, formats="nvfp4", rows=rows, layers=None)

    with pytest.raises(SystemExit, match="bad row 'saved-q4_0:inductor'"):  # q4_0 is not among the formats
        bench_quantized.resolve(options("saved-q4_0:inductor"))
    resolved = bench_quantized.resolve(options("bf16:inductor,saved-nvfp4:graphopt"))
    assert resolved.rows == [("bf16", "inductor"), ("saved-nvfp4", "graphopt")] and resolved.shape == "tiny"
