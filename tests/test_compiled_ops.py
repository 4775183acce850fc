"""graphopt's Triton-backed ops inside an Inductor graph (GPU; skipped without one).

Inductor must launch the ops' Triton kernels from its own generated code (no call back into the
op's Python body), must not copy the packed weights per call (its kernel mutation analysis must
see that only the outputs and the per-call split-K buffers are written), and the results must
equal the op called eagerly, with and without CUDA graphs, and with Inductor's C++ wrapper."""

import pytest
import torch

import graphopt
from graphopt.compiler import recording_decisions

# a rewritten graph that fell back to the unrewritten one would still give equal outputs: make it fail
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("error:graphopt. the downstream compiler failed:RuntimeWarning")]


class _Mlp(torch.nn.Module):
    def __init__(self, hidden: int = 1024, inner: int = 2816):
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner, bias=False)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _compiled_code(model, x, options, mode):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphopt.backend(**options), mode=mode)
    with torch.no_grad(), recording_decisions() as decisions:
        out, code = run_and_get_code(compiled, x)
        out = out.clone()  # a CUDA-graph output is overwritten by the next replay
        outputs = []
        for _ in range(3):  # replays, with fresh activations for the last one
            torch.compiler.cudagraph_mark_step_begin()
            outputs.append(compiled(x).clone())
    return out, outputs, "\n".join(code), decisions


@pytest.mark.parametrize("pass_name", ["fp4_linear", "q4_linear"])
@pytest.mark.parametrize("tokens", [1, 48])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_launches_the_kernels_and_copies_no_weight(pass_name, tokens, mode, caplog):
    caplog.set_level("WARNING")
    torch.manual_seed(tokens)
    model = _Mlp().cuda().to(torch.bfloat16).eval()
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    options = {"passes": {pass_name: True}, "force": True}
    out, replays, code, decisions = _compiled_code(model, x, options, mode)
    applied = [d for d in decisions if d.pass_name == pass_name and d.applied]
    assert len(applied) == 2, [d.reason for d in decisions]
    # the ops' own Python bodies are not called from the compiled code, except the Gluon decodes
    # (opaque ops by design)
    assert f"torch.ops.graphopt.{pass_name}.default" not in code
    # no per-call copy of a packed weight: had the mutation analysis failed, every kernel argument
    # would be cloned before the launch (Inductor logs that, and names the copy kernels so)
    assert "fused_clone" not in code and "fused_copy" not in code
    assert not [r for r in caplog.records if "assuming every input is mutated" in r.getMessage()]
    # equal to the same graph run eagerly through the ops
    eager = torch.compile(model, backend=graphopt.backend(downstream="eager", **options))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = eager(x)
    for got in [out, *replays]:
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pass_name", ["fp4_linear", "q4_linear"])
@pytest.mark.parametrize("tokens", [1, 48])
def test_the_cpp_wrapper_launches_the_kernels_from_cpp_with_the_same_results(pass_name, tokens):
    """Inductor's C++ wrapper (`cpp_wrapper`, the way to a one-launch host cost without CUDA
    graphs): the kernels are launched from the generated C++ with no Python op body, and the results
    equal the Python wrapper's (same kernels and tiles; split-K tiles add their partial sums in
    whatever order the programs finish)."""
    from torch._inductor import config as inductor_config

    torch.manual_seed(tokens + 7)
    model = _Mlp().cuda().to(torch.bfloat16).eval()
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    options = {"passes": {pass_name: True}, "force": True}
    python_out, _, _, _ = _compiled_code(model, x, options, "default")
    with inductor_config.patch(cpp_wrapper=True):
        cpp_out, replays, code, decisions = _compiled_code(model, x, options, "default")
    assert len([d for d in decisions if d.pass_name == pass_name and d.applied]) == 2
    assert "launchKernel" in code and f"torch.ops.graphopt.{pass_name}" not in code
    for got in [cpp_out, *replays]:
        torch.testing.assert_close(got, python_out, atol=1e-2, rtol=1e-2)


class _CausalGqaAttention(torch.nn.Module):
    """LLaMA-style hand-written attention: GQA 8/2 with repeated K/V, an additive causal mask, and
    optionally an additive per-key float bias on top (of a size bf16 adds to the scores exactly
    enough to compare with float64)."""

    def __init__(self, padded: bool):
        super().__init__()
        self.padded = padded
        self.register_buffer("key_bias", torch.randn(257, generator=torch.Generator().manual_seed(0)))

    def forward(self, q, k, v):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        length = q.shape[-2]
        mask = torch.full((length, length), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        if self.padded:
            mask = mask + self.key_bias[:length].to(q.dtype)
        scores = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask, -1)
        return scores @ v


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_backends_go_into_the_graph_as_aten_calls_and_train(backend, padded):
    """An attention rewritten onto an SDPA backend reaches Inductor as that backend's aten call:
    the generated code never calls graphopt::attention's Python body, and the backend's own
    backward runs. Forward and gradients against float64, under CUDA graphs too."""
    if backend == "flash" and padded:
        pytest.skip("flash takes no mask")
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(1)
    shape_q, shape_kv = (2, 8, 257, 64), (2, 2, 257, 64)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    model = _CausalGqaAttention(padded).cuda()
    reference = model(*(t.double() for t in (q, k, v)))
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        options = {"attention_backend": backend, "force": True}
        compiled = torch.compile(model, backend=graphopt.backend(**options), mode=mode)
        with recording_decisions() as decisions:
            out, code = run_and_get_code(compiled, q, k, v)
        (d,) = [d for d in decisions if d.pass_name == "attention"]
        assert d.applied and d.implementation == backend and d.details["emitted"] == f"aten SDPA ({backend})", d.reason
        code = "\n".join(code)
        assert "graphopt.attention" not in code and "scaled_dot_product" in code
        torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        want = torch.autograd.grad(reference, (q, k, v), grad.double(), retain_graph=True)
        for g, w in zip(got, want):
            scale = w.abs().max().item()
            torch.testing.assert_close(g.double(), w.double(), atol=2e-2 * scale, rtol=2e-2)
