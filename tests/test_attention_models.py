"""The attention pass on real `transformers` models (tiny random configs, eager attention, CPU,
fp32): every attention layer is rewritten, outputs match eager, output_attentions=True is left
alone, gradients match, and the rewritten BERT exports to ONNX with standard Attention nodes."""

from __future__ import annotations

import copy

import pytest
import torch

import graphopt

transformers = pytest.importorskip("transformers")
T = transformers

SEQ = 12


def _config(family: str):
    small = dict(vocab_size=97)
    if family == "gpt2":
        return T.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0, **small), 2
    if family == "llama":
        return T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, **small), 2
    if family == "mistral":  # GQA: 4 query heads over 2 kv heads
        return T.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **small), 2
    if family == "qwen2":  # GQA, q/k/v projections with bias
        return T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **small), 2
    if family == "gemma":  # MQA, head_dim != hidden/heads
        return T.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16, **small), 2
    if family == "phi":
        return T.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **small), 2
    if family == "opt":
        return T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=64, **small), 2
    if family == "bert":
        return T.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **small), 2
    if family == "t5":  # encoder self, decoder self (causal + position bias), decoder cross: 3 per layer pair
        return T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, decoder_start_token_id=0, **small), 6
    raise KeyError(family)


class Logits(torch.nn.Module):
    """Model -> one tensor (logits or last hidden state), with fixed keyword inputs."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_ids, attention_mask=None):
        extra = dict(self.kwargs)
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        out = self.model(input_ids, **extra)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def build(family: str, **kwargs):
    torch.manual_seed(0)
    config, n_attention = _config(family)
    cls = T.AutoModel if family in ("bert", "t5") else T.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").eval()
    extra = dict(use_cache=False, **kwargs)
    if family == "t5":
        extra["decoder_input_ids"] = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    if family == "bert":
        extra.pop("use_cache")
    return Logits(model, **extra), n_attention


def inputs(family: str):
    ids = torch.randint(1, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    if family == "bert":  # padding in the second sequence
        return ids, torch.tensor([[1] * SEQ, [1] * (SEQ - 3) + [0] * 3])
    return (ids,)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "opt", "bert", "t5"])
def test_every_attention_layer_is_rewritten(family):
    model, n_attention = build(family)
    args = inputs(family)
    report = graphopt.explain(model, *args, downstream="eager")
    assert report.counts["attention"] == n_attention, str(report)
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(report.output, expected, atol=2e-4, rtol=0)
    decoders = [d for d in report.applied("attention") if "encoder" not in d.location and "EncDec" not in d.location]
    if family not in ("bert", "t5"):  # decoder-only: the HF causal mask is proven causal, no bias left
        assert all(d.details["is_causal"] and d.details["bias"] == "none" for d in decoders)
    if family in ("mistral", "qwen2", "gemma"):
        assert all(d.details["num_kv_groups"] > 1 for d in decoders)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dynamic_true_rewrites_attention_and_follows_a_changed_scale(family):
    """Under dynamic=True Dynamo does not specialize floats: HF's `self.scaling` (GPT-2's constant
    too) reaches the graph as a 0-d tensor input and `.item()`. The pass takes such module floats
    as constants guarded by value:
    one graph serves every length, and after a change of the scale the graph runs unrewritten
    (it cannot be recompiled outside Dynamo), with the new value."""
    from graphopt import compiler as backend_module

    model, n_attention = build(family)
    with backend_module.recording_decisions(reset=True) as decisions, torch.no_grad():
        compiled = torch.compile(model, backend="graphopt", options={"downstream": "eager"}, dynamic=True)
        for length in (12, 17, 23):
            ids = torch.randint(1, 97, (2, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(compiled(ids), model(ids), atol=2e-4, rtol=0)
        applied = [d for d in decisions if d.pass_name == "attention" and d.applied]
        assert len(applied) == n_attention, [d.reason for d in decisions]
        if family == "llama":
            attention = model.model.model.layers[0].self_attn
            attention.scaling *= 3.0  # a module float graphopt baked into the graph
            torch.testing.assert_close(compiled(ids), model(ids), atol=2e-4, rtol=0)


def test_dynamic_true_on_the_model_itself_rewrites_attention():
    """Compiled directly, an HF model's forward may be wrapped by a (*args, **kwargs) decorator
    (transformers 5.2x): Dynamo then names the model `L['args'][0]` and its lifted `self.scaling`
    an attribute of it, which must count as the model's float as `L['self']`'s does."""
    model, n_attention = build("llama")
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(12))
    from graphopt import compiler as backend_module

    with backend_module.recording_decisions(reset=True) as decisions, torch.no_grad():
        compiled = torch.compile(model.model, backend=graphopt.backend(downstream="eager"), dynamic=True)
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids), atol=2e-4, rtol=0)
    assert len([d for d in decisions if d.pass_name == "attention" and d.applied]) == n_attention, \
        [d.reason for d in decisions]


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_a_changing_model_float_read_outside_the_attention_too(downstream):
    """A float the attention pass baked (dynamic=True lifts it to an input) that the graph also reads
    elsewhere: when it changes, the graph switches to its unrewritten compile, once, and follows
    every value (recompiling outside Dynamo would fail in AOTAutograd: `.item()` on real inputs)."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.temperature = 0.25, 1.0

        def forward(self, q, k, v):
            scores = (q @ k.transpose(-1, -2)) * self.scale / self.temperature
            return (torch.softmax(scores, -1) @ v) * self.temperature

    model = Attention()
    q, k, v = torch.randn(3, 1, 2, 8, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        compiled = torch.compile(model, backend="graphopt", options={"downstream": downstream}, dynamic=True)
        for step in range(4):
            model.temperature = 1.0 + 0.5 * step
            torch.testing.assert_close(compiled(q, k, v), model(q, k, v))


def test_inductor_downstream():
    model, n_attention = build("llama")
    args = inputs("llama")
    report = graphopt.explain(model, *args)  # downstream="inductor" (the default)
    assert report.counts["attention"] == n_attention
    with torch.no_grad():
        torch.testing.assert_close(report.output, model(*args), atol=2e-4, rtol=0)


def test_output_attentions_leaves_attention_alone():
    model, n_attention = build("llama", output_attentions=True)

    class LogitsAndAttentions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model.model

        def forward(self, ids):
            out = self.inner(ids, **self_kwargs)
            return out.logits, out.attentions

    self_kwargs = model.kwargs
    wrapped = LogitsAndAttentions()
    report = graphopt.explain(wrapped, *inputs("llama"), downstream="eager")
    assert report.counts["attention"] == 0
    declined = report.declined("attention")
    assert len(declined) == n_attention and all("users" in d.reason for d in declined)
    with torch.no_grad():
        logits, attentions = wrapped(*inputs("llama"))
    torch.testing.assert_close(report.output[0], logits)
    for got, want in zip(report.output[1], attentions):
        torch.testing.assert_close(got, want)


def test_llama_gradients_match_eager():
    model, _ = build("llama")
    model.train()  # attention dropout p=0: the pass still applies
    (ids,) = inputs("llama")
    eager, trained = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(trained, backend="graphopt", options={"downstream": "eager"})
    from graphopt import compiler as backend_module

    with backend_module.recording_decisions() as sink:
        loss = torch.nn.functional.cross_entropy(compiled(ids).flatten(0, 1), ids.flatten())
    assert sum(d.applied for d in sink if d.pass_name == "attention") == 2
    loss.backward()
    expected = torch.nn.functional.cross_entropy(eager(ids).flatten(0, 1), ids.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for (name, p), (_, q) in zip(eager.named_parameters(), trained.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_bert_onnx_export_uses_standard_attention(tmp_path):
    import onnx

    from graphopt.onnx_export import run_onnxruntime

    model, n_attention = build("bert")
    ids, mask = inputs("bert")
    # BERT reads attention_mask before input_ids: Dynamo's placeholders are not in argument order
    path = graphopt.export_onnx(model, (ids, mask), tmp_path / "bert.onnx")
    graph = onnx.load(str(path)).graph
    assert sum(n.op_type == "Attention" for n in graph.node) == n_attention
    assert not any(n.op_type == "Softmax" for n in graph.node)
    (out,) = run_onnxruntime(path, ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(ids, mask), atol=1e-3, rtol=0)


def test_softcapped_attention_is_declined_with_the_reason():
    # Gemma 2 soft-caps the scores (cap * tanh(s / cap)) before the mask and softmax: recognized as
    # attention, declined with that reason, and the model's output is unchanged
    torch.manual_seed(0)
    config = T.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0, sliding_window=8,
                            vocab_size=97)
    model = Logits(T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), use_cache=False)
    (ids,) = inputs("llama")
    report = graphopt.explain(model, ids, downstream="eager")
    declined = [d for d in report.decisions if d.pass_name == "attention"]
    assert len(declined) == 2 and not any(d.applied for d in declined)
    assert all("soft-capping" in d.reason for d in declined)
    with torch.no_grad():
        torch.testing.assert_close(report.output, model(ids), atol=1e-5, rtol=0)


def _checkpointed_llama():
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=97)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # transformers >= 5.20 names it activation_checkpointing_enable (the old name warns)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


