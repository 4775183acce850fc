"""graphopt::attention's training path on the Triton backend: the forward keeps the kernel's
log-sum-exp (graphopt::attention_forward_with_lse) and the backward (graphopt::attention_backward)
runs from it, launching no forward kernel; inference calls run graphopt::attention alone.

The op sends CPU tensors to SDPA, so without a GPU the `triton_here` fixture points its
"triton" backend at the Triton kernels, which conftest runs under TRITON_INTERPRET=1 (small, odd
shapes: full, partial and diagonal blocks). Gradients are checked against float64 autograd of the
torch reference."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from graphopt import ops
from graphopt.kernels.flash_attention import launchers, reference_attention

from tests.kernels.test_flash_attention import DEVICE, GRAD_TOL, OUT_TOL, _qkv
from tests.kernels.test_flash_attention_variants import _bias, _slopes


@pytest.fixture
def triton_here(monkeypatch):
    """The "triton" backend runs the Triton kernels on DEVICE (the GPU, or the CPU's interpreter)."""
    monkeypatch.setattr(ops, "_triton_kernel_runs", lambda q, backend: backend == "triton")


@pytest.fixture
def launches(monkeypatch):
    """Names of the autotuned flash-attention kernels launched, in order."""
    seen = []
    original = launchers.launch_tuned

    def counting(kernel, *args, **kwargs):
        seen.append(kernel.fn.__name__)
        return original(kernel, *args, **kwargs)

    monkeypatch.setattr(launchers, "launch_tuned", counting)
    return seen


class _GraphoptOps(TorchDispatchMode):
    """Records the graphopt::* ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "graphopt":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


# (batch, heads, kv_heads, Lq, Lk, head_dim, causal, softcap, alibi, bias, dtype)
CASES = {
    "odd-causal": (1, 2, 2, 37, 37, 64, True, 0.0, False, None, torch.float32),
    "gqa-lq<lk-fp16": (1, 4, 2, 19, 45, 64, False, 0.0, False, None, torch.float16),
    "gqa4-causal-lq>lk-d40": (2, 4, 1, 45, 19, 40, True, 0.0, False, None, torch.float32),
    "d128-gqa-causal": (1, 8, 2, 33, 33, 128, True, 0.0, False, None, torch.float32),
    "llama-3.2-1b-heads-fp16": (1, 32, 8, 67, 67, 64, True, 0.0, False, None, torch.float16),
    "softcap-causal-gqa": (1, 4, 2, 37, 45, 64, True, 5.0, False, None, torch.float32),
    "alibi-padding-mask-fp16": (2, 2, 2, 37, 37, 32, False, 0.0, True, "mask", torch.float16),
    "softcap-alibi-causal-float-bias": (1, 2, 2, 33, 33, 32, True, 8.0, True, "float", torch.float32),
}


def _case(name, seed=0):
    batch, heads, kv_heads, len_q, len_k, head_dim, causal, softcap, alibi, bias_kind, dtype = CASES[name]
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed, qk_scale=2.0 if softcap else 1.0)
    bias = _bias(bias_kind, batch, heads, len_q, len_k)
    if bias is not None and bias.is_floating_point():
        bias = bias.to(dtype)
    args = (bias, head_dim ** -0.5, causal, heads // kv_heads, "triton", softcap, _slopes(heads) if alibi else None)
    return q, k, v, args


def _reference64(q, k, v, args):
    bias, scale, causal, _, _, softcap, slopes = args
    if bias is not None and bias.is_floating_point():
        bias = bias.double()
    return reference_attention(q, k, v, bias, scale=scale, is_causal=causal, softcap=softcap, alibi_slopes=slopes)


def _assert_grads_close(got, want, dtype, names):
    for g, w, name in zip(got, want, names):
        scale = float(w.abs().max())
        torch.testing.assert_close(g.double(), w, atol=GRAD_TOL[dtype] * scale, rtol=GRAD_TOL[dtype],
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_backward_runs_from_the_forward_lse_and_matches_float64(name, triton_here, launches):
    q, k, v, args = _case(name)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with _GraphoptOps() as forward_ops:
        out = torch.ops.graphopt.attention(*leaves, *args)
    forward_launches = list(launches)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, q.dtype)
    launches.clear()
    with _GraphoptOps() as backward_ops:
        grads = torch.autograd.grad(out, leaves, grad_out)
    assert launches == ["_flash_attention_bwd_dkdv_kernel", "_flash_attention_bwd_dq_kernel"]  # no forward
    assert forward_launches == ["_flash_attention_fwd_kernel"]
    assert forward_ops.names == ["attention_forward_with_lse"] and backward_ops.names == ["attention_backward"]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _reference64(*ref_leaves, args)
    torch.testing.assert_close(out.double(), ref, atol=OUT_TOL[q.dtype], rtol=OUT_TOL[q.dtype])
    _assert_grads_close(grads, torch.autograd.grad(ref, ref_leaves, grad_out.double()), q.dtype, "qkv")


@pytest.mark.parametrize("name", ["odd-causal", "softcap-alibi-causal-float-bias"])
def test_a_trainable_bias_takes_the_recomputing_route(name, triton_here, launches):
    """The Triton backward has no bias gradient: where the bias needs one, the forward returns no
    LSE and the backward differentiates SDPA instead (soft-capped: the explicit formulas)."""
    q, k, v, args = _case(name)
    bias = torch.randn(1, q.shape[1], q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    with _GraphoptOps() as recorded:
        out = torch.ops.graphopt.attention(*leaves, *args[1:])
    assert recorded.names == ["attention"] and launches == ["_flash_attention_fwd_kernel"]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = _reference64(*ref_leaves[:3], (ref_leaves[3], *args[1:]))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE, q.dtype)
    got = torch.autograd.grad(out, leaves, grad_out)
    _assert_grads_close(got, torch.autograd.grad(ref, ref_leaves, grad_out.double()), q.dtype, ["q", "k", "v", "bias"])


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "frozen inputs"])
def test_inference_calls_run_the_plain_forward(context, triton_here, launches):
    """Without a gradient to record, the op returns `out` alone: no LSE op, no autograd node."""
    q, k, v, args = _case("gqa4-causal-lq>lk-d40")
    guard = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(context, torch.enable_grad)
    inputs = (q, k, v) if context == "frozen inputs" else [t.clone().requires_grad_() for t in (q, k, v)]
    with guard(), _GraphoptOps() as recorded:
        out = torch.ops.graphopt.attention(*inputs, *args)
    assert recorded.names == ["attention"] and launches == ["_flash_attention_fwd_kernel"]
    assert isinstance(out, torch.Tensor) and out.grad_fn is None
    torch.testing.assert_close(out.double(), _reference64(q.double(), k.double(), v.double(), args),
                               atol=OUT_TOL[q.dtype], rtol=OUT_TOL[q.dtype])


def test_compiled_training_saves_the_lse_for_the_backward(triton_here, launches):
    """Under AOT autograd the forward graph holds attention_forward_with_lse, the backward graph
    graphopt::attention_backward reading its LSE and no forward op; at run time the backward
    launches no forward kernel, and gradients match float64."""
    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    q, k, v, args = _case("softcap-causal-gqa")

    def step(q, k, v):
        return torch.ops.graphopt.attention(q, k, v, *args).float().square().sum()

    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward")))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss = compiled(*leaves)
    assert torch.ops.graphopt.attention_forward_with_lse.default in graphs["forward"]
    assert torch.ops.graphopt.attention.default not in graphs["forward"]
    launches.clear()
    grads = torch.autograd.grad(loss, leaves)  # compiles the backward graph, then runs it
    assert torch.ops.graphopt.attention_backward.default in graphs["backward"]
    assert not {torch.ops.graphopt.attention.default, torch.ops.graphopt.attention_forward_with_lse.default} & set(
        graphs["backward"])
    assert "_flash_attention_fwd_kernel" not in launches and "_flash_attention_bwd_dq_kernel" in launches
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_loss = _reference64(*ref_leaves, args).square().sum()
    _assert_grads_close(grads, torch.autograd.grad(ref_loss, ref_leaves), q.dtype, "qkv")


def test_triton_backward_refuses_a_missing_lse(triton_here):
    q, k, v, args = _case("odd-causal")
    bias, scale, causal, groups, _, softcap, slopes = args
    out = torch.ops.graphopt.attention(q, k, v, *args)
    with pytest.raises(ValueError, match=r"needs the forward's lse \(B, H, Lq\) = \(1, 2, 37\) from "
                                         r"graphopt::attention_forward_with_lse, got none"):
        torch.ops.graphopt.attention_backward(torch.ones_like(out), q, k, v, bias, out, scale, causal, groups, False)
    with pytest.raises(ValueError, match=r"got shape \(1, 2\)"):
        torch.ops.graphopt.attention_backward(torch.ones_like(out), q, k, v, bias, out, scale, causal, groups, False,
                                              softcap, slopes, torch.zeros(1, 2))


def test_forward_with_lse_op_contract():
    """Off the Triton kernel the op is the torch reference's (out, lse); its fake matches; it has
    no autograd of its own and says where to go instead."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 7, 16, generator=gen)
    k, v = (torch.randn(2, 2, 11, 16, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 1, 11, generator=gen) > 0.3
    mask[..., 0] = True
    args = (q, k, v, mask, 0.3, False, 2, 4.0, _slopes(4).cpu())
    torch.library.opcheck(torch.ops.graphopt.attention_forward_with_lse.default, args)
    out, lse = torch.ops.graphopt.attention_forward_with_lse(*args)
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), mask, scale=0.3, is_causal=False,
                                       return_lse=True, softcap=4.0, alibi_slopes=_slopes(4).cpu())
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    backward_args = (torch.randn_like(out), q, k, v, mask, out, 0.3, False, 2, False, 4.0, _slopes(4).cpu(), lse)
    torch.library.opcheck(torch.ops.graphopt.attention_backward.default, backward_args)
    with pytest.raises(RuntimeError, match="attention_forward_with_lse has no backward of its own.*call graphopt::attention"):
        torch.ops.graphopt.attention_forward_with_lse(q.clone().requires_grad_(), *args[1:])
    with pytest.raises(ValueError, match="num_kv_groups"):
        torch.ops.graphopt.attention_forward_with_lse(*args[:6], 3, *args[7:])


