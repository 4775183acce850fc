import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.passes import register_extra_pass, unregister_extra_pass
from graphopt.passes.base import Decision, GraphPass


class _CountGraphs(GraphPass):
    name = "count_graphs_for_test"

    def run(self, ctx):
        ctx.record(self.name, True, "one graph seen")


class WithGraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_report_aggregates_over_graph_breaks_and_prints_a_table():
    register_extra_pass(_CountGraphs())
    try:
        model, x = WithGraphBreak(), torch.randn(2, 4)
        report = graphopt.explain(model, x, downstream="eager")
    finally:
        unregister_extra_pass("count_graphs_for_test")
    assert report.counts["count_graphs_for_test"] == 2
    assert isinstance(report.decisions[0], Decision)
    torch.testing.assert_close(report.output, model(x))
    text = str(report)
    assert "graphopt decisions" in text and "count_graphs_for_test" in text and "one graph seen" in text


def test_decision_fields_and_speedup():
    d = Decision("attention", True, "why", "model.layers.0", 2.0, 0.5, "triton")
    assert d.predicted_speedup == 4.0
    assert Decision("attention", False, "why").predicted_speedup is None


def test_module_paths_are_cleaned():
    from graphopt.passes.base import _clean_module_path

    assert _clean_module_path("L['self'].model.layers[0].self_attn") == "model.layers.0.self_attn"
    assert _clean_module_path("L['self']._modules['encoder']._modules['layer'][3]") == "encoder.layer.3"
    assert _clean_module_path("L['args'][0].model.layers.1.mlp.down_proj") == "model.layers.1.mlp.down_proj"
    assert _clean_module_path("L['self'][2].mlp") == "2.mlp"  # an indexed Sequential root keeps its index


def test_memory_saved_is_totalled_in_the_caption():
    """explain sums the weight memory the applied rewrites save (a tied weight once) and prints it."""
    from graphopt.explain import Report

    decisions = [Decision("q4_linear", True, "a", details={"memory_saved_bytes": 3 * 2**20}),
                 Decision("q4_linear", True, "tied", details={"memory_saved_bytes": 0}),
                 Decision("q4_linear", False, "declined", details={"memory_saved_bytes": 2**30})]
    report = Report(decisions)
    assert report.memory_saved_bytes == 3 * 2**20
    assert "weight memory saved: 3.00 MiB" in str(report)
    assert "memory saved" not in str(Report([Decision("attention", True, "x")]))


def test_model_inputs_passed_as_keywords_get_a_clear_error():
    """HF users write model(input_ids=...): explain's keywords are graphopt options, so a keyword
    that names a model input gets an error saying so, not "unknown graphopt option 'input_ids'"."""
    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids * 2

    with pytest.raises(ValueError, match="input_ids: an input of Model.forward, passed as a keyword; model inputs go positionally"):
        graphopt.explain(Model(), input_ids=torch.ones(2))
    with pytest.raises(ValueError, match="unknown graphopt option 'fp4'"):
        graphopt.explain(Model(), torch.ones(2), fp4=True)
