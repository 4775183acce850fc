"""Which implementation runs a matched attention: the candidates that apply (our Triton kernels,
SDPA's backends, with the checks PyTorch's dispatcher makes), their estimates or measured times,
and the emulation of PyTorch's own SDPA dispatch, which prices an SDPA call as it stands (the
"before") and tells when a rewritten call can stay a plain SDPA call."""

from __future__ import annotations

import functools

import torch

from graphopt import cost_model
from graphopt.cost.attention import attention_key
from graphopt.cost_model import Estimate
from graphopt.passes.attention.match import AttentionMatch
from graphopt.passes.attention.rewrite import in_graph_sdpa
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import dtype, fake

_SDPA_CANDIDATES = ("cudnn", "flash", "efficient")
SOFTCAP_SDPA = "SDPA has no soft-capping (cap * tanh(scores / cap))"


# ---------------------------------------------------------------------------------------------
# Decision: which implementation
# ---------------------------------------------------------------------------------------------
def _dtype_bytes(dt: torch.dtype | None) -> int:
    return torch.finfo(dt).bits // 8 if dt is not None and dt.is_floating_point else 2


def _bias_kind(match: AttentionMatch) -> str:
    if not match.terms:
        return "none"
    if len(match.terms) == 1 and match.terms[0].kind in ("keep", "drop") and match.terms[0].fill == float("-inf"):
        return "bool"
    return "float"


def sdpa_applicable(backend: str, dt: torch.dtype, d: int, dv: int, has_bias: bool, lk: int | None = None) -> tuple[bool, str]:
    """Conservative summary of PyTorch's sdp_utils checks (torch 2.5 .. 2.13) for one backend
    (`lk`: the key length, where known)."""
    half = dt in (torch.float16, torch.bfloat16)
    if backend == "flash":
        if not half:
            return False, "SDPA flash needs fp16/bf16"
        if has_bias:
            return False, "SDPA flash takes no attention mask"
        if d != dv or d > 256 or d % 8:
            return False, f"SDPA flash needs equal q/v head dims, a multiple of 8, <= 256 (got {d}, {dv})"
        return True, ""
    if backend == "cudnn":
        if not half:
            return False, "SDPA cuDNN needs fp16/bf16"
        if d != dv or d > 128 or d % 8:
            return False, f"SDPA cuDNN needs equal q/v head dims, a multiple of 8, <= 128 (got {d}, {dv})"
        if lk == 1:  # torch 2.11, H100: "No available kernel" with cuDNN forced; the dispatcher skips it
            return False, "SDPA cuDNN takes no single-key attention"
        return True, ""
    if backend == "efficient":
        align = 8 if half else 4
        if dt not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"SDPA memory-efficient does not take {dt}"
        if d % align or dv % align:
            return False, f"SDPA memory-efficient needs head dims that are multiples of {align} (got {d}, {dv})"
        return True, ""
    if backend == "math":
        return True, ""
    return False, f"unknown SDPA backend {backend}"


def _kernel_operands(match: AttentionMatch):
    """Fake (B, H, L, D) q, k, v and a memory-free bias of the match, as our kernels receive them."""
    q, k, v = fake(match.q), fake(match.k), fake(match.v)
    if match.k_transposed:
        k = k.transpose(-2, -1)
    if match.batched_3d:  # (B*H, L, D) as the rewrite passes it: (B, H, L, D) or (1, B*H, L, D)
        q, k, v = (t.unflatten(0, (-1, match.heads)) if match.heads else t.unsqueeze(0) for t in (q, k, v))
    bias = None
    if match.terms and match.scores_shape:
        bias_dtype = torch.bool if _bias_kind(match) == "bool" else (match.bias_dtype() or q.dtype)
        bias = torch.empty((), dtype=bias_dtype, device=q.device).expand(match.scores_shape)  # no memory
    return q, k, v, bias


def bias_rounding(match: AttentionMatch, dt: torch.dtype) -> tuple[str | None, str | None]:
    """Where eager adds the mask in a wider dtype than q's (a float32 bias on bf16 scores), why SDPA's
    fused GPU backends, which take the mask in q's dtype, and every candidate, which reads it at most
    in float32, would round it: (SDPA's reason, every candidate's reason), None where it holds."""
    wide = match.bias_dtype()
    if wide is None or wide == dt:
        return None, None
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    every = (f"eager adds the {name(wide)} mask to {name(dt)} scores in {name(wide)}; the fused kernels "
             f"read it in float32 at most") if wide == torch.float64 else None
    return (every or f"eager adds the {name(wide)} mask to {name(dt)} scores in {name(wide)}; this backend "
                     f"would round it to {name(dt)}"), every


