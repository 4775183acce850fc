"""graphopt's Triton-backed ops inside an Inductor graph (GPU; skipped without one).

Inductor must launch the ops' Triton kernels from its own generated code (no call back into the
op's Python body), must not copy the packed weights per call (its kernel mutation analysis must
see that only the outputs and the per-call split-K buffers are written), and the results must
equal the op called eagerly, with and without CUDA graphs."""

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
