"""Decode fusion (graphopt.passes.linear_fusion): at one token the RMSNorms, the SiLU gate and the
residual adds of a LLaMA layer go into the quantized linears' op, and the outputs stay those of the
unfused graph; chains read by anything else, other token counts and other forms are left alone."""

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.passes import GraphPass, register_extra_pass, unregister_extra_pass

transformers = pytest.importorskip("transformers")


def _llama(dtype=torch.float32, layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def _explain(model, ids, **options):
    return graphopt.explain(model, ids, passes={"fp4_linear": True}, force=True, downstream="eager", **options)


def _same(got, want):
    """Equal bit for bit, but in fp32 to a few ulps: the gated call's interleaved gate and up rows
    change the order of the CPU GEMV's sums."""
    exact = got.dtype != torch.float32
    torch.testing.assert_close(got, want, atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5)


def _fused(report):
    return [d.details.get("fused", []) for d in report.decisions if d.pass_name == "fp4_linear" and d.applied]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_llama_layers_take_their_norms_gate_and_residuals_in_and_compute_the_same(dtype):
    model = _llama(dtype)
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(3))
    fused = _explain(model, ids)
    plain = _explain(model, ids, fuse_decode_neighbours=False)
    # per layer: q/k/v (one call) take their RMSNorm, gate/up (one call) its RMSNorm and the SiLU gate after
    # it, o_proj and down_proj the residual; lm_head the final norm (through HF's no-op slice)
    by_location = {d.location: d.details.get("fused") for d in fused.decisions if d.pass_name == "fp4_linear"}
    for i in range(2):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert by_location[f"model.layers.{i}.self_attn.{name}"] == ["rms_norm"]
        assert by_location[f"model.layers.{i}.self_attn.o_proj"] == ["residual"]
        assert by_location[f"model.layers.{i}.mlp.gate_proj"] == ["rms_norm", "silu_gate"]
        assert by_location[f"model.layers.{i}.mlp.up_proj"] == ["rms_norm", "silu_gate"]
        assert by_location[f"model.layers.{i}.mlp.down_proj"] == ["residual"]
    assert by_location["lm_head"] == ["rms_norm"]
    assert all(not f for f in _fused(plain))
    # the op computes the neighbours as the model did, op for op (the CPU path): the same logits
    _same(fused.output.logits, plain.output.logits)


class _Calls(GraphPass):
    """Records (target, args) of every call in the graph the registry's passes left (run after them)."""
    name = "record_calls"
    lossless = True

    def __init__(self):
        self.calls = []

    def run(self, ctx):
        self.calls = [(n.target, n.args) for n in ctx.gm.graph.nodes if n.op in ("call_function", "call_method")]


def _explain_recording_calls(model, ids):
    recorder = _Calls()
    register_extra_pass(recorder)
    try:
        report = _explain(model, ids)
    finally:
        unregister_extra_pass(recorder.name)
    return report, recorder.calls


def test_the_fused_graph_has_no_norm_gate_or_residual_ops_left():
    model = _llama()
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(4))
    _, calls = _explain_recording_calls(model, ids)
    targets = [str(target) for target, _ in calls]
    assert not any("rsqrt" in t or "silu" in t or t in ("pow", "mean") for t in targets), targets
    assert sum("fp4_linear" in t for t in targets) == 2 * 4 + 1  # qkv, o, gate/up, down per layer; lm_head
    assert "<built-in function add>" in targets  # RoPE's adds stay: only the residual adds went in


def test_prefill_is_not_fused():
    model = _llama()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    prefill = _explain(model, ids)
    assert _fused(prefill) and all(not f for f in _fused(prefill))
    torch.testing.assert_close(prefill.output.logits, _explain(model, ids, fuse_decode_neighbours=False).output.logits,
                               atol=0, rtol=0)


class _NormReadTwice(torch.nn.Module):
    """A LLaMA-style RMSNorm whose output also leaves the graph: it must stay computed."""

    def __init__(self, width=64):
        super().__init__()
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(width, eps=1e-5)
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        normed = self.norm(h)
        return self.proj(normed), normed


class _GateUpDown(torch.nn.Module):
    """A [gate | up] GEMM (gate_up) and a down projection; subclasses write the forward between them."""

    def __init__(self, width=64, bias=False):
        super().__init__()
        self.gate_up = torch.nn.Linear(width, 2 * width, bias=bias)
        self.down = torch.nn.Linear(width, width, bias=False)


class _GemmaNorm(_GateUpDown):
    """(1 + w) RMSNorm and a GELU gate: forms the fusion does not take."""

    def __init__(self, width=64):
        super().__init__(width)
        self.weight = torch.nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, h):
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = (x * (1.0 + self.weight.float())).to(h.dtype)
        gate, up = self.gate_up(x).split([64, 64], -1)
        return h + self.down(F.gelu(gate) * up)


