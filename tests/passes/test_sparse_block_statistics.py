"""The sparse_attention pass emits the predictor's block statistics (pooled Q/K blocks and their
self-similarity) as aten ops right after q and k, feeding graphopt::sparse_attention, so the
downstream compiler fuses them with the kernel that produces q and k. The results must be those
of the op pooling q and k itself."""

import dataclasses
import operator

import pytest
import torch

import graphopt
from graphopt.hardware import get_spec
from graphopt.kernels import sparse_attention as sa
from graphopt.passes import sparse_attention as sp

transformers = pytest.importorskip("transformers")

SPARSE = {"passes": {"sparse_attention": True}, "force": True}


class RotaryAttention(torch.nn.Module):
    """q/k/v projections, a rotary embedding on q and k, causal SDPA (GQA): the producer of q and
    k that the statistics fuse with."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)

        def rotate(t):
            a, b = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-b, a], dim=-1) * sin
        return torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True,
                                                                enable_gqa=True)


def rotary_inputs(L=300, dim=64, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # slowly varying activations: self-similar blocks, so the predictor's selection decides
    x = torch.randn(1, 1, dim, generator=gen) + 0.3 * torch.randn(1, L, dim, generator=gen)
    angle = torch.arange(L)[:, None] / 10000 ** (torch.arange(head_dim // 2) / (head_dim // 2))
    angle = torch.cat([angle, angle], -1)
    return x, angle.cos(), angle.sin()


def rewritten_graph(model, inputs, *, dynamic: bool):
    """(the graph after the passes, the inputs Dynamo gave it)."""
    from graphopt.passes import run_passes

    graphs = []

    def capture(gm, example_inputs):
        config = graphopt.GraphOptConfig.from_options({"downstream": "eager", **SPARSE}, environ={})
        run_passes(gm, example_inputs, config, get_spec("cpu"))
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=dynamic)(*inputs)
    (result,) = graphs
    return result


SYMBOLIC_ARITHMETIC = (operator.neg, operator.floordiv, operator.mul, operator.sub, operator.add)


@pytest.mark.parametrize("dynamic", [False, True])
def test_statistics_are_aten_ops_right_after_q_and_k_feeding_the_op(dynamic):
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    inputs = rotary_inputs()
    gm, example_inputs = rewritten_graph(model, inputs, dynamic=dynamic)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.graphopt.sparse_attention.default]
    q, k = op.args[:2]
    statistics = op.args[10:]
    assert len(statistics) == 4 and all(isinstance(n, torch.fx.Node) for n in statistics)
    # every node between q/k and the statistics is a plain aten op (or size arithmetic)
    pooling, stack = set(), list(statistics)
    while stack:
        node = stack.pop()
        if node in (q, k) or node in pooling:
            continue
        assert node.op == "call_function", node.format_node()
        assert isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten" \
            or node.target in SYMBOLIC_ARITHMETIC, node.format_node()
        pooling.add(node)
        stack.extend(node.all_input_nodes)
    targets = {n.target for n in pooling}
    assert {torch.ops.aten.sum.dim_IntList, torch.ops.aten.linalg_vector_norm.default} <= targets
    assert all(n.target is not torch.ops.graphopt.sparse_attention.default for n in pooling)
    # right after q and k: the pooling follows the later of the two directly
    order = list(gm.graph.nodes)
    first = min(order.index(n) for n in pooling)
    assert first == max(order.index(q), order.index(k)) + 1
    # the statistics are those of the values q and k hold
    values = {}
    interpreter = torch.fx.Interpreter(gm)
    interpreter.run_node = lambda n, run=interpreter.run_node: values.setdefault(n, run(n))
    with torch.no_grad():
        interpreter.run(*[x.node.hint if isinstance(x, torch.SymInt) else x for x in example_inputs])
    expected = sa.block_statistics(values[q], values[k])
    for node, want in zip(statistics, expected):
        torch.testing.assert_close(values[node], want, atol=0, rtol=0)


def tiny_llama(layers=2):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                      max_position_embeddings=512, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def llama_ids(L=300):
    # runs of one token: neighbouring queries and keys differ by their rotary angle only, so blocks
    # are self-similar and the predictor skips some
    return torch.arange(L)[None, :].div(40, rounding_mode="floor") % 97


def llama_plan(tmp_path, layers=2):
    """Thresholds that skip blocks on a random-weight model (every block taken as self-similar in
    two heads)."""
    from graphopt.plan import save_plan

    layer = {"heads": 4, "is_causal": True, "seq_len": 300, "head_dim": 16, "simthreshd1": [-1.0, 0.3, 0.6, -1.0],
             "cdfthreshd": [0.5, 0.7, 0.9, 0.8], "pvthreshd": [None] * 4, "dense": [False] * 4,
             "sparsity": [0.5] * 4, "l1": [0.03] * 4, "pv_l1": [0.03] * 4, "heldout_l1": [0.04] * 4}
    path = tmp_path / "plan.json"
    save_plan(path, {"sparse_attention": {"version": 1, "block_m": 128, "block_n": 64, "l1": 0.05, "pv_l1": 0.05,
                                          "layers": {f"model.layers.{i}.self_attn": layer for i in range(layers)}}})
    return str(path)


def compiled_logits(model, ids, *, statistics_in_graph: bool, monkeypatch, **options):
    from graphopt import compiler as backend_module

    with monkeypatch.context() as patch:
        if not statistics_in_graph:  # the op pools q and k itself
            patch.setattr(sp, "emit_block_statistics", lambda graph, q, k: ())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="graphopt", options={"downstream": "eager", **SPARSE, **options})
        with backend_module.recording_decisions(reset=True) as sink, torch.no_grad():
            logits = compiled(ids).logits
    decisions = [d for d in sink if d.pass_name == "sparse_attention"]
    assert decisions and all(d.applied and "tuned plan" in d.reason for d in decisions), [d.reason for d in decisions]
    assert all(d.details["statistics_in_graph"] is statistics_in_graph for d in decisions)
    return logits


def test_llama_with_statistics_in_the_graph_equals_the_op_pooling_itself(monkeypatch, tmp_path):
    model, ids, plan = tiny_llama(), llama_ids(), llama_plan(tmp_path)
    with torch.no_grad():
        dense = model(ids).logits
    before = compiled_logits(model, ids, statistics_in_graph=False, monkeypatch=monkeypatch, plan=plan)
    after = compiled_logits(model, ids, statistics_in_graph=True, monkeypatch=monkeypatch, plan=plan)
    assert not torch.allclose(before, dense, atol=1e-4), "the predictor should skip blocks here"
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.slow
def test_llama_under_inductor_with_statistics_in_the_graph(monkeypatch, tmp_path):
    """Inductor compiles the statistics (its own reduction order): the same logits within fp32
    rounding."""
    model, ids, plan = tiny_llama(1), llama_ids(), llama_plan(tmp_path, 1)
    before = compiled_logits(model, ids, statistics_in_graph=False, monkeypatch=monkeypatch, plan=plan)
    after = compiled_logits(model, ids, statistics_in_graph=True, monkeypatch=monkeypatch, plan=plan,
                            downstream="inductor")
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_cost_model_prices_the_qk_read_in_the_graph_not_in_the_op():
    from graphopt.cost import sparse_attention as sparse_cost

    hw = get_spec("h100")
    b, h, hkv, length, d = 1, 32, 8, 8192, 128
    own = sparse_cost.estimate_predictor(hw, b, h, hkv, length, length, d)
    given = sparse_cost.estimate_predictor(hw, b, h, hkv, length, length, d, statistics_in_graph=True)
    qk_bytes = 2 * (b * h * length * d + b * hkv * length * d)
    assert own.bytes - given.bytes == qk_bytes and (own.launches, given.launches) == (3, 2)
    statistics = sparse_cost.estimate_block_statistics(hw, b, h, hkv, length, length, d)
    assert qk_bytes < statistics.bytes < 1.1 * qk_bytes and statistics.launches == sparse_cost.STATISTICS_LAUNCHES
    kernel = sparse_cost.estimate_sparse_kernel(hw, b, h, hkv, length, length, d, causal=True, sparsity=0.5)
    for in_graph, parts in ((True, (given, statistics)), (False, (own,))):
        whole = sparse_cost.estimate_sparse_attention(hw, b, h, hkv, length, length, d, causal=True, sparsity=0.5,
                                                      statistics_in_graph=in_graph)
        assert whole.ms == pytest.approx(kernel.ms + sum(p.ms for p in parts))


def test_the_cost_model_picks_where_the_statistics_are_computed(monkeypatch):
    """Without force, the graph gets the statistics only where the estimate says so; the decision
    names both estimates."""
    model, inputs = RotaryAttention(), rotary_inputs(L=512)
    for graph_cheaper in (True, False):
        monkeypatch.setattr(sp, "estimate_sparse_attention", _scaled_statistics(graph_cheaper))
        report = graphopt.explain(model, *inputs, target="h100", downstream="eager", passes={"sparse_attention": True})
        (decision,) = [d for d in report.decisions if d.pass_name == "sparse_attention"]
        assert decision.applied and decision.details["statistics_in_graph"] is graph_cheaper, decision.reason
        assert ("block statistics in the graph (estimated" if graph_cheaper else "pooled in the op (estimated") \
            in decision.reason


def _scaled_statistics(graph_cheaper: bool):
    """estimate_sparse_attention at 1 us (a win over dense), with the in-graph variant 10x cheaper
    or dearer than the op's."""
    from graphopt.cost import sparse_attention as sparse_cost

    def estimate(*args, statistics_in_graph=False, **kwargs):
        est = sparse_cost.estimate_sparse_attention(*args, **kwargs)
        return dataclasses.replace(est, ms=1e-3 * ((0.1 if graph_cheaper else 10.0) if statistics_in_graph else 1.0))
    return estimate
