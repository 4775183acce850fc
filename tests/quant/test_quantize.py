"""graphopt.quantize_ and QuantizedLinear: in-place quantization of a tiny LlamaForCausalLM in each
format, run eagerly and compiled (Inductor, graphopt), against the compile-time passes on the same
weights; the output layer's cosine; bad input; dtype moves; plans."""

import copy

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.kernels import fp4 as fp4k
from graphopt.kernels import q4 as q4k
from graphopt.passes.base import GraphPass, module_path
from graphopt.quant import FORMATS, QuantizedLinear, quantized_layers

PASS_OF = {"nvfp4": "fp4_linear", "mxfp4": "fp4_linear", "q4_0": "q4_linear"}


def llama_tiny(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), **overrides})
    return LlamaForCausalLM(cfg).eval()


def prompt(vocab: int = 128, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def pass_options(fmt: str, **extra) -> dict:
    options = dict(passes={PASS_OF[fmt]: True}, **extra)
    if fmt != "q4_0":
        options["fp4_format"] = fmt
    return options


class _Constants(GraphPass):
    """Runs after the registry: {module path: the packed constants} of every quantized-linear op."""

    name = "record_constants"

    def __init__(self):
        self.found: dict[str, list[torch.Tensor]] = {}

    def run(self, ctx):
        ops = (torch.ops.graphopt.fp4_linear.default, torch.ops.graphopt.q4_linear.default)
        for node in ctx.gm.graph.nodes:
            if node.op == "call_function" and node.target in ops:
                tensors = [getattr(ctx.gm, a.target) for a in node.args if getattr(a, "op", None) == "get_attr"]
                self.found[module_path(node)] = tensors


def _packed(layer: QuantizedLinear) -> list[torch.Tensor]:
    if layer.format == "q4_0":
        return [layer.qweight, layer.scales]
    return [layer.codes, layer.scales, layer.global_scale]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_in_place_equals_the_compile_time_pass_bytes_and_logits(fmt):
    """Every linear of the tiny LLaMA, lm_head included, becomes a QuantizedLinear; no dense weight
    of a quantized layer is left among the parameters; the packed buffers are the constants the
    pass bakes for the same weights (one layer at a time), and the eager logits equal the pass's."""
    from graphopt.passes import register_extra_pass, unregister_extra_pass

    model = llama_tiny()
    ids = prompt()
    quantized = graphopt.quantize_(copy.deepcopy(model), format=fmt)
    layers = quantized_layers(quantized)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(layers) == sorted(linears) and len(linears) == 15
    dense = {n for n, p in model.named_parameters()} - {n for n, _ in quantized.named_parameters()}
    assert dense == {f"{n}.weight" for n in linears}
    assert all(m.format == fmt for m in layers.values())

    recorder = _Constants()
    register_extra_pass(recorder)
    try:
        report = graphopt.explain(model, ids, force=True, fuse_sibling_linears=False, downstream="eager",
                                  **pass_options(fmt))
    finally:
        unregister_extra_pass(recorder.name)
    assert report.counts[PASS_OF[fmt]] == 15
    assert set(recorder.found) == set(linears)
    for name, layer in layers.items():
        constants = recorder.found[name]
        packed = _packed(layer)
        assert len(constants) >= len(packed)
        assert all(_same_bits(p, c) for p, c in zip(packed, constants[-len(packed):] if fmt == "q4_0" else
                                                    [constants[0], *constants[-2:]])), name
    with torch.no_grad():
        eager = quantized(ids).logits
        original = model(ids).logits
    assert torch.equal(eager, report.output.logits)
    assert (eager - original).abs().max() > 1e-4  # the weights really changed


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_compiles_with_inductor_and_graphopt(fmt):
    """Plain Inductor and backend="graphopt" (the matching pass on) run the quantized model to the
    eager logits; the pass records each quantized layer as kept, quantizes nothing again."""
    model = graphopt.quantize_(llama_tiny(), format=fmt)
    ids = prompt()
    with torch.no_grad():
        eager = model(ids).logits
        inductor = torch.compile(model, backend="inductor")(ids).logits
        torch._dynamo.reset()
        report = graphopt.explain(model, ids, **pass_options(fmt))
    torch.testing.assert_close(inductor, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(report.output.logits, eager, atol=1e-5, rtol=1e-5)
    decisions = [d for d in report.decisions if d.pass_name == PASS_OF[fmt]]
    assert len(decisions) == 15 and report.counts[PASS_OF[fmt]] == 0
    assert all(not d.applied and d.details["quantized_in_place"] and "already quantized" in d.reason
               for d in decisions)


def test_gpu_target_chooses_the_q4_mode_at_compile_time_weights_untouched():
    """Against an H100 cost model the q4 pass writes its mode choice into the op of each layer
    (the weights stay the model's buffers); on CPU tensors the op runs its reference whatever the mode."""
    model = graphopt.quantize_(llama_tiny(), format="q4_0")
    ids = prompt()
    with torch.no_grad():
        eager = model(ids).logits
    report = graphopt.explain(model, ids, passes={"q4_linear": True}, target="h100", downstream="eager")
    decisions = [d for d in report.decisions if d.pass_name == "q4_linear"]
    assert len(decisions) == 15 and all(d.details["mode"] in ("fused", "separate") for d in decisions)
    assert all(f"mode {d.details['mode']}" in d.reason for d in decisions)
    assert torch.equal(report.output.logits, eager)


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_layer_keeps_logit_cosine(fmt):
    """quantize_ includes lm_head by default. On a small LLaMA (random weights) its quantization
    keeps every token's logits at cosine >= 0.99 with the same model whose output layer stays dense."""
    model = llama_tiny(vocab_size=1024, hidden_size=128, intermediate_size=352, num_attention_heads=8)
    ids = prompt(1024, 24)
    body = graphopt.quantize_(copy.deepcopy(model), format=fmt, filter_fn=lambda m, name: name != "lm_head")
    with torch.no_grad():
        dense_head = body(ids).logits
        assert isinstance(body.lm_head, torch.nn.Linear)
        graphopt.quantize_(body, format=fmt)
        assert isinstance(body.lm_head, QuantizedLinear)
        cosine = F.cosine_similarity(body(ids).logits.double(), dense_head.double(), dim=-1)
    assert cosine.min() >= 0.99, cosine.min()


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_matches_float64_reference_at_odd_sizes(fmt):
    """A QuantizedLinear with bias against a float64 product of its dequantized weight, on fresh
    inputs of three leading dims (K = 96: an odd number of 32-blocks, padded inside the layout)."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(96, 40, bias=True)
    layer = QuantizedLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 96)
    expected = x.double() @ layer.dequantize(torch.float64).T + linear.bias.double()
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float32
    if fmt == "q4_0":  # activations go through Q8_1 too: judged by SQNR
        assert fp4k.sqnr_db(expected, got) > 35
    else:
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    assert fp4k.sqnr_db(linear.weight, layer.dequantize()) > 15


def test_bad_input_gets_clear_errors():
    model = llama_tiny()
    with pytest.raises(ValueError, match="unknown quantization format 'int4'; valid choices: nvfp4, mxfp4, q4_0"):
        graphopt.quantize_(model, format="int4")
    with pytest.raises(ValueError, match="format='q4_0' takes none"):
        graphopt.quantize_(model, format="q4_0", plan="plan.json")
    with pytest.raises(ValueError, match="wrap a lone nn.Linear"):
        graphopt.quantize_(torch.nn.Linear(64, 64))
    with pytest.raises(TypeError, match="takes an nn.Module"):
        graphopt.quantize_(torch.randn(3))
    broken = torch.nn.Sequential(torch.nn.Linear(64, 8))
    with torch.no_grad():
        broken[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer '0'.*NaN or Inf"):
        graphopt.quantize_(broken)
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(64, 8))
    with pytest.raises(ValueError, match="meta device"):
        graphopt.quantize_(empty)
    assert isinstance(model.lm_head, torch.nn.Linear)  # nothing changed by the refused calls


def test_q4_0_leaves_layers_it_cannot_hold_dense_with_a_warning(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))  # K=48: no Q4_0
    x = torch.randn(3, 64)
    with caplog.at_level("WARNING", logger="graphopt"):
        graphopt.quantize_(model, format="q4_0")
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[2], torch.nn.Linear)
    assert "left 1 layer(s) dense: 2 (in_features=48 is not a multiple of 32" in caplog.text
    with torch.no_grad():
        assert model(x).shape == (3, 8)


def test_multihead_attention_projection_is_not_selected():
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(64, 4, batch_first=True))
    graphopt.quantize_(model)
    assert not quantized_layers(model)  # its out_proj weight is read directly by F.multi_head_attention_forward


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_moves_keep_the_packed_bits(fmt):
    """model.to(bfloat16) converts the dense tensors, not the packed buffers (fp16 Q4_0 scales,
    e4m3 NVFP4 scales, fp32 global scales keep their dtype and bits)."""
    model = graphopt.quantize_(llama_tiny(), format=fmt)
    layers = quantized_layers(model)
    before = {name: [t.clone() for t in _packed(layer)] for name, layer in layers.items()}
    model.to(torch.bfloat16)
    for name, layer in layers.items():
        assert all(_same_bits(a, b) for a, b in zip(_packed(layer), before[name])), name
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(prompt()).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_plan_weights_are_used_for_the_layers_they_name(tmp_path):
    """A plan's fp4_linear weights (here: quantized without the scale search, so they differ from
    quantize_'s own) replace quantization for the layers they name; the other layers quantize
    as without a plan; a plan made for another format is refused with the reason."""
    from graphopt.passes.fp4_linear import save_fp4_plan

    model = llama_tiny()
    name = "model.layers.0.mlp.down_proj"
    planned = fp4k.quantize_fp4(model.get_submodule(name).weight, "nvfp4", scale_search=False)
    plan = save_fp4_plan(tmp_path / "plan.json", {name: planned})
    quantized = graphopt.quantize_(copy.deepcopy(model), format="nvfp4", plan=plan)
    layer = quantized.get_submodule(name)
    assert _same_bits(layer.codes, fp4k.to_kernel_layout(planned).codes)
    plain = graphopt.quantize_(copy.deepcopy(model), format="nvfp4")
    assert not torch.equal(plain.get_submodule(name).codes, layer.codes)
    other = "model.layers.1.mlp.down_proj"
    assert torch.equal(plain.get_submodule(other).codes, quantized.get_submodule(other).codes)
    with pytest.raises(ValueError, match="format 'nvfp4' does not match fp4_format='mxfp4'"):
        graphopt.quantize_(copy.deepcopy(model), format="mxfp4", plan=plan)


def test_nvfp4_resident_weights_of_the_8b_shape_under_the_target():
    """The arithmetic behind the memory target, from the layouts (nothing allocated): LLaMA-3-8B's
    weights with every linear, lm_head included, in NVFP4 and the embedding in bf16 take <= 0.35x
    of the bf16 model; with lm_head dense they would not."""
    from graphopt.quant.linear import packed_layout

    hidden, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
              (hidden, inter)] * layers
    def packed(n, k):
        return sum(torch.Size(s).numel() * d.itemsize for s, d in packed_layout(n, k, "nvfp4").values())
    norms = (2 * layers + 1) * hidden * 2
    bf16 = sum(n * k for n, k in shapes) * 2 + 2 * vocab * hidden * 2 + norms
    with_head = sum(packed(n, k) for n, k in shapes) + packed(vocab, hidden) + vocab * hidden * 2 + norms
    without_head = with_head - packed(vocab, hidden) + vocab * hidden * 2
    assert with_head / bf16 <= 0.35 < without_head / bf16
    assert 4 * 4096 // 2 + 4 * 4096 // 32 * 2 == sum(torch.Size(s).numel() * d.itemsize
                                                     for s, d in packed_layout(4, 4096, "q4_0").values())
    assert q4k.QK == 32


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_quantized_model_runs_its_kernels_and_the_pass_chooses_them(fmt):
    """On a GPU: eager (the ops' default kernels), and backend="graphopt" with the pass, which
    writes a kernel choice into every quantized layer's op; logits close to the reference's."""
    model = llama_tiny(hidden_size=256, intermediate_size=512, num_attention_heads=8).to("cuda", torch.bfloat16)
    graphopt.quantize_(model, format=fmt)
    ids = prompt().cuda()
    with torch.no_grad():
        eager = model(ids).logits.float()
        reference = model.cpu().float()(ids.cpu()).logits
        model.to("cuda", torch.bfloat16)
        report = graphopt.explain(model, ids, **pass_options(fmt))
    assert F.cosine_similarity(eager.cpu(), reference, dim=-1).min() > 0.99
    assert F.cosine_similarity(report.output.logits.float().cpu(), reference, dim=-1).min() > 0.99
    decisions = [d for d in report.decisions if d.pass_name == PASS_OF[fmt]]
    assert decisions and all(d.details["quantized_in_place"] for d in decisions)
    if fmt != "q4_0":
        assert all(d.details["kernel"] for d in decisions)
