"""Flash attention in Triton: fused forward and backward, with causal masking, bias/mask, GQA,
logit soft-capping and ALiBi.

    out = softmax(cap(q @ k^T * scale) + alibi + bias, causal-masked) @ v

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H % Hkv == 0. Query head h reads key/value
head h // (H // Hkv) (grouped-query attention); K and V are never repeated in memory.

Supported
- dtypes: bfloat16 and float16 (tensor-core dots, fp32 accumulation); float32 through the tensor
  cores' TF32 mode (about 10 mantissa bits in the products: expect ~1e-3 relative error, not 1e-6).
- head dims 1..128. Powers of two >= 16 (64, 128, ...) run as they are; other sizes (40, 80, 96, ...)
  are zero-padded inside the kernel to the next power of two (masked loads, no copy). Head dims
  above 128 are declined by `supports` (the tiles would not fit in shared memory with these configs).
- any Lq, Lk >= 1; lengths that are not multiples of the block size are handled with masked loads.
- `is_causal`: TOP-LEFT aligned, exactly like torch SDPA's `is_causal=True`: query i attends keys
  j <= i, whatever Lq and Lk are. (This is *not* the bottom-right alignment of KV-cache decoding,
  where the last query sees every key; pass an explicit mask for that.) Key blocks entirely above
  the diagonal are skipped; blocks entirely below it run without any masking.
- `bias`: None; a bool mask (True = attend, the SDPA convention); or an additive float tensor
  (fp16/bf16/fp32). Any shape broadcastable to (B, H, Lq, Lk) - e.g. (B, 1, 1, Lk) padding masks,
  (1, H, Lq, Lk) position biases, (Lq, Lk) - is read in place through stride-0 broadcast strides.
- rows whose keys are all masked produce 0 (and lse = -inf), like SDPA's "safe softmax".
- `scale` must be > 0 (the forward takes the running max of the unscaled products).
- `softcap` > 0: the scores s = q.k * scale become softcap * tanh(s / softcap) before ALiBi, bias
  and masks (Gemma 2's attn_logit_softcapping); the backward multiplies by 1 - tanh^2. Such scores
  are at most softcap, so without an additive bias or ALiBi the forward subtracts a constant instead
  of a running max (no rescaling per key block; bf16/fp32 inputs, softcap up to about 63).
- `alibi_slopes` (H,): adds slopes[h] * (j - i) for query i, key j (ALiBi, computed in the kernel,
  nothing read); per row it differs from BLOOM's slope * j and MPT's slope * (j - Lk + 1) by a
  constant, which softmax ignores. No gradient for the slopes.

Outputs of the forward: `out` (B, H, Lq, D) in the input dtype and `lse` (B, H, Lq) float32, the
NATURAL-log log-sum-exp of each row's scaled, biased scores (SDPA's flash backend uses the same
convention); the kernel works in base 2 internally (exp2) and converts on store. Its programs form
a 1-D grid; under causality each group of heads whose K/V fit in L2 starts its heaviest (last)
query blocks first (tile_order.py).

Backward: `delta = rowsum(dO * O)` in a small kernel, then one kernel for dK/dV (one program per
key block and KV head, looping over the query heads of its GQA group and over query blocks, so dK/dV
are summed over the group without atomics) and one kernel for dQ (one program per query block and
head, looping over key blocks). The gradient with respect to `bias` is NOT computed: graphopt uses
the bias as a constant mask; the backward of `flash_attention` raises if the bias requires grad
(the forward runs).

Modules: `reference` (reference_attention, supports), `configs` (autotune), `kernels` (Triton),
`launchers` (flash_attention_forward / _backward, flash_attention with autograd).

Caveats
- No dropout. No TMA / tensor-descriptor path: plain pointer loads, software-pipelined by Triton
  (`num_stages`), which runs on every triton from 3.6 to 3.9.
- Under TRITON_INTERPRET=1 (CPU tests) a single small block configuration is used; on a GPU block
  sizes, num_warps and num_stages are autotuned per (head dim, causal, bias kind, sequence bucket).
"""

from __future__ import annotations

from graphopt.kernels.flash_attention.configs import _config, _prune, _seq_bucket
from graphopt.kernels.flash_attention.launchers import (
    FlashAttentionFunction,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)
from graphopt.kernels.flash_attention.reference import (
    BIAS_ADDITIVE,
    BIAS_BOOL,
    BIAS_NONE,
    HAS_TRITON,
    LN2,
    LOG2E,
    MAX_GRID_Y,
    MAX_HEAD_DIM,
    SUPPORTED_BIAS_DTYPES,
    SUPPORTED_DTYPES,
    alibi_bias,
    reference_attention,
    supports,
)

if HAS_TRITON:
    from graphopt.kernels.flash_attention.kernels import (
        _flash_attention_bwd_dkdv_kernel,
        _flash_attention_bwd_dq_kernel,
        _flash_attention_bwd_preprocess_kernel,
        _flash_attention_fwd_kernel,
    )

__all__ = ["FlashAttentionFunction", "flash_attention", "flash_attention_backward", "flash_attention_forward",
           "reference_attention", "supports", "alibi_bias", "HAS_TRITON", "MAX_HEAD_DIM", "MAX_GRID_Y",
           "SUPPORTED_DTYPES", "SUPPORTED_BIAS_DTYPES", "BIAS_NONE", "BIAS_ADDITIVE", "BIAS_BOOL", "LOG2E", "LN2",
           # autotune helpers and kernels, read by tests and benchmarks
           "_config", "_prune", "_seq_bucket", "_flash_attention_fwd_kernel", "_flash_attention_bwd_dkdv_kernel",
           "_flash_attention_bwd_dq_kernel", "_flash_attention_bwd_preprocess_kernel"]
