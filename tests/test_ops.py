"""graphopt/ops.py: the inference-only ops (torch.library.Library definitions without an autograd
layer) refuse inputs that require grad in grad mode, in the kernel and in the fake, and run
otherwise; the passes that emit them decline graphs that will be differentiated."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt.kernels import fp4, q4


def _fp4_args(x):
    w = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(16, 64), "nvfp4"))
    return (x, w.codes, w.codes, w.scales, w.global_scale, None, 16, 64, "nvfp4")


def _q4_args(x):
    qweight, scales = q4.quantize_weight(torch.randn(16, 64))
    return (x, qweight, scales, None, "fused")


@pytest.mark.parametrize("op, make_args", [(torch.ops.graphopt.fp4_linear, _fp4_args),
                                           (torch.ops.graphopt.q4_linear, _q4_args)])
def test_inference_op_refuses_inputs_that_require_grad(op, make_args):
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    args = make_args(x)
    expected = op(*args)
    assert expected.shape == (3, 16) and not expected.requires_grad
    args_grad = make_args(x.clone().requires_grad_(True))[:1] + args[1:]
    with pytest.raises(RuntimeError, match="inference-only .* requires grad"):
        op(*args_grad)
    with torch.no_grad():  # the same input without grad mode: runs, same numbers
        torch.testing.assert_close(op(*args_grad), expected)
    with torch.inference_mode():
        torch.testing.assert_close(op(*args), expected)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the fake (what torch.compile traces) refuses too
        fake_x = mode.from_tensor(x.clone().requires_grad_(True))
        with pytest.raises(RuntimeError, match="inference-only"):
            op(fake_x, *args[1:])
        assert op(mode.from_tensor(x), *args[1:]).shape == (3, 16)


def test_pass_declines_a_graph_that_is_differentiated():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).requires_grad_(False)  # frozen weights, but the input requires grad
    x = torch.randn(2, 64, requires_grad=True)
    compiled = torch.compile(model, backend="graphopt", options={"passes": {"fp4_linear": True}, "force": True})
    y = compiled(x)
    y.sum().backward()  # the original linear stayed in place, so gradients reach x
    torch.testing.assert_close(x.grad, model.weight.sum(0).expand(2, 64))
    report = graphopt.explain(model, x.detach(), force=True, passes={"fp4_linear": True})
    assert report.counts.get("fp4_linear") == 1  # the same model, not differentiated: rewritten
