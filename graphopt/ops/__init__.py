"""The `graphopt::*` custom ops: the single nodes that passes emit.

Ops whose CUDA work is Triton kernels (fp4_linear and the Q4 ops) are `torch.library.triton_op`s:
Inductor traces their bodies and launches the kernels from its own generated code, inside its
CUDA graphs, with no Python per call. Their tile is an argument the pass chose at compile time.
The others are opaque: graphopt::attention and graphopt::sparse_attention (Library ops, whose
Python launch path the cost model prices unless CUDA graphs replay them), the Gluon TMA decodes
(fp4_gluon_linear, q4_gluon_linear: Gluon kernels are not Triton JIT functions that Inductor can
launch) and fft_chain_linear (a custom_op with an autograd formula; its operand tables are graph
constants the pass builds). Every op has a fake (meta) implementation. The CPU implementation is
always the kernel family's torch reference.

Inference-only ops have no autograd formula; a call that needs a gradient is refused with a clear
error (`_refuse_gradients` for custom ops, `_refusing_grad` for Library ops, whose fallthrough
Autograd kernel records nothing).

One section per kernel family, in the order of graphopt/kernels/. Importing this module registers
every op; `graphopt/__init__.py` imports it.
"""

from __future__ import annotations

import torch

from graphopt.ops.registration import (_LIB, _gradient_needed, _inference_fake, _inference_op, _refuse_gradients,
                                       _refusing_grad)

# ==== attention (graphopt/kernels/flash_attention/, passes/attention/) ========================
# graphopt::attention(q, k, v, bias, scale, is_causal, num_kv_groups, backend) -> out
#   q (B, H, Lq, D); k (B, Hkv, Lk, D); v (B, Hkv, Lk, Dv) with H == Hkv * num_kv_groups (GQA:
#   query head h reads kv head h // num_kv_groups, as SDPA's enable_gqa and HF's repeat_kv);
#   bias None, bool (True = attend) or additive float, broadcastable to (B, H, Lq, Lk);
#   is_causal: top-left aligned (query i sees keys j <= i), as SDPA. Output (B, H, Lq, Dv),
#   contiguous, in q's dtype. softcap > 0: the scores s = scale * q.k become softcap * tanh(s /
#   softcap) before bias and masks (Gemma 2); alibi_slopes (H,): plus slope * (j - i) (ALiBi).
#   SDPA takes neither: with soft-capping the SDPA backends and the CPU run the explicit torch
#   reference; ALiBi becomes part of the bias there.
# `backend` is the implementation the attention pass chose at compile time: "triton" (our
# flash-attention kernel), "flash" / "cudnn" / "efficient" / "math" (SDPA with that backend only,
# falling back to math if PyTorch rejects the inputs at run time), or "sdpa_cpu". CPU tensors
# always run SDPA's CPU kernel, whatever the backend says.
# Backward (an Autograd kernel, _attention_autograd_kernel): SDPA backends recompute the forward
# through SDPA's own autograd and differentiate it (this also gives the bias gradient, e.g. T5's
# learned position bias; under torch.compile it traces into SDPA's fused backward). Triton: the
# forward of a call that will be differentiated is graphopt::attention_forward_with_lse, which also
# returns the kernel's log-sum-exp; it is saved for graphopt::attention_backward, an opaque op
# running the kernel's backward from it, with no forward launch.
from typing import Optional as _Optional

ATTENTION_OP_BACKENDS: tuple[str, ...] = ("triton", "flash", "cudnn", "efficient", "math", "sdpa_cpu")
# SDPA backends that take K/V with fewer heads than Q (enable_gqa); the others get K/V repeated.
_SDPA_GQA_BACKENDS = ("flash", "math", "sdpa_cpu")


def _attention_check(q, k, v, bias, num_kv_groups: int, backend: str) -> None:
    if backend not in ATTENTION_OP_BACKENDS:
        raise ValueError(f"graphopt::attention: unknown backend {backend!r}; valid choices: {', '.join(ATTENTION_OP_BACKENDS)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"graphopt::attention expects 4-D (B, H, L, D) q, k, v; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] * num_kv_groups != q.shape[1] or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"graphopt::attention: q has {q.shape[1]} heads, k {k.shape[1]}, v {v.shape[1]}, num_kv_groups={num_kv_groups}; "
            "need q heads == k heads * num_kv_groups and k heads == v heads")
    if bias is not None:
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = bias.dim() <= 4 and torch.broadcast_shapes(bias.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"graphopt::attention: bias must broadcast to (B, H, Lq, Lk) = {target}, got shape {tuple(bias.shape)}")


