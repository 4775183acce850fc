"""graphopt.ops: the inference-only ops (torch.library.Library definitions without an autograd
layer) refuse inputs that require grad in grad mode, in the kernel and in the fake, and run
otherwise; the passes that emit them decline graphs that will be differentiated. graphopt::attention
records an autograd node exactly when a gradient is needed."""

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


def test_attention_op_records_autograd_only_when_a_gradient_is_needed():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 4, 9, 9, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False, scale=0.3)
    out = torch.ops.graphopt.attention(q, k, v, bias, 0.3, False, 1, "math")  # grad mode, nothing requires grad
    assert out.grad_fn is None
    torch.testing.assert_close(out, expected)
    for trainable in ((q,), (k, bias), (v,)):  # any one input that needs a gradient gets one
        leaves = [t.clone().requires_grad_(any(t is x for x in trainable)) for t in (q, k, v, bias)]
        out = torch.ops.graphopt.attention(*leaves, 0.3, False, 1, "math")
        assert out.grad_fn is not None
        ref_leaves = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
        ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves[:3], attn_mask=ref_leaves[3], scale=0.3)
        grad_out = torch.randn_like(out)
        wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
        got = torch.autograd.grad(out, [leaves[i] for i in wanted], grad_out)
        want = torch.autograd.grad(ref, [ref_leaves[i] for i in wanted], grad_out)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    with torch.no_grad():
        assert torch.ops.graphopt.attention(q.requires_grad_(True), k, v, bias, 0.3, False, 1, "math").grad_fn is None


def _hf_views(b=2, h=3, length=5, d=8, dtype=torch.float32, seed=0):
    """q, k, v as HF's attention builds them: proj(x).view(B, L, H, D).transpose(1, 2), strided."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, length, h, d, generator=g, dtype=dtype).transpose(1, 2) for _ in range(3))


@pytest.mark.parametrize("bias_grad", [False, True])
def test_attention_backward_fake_matches_the_real_strides(bias_grad):
    """The fake returns the real op's strides: the real dq is contiguous, and empty_like(q) (the
    strides of a transposed view) would fail Inductor's stride assertion when training with the
    Triton backend."""
    q, k, v = _hf_views()
    bias = torch.randn(1, 1, 5, 5).expand(2, 3, 5, 5) if bias_grad else None  # broadcast: stride 0
    out = torch.ops.graphopt.attention(q, k, v, bias, 0.3, False, 1, "sdpa_cpu")
    args = (torch.randn_like(out), q, k, v, bias, out, 0.3, False, 1, bias_grad)
    torch.library.opcheck(torch.ops.graphopt.attention_backward.default, args)
    real = torch.ops.graphopt.attention_backward(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.graphopt.attention_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                       for a in args))
    assert [t.stride() for t in fake] == [t.stride() for t in real]


@pytest.mark.parametrize("q_dtype, bias_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.float64, torch.float32), (torch.bfloat16, torch.float16),
                                                 (torch.bfloat16, torch.float32)])
def test_attention_op_takes_a_bias_of_another_float_dtype(q_dtype, bias_dtype):
    """A bias narrower than q works on CPU (q's finfo.min is not clamped in the bias dtype); a
    float32 one on half-precision q stays float32 (the CPU's SDPA adds it in float32, as eager's type
    promotion does); another one keeps HF's finfo.min padding finite. Reference: SDPA with the
    float32 bias as it is, or on q's dtype with the bias cast to it and clamped there."""
    q, k, v = (t.to(q_dtype) for t in _hf_views(seed=1))
    bias = torch.randn(2, 1, 5, 5).to(bias_dtype)
    bias[..., -1] = torch.finfo(bias_dtype).min  # padding, as HF writes it
    out = torch.ops.graphopt.attention(q, k, v, bias, 0.3, False, 1, "sdpa_cpu")
    kept = bias_dtype == torch.float32 and q_dtype in (torch.float16, torch.bfloat16)
    ref_bias = bias if kept else bias.to(q_dtype).clamp(min=torch.finfo(q_dtype).min)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ref_bias, scale=0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected)