def _kernel_supports(kernel, what: str, q, k, v, bias, **variants) -> tuple[bool, str]:
    try:
        ok, why = kernel.supports(q, k, v, bias, **variants)
    except Exception as exc:
        return False, f"{what} supports() failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(why)


def _triton_applicable(match: AttentionMatch) -> tuple[bool, str]:
    try:
        from graphopt.kernels import flash_attention
    except Exception as exc:  # the kernel module is optional at import time
        return False, f"Triton kernel unavailable ({type(exc).__name__}: {exc})"
    q, k, v, bias = _kernel_operands(match)
    if q.dtype == torch.float32 and not _tf32_allowed():
        return False, ("fp32 inputs: the Triton kernel computes in TF32 (~1e-3 relative error), which this "
                       "lossless pass uses only when torch.backends.cuda.matmul.allow_tf32 is on")
    return _kernel_supports(flash_attention, "Triton kernel", q, k, v, bias, softcap=match.softcap)


def _decode_applicable(match: AttentionMatch) -> tuple[bool, str]:
    """Whether the split-key decode kernel takes this call (few query rows, no causal flag)."""
    try:
        from graphopt.kernels import decode_attention
    except Exception as exc:  # the kernel module is optional at import time
        return False, f"Triton decode kernel unavailable ({type(exc).__name__}: {exc})"
    if match.is_causal:
        return False, "the decode kernel takes a mask, not a causal flag"
    if match.softcap:
        return False, "the decode kernel takes no soft-capping"
    return _kernel_supports(decode_attention, "Triton decode kernel", *_kernel_operands(match))


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _device_name(hw) -> str:
    try:
        if hw.is_gpu and torch.cuda.is_available():
            from graphopt.hardware import spec_for_device_name

            name = torch.cuda.get_device_name()
            if spec_for_device_name(name) is not None and spec_for_device_name(name).name == hw.name:
                return name
    except Exception:
        pass
    return hw.name