def _attention_merge_causal(q, k, bias):
    """bias with the top-left causal mask folded in (SDPA refuses attn_mask together with is_causal)."""
    lq, lk = q.shape[-2], k.shape[-2]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()  # (Lq, Lk)
    if bias.dtype == torch.bool:
        return bias & allowed
    # The dtype's lowest finite value, not -inf: a row masked everywhere then averages uniformly,
    # as the eager form with HF's finfo.min masks does, instead of producing NaN.
    return bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)


def _attention_sdpa(q, k, v, bias, scale: float, is_causal: bool, num_kv_groups: int, backend: str,
                    dropout_p: float = 0.0):
    import torch.nn.functional as F

    on_cpu = q.device.type == "cpu"
    if bias is not None:
        # A float32 bias on half-precision q stays float32 where SDPA computes in float32 with it (the
        # CPU kernels, the math backend), as eager's type promotion adds it; the fused GPU backends
        # take it in q's dtype (the attention pass does not send them a wider bias).
        keeps_float32 = bias.dtype == torch.float32 and (on_cpu or backend == "math")
        if bias.is_floating_point() and bias.dtype != q.dtype and not keeps_float32:
            # Then clamp: fp32's -3.4e38 (HF's finfo.min) rounds to -inf in bf16/fp16. (Clamping
            # first fails for a bias narrower than q: q's finfo.min does not fit the bias dtype.)
            bias = bias.to(q.dtype).clamp(min=torch.finfo(q.dtype).min)
        if bias.dim() < 2:  # SDPA takes masks of 2 dims or more; (Lk,) broadcasts as (1, Lk)
            bias = bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape))
        if is_causal:
            bias, is_causal = _attention_merge_causal(q, k, bias), False
    gqa = num_kv_groups > 1
    if gqa and not on_cpu and backend not in _SDPA_GQA_BACKENDS:
        k = k.repeat_interleave(num_kv_groups, dim=1)
        v = v.repeat_interleave(num_kv_groups, dim=1)
        gqa = False
    kwargs = dict(attn_mask=bias, is_causal=is_causal, scale=scale)
    if dropout_p:
        kwargs["dropout_p"] = dropout_p
    if gqa:
        kwargs["enable_gqa"] = True
    if on_cpu or backend in ("sdpa_cpu", "triton"):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    order = [chosen] if chosen == SDPBackend.MATH else [chosen, SDPBackend.MATH]
    try:
        context = sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without set_priority: the list is a set, math only as the fallback
        context = sdpa_kernel(order)
    with context:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def attention_with_dropout(q, k, v, bias, scale: float, is_causal: bool, num_kv_groups: int, dropout_p: float):
    """softmax(scale * q @ k^T + bias), dropout with probability `dropout_p` on it (survivors scaled
    by 1 / (1 - p), as F.dropout), @ v: graphopt::attention's arguments plus the dropout, through
    SDPA's dropout_p and PyTorch's own backend choice. A plain function, not an op: a compiler
    traces it into its SDPA call, whose random mask its backward reuses."""
    _attention_check(q, k, v, bias, num_kv_groups, "sdpa_cpu")
    if not 0 < dropout_p < 1:
        raise ValueError(f"attention_with_dropout: dropout_p must be in (0, 1), got {dropout_p!r}")
    return _attention_sdpa(q, k, v, bias, scale, is_causal, num_kv_groups, "sdpa_cpu", dropout_p)


# Defined with torch.library.Library (not custom_op) for its host path. Its Autograd kernel
# (_attention_autograd_kernel) builds an autograd node only when a gradient is needed, and otherwise
# goes straight below autograd. On an H100 host (bench/tools/probe_attention_host.py) a call
# with SDPA backends took less host time this way than as a custom_op in grad mode with inputs
# that need no gradient, and about as much under no_grad; a plain SDPA call took less than either.
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal, int num_kv_groups, "
            "str backend, float softcap=0.0, Tensor? alibi_slopes=None) -> Tensor")


