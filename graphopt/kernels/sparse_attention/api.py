"""The public entry points: `sparse_attention` (predictor + kernel, or the torch reference) and
`block_sparse_attention`, the launcher of the attention kernel over given block lists, which only
checks its inputs, allocates the output and launches."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None

from graphopt.kernels.launch import INTERPRET, cdiv, launch, launch_tuned
from graphopt.kernels.sparse_attention.attention_kernel import (
    _ensure_descriptor_allocator,
    _host_descriptors,
    _single_loop_body_supported,
    host_descriptors_supported,
    tma_loads_supported,
)
from graphopt.kernels.sparse_attention.predictor import _require_triton, predict_block_lut, select_block_lut
from graphopt.kernels.sparse_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    DEFAULT_CDFTHRESHD,
    DEFAULT_SIMTHRESHD1,
    IMPLEMENTATIONS,
    LOG2E,
    _check_inputs,
    _empty_result,
    _no_blocks,
    _threshold_args,
    allowed_block_count,
    pv_skipping_requested,
    reference_sparse_attention,
)
from graphopt.kernels.tile_order import causal_head_group

if triton is not None:
    from graphopt.kernels.sparse_attention.attention_kernel import _sparse_attention_kernel, _sparse_attention_kernel_tuned


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lut: torch.Tensor,
    counts: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    pvthreshd=None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    config: dict | None = None,
) -> torch.Tensor:
    """The Triton kernel over a given compact block list (lut, counts) from `block_mask_to_lut` or
    `predict_block_lut`. Under `is_causal` every diagonal-crossing block must be in the list.

    config: None = autotuned on a GPU (the interpreter uses one fixed config); or an explicit
    {"PREFETCH_INDEX": 0/1, "USE_TMA": 0/1, "PAIR_BLOCKS": 0/1, "SINGLE_LOOP": 0/1, "MERGED_SUFFIX": 0/1,
    "num_warps": ..., "num_stages": ..., "HOST_DESCRIPTORS": 0/1}
    (tests, ablations). HOST_DESCRIPTORS (single loop only) defaults to 1 wherever
    `host_descriptors_supported` holds."""
    _require_triton(q, k, v)
    group, Dv = _check_inputs(q, k, v, is_causal)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if Dv != D:
        raise ValueError(f"the Triton path needs v's head dim equal to q's (got {Dv} and {D})")
    if D > 256:
        raise ValueError(f"the Triton path supports head dims up to 256, got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    n_q, n_k = cdiv(Lq, block_m), cdiv(Lk, block_n)
    if lut.shape != (B, H, n_q, n_k) or counts.shape != (B, H, n_q):
        raise ValueError(f"lut {tuple(lut.shape)} / counts {tuple(counts.shape)} do not match blocks {block_m}x{block_n} "
                         f"of q {tuple(q.shape)}, k {tuple(k.shape)}: expected {(B, H, n_q, n_k)} / {(B, H, n_q)}")
    if lut.dtype != torch.int32 or not lut.is_contiguous():
        lut = lut.to(torch.int32).contiguous()
    if counts.dtype != torch.int32 or not counts.is_contiguous():
        counts = counts.to(torch.int32).contiguous()
    # the kernel assumes a contiguous head dim (vectorized loads); other strides are free
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = D**-0.5 if scale is None else float(scale)
    pv_skip = pv_skipping_requested(pvthreshd)  # decided on the host, without a device sync
    pv_tensor, pv_value = _threshold_args(pvthreshd if pv_skip else None, H, "pvthreshd", q.device)
    out = torch.empty(B, H, Lq, D, device=q.device, dtype=q.dtype)  # (B, H, Lq, D)
    args = (q, k, v, out, lut, counts, pv_tensor if pv_tensor is not None else counts, pv_value if pv_skip else 0.0,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, group, Lq, Lk, n_q, n_k, scale * LOG2E, min(max(triton.next_power_of_2(Lk), 1024), 32768),
            causal_head_group(B * H, group, Lk, D, k.element_size()) if is_causal else 1)
    meta = dict(HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
                IS_CAUSAL=is_causal, PV_SKIP=pv_skip, PV_PER_HEAD=pv_tensor is not None,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PARTIAL_KEYS=Lk % block_n != 0)
    grid = (n_q * B * H,)
    if config is None and INTERPRET:
        config = {"PREFETCH_INDEX": 1, "PAIR_BLOCKS": 1, "num_warps": 4, "num_stages": 1}
    use_tma = int(config.get("USE_TMA", 0)) if config is not None else None
    single_loop = int(config.get("SINGLE_LOOP", 0)) if config is not None else 0
    if config is not None and int(config.get("MERGED_SUFFIX", 0)) and not single_loop:
        raise ValueError("config MERGED_SUFFIX=1 merges the single loop's masked suffix and needs SINGLE_LOOP=1; "
                         "valid choices: SINGLE_LOOP=1, or MERGED_SUFFIX=0")
    # the launcher's checks run on every call: each tensor is checked once
    tma_kv = tma_loads_supported(k, v)
    tma_all = tma_kv and tma_loads_supported(q, out)
    if use_tma and not tma_kv:
        raise ValueError("config USE_TMA=1 needs a Hopper+ GPU, tl.make_tensor_descriptor and 16-byte aligned K/V "
                         "rows; valid choice here: USE_TMA=0")
    single_ok = tma_all and _single_loop_body_supported(D, pv_skip)
    if single_loop and not single_ok:
        raise ValueError("config SINGLE_LOOP=1 needs tensor descriptors for q, k, v and the output (USE_TMA's "
                         "conditions), a power-of-two head dim and no PV skipping; valid choice here: SINGLE_LOOP=0")
    if (config is None or use_tma or single_loop) and tma_kv and not INTERPRET:
        _ensure_descriptor_allocator()
    host_possible = (config is None or single_loop) and single_ok \
        and host_descriptors_supported(q, k, v, out, block_m, block_n)
    host_descriptors = bool(int(config.get("HOST_DESCRIPTORS", host_possible))) if config is not None else host_possible
    if host_descriptors and not host_possible:
        raise ValueError("config HOST_DESCRIPTORS=1 needs the single loop, (B, H, L) dims of q, k, v that collapse into "
                         f"rows, and lengths that are multiples of the blocks ({block_m} queries, {block_n} keys); "
                         "valid choice here: HOST_DESCRIPTORS=0")
    args += _host_descriptors(q, k, v, out, block_m, block_n) if host_descriptors else (None,) * 4
    meta["HOST_DESCRIPTORS"] = host_descriptors
    meta["TMA_ELIGIBLE"] = 2 if single_ok else 1 if tma_kv else 0
    # through the compiled kernel once a call with the same key has compiled (or tuned) it: the
    # JIT's launch path re-derives the specialization of 33 arguments on every call
    if config is None:
        launch_tuned(_sparse_attention_kernel_tuned, lambda _meta: grid, *args, **meta)
    else:
        launch(_sparse_attention_kernel, grid, *args, **meta, PREFETCH_INDEX=int(config.get("PREFETCH_INDEX", 1)),
               USE_TMA=use_tma, PAIR_BLOCKS=int(config.get("PAIR_BLOCKS", 0)), SINGLE_LOOP=single_loop,
               MERGED_SUFFIX=int(config.get("MERGED_SUFFIX", 0)),
               num_warps=config.get("num_warps", 8), num_stages=config.get("num_stages", 3))
    return out


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1=DEFAULT_SIMTHRESHD1,
    cdfthreshd=DEFAULT_CDFTHRESHD,
    pvthreshd=None,
    return_sparsity: bool = False,
    implementation: str = "auto",
    statistics=None,
):
    """Predicted block-sparse attention on (B, H, L, D) tensors (see the module docstring).

    implementation: "auto" (Triton on CUDA, the torch reference elsewhere), "triton" (also on CPU
    under TRITON_INTERPRET=1), or "reference". The Triton path is 4 launches (3 predictor + 1
    attention) with no host synchronization unless `return_sparsity` is asked for.
    statistics: the predictor's block statistics `block_statistics(q, k)`, computed by the caller
    (the sparse_attention pass emits them into the graph next to the kernel that produces Q and K);
    the predictor then reads only them, never Q or K, and skips its pooling launch. None: pooled here.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not valid; valid choices: {', '.join(IMPLEMENTATIONS)}")
    _check_inputs(q, k, v, is_causal)
    if _no_blocks(q, k):
        return _empty_result(q, v, return_sparsity)
    use_triton = implementation == "triton" or (implementation == "auto" and q.is_cuda and triton is not None)
    if not use_triton:
        return reference_sparse_attention(q, k, v, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
                                          cdfthreshd=cdfthreshd, pvthreshd=pvthreshd, return_sparsity=return_sparsity,
                                          statistics=statistics)
    thresholds = dict(is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd)
    if statistics is None:
        lut, counts = predict_block_lut(q, k, **thresholds)
    else:
        lut, counts = select_block_lut(statistics, q.shape[2], k.shape[2], **thresholds)
    out = block_sparse_attention(q, k, v, lut, counts, is_causal=is_causal, scale=scale, pvthreshd=pvthreshd)
    if return_sparsity:
        B, H, Lq, _ = q.shape
        total = allowed_block_count(B, H, Lq, k.shape[2], is_causal, BLOCK_M, BLOCK_N)
        return out, 1.0 - int(counts.sum()) / total
    return out