def choose_implementation(ctx: PassContext, match: AttentionMatch) -> tuple[Estimate | None, dict[str, Estimate], dict[str, str], str | None]:
    """(before, {candidate: estimate}, {candidate: why not applicable}, measured-table note)."""
    hw = ctx.hardware
    dims = match.dims()
    dt = dtype(match.q)
    if dims is None:
        return None, {}, {}, None
    b, h, hkv, lq, lk, d, dv = dims
    nbytes = _dtype_bytes(dt)
    has_mask = bool(match.terms)
    default = dispatched_sdpa_backend(ctx, match)
    if default is not None:  # the SDPA call as written, as PyTorch would run it (an explicit causal
        # mask is read, and its upper triangle computed). "sdpa_cpu": priced like the CPU candidate below.
        kv = hkv if default in ("flash", "math", "sdpa_cpu") else h
        backend = {} if default == "sdpa_cpu" else {"backend": default}
        now = cost_model.sdpa(hw, b, h, lq, lk, d, **backend, causal=match.call_is_causal, dtype_bytes=nbytes,
                              has_mask=match.call_has_mask, kv_heads=kv, repeated_from=hkv)
        before = Estimate(f"SDPA as dispatched ({default})", now.ms, now.flops, now.bytes, now.launches, now.bound)
    else:
        before = cost_model.naive_attention(
            hw, b, h, lq, lk, d, dtype_bytes=nbytes, has_mask=has_mask, softmax_fp32=match.softmax_fp32,
            fused_pointwise=ctx.config.downstream == "inductor", kv_heads=h,
        )
    candidates: dict[str, Estimate] = {}
    rejected: dict[str, str] = {}
    sdpa_rounds, every_rounds = bias_rounding(match, dt)
    if every_rounds:
        names = ("sdpa_cpu",) if not hw.is_gpu else ("triton", "triton_decode", *_SDPA_CANDIDATES, "math")
        return before, candidates, dict.fromkeys(names, every_rounds), None
    if not hw.is_gpu and match.softcap:
        rejected["sdpa_cpu"] = SOFTCAP_SDPA
        rejected["triton"] = "graphopt's Triton kernel, which soft-caps, runs on a GPU target"
        return before, candidates, rejected, None
    if not hw.is_gpu:
        candidates["sdpa_cpu"] = cost_model.sdpa(hw, b, h, lq, lk, d, causal=match.is_causal, dtype_bytes=nbytes,
                                                 has_mask=has_mask, kv_heads=hkv)
        return before, candidates, rejected, None
    ok, why = _triton_applicable(match)
    if ok:
        candidates["triton"] = cost_model.fused_attention(hw, b, h, lq, lk, d, family="triton_flash", causal=match.is_causal,
                                                          dtype_bytes=nbytes, has_mask=has_mask, kv_heads=hkv, name="Triton flash")
    else:
        rejected["triton"] = why
    ok, why = _decode_applicable(match)
    if ok:
        candidates["triton_decode"] = cost_model.decode_attention(hw, b, h, lq, lk, d, kv_heads=hkv, dtype_bytes=nbytes,
                                                                  has_mask=has_mask)
    else:
        rejected["triton_decode"] = why
    for backend in (*_SDPA_CANDIDATES, "math"):  # math: only when forced (never the fastest)
        ok, why = sdpa_applicable(backend, dt, d, dv, has_mask, lk)
        if match.softcap:
            ok, why = False, SOFTCAP_SDPA
        elif sdpa_rounds and backend != "math":  # the math backend computes in float32
            ok, why = False, sdpa_rounds
        if not ok:
            rejected[backend] = why
            continue
        kv = hkv if backend in ("flash", "math") else h  # others get K/V repeated for GQA
        candidates[backend] = cost_model.sdpa(hw, b, h, lq, lk, d, backend=backend, causal=match.is_causal,
                                              dtype_bytes=nbytes, has_mask=has_mask, kv_heads=kv, repeated_from=hkv)
    note = None
    measured = cost_model.lookup_measured("attention", _device_name(hw), attention_key(b, h, hkv, lq, lk, d, dt, match.is_causal, _bias_kind(match)))
    if measured and any(name in measured for name in candidates):
        # Measured and modelled times are not comparable: choose among the measured ones only.
        note = "measured table"
        for name in list(candidates):
            e = candidates.pop(name)
            if name in measured:
                candidates[name] = Estimate(f"{e.name} (measured)", measured[name], e.flops, e.bytes, e.launches, "measured")
        measured_before = default if default is not None else "naive"
        if measured_before in measured:
            before = Estimate(f"{before.name} (measured)", measured[measured_before], before.flops, before.bytes,
                              before.launches, "measured")
    if ctx.config.prices_host_path:
        native = native_sdpa_backend(ctx, match)
        for name, e in candidates.items():
            # graphopt::decode_attention is a triton_op (Inductor launches its kernels itself), and an
            # SDPA backend's call goes into the graph as its aten op: neither has a Python host path
            in_graph = in_graph_sdpa(ctx, match, name) or (name == "triton_decode" and ctx.config.downstream == "inductor")
            if name != native and not in_graph:
                candidates[name] = cost_model.host_paced(hw, e, cost_model.attention_op_host_launches(hw, name),
                                                         "graphopt::attention host path")
    return before, candidates, rejected, note


def dispatched_sdpa_backend(ctx: PassContext, match: AttentionMatch) -> str | None:
    """For an SDPA call with static shapes: the backend it runs as it stands; else None."""
    dims = match.dims()
    if not match.from_sdpa or dims is None:
        return None
    return default_sdpa_backend(ctx.hardware, dtype(match.q), dims[5], dims[6], match.call_has_mask, dims[4],
                                lq=dims[3], is_causal=match.call_is_causal)


# PyTorch's SDPA dispatch order on CUDA when torch cannot tell us (torch 2.5-2.13 default).
_DEFAULT_SDPA_ORDER = ("flash", "efficient", "math", "cudnn")
_SDPA_BACKEND_IDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def _sdpa_flags() -> tuple[bool, ...]:
    """PyTorch's SDPA backend switches (torch.backends.cuda.*_sdp_enabled): part of a dispatcher
    choice's cache key, since turning a backend off changes the pick."""
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
            cuda.math_sdp_enabled())