class _BroadcastResidual(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.shift = torch.nn.Parameter(torch.randn(width))

    def forward(self, h):
        return self.proj(h) + self.shift  # (width,) broadcast: not a residual of the output's shape


class _LastLogits(torch.nn.Module):
    """The decode loop's call: logits of the last position only (HF's x[:, -1:, :] before lm_head)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, logits_to_keep=1).logits


def test_lm_head_takes_the_final_norm_through_the_last_position_slice_of_one_token():
    wrapped = _LastLogits(_llama()).eval()
    one = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(7))
    fused = _explain(wrapped, one)
    by_location = {d.location: d.details.get("fused") for d in fused.decisions if d.pass_name == "fp4_linear"}
    assert by_location["model.lm_head"] == ["rms_norm"]
    _same(fused.output, _explain(wrapped, one, fuse_decode_neighbours=False).output)


class _ResidualChangedInPlace(torch.nn.Module):
    """r is written in place after the linear and before the add: the add must read the new value."""

    def __init__(self, width=64):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        r = h * 1.0
        y = self.proj(h)
        r.mul_(2.0)
        return r + y


@torch.library.custom_op("graphopt_tests::scale_in_place", mutates_args=("t",))
def _scale_in_place(t: torch.Tensor, s: float) -> None:
    t.mul_(s)


class _ResidualWrittenOtherwise(torch.nn.Module):
    """r is written after the linear and before the add by a form whose name does not end in "_":
    relu(inplace=True), an out= argument, a custom op with a mutable argument."""

    def __init__(self, how: str, width=64):
        super().__init__()
        self.how = how
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        r = h * 1.0
        y = self.proj(h)
        if self.how == "inplace":
            F.relu(r, inplace=True)
        elif self.how == "out":
            torch.mul(h, 2.0, out=r)
        else:
            torch.ops.graphopt_tests.scale_in_place(r, 3.0)
        return r + y


class _NormWithMeanInAnotherDtype(torch.nn.Module):
    """An RMSNorm whose mean of squares is taken in bf16 (dtype=): not LLaMA's fp32 mean."""

    def __init__(self, width=64):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True, dtype=torch.bfloat16) + 1e-5)
        return self.proj(self.weight * x.to(h.dtype))


class _NormInputChangedInPlace(torch.nn.Module):
    """h is written in place between the norm and the linear: the linear must see the norm of the old h
    (the residual add after it reads the new h, as the op would)."""

    def __init__(self, width=64):
        super().__init__()
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(width, eps=1e-5)
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        h = h * 1.0
        normed = self.norm(h)
        h.add_(1.0)
        return self.proj(normed) + h


class _NormWeightNotPerFeature(torch.nn.Module):
    """An RMSNorm whose weight is (1, 1, K): broadcasting makes it the same product, but the op takes (K,)."""

    def __init__(self, width=64):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(1, 1, width))
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.proj(self.weight * x.to(h.dtype))


class _SiluOfTheSecondHalf(_GateUpDown):
    """silu of the second half of a packed GEMM's output times the first: not the [gate | up] order
    the op reads."""

    def forward(self, h):
        up, gate = self.gate_up(h).split([64, 64], -1)
        return self.down(up * F.silu(gate))


class _GateWithBias(_GateUpDown):
    """A [gate | up] GEMM with a bias: the gate stays outside (the pass interleaves only bias-free weights)."""

    def __init__(self, width=64):
        super().__init__(width, bias=True)

    def forward(self, h):
        gate, up = self.gate_up(h).split([64, 64], -1)
        return self.down(F.silu(gate) * up)


class _GateReadTwice(_GateUpDown):
    """The gate half is also returned: the gated op would not produce it."""

    def forward(self, h):
        gate, up = self.gate_up(h).split([64, 64], -1)
        return self.down(F.silu(gate) * up), gate


class _InPlaceResidualAndWiderResidual(torch.nn.Module):
    """y += h (written into the op's output) and an fp32 residual added to a bf16 output."""

    def __init__(self, width=64):
        super().__init__()
        self.a = torch.nn.Linear(width, width, bias=False)
        self.b = torch.nn.Linear(width, width, bias=False)

    def forward(self, h):
        y = self.a(h)
        y += h
        return y, self.b(h) + h.float()