@pytest.mark.parametrize("downstream", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_activation_checkpointed_llama_is_rewritten_inside_the_checkpoints(downstream):
    """Dynamo puts each checkpointed layer's code in the body of a tag_activation_checkpoint call:
    the attention is rewritten there, and loss and gradients equal eager's."""
    from graphopt import compiler as backend_module
    from graphopt.passes.subgraphs import higher_order_bodies, is_checkpoint

    model = _checkpointed_llama()
    (ids,) = inputs("llama")
    eager, trained = copy.deepcopy(model), copy.deepcopy(model)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return backend_module.graphopt_backend(gm, example_inputs, options={"downstream": downstream})

    with backend_module.recording_decisions(reset=True) as decisions:
        loss = torch.compile(trained, backend=capture)(ids, labels=ids, use_cache=False).loss
        loss.backward()
    applied = [d for d in decisions if d.pass_name == "attention" and d.applied]
    assert sorted(d.location for d in applied) == ["model.layers.0.self_attn", "model.layers.1.self_attn"], \
        [d.reason for d in decisions]
    bodies = [body for gm in graphs for call, body in higher_order_bodies(gm) if is_checkpoint(call)]
    assert len(bodies) == 2
    assert all(any(n.target is torch.ops.graphopt.attention.default for n in body.graph.nodes) for body in bodies)
    expected = eager(ids, labels=ids, use_cache=False).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for (name, p), (_, q) in zip(eager.named_parameters(), trained.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_attention_inside_another_higher_order_op_is_declined_with_the_reason():
    """A body graphopt does not rewrite (here torch.cond's branches) still gets a decision per attention."""
    class Branchy(torch.nn.Module):
        def forward(self, q, k, v, flag):
            def attend(q, k, v):
                return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v

            def plain(q, k, v):
                return q + 0.0
            return torch.cond(flag, attend, plain, (q, k, v))

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))  # torch.cond (2.11) refuses operands that alias
    report = graphopt.explain(Branchy(), q, k, v, torch.tensor(True), downstream="eager")
    (d,) = report.declined("attention")
    assert "higher-order op cond" in d.reason and report.counts["attention"] == 0
    with torch.no_grad():
        torch.testing.assert_close(report.output, Branchy()(q, k, v, torch.tensor(True)))