def _dispatcher_choice(hw_name: str, dt: torch.dtype, d: int, dv: int, has_mask: bool, lq: int | None,
                       lk: int | None, is_causal: bool) -> str | None:
    """_cached_dispatcher_choice under the backend switches in force now."""
    return _cached_dispatcher_choice(hw_name, dt, d, dv, has_mask, lq, lk, is_causal, _sdpa_flags())


@functools.lru_cache(maxsize=256)
def _cached_dispatcher_choice(hw_name: str, dt: torch.dtype, d: int, dv: int, has_mask: bool, lq: int | None,
                              lk: int | None, is_causal: bool, flags: tuple[bool, ...]) -> str | None:
    """PyTorch's own pick for such a call (torch._fused_sdp_choice, on small CUDA tensors of the
    call's dtype and head dims) when the target is the GPU present; None elsewhere. It applies
    rules the priority order does not show: torch 2.11 on an H100 lists flash first
    (torch._C._get_sdp_priority_order() == [1, 2, 0, 3, 4]) and runs cuDNN, for causal and
    non-causal prefill and for one-token decode alike."""
    if not torch.cuda.is_available() or dt not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    try:
        from graphopt.hardware import device_spec

        if device_spec(torch.cuda.current_device()).name != hw_name:
            return None
        rows = 1 if lq == 1 else 64  # one-token decode has its own rules (cuDNN takes no single key)
        keys = 1 if lk == 1 else 64
        q = torch.zeros(1, 1, rows, d, device="cuda", dtype=dt)
        k = torch.zeros(1, 1, keys, d, device="cuda", dtype=dt)
        v = torch.zeros(1, 1, keys, dv, device="cuda", dtype=dt)
        mask = torch.ones(1, 1, rows, keys, device="cuda", dtype=torch.bool) if has_mask else None
        choice = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal and not has_mask))
    except Exception:  # an older torch, or no usable device: the priority order below decides
        return None
    return _SDPA_BACKEND_IDS.get(choice)


def default_sdpa_backend(hw, dt: torch.dtype | None, d: int, dv: int, has_mask: bool, lk: int | None = None, *,
                         lq: int | None = None, is_causal: bool = False) -> str:
    """The backend PyTorch's SDPA dispatcher would run for such a call: "sdpa_cpu" on a CPU target;
    on the GPU present, the dispatcher's own pick (_dispatcher_choice); else the first enabled
    backend of its priority order that sdpa_applicable admits."""
    if not hw.is_gpu:
        return "sdpa_cpu"
    if dt is not None:
        choice = _dispatcher_choice(hw.name, dt, d, dv, has_mask, lq, lk, is_causal)
        if choice is not None:
            return choice
    try:
        order = tuple(_SDPA_BACKEND_IDS[i] for i in torch._C._get_sdp_priority_order() if i in _SDPA_BACKEND_IDS)
    except Exception:  # older or trimmed builds
        order = _DEFAULT_SDPA_ORDER
    enabled = dict(zip(("flash", "efficient", "cudnn", "math"), _sdpa_flags()))
    for backend in order:
        if enabled.get(backend) and dt is not None and sdpa_applicable(backend, dt, d, dv, has_mask, lk)[0]:
            return backend
    return "math"


def native_sdpa_backend(ctx: PassContext, match: AttentionMatch) -> str | None:
    """The backend PyTorch dispatches a plain F.scaled_dot_product_attention call of the rewritten
    form (no mask, no K/V head grouping) to, when that call can be emitted; else None. A candidate
    equal to it is emitted as that call: Inductor launches it from its own wrapper, without
    graphopt::attention's Python path (cost_model.attention_op_host_launches). Not for a forced
    backend or `force` (the tuner records graphopt::attention nodes), nor on CPU."""
    if not ctx.hardware.is_gpu or ctx.config.force:
        return None
    dims = match.dims()
    if ctx.config.attention_backend != "auto" or match.terms or match.num_kv_groups != 1 or match.softcap or dims is None:
        return None
    backend = default_sdpa_backend(ctx.hardware, dtype(match.q), dims[5], dims[6], False, dims[4], lq=dims[3],
                                   is_causal=match.is_causal)
    return backend if backend in ("flash", "cudnn", "efficient") else None