@pytest.mark.parametrize("model,dtype,expected", [
    (_NormReadTwice(), torch.float32, {"proj": []}),
    (_GemmaNorm(), torch.float32, {"gate_up": [], "down": ["residual"]}),
    (_BroadcastResidual(), torch.float32, {"proj": []}),
    (_ResidualChangedInPlace(), torch.bfloat16, {"proj": []}),
    (_NormInputChangedInPlace(), torch.bfloat16, {"proj": ["residual"]}),  # the add reads h after the write, as the op does
    (_NormWeightNotPerFeature(), torch.bfloat16, {"proj": []}),
    (_SiluOfTheSecondHalf(), torch.bfloat16, {"gate_up": [], "down": []}),
    (_InPlaceResidualAndWiderResidual(), torch.bfloat16, {"a": [], "b": []}),
    (_GateWithBias(), torch.bfloat16, {"gate_up": [], "down": []}),
    (_GateReadTwice(), torch.bfloat16, {"gate_up": [], "down": []}),
    (_ResidualWrittenOtherwise("inplace"), torch.float32, {"proj": []}),
    (_ResidualWrittenOtherwise("out"), torch.float32, {"proj": []}),
    (_ResidualWrittenOtherwise("custom_op"), torch.float32, {"proj": []}),
    (_NormWithMeanInAnotherDtype(), torch.float32, {"proj": []}),
], ids=["norm-read-twice", "gemma-norm-gelu-gate", "broadcast-add", "residual-written-in-place",
        "norm-input-written-in-place", "norm-weight-1x1xK", "silu-of-the-second-half", "in-place-add-and-fp32-residual",
        "gate-with-bias", "gate-read-twice", "residual-written-by-relu-inplace", "residual-written-through-out",
        "residual-written-by-a-custom-op", "norm-mean-in-bf16"])
def test_forms_it_does_not_take_and_writes_in_between_are_left_alone_and_compute_the_same(model, dtype, expected):
    model = model.eval().to(dtype)
    h = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    report = _explain(model, h)
    got = {d.location: d.details.get("fused", []) for d in report.decisions if d.pass_name == "fp4_linear" and d.applied}
    assert got == expected
    plain = _explain(model, h, fuse_decode_neighbours=False).output
    for fused_out, plain_out in zip(*(o if isinstance(o, tuple) else (o,) for o in (report.output, plain))):
        torch.testing.assert_close(fused_out, plain_out, atol=0, rtol=0)


def test_no_kernel_placeholder_is_left_in_the_graph_or_the_decisions():
    """Kernels are chosen after the fusion from placeholders: none may reach the compiled graph (the
    CPU reference never reads the string, so a leak would only show on a GPU)."""
    report, calls = _explain_recording_calls(_llama(), torch.randint(0, 128, (1, 1)))
    kernels = [args[9] for target, args in calls if target is torch.ops.graphopt.fp4_linear.default]
    assert len(kernels) == 2 * 4 + 1
    assert not [k for k in kernels if "pending" in k]
    assert not [d for d in report.decisions if "pending" in str(d.details.get("kernel", ""))]


@pytest.mark.parametrize("kept", [("residual",), ("rms_norm", "silu_gate")], ids="+".join)
def test_a_list_of_neighbours_keeps_only_those(kept):
    """fuse_decode_neighbours=[names]: the ablation of one kind of neighbour."""
    model = _llama()
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(9))
    report = _explain(model, ids, fuse_decode_neighbours=list(kept))
    taken = {name for names in _fused(report) for name in names}
    assert taken == set(kept)
    _same(report.output.logits, _explain(model, ids, fuse_decode_neighbours=False).output.logits)


def test_calls_that_read_another_calls_output_are_marked_dependent_on_the_gpu(monkeypatch):
    """On a GPU under CUDA graphs (device and eligibility patched: CI has no GPU), a one-token call whose x is another
    call's output is launched as that kernel's dependent: per layer the gate/up call (after o_proj), down
    (after gate/up) and the next layer's q/k/v (after down), and lm_head; never the first q/k/v (after
    the embedding) nor o_proj (after attention). Without the fusion no call reads another's output."""
    from graphopt.passes import linear_fusion

    monkeypatch.setattr(linear_fusion, "device", lambda node: torch.device("cuda"))
    monkeypatch.setattr(linear_fusion, "_eligible", lambda ctx, call: linear_fusion.tokens(call.args[0]) == 1)
    model = _llama(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(11))

    class Kwargs(_Calls):
        def run(self, ctx):
            self.calls = [n.kwargs for n in ctx.gm.graph.find_nodes(op="call_function",
                                                                     target=torch.ops.graphopt.fp4_linear.default)]

    for fuse, expected in ((True, 6), (False, 0)):
        recorder = Kwargs()
        register_extra_pass(recorder)
        try:
            _explain(model, ids, fuse_decode_neighbours=fuse)
        finally:
            unregister_extra_pass(recorder.name)
        assert len(recorder.calls) == 9  # 2 x (qkv, o, gate/up, down) + lm_head
        assert sum(bool(kw.get("dependent")) for kw in recorder.calls) == expected