@pytest.mark.parametrize("name", ["softcap-alibi-causal-float-bias", "alibi-padding-mask-fp16"])
def test_backward_op_formulas_off_the_kernel_match_float64(name):
    """graphopt::attention_backward off the Triton kernel (CPU, or a bias that takes a gradient):
    the explicit formulas, soft-capping, ALiBi and the bias gradient included."""
    q, k, v, args = _case(name)
    q, k, v = (t.cpu() for t in (q, k, v))
    bias, scale, causal, groups, _, softcap, slopes = args
    bias = bias.cpu() if bias is not None else None
    slopes = slopes.cpu() if slopes is not None else None
    bias_grad = bias is not None and bias.is_floating_point()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)] + ([bias.double().requires_grad_()] if bias_grad else [])
    ref = reference_attention(*leaves[:3], leaves[3] if bias_grad else bias, scale=scale, is_causal=causal,
                              softcap=softcap, alibi_slopes=slopes)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype)
    got = torch.ops.graphopt.attention_backward(grad_out, q, k, v, bias, ref.to(q.dtype), scale, causal, groups,
                                                bias_grad, softcap, slopes)
    want = torch.autograd.grad(ref, leaves, grad_out.double())
    _assert_grads_close(got[:len(want)], want, q.dtype, ["q", "k", "v", "bias"])
    assert bias_grad or got[3].numel() == 0