def test_attention_op_bias_shapes():
    """A (Lk,) bias broadcasts as documented (SDPA itself refuses masks under 2-D); a bias that
    does not broadcast to (B, H, Lq, Lk) is a clear error, not an IndexError from inside SDPA."""
    q, k, v = _hf_views(seed=2)
    row = torch.randn(5)
    out = torch.ops.graphopt.attention(q, k, v, row, 0.3, False, 1, "sdpa_cpu")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=row.expand(2, 3, 5, 5), scale=0.3))
    with pytest.raises(ValueError, match=r"bias must broadcast to \(B, H, Lq, Lk\) = \(2, 3, 5, 5\), got shape \(4,\)"):
        torch.ops.graphopt.attention(q, k, v, torch.randn(4), 0.3, False, 1, "sdpa_cpu")


def test_fft_chain_op_output_is_contiguous_and_empty_batches_run():
    """Without a bias and with out_features not a multiple of the block, the op returned the
    cropped (..., n_out * B) view; its fake says contiguous, and Inductor asserted on the strides.
    An empty batch made MKL's FFT fail, forward and backward."""
    from graphopt.kernels.fft_chain import FFTChainLinear

    layer = FFTChainLinear(24, 20, 8, 2, bias=False, seed=0)
    x = torch.randn(2, 3, 24)
    y = layer(x)
    assert y.is_contiguous()
    torch.testing.assert_close(torch.compile(layer, backend="inductor")(x), y)
    biased = FFTChainLinear(24, 20, 8, 2, bias=True, seed=0)
    empty = torch.randn(0, 24, requires_grad=True)
    out = biased(empty)
    assert out.shape == (0, 20)
    out.sum().backward()
    assert empty.grad.shape == (0, 24) and not biased.bias.grad.any() and not biased.coeffs.grad.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton attention backward runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_attention_backend_trains_under_inductor(dtype):
    """A LLaMA-style causal attention on HF's transposed q/k/v views, compiled with the Triton
    backend and trained one step: the backward passes Inductor's stride assertion on the fake's dq.
    Gradients match eager's."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 192)

        def forward(self, x):
            b, length, _ = x.shape
            q, k, v = (t.transpose(1, 2) for t in self.proj(x).view(b, length, 3, 4, 16).unbind(2))
            mask = torch.full((length, length), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
            scores = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, -1)
            return (scores @ v).transpose(1, 2).reshape(b, length, 64)

    torch.manual_seed(0)
    model = Attention().to("cuda", dtype)
    x = torch.randn(2, 128, 64, device="cuda", dtype=dtype)
    model(x).float().square().sum().backward()
    expected = model.proj.weight.grad.clone()
    model.zero_grad()
    from graphopt import compiler as backend_module

    with backend_module.recording_decisions(reset=True) as decisions:
        compiled = torch.compile(model, backend="graphopt", options={"attention_backend": "triton", "force": True})
        compiled(x).float().square().sum().backward()
    assert any(d.pass_name == "attention" and d.applied for d in decisions)
    torch.testing.assert_close(model.proj.weight.grad, expected, atol=0.05 * expected.abs().max().item(), rtol=0.05)


def _float64_attention(q, k, v, bias, scale, groups):
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.double()
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("bias_kind", ["none", "bool", "float"])
def test_attention_in_graph_traces_into_sdpa_and_trains(bias_kind):
    """The rewrite's in-graph form of an SDPA-backend attention: under AOT autograd it becomes the
    backend's aten call (math on the CPU) with SDPA's own backward; GQA 6/2, odd lengths, a mask
    of either kind. Forward and gradients equal a float64 reference."""
    from graphopt.ops import attention_in_graph

    torch.manual_seed(3)
    q = torch.randn(2, 6, 7, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 11, 16, requires_grad=True) for _ in range(2))
    bias = {"none": None, "bool": torch.rand(1, 1, 7, 11) > 0.3, "float": torch.randn(2, 1, 7, 11)}[bias_kind]
    if bias is not None and bias.dtype == torch.bool:
        bias[..., 0] = True  # no row masked everywhere
    fn = torch.compile(lambda q, k, v: attention_in_graph(q, k, v, bias, 0.3, False, 3, "math"), backend="aot_eager")
    out = fn(q, k, v)
    expected = _float64_attention(q, k, v, bias, 0.3, 3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not an SDPA backend; valid choices: flash, cudnn, efficient, math"):
        attention_in_graph(q, k, v, None, 0.3, False, 3, "triton")
