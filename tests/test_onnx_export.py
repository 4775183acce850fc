import onnx
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.onnx_export import MAX_IR_VERSION, run_onnxruntime, translation_table


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def test_export_checks_and_runs_in_onnxruntime(tmp_path):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 5, 16)
    path = graphopt.export_onnx(model, (x,), tmp_path / "block.onnx")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert proto.ir_version <= MAX_IR_VERSION
    assert len(proto.graph.initializer) >= 2  # parameters are initializers, not inputs
    assert [i.name for i in proto.graph.input] == ["x"]  # named after the forward's parameter
    (out,) = run_onnxruntime(path, x)
    torch.testing.assert_close(torch.from_numpy(out), model(x), rtol=1e-4, atol=1e-5)


def test_unknown_onnx_form_is_a_clear_error():
    with pytest.raises(ValueError, match="no ONNX form 'bogus' for graphopt::attention; valid choices"):
        translation_table({"graphopt::attention": "bogus"})


def test_dynamic_axes_export_runs_at_other_shapes(tmp_path):
    # batch and sequence stay symbolic: one ONNX model serves shapes it was not exported at
    from tests.test_attention_models import build, inputs

    model, n_attention = build("llama")
    (ids,) = inputs("llama")
    path = graphopt.export_onnx(model, (ids,), tmp_path / "llama.onnx", dynamic_axes={0: {0: "batch", 1: "seq"}})
    graph = onnx.load(str(path)).graph
    assert [(i.name, [d.dim_param for d in i.type.tensor_type.shape.dim]) for i in graph.input] == \
        [("input_ids", ["batch", "seq"])]
    assert sum(n.op_type == "Attention" for n in graph.node) == n_attention  # still rewritten
    for batch, seq in ((3, 17), (1, 5), tuple(ids.shape)):
        other = torch.randint(1, 97, (batch, seq), generator=torch.Generator().manual_seed(batch * seq))
        (out,) = run_onnxruntime(path, other)
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(out), model(other), atol=1e-4, rtol=0)


def test_dynamic_axes_shared_by_two_inputs(tmp_path):
    # BERT reads attention_mask before input_ids (Dynamo's placeholder order differs from the
    # forward's); one name is one size across both inputs; padding at a new shape
    from tests.test_attention_models import build, inputs

    model, _ = build("bert")
    axes = [{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}]
    path = graphopt.export_onnx(model, inputs("bert"), tmp_path / "bert.onnx", dynamic_axes=axes)
    graph = onnx.load(str(path)).graph
    assert [(i.name, [d.dim_param for d in i.type.tensor_type.shape.dim]) for i in graph.input] == \
        [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"])]
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7])
    (out,) = run_onnxruntime(path, ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), model(ids, mask), atol=1e-3, rtol=0)


class _BranchesOnLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * 2 if x.shape[1] == 5 else self.fc(x)


@pytest.mark.parametrize("axes, fragment", [
    ({0: {1: "seq"}}, "one of these sizes was fixed during capture (typically the model's code branches on it"),
    ({1: {0: "batch"}}, "1 is not the position of a tensor input; valid choices: 0"),
    ({0: {3: "batch"}}, "dim 3 is not a dim of input 0 (shape (2, 5, 16)); valid choices: 0, 1, 2"),
    ({0: {0: "2b"}}, "must be a Python identifier"),
    ("batch", "dynamic_axes must map input positions"),
    ({0: {0: "n", 1: "n"}}, "the name 'n' is given to dim 0 of input 0 (size 2) and dim 1 of input 0 (size 5)"),
])
def test_bad_dynamic_axes_are_clear_errors(tmp_path, axes, fragment):
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError) as info:
        graphopt.export_onnx(_BranchesOnLength().eval(), (x,), tmp_path / "m.onnx", dynamic_axes=axes)
    assert fragment in str(info.value)


@pytest.mark.parametrize("where", ["directory", "under a file"])
def test_an_output_path_that_cannot_become_a_file_is_a_clear_error(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    path = tmp_path if where == "directory" else tmp_path / "afile" / "m.onnx"
    with pytest.raises(ValueError, match="is a directory" if where == "directory" else "afile' is a file"):
        graphopt.export_onnx(Block().eval(), (torch.randn(2, 5, 16),), path)


def test_dynamic_axis_of_example_size_one_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="example input has size 1 there; .* size >= 2"):
        graphopt.export_onnx(Block().eval(), (torch.randn(1, 5, 16),), tmp_path / "m.onnx", dynamic_axes={0: {0: "batch"}})


def test_outputs_are_named_after_the_model_output_in_its_order(tmp_path):
    """A causal LM with a KV cache: inputs input_ids, attention_mask; outputs logits first, then
    present.N.key / present.N.value per layer (Dynamo's graph lists them in another order), each
    equal to the eager model's tensor of that name."""
    from graphopt.models import build
    from graphopt.onnx_export import named_outputs

    model, (ids,) = build("tiny-llama", seq_len=12, device="cpu")
    mask = torch.ones_like(ids)
    path = graphopt.export_onnx(model, (ids, mask), tmp_path / "lm.onnx")
    graph = onnx.load(str(path)).graph
    layers = model.config.num_hidden_layers
    expected = ["logits"] + [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in graph.output] == expected
    with torch.no_grad():
        reference = dict(named_outputs(model(ids, mask)))
    assert list(reference) == expected
    for name, value in zip(expected, run_onnxruntime(path, ids, mask)):
        torch.testing.assert_close(torch.from_numpy(value), reference[name], rtol=1e-4, atol=1e-4, msg=name)


def test_named_outputs_of_other_structures():
    from graphopt.onnx_export import named_outputs

    a, b, c, d = (torch.randn(2) for _ in range(4))
    assert [n for n, _ in named_outputs(a)] == ["output"]
    assert [n for n, _ in named_outputs((a, b))] == ["output_0", "output_1"]
    assert [n for n, _ in named_outputs({"logits": a, "hidden_states": (b, c)})] == \
        ["logits", "hidden_states.0", "hidden_states.1"]
    # the legacy tuple-of-pairs cache
    named = named_outputs({"logits": a, "past_key_values": ((b, c), (d, a))})
    assert [n for n, _ in named] == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert named[1][1] is b and named[4][1] is a
