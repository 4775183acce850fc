"""Every pass under CUDA graphs (GPU; skipped without one).

The same model, compiled with one pass forced on, once without CUDA graphs and once with
mode="reduce-overhead": the recorded graph replays with fresh inputs and gives the outputs of the
graph without CUDA graphs, and the pass did rewrite."""

import pytest
import torch

import graphopt
from graphopt.compiler import recording_decisions
from graphopt.kernels import fft_chain
from graphopt.kernels import sparse_attention as sa

# a rewritten graph that fell back to the unrewritten one would still give equal outputs: make it fail
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("error:graphopt. the downstream compiler failed:RuntimeWarning")]
BF16 = torch.bfloat16


class _Attention(torch.nn.Module):
    """softmax(q k^T * scale, causal) v, hand-written."""

    def __init__(self, length: int, head_dim: int):
        super().__init__()
        self.scale = head_dim**-0.5
        self.register_buffer("tril", torch.ones(length, length, dtype=torch.bool).tril(), persistent=False)

    def forward(self, q, k, v):
        scores = (q * self.scale) @ k.transpose(-2, -1)
        return scores.masked_fill(~self.tril, float("-inf")).softmax(dim=-1) @ v


def _attention_case(seed):
    length, head_dim = 512, 64
    q, k, v = (t.to("cuda", BF16) for t in sa.local_sink_qkv(1, 4, length, head_dim, seed=seed))
    return _Attention(length, head_dim).cuda(), (q, k, v)


def _linear_case(seed, tokens=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2816, bias=False), torch.nn.SiLU(),
                                torch.nn.Linear(2816, 1024, bias=False)).cuda().to(BF16)
    return model, (torch.randn(tokens, 1024, device="cuda", dtype=BF16, generator=_gen(seed)),)


def _fft_case(seed):
    torch.manual_seed(0)
    layer = fft_chain.FFTChainLinear(1024, 1024, block_size=256, k=2, device="cuda")
    torch.nn.init.normal_(layer.coeffs, std=0.02)
    torch.nn.init.normal_(layer.bias, std=0.02)
    return layer, (torch.randn(8, 1024, device="cuda", generator=_gen(seed)),)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


CASES = {"attention": _attention_case, "sparse_attention": _attention_case, "fp4_linear": _linear_case,
         "q4_linear": _linear_case, "fft_linear": _fft_case}


def _outputs(pass_name, mode):
    """The model's outputs on three fresh inputs, compiled with `pass_name` forced on, and the
    decisions of the compile."""
    torch._dynamo.reset()
    model, _ = CASES[pass_name](0)
    compiled = torch.compile(model.eval(), backend=graphopt.backend(passes={pass_name: True}, force=True), mode=mode)
    outputs = []
    with torch.no_grad(), recording_decisions(reset=True) as decisions:
        for seed in (1, 2, 3):
            _, inputs = CASES[pass_name](seed)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            outputs.append(compiled(*inputs).clone())  # a replay overwrites the last output
    torch._dynamo.reset()
    return outputs, list(decisions)


@pytest.mark.parametrize("pass_name", sorted(CASES))
def test_every_pass_replays_under_cuda_graphs_with_the_outputs_of_the_plain_graph(pass_name):
    plain, _ = _outputs(pass_name, "default")
    graphed, decisions = _outputs(pass_name, "reduce-overhead")
    assert any(d.pass_name == pass_name and d.applied for d in decisions), [d.reason for d in decisions]
    for got, want in zip(graphed, plain):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16: a tile may sum in another order
    assert not torch.allclose(plain[0], plain[1])  # the inputs differ, so must the outputs