def _check_score_variants(q, softcap: float, alibi_slopes) -> None:
    if not 0 <= softcap < float("inf"):
        raise ValueError(f"graphopt::attention: softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (q.shape[1],):
        raise ValueError(f"graphopt::attention: alibi_slopes must have one slope per query head ({q.shape[1]},), "
                         f"got shape {tuple(alibi_slopes.shape)}")


def _attention_reference(q, k, v, bias, scale, is_causal, softcap, alibi_slopes):
    """The explicit torch form (scores materialized, fp32 for half inputs): soft-capping outside the
    Triton kernel."""
    from graphopt.kernels.flash_attention import reference_attention

    return reference_attention(q, k, v, bias, scale=scale, is_causal=is_causal, softcap=softcap, alibi_slopes=alibi_slopes)


def _with_alibi(q, k, bias, alibi_slopes):
    """bias plus ALiBi's slope * (j - i) (B?, H, Lq, Lk), for the SDPA backends."""
    from graphopt.kernels.flash_attention import alibi_bias

    alibi = alibi_bias(alibi_slopes, q.shape[2], k.shape[2]).to(q.dtype if q.is_floating_point() else torch.float32)
    if bias is None:
        return alibi
    if bias.dtype == torch.bool:
        return alibi.masked_fill(~bias, float("-inf"))
    return bias + alibi


def _triton_kernel_runs(q: torch.Tensor, backend: str) -> bool:
    """Whether a graphopt::attention call on `backend` runs graphopt's Triton kernel: "triton" on a
    CUDA device. Elsewhere the op runs SDPA or the torch reference, forward and backward."""
    return backend == "triton" and q.is_cuda


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: _Optional[torch.Tensor],
    scale: float, is_causal: bool, num_kv_groups: int, backend: str, softcap: float = 0.0,
    alibi_slopes: _Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _attention_check(q, k, v, bias, num_kv_groups, backend)
    _check_score_variants(q, softcap, alibi_slopes)
    if _triton_kernel_runs(q, backend):
        from graphopt.kernels.flash_attention import flash_attention_forward

        out, _ = flash_attention_forward(q, k, v, bias, scale=scale, is_causal=is_causal, softcap=softcap,
                                         alibi_slopes=alibi_slopes)
    elif softcap:
        out = _attention_reference(q, k, v, bias, scale, is_causal, softcap, alibi_slopes)
    else:
        if alibi_slopes is not None:
            bias = _with_alibi(q, k, bias, alibi_slopes)
        out = _attention_sdpa(q, k, v, bias, scale, is_causal, num_kv_groups, backend)
    return out.contiguous()


_LIB.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("graphopt::attention", lib=_LIB)
def _attention_fake(q, k, v, bias, scale, is_causal, num_kv_groups, backend, softcap=0.0, alibi_slopes=None):
    _attention_check(q, k, v, bias, num_kv_groups, backend)
    _check_score_variants(q, softcap, alibi_slopes)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# graphopt::attention_forward_with_lse(q, k, v, bias, scale, is_causal, num_kv_groups, softcap=0.0,
#                                      alibi_slopes=None) -> (out, lse)
#   The forward of a differentiated graphopt::attention call on the Triton backend: `out` as
#   graphopt::attention's (backend "triton") and lse (B, H, Lq) float32, each row's natural-log
#   log-sum-exp (-inf for a row masked everywhere), which graphopt::attention_backward takes instead
#   of recomputing it. CUDA: the Triton kernel; elsewhere the torch reference. No autograd of its
#   own: graphopt::attention's autograd formula calls it with grad mode off.
# Inference keeps graphopt::attention, which returns `out` alone. The kernel stores the LSE on every
# call either way: 4 bytes a row beside the output's 2 * D (under 2% of its stores at D = 128), while
# a flag to skip it would double the kernel's compiled and autotuned variants.
def attention_forward_with_lse(q, k, v, bias, scale, is_causal, num_kv_groups, softcap=0.0, alibi_slopes=None):
    _attention_check(q, k, v, bias, num_kv_groups, "triton")
    _check_score_variants(q, softcap, alibi_slopes)
    if _triton_kernel_runs(q, "triton"):
        from graphopt.kernels.flash_attention import flash_attention_forward

        out, lse = flash_attention_forward(q, k, v, bias, scale=scale, is_causal=is_causal, softcap=softcap,
                                           alibi_slopes=alibi_slopes)
    else:
        from graphopt.kernels.flash_attention import reference_attention

        out, lse = reference_attention(q, k, v, bias, scale=scale, is_causal=is_causal, return_lse=True,
                                       softcap=softcap, alibi_slopes=alibi_slopes)
    return out.contiguous(), lse.float().contiguous()


def _attention_forward_with_lse_fake(q, k, v, bias, scale, is_causal, num_kv_groups, softcap=0.0, alibi_slopes=None):
    _attention_check(q, k, v, bias, num_kv_groups, "triton")
    _check_score_variants(q, softcap, alibi_slopes)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


_LIB.define("attention_forward_with_lse(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal, "
            "int num_kv_groups, float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor, Tensor)")
_NO_OWN_BACKWARD = ("graphopt::attention_forward_with_lse has no backward of its own, and an input requires grad: "
                    "call graphopt::attention, whose autograd formula runs it")
_LIB.impl("attention_forward_with_lse", _refusing_grad("attention_forward_with_lse", attention_forward_with_lse,
                                                       _NO_OWN_BACKWARD), "CompositeExplicitAutograd")
_LIB.impl("attention_forward_with_lse", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("graphopt::attention_forward_with_lse",
                            _refusing_grad("attention_forward_with_lse", _attention_forward_with_lse_fake,
                                           _NO_OWN_BACKWARD), lib=_LIB)


# SDPA backends whose graphopt::attention call a compiled graph holds as attention_in_graph instead.
ATTENTION_GRAPH_BACKENDS: tuple[str, ...] = ("flash", "cudnn", "efficient", "math")


def attention_in_graph(q, k, v, bias, scale: float, is_causal: bool, num_kv_groups: int, backend: str):
    """graphopt::attention on an SDPA backend, as a plain function in a compiled graph. AOT autograd
    traces it into the backend's aten call (the sdpa_kernel priority is in force while it traces),
    so Inductor launches that kernel from its generated code, with no Python op on the host path,
    and the backend's own backward applies. Same arguments and result as graphopt::attention."""
    _attention_check(q, k, v, bias, num_kv_groups, backend)
    if backend not in ATTENTION_GRAPH_BACKENDS:
        raise ValueError(f"attention_in_graph: backend {backend!r} is not an SDPA backend; valid choices: "
                         f"{', '.join(ATTENTION_GRAPH_BACKENDS)}")
    return _attention_sdpa(q, k, v, bias, scale, is_causal, num_kv_groups, backend)


# What a rewritten dense attention is in a graph: either call, arguments as graphopt::attention's.
DENSE_ATTENTION_TARGETS = (torch.ops.graphopt.attention.default, attention_in_graph)


def _attention_backward_math(grad_out, q, k, v, bias, out, scale, is_causal, num_kv_groups, bias_grad, softcap=0.0,
                             alibi_slopes=None):
    """Explicit-formula backward in fp32 (materializes the (Lq, Lk) scores), soft-capping and ALiBi
    included: the CPU/fallback body of graphopt::attention_backward (a custom op's body runs below
    autograd, so it cannot differentiate the reference), checked in the tests against autograd of
    the float64 reference. Rows masked everywhere get zero gradients, as from the Triton kernel."""
    f32 = torch.float32
    qf, do, of = q.to(f32), grad_out.to(f32), out.to(f32)
    kf = k.to(f32).repeat_interleave(num_kv_groups, dim=1)  # (B, H, Lk, D)
    vf = v.to(f32).repeat_interleave(num_kv_groups, dim=1)  # (B, H, Lk, Dv)
    s = scale * (qf @ kf.transpose(-2, -1))  # (B, H, Lq, Lk)
    if softcap:
        capped = torch.tanh(s / softcap)
        s = softcap * capped
    if alibi_slopes is not None:
        from graphopt.kernels.flash_attention import alibi_bias

        s = s + alibi_bias(alibi_slopes, s.shape[-2], s.shape[-1])
    if bias is not None:
        s = s.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else s + bias.to(f32)
    if is_causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    p = s.softmax(-1).masked_fill(s.amax(-1, keepdim=True) == float("-inf"), 0.0)
    dv = p.transpose(-2, -1) @ do  # (B, H, Lk, Dv)
    dp = do @ vf.transpose(-2, -1)
    ds = p * (dp - (do * of).sum(-1, keepdim=True))  # d(final scores): the bias gradient
    dbias = ds.sum_to_size(bias.shape).to(bias.dtype) if bias_grad else q.new_empty(0)
    if softcap:
        ds = ds * (1.0 - capped * capped)  # d(cap * tanh(s / cap)) / ds
    dq = scale * (ds @ kf)
    dk = scale * (ds.transpose(-2, -1) @ qf)
    if num_kv_groups > 1:
        b, h, lk = k.shape[0], k.shape[1], k.shape[2]
        dk = dk.view(b, h, num_kv_groups, lk, -1).sum(2)
        dv = dv.view(b, h, num_kv_groups, lk, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


@torch.library.custom_op("graphopt::attention_backward", mutates_args=())
def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: _Optional[torch.Tensor],
    out: torch.Tensor, scale: float, is_causal: bool, num_kv_groups: int, bias_grad: bool,
    softcap: float = 0.0, alibi_slopes: _Optional[torch.Tensor] = None, lse: _Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias) of graphopt::attention for the Triton backend (an opaque op: AOTAutograd
    cannot trace into a Triton launch). dbias is empty unless bias_grad. On CUDA without a bias
    gradient: the Triton kernel's backward from `out` and `lse` (B, H, Lq), what
    graphopt::attention_forward_with_lse returned; else the explicit fp32 formulas (with
    soft-capping or ALiBi: autograd of the torch reference), which need no `lse`."""
    if _triton_kernel_runs(q, "triton") and not bias_grad:
        from graphopt.kernels.flash_attention import flash_attention_backward

        if lse is None or tuple(lse.shape) != tuple(q.shape[:-1]):
            got = "none" if lse is None else f"shape {tuple(lse.shape)}"
            raise ValueError(f"graphopt::attention_backward: the Triton backward needs the forward's lse (B, H, Lq) = "
                             f"{tuple(q.shape[:-1])} from graphopt::attention_forward_with_lse, got {got}")
        dq, dk, dv = flash_attention_backward(grad_out, q, k, v, bias, out, lse, scale=scale, is_causal=is_causal,
                                              softcap=softcap, alibi_slopes=alibi_slopes)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_empty(0)
    grads = _attention_backward_math(grad_out, q, k, v, bias, out, scale, is_causal, num_kv_groups, bias_grad, softcap,
                                     alibi_slopes)
    return tuple(g.contiguous() for g in grads)


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, bias, out, scale, is_causal, num_kv_groups, bias_grad, softcap=0.0,
                             alibi_slopes=None, lse=None):
    # Contiguous, as the real outputs are (empty_like would copy the strides of HF's transposed
    # q/k/v views and of a broadcast bias, and Inductor asserts the real strides against these)
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


class _AttentionFunction(torch.autograd.Function):
    """graphopt::attention where a gradient is needed: the op below autograd, then the backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, is_causal, num_kv_groups, backend, softcap=0.0, alibi_slopes=None):
        # Grad mode is off here. The Triton backward reads the forward's LSE, except where the bias
        # takes a gradient (the SDPA route below, which recomputes the forward anyway).
        lse = None
        if _triton_kernel_runs(q, backend) and not _bias_takes_grad(bias, ctx.needs_input_grad[3]):
            out, lse = torch.ops.graphopt.attention_forward_with_lse(q, k, v, bias, scale, is_causal, num_kv_groups,
                                                                     softcap, alibi_slopes)
        else:
            out = torch.ops.graphopt.attention(q, k, v, bias, scale, is_causal, num_kv_groups, backend, softcap,
                                               alibi_slopes)
        ctx.save_for_backward(q, k, v, bias, out, alibi_slopes, lse)
        ctx.options = (scale, is_causal, num_kv_groups, backend, softcap)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _attention_backward(ctx, grad_out)


def _bias_takes_grad(bias, needs_grad: bool) -> bool:
    return bool(bias is not None and bias.is_floating_point() and needs_grad)


def _attention_backward(ctx, grad_out):
    q, k, v, bias, out, alibi_slopes, lse = ctx.saved_tensors
    scale, is_causal, num_kv_groups, backend, softcap = ctx.options
    bias_grad = _bias_takes_grad(bias, ctx.needs_input_grad[3])
    variants_none = (None, None)  # no gradient for softcap, alibi_slopes
    if lse is not None:  # the Triton forward ran and kept its LSE
        dq, dk, dv, _ = torch.ops.graphopt.attention_backward(grad_out, q, k, v, bias, out, scale, is_causal, num_kv_groups,
                                                              False, softcap, alibi_slopes, lse)
        return dq, dk, dv, None, None, None, None, None, *variants_none
    if softcap or alibi_slopes is not None:  # SDPA takes neither: the explicit formulas
        dq, dk, dv, dbias = _attention_backward_math(grad_out, q, k, v, bias, out, scale, is_causal, num_kv_groups,
                                                     bias_grad, softcap, alibi_slopes)
        return dq, dk, dv, (dbias if bias_grad else None), None, None, None, None, *variants_none
    # SDPA backends (and a trainable bias): recompute the forward through SDPA's autograd and
    # differentiate it. Under torch.compile this traces into SDPA's own fused backward.
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        bias_leaf = bias.detach().requires_grad_(True) if bias_grad else bias
        sdpa_backend = "efficient" if backend == "triton" else backend
        recomputed = _attention_sdpa(*leaves, bias_leaf, scale, is_causal, num_kv_groups, sdpa_backend)
        grads = torch.autograd.grad(recomputed, leaves + ([bias_leaf] if bias_grad else []), grad_out)
    return grads[0], grads[1], grads[2], (grads[3] if bias_grad else None), None, None, None, None, *variants_none


def _attention_autograd_kernel(keyset, q, k, v, bias, scale, is_causal, num_kv_groups, backend, softcap=0.0,
                               alibi_slopes=None):
    """The op's Autograd kernel. Without a gradient to record (inference, no_grad, frozen inputs) it
    goes straight to the implementation below autograd: no autograd.Function, none of
    register_autograd's argument walks (Python work on every call)."""
    if _gradient_needed((q, k, v, bias)):
        return _AttentionFunction.apply(q, k, v, bias, scale, is_causal, num_kv_groups, backend, softcap, alibi_slopes)
    return torch.ops.graphopt.attention.default.redispatch(keyset & torch._C._after_autograd_keyset, q, k, v, bias,
                                                           scale, is_causal, num_kv_groups, backend, softcap,
                                                           alibi_slopes)


_LIB.impl("attention", _attention_autograd_kernel, "Autograd", with_keyset=True)
# ==== end attention ============================================================================

# ==== decode_attention (graphopt/kernels/decode_attention.py, passes/attention.py) =============
# graphopt::decode_attention(q, k, v, bias, scale, splits) -> out
#   q (B, H, Lq, D), k/v (B, Hkv, Lk, D) with H a multiple of Hkv, few query rows (a decode step);
#   bias None, bool (True keeps) or additive, broadcastable to (B, H, Lq, Lk). `splits`: the key
#   chunks the attention pass chose at compile time. A triton_op: Inductor launches its two kernels
#   from its own generated code. CPU: the torch reference. Inference only.
@torch.library.triton_op("graphopt::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: _Optional[torch.Tensor],
                        scale: float, splits: int) -> torch.Tensor:
    from graphopt.kernels import decode_attention as da

    if not q.is_cuda:
        return da.reference_decode_attention(q, k, v, bias, scale=scale)
    return da.decode_attention(q, k, v, bias, scale=scale, splits=splits)


_refuse_gradients(decode_attention_op, "decode_attention")
# ==== end decode_attention =====================================================================


# ==== sparse_attention (graphopt/kernels/sparse_attention/, passes/sparse_attention.py) =======
def sparse_attention_runs_dense(lq: int, lk: int, is_causal: bool, dense_below: int) -> bool:
    """Whether graphopt::sparse_attention runs dense attention for these lengths (see below)."""
    return dense_below > 0 and (min(lq, lk) < dense_below or (is_causal and lq != lk))


def _check_dense_backend(dense_backend: str) -> None:
    if dense_backend not in ATTENTION_OP_BACKENDS:
        raise ValueError(f"graphopt::sparse_attention: unknown dense_backend {dense_backend!r}; "
                         f"valid choices: {', '.join(ATTENTION_OP_BACKENDS)}")


# graphopt::sparse_attention(q, k, v, scale, is_causal, simthreshd1, cdfthreshd, pvthreshd, dense_below,
#                            dense_backend, pooled_q=None, sim_q=None, pooled_k=None, sim_k=None) -> out
#   q (B, H, Lq, D); k, v (B, Hkv, Lk, D), H % Hkv == 0 (GQA reads kv head h // (H // Hkv));
#   thresholds are float32 (H,) tensors (pvthreshd empty (0,) = PV skipping off). Output (B, H, Lq, D)
#   in q's dtype. CUDA: the Triton predictor + block-sparse kernel; elsewhere: the torch reference
#   (same block mask, same PV skipping). Inference only (_inference_op): inputs that require grad are
#   refused in grad mode (the sparse_attention pass is opt-in and meant for inference).
#   pooled_q, sim_q, pooled_k, sim_k: the predictor's block statistics, block_statistics(q, k) of
#   graphopt.kernels.sparse_attention (fp32 (B, H, nQ, D), (B, H, nQ), (B, Hkv, nK, D), (B, Hkv, nK)).
#   The pass computes them in the graph, next to the kernels that produce q and k, where the cost model
#   picks that; the predictor then reads only them. All four or none: without them the op pools q and k.
#   dense_below: with dense_below > 0 a call runs dense attention instead (graphopt::attention's body
#   on dense_backend, one of ATTENTION_OP_BACKENDS) where min(Lq, Lk) < dense_below, or under
#   is_causal where Lq != Lk (sparse_attention_runs_dense). The pass sets it to the cost model's
#   break-even length where the sequence length is symbolic, and to 0 (always sparse) where it is not.
def _given_statistics(pooled_q, sim_q, pooled_k, sim_k):
    """The block statistics as a tuple, None when none is given; a partial set is an error."""
    given = [t is not None for t in (pooled_q, sim_q, pooled_k, sim_k)]
    if any(given) and not all(given):
        missing = [name for name, ok in zip(("pooled_q", "sim_q", "pooled_k", "sim_k"), given) if not ok]
        raise ValueError(f"graphopt::sparse_attention: block statistics need all of pooled_q, sim_q, pooled_k, sim_k "
                         f"(or none, to pool q and k in the op); missing {', '.join(missing)}")
    return (pooled_q, sim_q, pooled_k, sim_k) if all(given) else None


@_inference_op("sparse_attention(Tensor q, Tensor k, Tensor v, float scale, bool is_causal, Tensor simthreshd1, "
               "Tensor cdfthreshd, Tensor pvthreshd, int dense_below, str dense_backend, Tensor? pooled_q=None, "
               "Tensor? sim_q=None, Tensor? pooled_k=None, Tensor? sim_k=None) -> Tensor")
def sparse_attention_op(q, k, v, scale, is_causal, simthreshd1, cdfthreshd, pvthreshd, dense_below, dense_backend,
                        pooled_q=None, sim_q=None, pooled_k=None, sim_k=None):
    _check_dense_backend(dense_backend)
    statistics = _given_statistics(pooled_q, sim_q, pooled_k, sim_k)
    if sparse_attention_runs_dense(q.shape[-2], k.shape[-2], is_causal, dense_below):
        return attention(q, k, v, None, scale, is_causal, q.shape[1] // k.shape[1], dense_backend)
    from graphopt.kernels.sparse_attention import sparse_attention

    pv = None if pvthreshd.numel() == 0 else pvthreshd  # empty: PV skipping off (no device sync)
    out = sparse_attention(q, k, v, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
                           cdfthreshd=cdfthreshd, pvthreshd=pv, statistics=statistics)
    return out.contiguous()


@_inference_fake("sparse_attention")
def _(q, k, v, scale, is_causal, simthreshd1, cdfthreshd, pvthreshd, dense_below, dense_backend,
      pooled_q=None, sim_q=None, pooled_k=None, sim_k=None):
    _check_dense_backend(dense_backend)
    _given_statistics(pooled_q, sim_q, pooled_k, sim_k)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
# ==== end sparse_attention =====================================================================

# fp4 and q4: graphopt/ops/quantized_linear.py
from graphopt.ops.quantized_linear import (Q4_LINEAR_MODES, fp4_gluon_linear, fp4_linear_op,  # noqa: F401,E402
                                           q4_gluon_linear, q4_linear, q4_linear_static, q4_q8_gemm,
                                           q4_quantize_q8_1)

# ==== fft_chain (graphopt/kernels/fft_chain/, passes/fft_linear.py) ===========================
# y = sum_k BC(C_k) P_k x + bias from spectral coefficient planes coeff_real/coeff_imag (C, N, F)
# and the K-1 non-identity permutations perms (K-1, in). impl: one of
# graphopt.kernels.fft_chain.IMPL_CHOICES; the fft_linear pass writes the cost model's choice,
# "auto" runs the kernel family's fixed rule (default_implementation). dft_forward, dft_inverse,
# source_index, coeff_operand: the operand tables of impl (fft_chain.operand_tables), which the
# pass builds at compile time and passes as graph constants where their sources are constant;
# one not given is built for the call and freed with it (trainable coefficients, eager calls).
# CPU: the torch rfft reference; CUDA: the chosen kernel. The kernel package is imported lazily.
@torch.library.custom_op("graphopt::fft_chain_linear", mutates_args=())
def fft_chain_linear(
    x: torch.Tensor, coeff_real: torch.Tensor, coeff_imag: torch.Tensor, perms: torch.Tensor,
    bias: torch.Tensor | None, block_size: int, out_features: int, impl: str,
    dft_forward: torch.Tensor | None = None, dft_inverse: torch.Tensor | None = None,
    source_index: torch.Tensor | None = None, coeff_operand: torch.Tensor | None = None,
) -> torch.Tensor:
    from graphopt.kernels import fft_chain as _fft

    return _fft.fft_chain_linear(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl,
                                 dft_forward, dft_inverse, source_index, coeff_operand)


@fft_chain_linear.register_fake
def _fft_chain_linear_fake(x, coeff_real, coeff_imag, perms, bias, block_size, out_features, impl, *tables):
    return x.new_empty(*x.shape[:-1], out_features)


def _fft_chain_linear_setup(ctx, inputs, output):
    x, coeff_real, coeff_imag, perms, bias, block_size = inputs[:6]
    ctx.save_for_backward(x, coeff_real, coeff_imag, perms)
    ctx.block_size, ctx.has_bias = block_size, bias is not None


def _fft_chain_linear_backward(ctx, grad):
    from graphopt.kernels import fft_chain as _fft

    x, coeff_real, coeff_imag, perms = ctx.saved_tensors
    d_x, d_real, d_imag, d_bias = _fft.fft_chain_backward(grad, x, coeff_real, coeff_imag, perms, ctx.has_bias, ctx.block_size)
    # perms, the sizes, impl and the four operand tables (constants) get no gradient
    return d_x, d_real, d_imag, None, d_bias, None, None, None, None, None, None, None


fft_chain_linear.register_autograd(_fft_chain_linear_backward, setup_context=_fft_chain_linear_setup)
# ==== end fft_chain ============================================================================

# ==== all_reduce (graphopt/ops/all_reduce.py, passes/all_reduce.py) ============================
# graphopt::all_reduce(x, group_name, slot): the sum of x over the group's ranks, through a
# symmetric-memory one-shot kernel where the pass prepared its buffer, else the functional
# all-reduce. Defined in its own module; inference only, like the others.
from graphopt.ops.all_reduce import all_reduce as all_reduce_op  # noqa: E402

_refuse_gradients(all_reduce_op, "all_reduce")
# ==== end all_reduce ===========================================================================
