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
    assert [i.name for i in proto.graph.input] and len(proto.graph.input) == 1
    (out,) = run_onnxruntime(path, x)
    torch.testing.assert_close(torch.from_numpy(out), model(x), rtol=1e-4, atol=1e-5)


def test_unknown_onnx_form_is_a_clear_error():
    with pytest.raises(ValueError, match="no ONNX form 'bogus' for graphopt::attention; valid choices"):
        translation_table({"graphopt::attention": "bogus"})
