"""Split-key decode attention (graphopt/kernels/decode_attention.py) against a float64 reference.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) with BLOCK_N 16, so key
lengths like 37 or 100 give full and partial steps, and several chunks; fp16 stands for the
half types (the interpreter misreads bfloat16 dot operands). On a GPU the same tests run bf16 too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from graphopt.kernels import decode_attention as da

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, len_q, head_dim), (batch, kv_heads, len_k, head_dim), (batch, kv_heads, len_k, head_dim)]
    return [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]


def _check(got, q, k, v, bias, scale):
    want = da.reference_decode_attention(q.double(), k.double(), v.double(),
                                         bias if bias is None or bias.dtype == torch.bool else bias.double(), scale=scale)
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < TOL[q.dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,len_q,len_k,head_dim,splits", [
    (1, 8, 2, 1, 100, 64, 3),      # GQA 4, one token, partial last step, 3 chunks
    (2, 4, 4, 1, 37, 32, 1),       # MHA, one chunk
    (1, 6, 2, 3, 45, 24, 8),       # three query rows per head, head dim padded, more chunks than steps
    (2, 4, 1, 2, 64, 16, 4),       # multi-query
])
def test_matches_the_float64_reference(dtype, batch, heads, kv_heads, len_q, len_k, head_dim, splits):
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, head_dim, dtype)
    scale = head_dim ** -0.5
    _check(da.decode_attention(q, k, v, scale=scale, splits=splits), q, k, v, None, scale)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_like_a_static_cache_step(kind):
    """A (B, 1, 1, Lk) mask that keeps the filled cache positions, different per sequence, as a
    static cache's decode step gives it; whole chunks of masked keys merge to nothing."""
    batch, heads, kv_heads, len_k, d = 2, 8, 2, 96, 32
    q, k, v = _qkv(batch, heads, kv_heads, 1, len_k, d, torch.float32, seed=3)
    filled = torch.tensor([20, 71], device=DEVICE)
    keep = (torch.arange(len_k, device=DEVICE) < filled[:, None])[:, None, None, :]
    bias = keep if kind == "bool" else torch.zeros(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    if kind == "additive":
        bias = bias + torch.randn(bias.shape, device=DEVICE, generator=None).clamp(-1, 1) * keep
    got = da.decode_attention(q, k, v, bias, scale=0.2, splits=4)
    _check(got, q, k, v, bias, 0.2)
    # the masked keys do not matter: changing them changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 20:], v2[0, :, 20:] = 100.0, -100.0
    torch.testing.assert_close(da.decode_attention(q, k2, v2, bias, scale=0.2, splits=4), got)


def test_per_head_bias_and_strided_inputs():
    batch, heads, kv_heads, len_q, len_k, d = 1, 4, 2, 2, 50, 32
    q, k, v = _qkv(batch, heads, kv_heads, len_q, len_k, d, torch.float32, seed=5)
    bias = torch.randn(batch, heads, len_q, len_k, device=DEVICE)
    k_strided = torch.randn(batch, len_k, kv_heads, d, device=DEVICE).transpose(1, 2)  # (B, Hkv, Lk, D) view
    _check(da.decode_attention(q, k_strided, v, bias, scale=0.3, splits=2), q, k_strided, v, bias, 0.3)


def test_bad_input_names_the_problem():
    q, k, v = _qkv(1, 6, 4, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of 4 KV heads"):
        da.decode_attention(q, k, v, scale=1.0, splits=1)
    q, k, v = _qkv(1, 4, 1, 17, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 64 query rows per KV head"):
        da.decode_attention(q, k, v, scale=1.0, splits=1)
    q, k, v = _qkv(1, 4, 4, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        da.decode_attention(q, k, v, scale=1.0, splits=0)


def test_the_split_kernel_compiles_with_the_scalar_types_inductor_passes():
    """Inductor launches a triton_op's kernel from its own code, where a Python float argument is
    fp64: the kernel's loop-carried values must keep their fp32 type then too. Compiled for an
    sm_90 target up to Triton's IR (no GPU needed), in a process without the interpreter (which
    would otherwise stand in for the kernel)."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import sys
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from graphopt.kernels import decode_attention as da

        fn = da._decode_split_kernel
        signature = {n: "*bf16" if n.endswith("_ptr") else "fp64" if n == "qk_scale" else
                     "constexpr" if n.isupper() else "i32" for n in fn.arg_names}
        signature["bias_ptr"] = "*i1"
        constants = {"HEAD_DIM": 128, "D_PAD": 128, "ROWS": 16, "BLOCK_N": 64, "BIAS_KIND": da.BIAS_BOOL, "IEEE": False}
        source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()})
        try:
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            if "Loop-carried" in str(exc) or "CompilationError" in type(exc).__name__:
                raise
            print(f"skip: {type(exc).__name__}")
            sys.exit(0)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip().startswith("skip"):
        pytest.skip(f"this machine cannot run Triton's sm_90 compile past the frontend ({done.stdout.strip()})")
    assert done.stdout.strip() == "ok"
