"""MXFP4 / NVFP4 formats and the Triton FP4 kernels (run under TRITON_INTERPRET=1 without a GPU)."""

import dataclasses
import math

import pytest
import torch

from graphopt.kernels import fp4, split_k
from graphopt.kernels.fp4 import (
    E2M1_VALUES, FORMATS, KernelConfig, dequantize_fp4, from_kernel_layout, quantize_fp4, round_to_e2m1_codes,
    sqnr_db, to_kernel_layout,
)

GRID = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Kernel tests run the Triton kernels: on the GPU when there is one, else in the interpreter
# (TRITON_INTERPRET=1, set by conftest). CPU tensors on a CUDA machine would silently take the
# torch reference path instead.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grid_weight(fmt: str, rows: int, blocks: int, seed: int) -> torch.Tensor:
    """Every block holds +-6 and random grid values, times a per-block scale the format represents
    exactly (MXFP4: a power of two; NVFP4: e4m3 powers of two times a power-of-two global scale)."""
    g = torch.Generator().manual_seed(seed)
    bs = fp4.BLOCK_SIZES[fmt]
    values = torch.cat([GRID, -GRID, torch.zeros(1)])[torch.randint(0, 15, (rows, blocks, bs), generator=g)]
    values[:, :, 0] = 6.0 * torch.where(torch.rand(rows, blocks, generator=g) < 0.5, -1.0, 1.0)
    if fmt == "mxfp4":
        scale = torch.exp2(torch.randint(-20, 10, (rows, blocks, 1), generator=g).float())
    else:
        # global scale 2^-6 (tensor amax = 6 * 448 * 2^-6); block scales 448 * 2^-j are exact e4m3
        scale = 448.0 * torch.exp2(-torch.randint(0, 12, (rows, blocks, 1), generator=g).float()) * 2.0**-6
        scale[0, 0, 0] = 448.0 * 2.0**-6
    return (values * scale).reshape(rows, blocks * bs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_roundtrip_exactly(fmt):
    w = _grid_weight(fmt, rows=6, blocks=5, seed=1)
    q = quantize_fp4(w, fmt)
    assert torch.equal(dequantize_fp4(q), w)
    assert torch.equal(dequantize_fp4(quantize_fp4(w, fmt, scale_search=True)), w)


def test_ties_round_to_even_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.0, 1e6, -0.25, -0.75, -2.5, -5.0, -1e6, 0.26, 4.99])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.0, -1.0, -2.0, -4.0, -6.0, 0.5, 4.0])
    assert torch.equal(fp4.e2m1_values(round_to_e2m1_codes(x)), expected)
    # Every code decodes to its table value and re-encodes to itself (except -0 -> +0).
    table = torch.tensor(E2M1_VALUES)
    codes = round_to_e2m1_codes(table)
    assert torch.equal(fp4.e2m1_values(codes), table)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_scale_rule_and_saturation(fmt):
    bs = fp4.BLOCK_SIZES[fmt]
    w = torch.full((1, bs), 0.1)
    w[0, 0] = 7.0  # MXFP4: amax 7 -> scale 2^(2 - 2) = 1, 7 saturates to 6
    q = quantize_fp4(w, fmt)
    d = dequantize_fp4(q)
    if fmt == "mxfp4":
        assert q.scales.item() == 127  # 2^0
        assert d[0, 0].item() == 6.0
    else:
        assert q.global_scale.item() == pytest.approx(7.0 / (6 * 448))
        assert d[0, 0].item() == pytest.approx(7.0, rel=2**-4)  # e4m3 rounding of the block scale
        assert d.abs().max().item() <= 7.0 * (1 + 2**-4)


def test_nibble_order_low_nibble_is_first_element():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 6.0, -1.0  # codes 7 and 8 + 2
    q = quantize_fp4(w, "mxfp4")  # scale 2^(2 - 2) = 1
    assert q.codes[0, 0].item() == 7 | (10 << 4)
    assert q.codes.shape == (1, 16) and q.scales.dtype == torch.uint8
    qn = quantize_fp4(w, "nvfp4")
    assert qn.scales.dtype == torch.float8_e4m3fn and qn.scales.shape == (1, 2)


@pytest.mark.parametrize("fmt,floor_db", [("mxfp4", 17.5), ("nvfp4", 19.5)])
def test_sqnr_gaussian(fmt, floor_db):
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    assert sqnr_db(w, dequantize_fp4(quantize_fp4(w, fmt))) >= floor_db


@pytest.mark.parametrize("fmt,min_gain_db", [("mxfp4", 0.1), ("nvfp4", 0.8)])
def test_scale_search_lowers_error(fmt, min_gain_db):
    """Measured on Gaussian (256, 1024): MXFP4 18.8 -> 19.1 dB, NVFP4 20.4 -> 21.7 dB."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    plain = sqnr_db(w, dequantize_fp4(quantize_fp4(w, fmt)))
    searched = sqnr_db(w, dequantize_fp4(quantize_fp4(w, fmt, scale_search=True)))
    assert searched - plain >= min_gain_db


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_search_never_decodes_past_the_weights_dtype(fmt):
    """fp16 weights near fp16's max: MXFP4's larger search candidate (the power of two above) would
    decode a weight to 65536, inf once the kernels cast W to fp16; it is skipped there. (NVFP4 cannot
    overshoot: its e4m3 scale is capped at 448 times a global scale of amax / (6 * 448); the case
    holds the property for it too.)"""
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(5)) * 100).half()
    w[:, 0] = 60000.0
    q = quantize_fp4(w, fmt, scale_search=True)
    assert torch.isfinite(dequantize_fp4(q, torch.float16)).all()
    assert dequantize_fp4(q).abs().max() <= torch.finfo(torch.float16).max


def test_scale_search_compares_with_the_chosen_candidate_not_a_rejected_one():
    """A block of 3.0s and three candidate scales in search order: 0.37 (the plain rule: 6 * 0.37
    = 2.22), 0.5 (exact, but decodes to 3.0, past finite_max 2.9: rejected) and 0.7 (4 * 0.7 = 2.8,
    within it). The third is better than the kept first and must win, although the rejected second
    had a lower error still."""
    blocks = torch.full((1, 1, 16), 3.0)
    candidates = [(torch.tensor([[b]], dtype=torch.uint8), torch.tensor([[s]])) for b, s in ((1, 0.37), (2, 0.5), (3, 0.7))]
    codes, stored, scale = fp4._best_scale_candidate(blocks, iter(candidates), None, finite_max=2.9)
    assert stored.item() == 3 and scale.item() == pytest.approx(0.7)
    assert torch.equal(fp4.e2m1_values(codes) * scale[..., None], torch.full((1, 1, 16), 4 * scale.item()))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(0, 5), (0, 64), (3, 0)])
def test_empty_weights_roundtrip(fmt, shape):
    w = torch.randn(*shape)
    q = quantize_fp4(w, fmt, scale_search=True)
    assert dequantize_fp4(q).shape == shape
    kw = to_kernel_layout(q)
    assert dequantize_fp4(from_kernel_layout(kw)).shape == shape
    assert fp4.dequantize_kernel_layout(kw.codes, kw.scales, kw.global_scale, *shape, fmt).shape == shape


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [100, 64, 200])
def test_kernel_layout_roundtrip_with_padding(fmt, k):
    w = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
    q = quantize_fp4(w, fmt)
    kw = to_kernel_layout(q)
    assert kw.codes.shape == (7, math.ceil(k / 64) * 32) and kw.codes.dtype == torch.uint8
    back = from_kernel_layout(kw)
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert back.shape == q.shape and back.format == fmt
    deq = fp4.dequantize_kernel_layout(kw.codes, kw.scales, kw.global_scale, 7, k, fmt)
    assert torch.equal(deq, dequantize_fp4(q))


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="valid choices: mxfp4, nvfp4"):
        quantize_fp4(torch.randn(4, 32), "fp4")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp4(torch.tensor([[1.0, float("nan")]]), "nvfp4")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp4(torch.randn(32), "nvfp4")


@pytest.mark.parametrize("search", [False, True], ids=["amax-rule", "scale-search"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_shard_with_the_whole_tensors_amax_quantizes_as_in_the_whole_tensor(fmt, search):
    """A tensor-parallel shard (rows, or columns on block boundaries) quantized with the whole
    weight's tensor_amax gets the bytes of that part of the whole weight's quantization."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 192, generator=g) * 0.02
    w[5, 7] = 0.3  # the whole weight's largest value, in the first row shard and column shard only
    whole = dequantize_fp4(quantize_fp4(w, fmt, scale_search=search))
    amax = w.abs().amax()
    for part, index in ((w[48:], (slice(48, None), slice(None))), (w[:, 96:], (slice(None), slice(96, None)))):
        shard = dequantize_fp4(quantize_fp4(part, fmt, scale_search=search, tensor_amax=amax))
        assert torch.equal(shard, whole[index])
    if fmt == "nvfp4":  # with its own amax the shard's NVFP4 global scale, and so its bytes, differ
        own = dequantize_fp4(quantize_fp4(w[48:], fmt, scale_search=search))
        assert not torch.equal(own, whole[48:])


@pytest.mark.parametrize("search", [False, True], ids=["amax-rule", "scale-search"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizing_in_row_chunks_gives_the_bytes_of_one_pass(fmt, search, monkeypatch):
    """quantize_fp4 works on weight_chunks.CHUNK_ELEMENTS at a time to bound its temporaries; the
    bytes must not depend on the chunking (the global scale comes from the whole weight), and a
    NaN in a later chunk is still refused."""
    from graphopt.kernels import weight_chunks

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(37, 200, generator=g) * torch.linspace(0.01, 0.1, 37)[:, None]).to(torch.bfloat16)
    w[30, 11] = 0.5  # the largest value, in the last chunk
    one = quantize_fp4(w, fmt, scale_search=search)
    monkeypatch.setattr(weight_chunks, "CHUNK_ELEMENTS", 3 * 200)  # 13 chunks, the last of one row
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a pass may quantize under the user's autocast
        chunked = quantize_fp4(w, fmt, scale_search=search)
    assert torch.equal(chunked.codes, one.codes) and torch.equal(chunked.global_scale, one.global_scale)
    assert torch.equal(chunked.scales.view(torch.uint8), one.scales.view(torch.uint8))
    # the SQNR, summed a chunk at a time, is the whole weight's
    whole_db = 10 * math.log10(w.double().square().sum() / (w.double() - dequantize_fp4(one).double()).square().sum())
    assert fp4.weight_sqnr_db(w, one) == pytest.approx(whole_db, rel=1e-9)
    assert fp4.sqnr_db(w, dequantize_fp4(one)) == pytest.approx(whole_db, rel=1e-9)
    w[36, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp4(w, fmt)


def test_sqnr_db_edge_values_and_shapes():
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(8))
    assert sqnr_db(w, w) == math.inf
    assert sqnr_db(w, torch.full_like(w, float("inf"))) == -math.inf  # infinite noise
    assert math.isnan(sqnr_db(torch.full_like(w, float("nan")), w))
    with pytest.raises(ValueError, match="differ in shape"):
        sqnr_db(w, w[0])  # no broadcasting: a mismatch is a caller's bug


def test_tensor_amax_below_the_weights_own_is_refused():
    w = torch.randn(4, 32)
    with pytest.raises(ValueError, match="tensor_amax .* is below the weight's own largest"):
        quantize_fp4(w, "nvfp4", tensor_amax=w.abs().amax() / 2)


# ---------------------------------------------------------------------------------------------
# Triton kernels vs the dequantize-then-matmul reference (float64)
# ---------------------------------------------------------------------------------------------
def _case(fmt, m, n, k, dtype, bias, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    kw = to_kernel_layout(quantize_fp4(w, fmt))
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    w_deq = fp4.dequantize_kernel_layout(kw.codes, kw.scales, kw.global_scale, n, k, fmt).double()
    ref = x.double() @ w_deq.T + (b.double() if bias else 0.0)
    kw = dataclasses.replace(kw, codes=kw.codes.to(device), scales=kw.scales.to(device),
                             global_scale=kw.global_scale.to(device))
    return x.to(device), kw, (b.to(device) if bias else None), ref


def _assert_close(y, ref, dtype):
    assert y.shape == ref.shape
    y = y.cpu()
    # bf16/fp16 output rounding plus (tensor-core paths) half-precision weights: ~2^-8 relative.
    tol = (2**-6 if dtype == torch.bfloat16 else 2**-8) * ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "m,n,k,path,config,dtype,bias",
    [
        (1, 40, 100, "gemv", KernelConfig(16, 1, 64, split_k=1), torch.bfloat16, True),  # CUDA cores, K tail
        (1, 40, 300, "gemv", KernelConfig(16, 1, 64, split_k=2), torch.float16, False),  # CUDA cores, split-K
        (1, 37, 600, "gemv", KernelConfig(16, 1, 128, split_k=4), torch.bfloat16, True),  # uneven split, odd N
        (2, 40, 200, "gemv", KernelConfig(16, 2, 64, split_k=2), torch.bfloat16, True),  # 2 tokens / program
        (3, 40, 300, "gemv", KernelConfig(16, 4, 64, split_k=2), torch.bfloat16, True),  # 4-token tile, 3 rows
        (6, 24, 128, "gemv", KernelConfig(16, 4, 128, split_k=1), torch.float16, True),  # 2 token groups
        (3, 40, 250, "gemv", KernelConfig(16, 16, 128, split_k=2), torch.bfloat16, True),  # MMA path, split-K
        (5, 37, 600, "gemv", KernelConfig(32, 16, 128, split_k=4), torch.bfloat16, False),  # MMA, uneven split
        (16, 24, 128, "gemv", KernelConfig(16, 16, 128, split_k=1), torch.float16, True),  # MMA path, direct store
        (20, 40, 380, "gemv", KernelConfig(16, 16, 128, split_k=3), torch.bfloat16, True),  # MMA, 2 token tiles, split
        (45, 40, 380, "gemv", KernelConfig(16, 32, 128, split_k=3), torch.bfloat16, True),  # 32-token MMA tiles
        (70, 37, 384, "gemv", KernelConfig(32, 64, 128, split_k=2), torch.float16, False),  # 64-token tiles, odd N
        (45, 40, 380, "gemv", KernelConfig(16, 32, 128, split_k=3, permute_x=True), torch.bfloat16, True),  # permuted x
        (70, 37, 384, "gemv", KernelConfig(32, 64, 128, split_k=2, permute_x=True), torch.float16, False),
        (5, 24, 200, "gemv", KernelConfig(16, 16, 256, split_k=1, permute_x=True), torch.bfloat16, True),  # 32 words
        (1, 40, 100, "gemv", KernelConfig(16, 1, 64, split_k=1, int_dots=True), torch.bfloat16, True),  # int dots
        (1, 37, 600, "gemv", KernelConfig(8, 1, 128, split_k=4, num_warps=1, int_dots=True), torch.float16,
         False),  # int dots, uneven split, odd N
        (2, 40, 300, "gemv", KernelConfig(16, 2, 64, split_k=2, int_dots=True), torch.bfloat16, True),  # 2 tokens
        (3, 37, 600, "gemv", KernelConfig(8, 4, 128, split_k=3, num_warps=1, int_dots=True), torch.bfloat16,
         True),  # 4-token tile with 3 rows, uneven split, odd N
        (6, 24, 128, "gemv", KernelConfig(16, 4, 128, split_k=1, int_dots=True), torch.float16, False),  # 2 groups
        (70, 24, 200, "gemm", KernelConfig(16, 16, 64), torch.bfloat16, True),  # prefill, odd M/N/K
        (70, 24, 200, "dequant", None, torch.bfloat16, True),  # prefill: Triton dequantize + matmul
    ],
)
def test_triton_kernels_match_reference(fmt, m, n, k, path, config, dtype, bias):
    x, kw, b, ref = _case(fmt, m, n, k, dtype, bias)
    y = fp4.fp4_linear(x, kw, b, path=path, config=config)
    assert y.dtype == dtype
    _assert_close(y, ref, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [KernelConfig(16, 16, 128, split_k=2), KernelConfig(16, 4, 64, split_k=2)],
                         ids=["tensor-cores", "cuda-cores"])
def test_decode_keeps_small_weights_exact_in_fp16(fmt, config):
    """fp16 activations with rows of very different size (row r scaled by 2^-(r % 12), down to
    ~1e-5): the tensor-core decode rounds weights to fp16 before its MMA, so the powers of two of
    the code and scale decodes must be in the weights by then (else NVFP4 weights of small blocks
    and MXFP4 weights below 2^-9 lose their bits or vanish). Checked per output row."""
    g = torch.Generator().manual_seed(11)
    n, k, m = 24, 256, 5
    w = torch.randn(n, k, generator=g) * 0.05 * torch.exp2(-(torch.arange(n) % 12).float())[:, None]
    kw = to_kernel_layout(quantize_fp4(w, fmt))
    x = torch.randn(m, k, generator=g).to(torch.float16)
    w_deq = fp4.dequantize_kernel_layout(kw.codes, kw.scales, kw.global_scale, n, k, fmt).double()
    ref = x.double() @ w_deq.T
    kw = dataclasses.replace(kw, codes=kw.codes.to(DEVICE), scales=kw.scales.to(DEVICE),
                             global_scale=kw.global_scale.to(DEVICE))
    y = fp4.fp4_linear(x.to(DEVICE), kw, None, path="gemv", config=config).double().cpu()
    row_scale = ref.abs().amax(dim=0)  # per output feature (column of y)
    assert ((y - ref).abs() <= 2**-8 * row_scale + 1e-12).all(), ((y - ref).abs() / row_scale).max()


def test_triton_default_dispatch_and_leading_dims():
    """No path/config given: the launcher picks the path and the interpreter tile; 3-D input."""
    x, kw, b, ref = _case("nvfp4", 6, 40, 96, torch.bfloat16, True, seed=3)
    y = fp4.fp4_linear(x.reshape(2, 3, 96), kw, b)
    assert y.shape == (2, 3, 40)
    _assert_close(y.reshape(6, 40), ref, torch.bfloat16)


def test_strided_bias_is_taken_as_a_copy():
    """A bias that is a strided view (b[::2]) is copied to a contiguous vector, not refused."""
    x, kw, b, ref = _case("nvfp4", 3, 40, 96, torch.bfloat16, True, seed=6)
    wide = torch.stack([b, torch.full_like(b, 1e3)], dim=1).reshape(-1)  # b interleaved with junk
    y = fp4.fp4_linear(x, kw, wide[::2])
    _assert_close(y, ref, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["gemv", "gemm", "dequant"])
def test_triton_fp32_activations_are_computed_from_bf16(fmt, path):
    """The Triton launcher multiplies a bf16 copy of fp32 activations by the exact weight, so the
    only rounding is x's. The tensors live on DEVICE, so on a GPU the kernel runs (CPU tensors
    would take the fp32 torch reference). The tiled GEMM scales the sums by NVFP4's fp32 global
    scale (folding it into each weight before the bf16 cast would give 4e-3 relative error)."""
    x, kw, b, _ = _case(fmt, 2, 24, 64, torch.float32, True, seed=4)
    y = fp4.fp4_linear(x, kw, b, path=path).cpu()
    assert y.dtype == torch.float32
    w = fp4.dequantize_kernel_layout(kw.codes.cpu(), kw.scales.cpu(), kw.global_scale.cpu(), 24, 64, fmt).double()
    x, b = x.cpu(), b.cpu()
    ref = x.bfloat16().double() @ w.T + b.double()
    assert (y.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_a_strided_bias_stays_right_after_the_first_call(tokens):
    """The first call copies a strided bias; repeated calls took a fast path (the call's checks
    cached) that passed the caller's view to the kernels, which read bias[n] contiguously: from
    the second call on, a stride-2 view gave wrong columns and an expanded one read past its end."""
    x, kw, b, ref = _case("nvfp4", tokens, 40, 96, torch.bfloat16, True, seed=7)
    wide = torch.stack([b, torch.full_like(b, 1e3)], dim=1).reshape(-1)
    for _ in range(3):
        _assert_close(fp4.fp4_linear(x, kw, wide[::2]), ref, torch.bfloat16)
    scalar = torch.full((1,), 0.5, device=x.device, dtype=torch.bfloat16).expand(40)
    ref_scalar = ref - b.double().cpu() + 0.5
    for _ in range(3):
        _assert_close(fp4.fp4_linear(x, kw, scalar), ref_scalar, torch.bfloat16)


@pytest.mark.gpu
def test_first_call_inside_a_cuda_graph_capture():
    """A token count first seen inside the user's CUDA-graph capture: the decode tuner would launch,
    synchronize and capture graphs of its own (the capture then fails); it takes an untimed config."""
    x, kw, b, ref = _case("nvfp4", 3, 256, 512, torch.bfloat16, True, seed=8)
    fp4.fp4_linear(x[:1], kw, b)  # warm up another token count
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp4.fp4_linear(x, kw, b)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(y, ref, torch.bfloat16)


def test_decode_tuner_times_each_call_over_its_own_weight_copy(monkeypatch):
    """The decode autotuner's cold timing: one call per weight copy (codes and scales both copied,
    up to 16), all equal to the original, each call computing the same result."""
    from graphopt.hardware import timing
    from graphopt.kernels.fp4 import tune

    x, kw, b, ref = _case("nvfp4", 1, 32, 128, torch.bfloat16, True, seed=5)
    args = (x, kw.codes, kw.scales.view(torch.uint8), kw.global_scale, b, 32, 128, "nvfp4", torch.bfloat16)
    seen = []
    real_launch = fp4._launch

    def recording_launch(path, cfg, x2, codes, scales, *rest, **options):
        seen.append((codes.data_ptr(), scales.data_ptr(), torch.equal(codes, kw.codes)))
        return real_launch(path, cfg, x2, codes, scales, *rest, **options)

    outputs = []
    cfg = fp4.tune_config("gemv", args)  # first: on a GPU this tunes with the real timer
    monkeypatch.setattr(tune, "_launch", recording_launch)
    monkeypatch.setattr(timing, "cold_graph_ms", lambda calls, reps: (outputs.extend(c() for c in calls), 1.0)[1])
    time_config = fp4._cold_decode_timer(args)
    assert time_config(cfg) == 1.0
    nbytes = kw.codes.numel() * kw.codes.element_size() + kw.scales.numel()
    expected = min(16, timing.copies_for(nbytes))
    assert len(seen) == expected == 16
    assert len({ptr for ptr, _, _ in seen}) == expected and len({ptr for _, ptr, _ in seen}) == expected
    assert all(same for _, _, same in seen)
    for out in outputs:
        _assert_close(out, ref, torch.bfloat16)


def test_launcher_rejects_bad_arguments():
    x, kw, b, _ = _case("nvfp4", 2, 16, 64, torch.bfloat16, False)
    args = (kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4")
    with pytest.raises(ValueError, match="valid choices: gemv, gemm, dequant"):
        fp4.fp4_linear_triton(x, *args, path="fast")
    with pytest.raises(ValueError, match="expects 64"):
        fp4.fp4_linear_triton(x[:, :32], *args)
    with pytest.raises(ValueError, match="kernel layout"):
        fp4.fp4_linear_triton(x, kw.codes[:, :16].contiguous(), *args[1:])
    with pytest.raises(ValueError, match="scales must be one byte each"):  # read as bytes in the kernel
        fp4.fp4_linear_triton(x, kw.codes, kw.scales.float(), *args[2:])
    with pytest.raises(ValueError, match="BLOCK_K must divide"):
        fp4.fp4_linear_triton(x, *args, path="gemv", config=KernelConfig(16, 16, 128))
    for block_m in (16, 32, 64):  # tensor-core decode: 16 words per row
        with pytest.raises(ValueError, match="BLOCK_K >= 128, for BLOCK_M >= 16"):
            fp4.fp4_linear_triton(x, *args, path="gemv", config=KernelConfig(16, block_m, 64))
    with pytest.raises(ValueError, match="1, 2, 4, 16, 32 or 64"):  # no 8- or 128-token decode program
        fp4.fp4_linear_triton(x, *args, path="gemv", config=KernelConfig(16, 8, 64))
    for bad in (KernelConfig(24, 1, 64), KernelConfig(16, 1, 64, split_k=0), KernelConfig(8, 16, 128)):
        with pytest.raises(ValueError, match="powers of two"):  # non-power-of-two tile, no split, narrow MMA tile
            fp4.fp4_linear_triton(x, *args, path="gemv", config=bad)
    with pytest.raises(ValueError, match="permute_x only on the tensor-core tiles"):  # a CUDA-core tile
        fp4.fp4_linear_triton(x, *args, path="gemv", config=KernelConfig(16, 2, 64, permute_x=True))
    with pytest.raises(ValueError, match="1, 2 or 4 for int_dots configs"):  # integer dots: up to 4 tokens
        fp4.fp4_linear_triton(x, *args, path="gemv", config=KernelConfig(16, 16, 128, int_dots=True))
    with pytest.raises(ValueError, match="activations must be"):
        fp4.fp4_linear_triton(x.to(torch.int32), *args)


@pytest.mark.parametrize("k_padded", [128, 4096, 5120, 11008, 13824, 14336])
def test_decode_candidates_by_token_count(k_padded):
    """What the decode tuner times: 1-4 tokens the CUDA-core kernels at the token bucket and
    16-token tensor-core programs, 5-16 four-token and 16-token ones, 17-32 tokens 32-token
    programs, more 32 or 64 (16-token ones re-read W: 1.5-2x slower on the H100). Every LLaMA K
    and the GPU tests' short K keep a candidate: one 128-element tile has unsplit 32- and 64-token
    tiles (the 16-token ones are all split)."""
    expected = {1: {1, 16}, 2: {2, 16}, 4: {4, 16}, 16: {4, 16}, 17: {32}, 32: {32}, 33: {32, 64}, 64: {32, 64},
                100: {32, 64}}
    for m, block_ms in expected.items():
        worth = [c for c in fp4.DECODE_CONFIGS if fp4._valid_config(c, "gemv", m, 40, k_padded, 16)
                 and fp4._worth_timing(c, "gemv", m, k_padded)]
        if k_padded == 128:
            block_ms -= {16}
        assert {c.block_m for c in worth} == block_ms, (m, k_padded)


def test_a_call_without_a_path_takes_the_static_default():
    """A call that names no path (an op's empty kernel string, a direct launcher call) decodes up to
    16 tokens and runs the tiled GEMM above: a fixed rule, never the cost model (the pass hands the
    cost model's path to the op, graphopt.cost.fp4)."""
    assert [fp4.default_path(t) for t in (1, 4, 16, 17, 4096)] == ["gemv", "gemv", "gemv", "gemm", "gemm"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_custom_op_cpu_reference_and_fake(fmt):
    import graphopt  # noqa: F401  (registers the ops)
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, kw, b, ref = _case(fmt, 4, 24, 80, torch.float32, True, device="cpu")  # the op's CPU path, also on a GPU machine
    args = (kw.codes, kw.codes.view(torch.float4_e2m1fn_x2), kw.scales, kw.global_scale, b, 24, 80, fmt, "")
    y = torch.ops.graphopt.fp4_linear(x, *args)
    assert torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-5)
    x3 = x.reshape(2, 2, 80)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in (x3, *args)]
        out = torch.ops.graphopt.fp4_linear(*fake_args)
    assert out.shape == (2, 2, 24) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# The word decode of the CUDA-core kernel, the split-K workspace, the dequantize kernel
# ---------------------------------------------------------------------------------------------
if fp4.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_words_kernel(words_ptr, out_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        lo, hi = fp4._decode_shift(tl.load(words_ptr + offs), SHIFT, USE_ASM)
        tl.store(out_ptr + 2 * offs, lo)
        tl.store(out_ptr + 2 * offs + 1, hi)

    @triton.jit
    def _bf16_pairs_kernel(words_ptr, scale_bytes_ptr, out_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                           USE_ASM: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        block_scale = fp4._block_scales(tl.load(scale_bytes_ptr + offs), True)
        lo, hi = fp4._bf16_scaled_pair(tl.load(words_ptr + offs), SHIFT, fp4._bf16_scale_pair(block_scale), USE_ASM)
        tl.store(out_ptr + 2 * offs, lo.to(tl.float32))
        tl.store(out_ptr + 2 * offs + 1, hi.to(tl.float32))

    @triton.jit
    def _int8_lanes_kernel(words_ptr, out_ptr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        lo, hi = fp4._e2m1_int8_lanes(tl.load(words_ptr + offs), USE_ASM)
        tl.store(out_ptr + 2 * offs, lo)
        tl.store(out_ptr + 2 * offs + 1, hi)

    @triton.jit
    def _dp2a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        a, b, c = tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)
        tl.store(out_ptr + 2 * offs, fp4._dp2a(a, b, c, False, USE_ASM))
        tl.store(out_ptr + 2 * offs + 1, fp4._dp2a(a, b, c, True, USE_ASM))


def _words_with_code_pairs(shift: int, repeats: int = 1):
    """int32 words whose nibbles at bits shift and shift + 16 run through all 16 x 16 code pairs
    (`repeats` times), random codes elsewhere; and the (low, high) codes."""
    g = torch.Generator().manual_seed(shift)
    lo_code, hi_code = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    lo_code, hi_code = lo_code.flatten().repeat(repeats), hi_code.flatten().repeat(repeats)
    nibbles = torch.randint(0, 16, (lo_code.numel(), 8), generator=g)
    nibbles[:, shift // 4] = lo_code
    nibbles[:, shift // 4 + 4] = hi_code
    words = (nibbles << (4 * torch.arange(8))).sum(1)  # int64, < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), lo_code, hi_code


@pytest.mark.parametrize("use_asm", [False] + ([True] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("shift", [0, 4, 8, 12])
def test_bf16_scaled_pairs_are_exact_for_every_code_pair_and_e4m3_scale(shift, use_asm):
    """The tensor-core decode's NVFP4 -> bf16 path: every code pair times every finite e4m3 scale
    (0 to 448) gives code * scale * 2^-7 exactly, through the bf16 codes' subnormals (0.5 is
    2^-127 before the multiply). use_asm: the PTX bf16x2 multiply (GPU only)."""
    words, lo_code, hi_code = _words_with_code_pairs(shift, repeats=128)  # 32768 words
    scale_bytes = torch.arange(words.numel()) // 256 % 127  # every byte 0-126 (0x7f is NaN)
    e4m3 = scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    out = torch.empty(2 * words.numel(), dtype=torch.float32, device=DEVICE)
    _bf16_pairs_kernel[(1,)](words.to(DEVICE), scale_bytes.to(torch.uint8).to(DEVICE), out, SHIFT=shift,
                             BLOCK=words.numel(), USE_ASM=use_asm)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    expected = torch.stack((table[lo_code] * e4m3, table[hi_code] * e4m3), 1).flatten() * 2.0**-7
    assert torch.equal(expected.to(torch.bfloat16).double(), expected)  # representable: the test can tell
    out = out.cpu().double()
    assert torch.equal(out, expected)
    assert torch.equal(torch.signbit(out), torch.signbit(expected))


@pytest.mark.parametrize("use_asm", [False] + ([True] if torch.cuda.is_available() else []))
def test_int8_lanes_are_twice_every_code_at_every_nibble(use_asm):
    """The integer decode: lane i of lo (hi) is twice the e2m1 value of nibble i (4 + i), as a
    signed byte, for all 16 x 16 code pairs at every pair of nibbles (-0 gives 0). use_asm: the
    PTX table lookups the GPU kernel runs (GPU only)."""
    words = torch.cat([_words_with_code_pairs(shift)[0] for shift in (0, 4, 8, 12)])  # 1024 words
    out = torch.empty(2 * words.numel(), dtype=torch.int32, device=DEVICE)
    _int8_lanes_kernel[(1,)](words.to(DEVICE), out, BLOCK=words.numel(), USE_ASM=use_asm)
    lanes = out.cpu().reshape(-1, 2).to(torch.int64) & 0xFFFFFFFF  # (words, lo / hi)
    got = ((lanes[:, :, None] >> (8 * torch.arange(4))) & 0xFF).reshape(-1, 8)  # bytes: nibbles 0-7
    got = torch.where(got >= 128, got - 256, got)
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF)[:, None] >> (4 * torch.arange(8))) & 15
    expected = (2 * torch.tensor(E2M1_VALUES, dtype=torch.float64)[nibbles]).to(torch.int64)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("use_asm", [False] + ([True] if torch.cuda.is_available() else []))
def test_dp2a_matches_integer_reference(use_asm):
    """c + a.h0 * b.byte(i) + a.h1 * b.byte(i + 1), signed, for the low (i = 0) and high (i = 2)
    halves of b, on random words (extreme values included)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-2**31, 2**31 - 1, (512,), generator=g, dtype=torch.int64)
    b = torch.randint(-2**31, 2**31 - 1, (512,), generator=g, dtype=torch.int64)
    c = torch.randint(-2**20, 2**20, (512,), generator=g, dtype=torch.int64)
    a[:4] = torch.tensor([0x7FFF7FFF, -0x7FFF8000 - 1, 0x80007FFF - 2**32, -1])  # +-32767/-32768 halves
    b[:4] = torch.tensor([0x7F807F80, -0x7F7F7F80 - 1, -1, 0x01FF01FF])
    out = torch.empty(1024, dtype=torch.int32, device=DEVICE)
    _dp2a_kernel[(1,)](a.to(torch.int32).to(DEVICE), b.to(torch.int32).to(DEVICE), c.to(torch.int32).to(DEVICE), out,
                       BLOCK=512, USE_ASM=use_asm)

    def signed(v, bits):
        v = v & ((1 << bits) - 1)
        return torch.where(v >= 1 << (bits - 1), v - (1 << bits), v)
    halves = [signed(a >> (16 * i), 16) for i in range(2)]
    bytes_ = [signed(b >> (8 * i), 8) for i in range(4)]
    lo = c + halves[0] * bytes_[0] + halves[1] * bytes_[1]
    hi = c + halves[0] * bytes_[2] + halves[1] * bytes_[3]
    assert torch.equal(out.cpu().reshape(-1, 2).to(torch.int64), torch.stack((lo, hi), 1))


@pytest.mark.parametrize("use_asm", [False] + ([True] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("shift", [0, 4, 8, 12])
def test_word_decode_is_exact_for_every_code_pair(shift, use_asm):
    """All 16 x 16 code pairs at the two nibbles one shift reads (bits s and s + 16), with random
    codes in the other nibbles: fp16 bit placement gives value * 2^-14 exactly, -0 included.
    use_asm: the PTX fp16-half conversion the GPU kernel runs (GPU only)."""
    words, lo_code, hi_code = _words_with_code_pairs(shift)
    out = torch.empty(512, dtype=torch.float32, device=DEVICE)
    _decode_words_kernel[(1,)](words.to(DEVICE), out, SHIFT=shift, BLOCK=256, USE_ASM=use_asm)
    table = torch.tensor(E2M1_VALUES) * 2.0**-14
    expected = torch.stack((table[lo_code], table[hi_code]), 1).flatten()
    out = out.cpu()
    assert torch.equal(out, expected)
    assert torch.equal(torch.signbit(out), torch.signbit(expected))  # code 8 is -0


def test_decode_word_positions_match_kernel_layout():
    """The (shift, half) -> element map the decode kernel assumes, checked on the real layout:
    word q of a block, shift s, half h holds element 4q + s//8 + 2h + ((s//4) % 2) * BS/2."""
    for fmt in FORMATS:
        bs = fp4.BLOCK_SIZES[fmt]
        w = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
        q = quantize_fp4(w, fmt)
        kw = to_kernel_layout(q)
        codes = fp4.unpack_nibbles(q.codes)[0]  # (64,) standard order
        words = kw.codes[0].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        for word_index in range(words.numel()):
            block, q_in_block = divmod(word_index, bs // 8)
            for shift in (0, 4, 8, 12):
                for half in (0, 1):
                    nibble = (int(words[word_index]) >> (shift + 16 * half)) & 15
                    element = block * bs + 4 * q_in_block + shift // 8 + 2 * half + ((shift // 4) % 2) * (bs // 2)
                    assert nibble == int(codes[element])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs run concurrently only on a GPU")
@pytest.mark.parametrize("cfg", [KernelConfig(8, 1, 256, split_k=4, num_stages=1),
                                 KernelConfig(16, 1, 256, split_k=4, num_warps=1, num_stages=1, int_dots=True),
                                 KernelConfig(16, 4, 256, split_k=4, num_stages=1),
                                 KernelConfig(16, 4, 256, split_k=4, num_warps=1, num_stages=1, int_dots=True),
                                 KernelConfig(64, 16, 128, split_k=8, num_stages=1)],
                         ids=lambda c: f"{c.block_n}x{c.block_m}{'-int' if c.int_dots else ''}")
def test_split_k_counters_under_concurrency(cfg):
    """Many N tiles, several token tiles and K splits in flight at once (the interpreter runs
    programs one after another, so a shared or misindexed arrival counter only races here)."""
    m = 20 if cfg.block_m == 16 else 7
    x, kw, b, ref = _case("nvfp4", m, 1000, 1024, torch.bfloat16, True, seed=12)
    for _ in range(3):
        _assert_close(fp4.fp4_linear(x, kw, b, path="gemv", config=cfg), ref, torch.bfloat16)


@pytest.mark.parametrize("k,cfg", [(300, KernelConfig(16, 4, 64, split_k=3)),  # CUDA cores
                                   (300, KernelConfig(8, 1, 64, split_k=2)),  # narrowest tile: 5 tiles of N
                                   (380, KernelConfig(16, 16, 128, split_k=3))])  # tensor cores
def test_split_k_calls_repeat_exactly_and_keep_no_buffers(k, cfg):
    """Each split-K call gets fresh zeroed sums and counters: repeated calls give the same result,
    and no buffer outlives a call (a CUDA graph would otherwise hold the first call's)."""
    x, kw, b, ref = _case("nvfp4", 3, 40, k, torch.bfloat16, True, seed=5)
    y1 = fp4.fp4_linear(x, kw, b, path="gemv", config=cfg)
    y2 = fp4.fp4_linear(x, kw, b, path="gemv", config=cfg)
    assert torch.equal(y1, y2)
    _assert_close(y2, ref, torch.bfloat16)
    assert not hasattr(split_k, "BUFFERS")


def test_the_call_path_never_times_tiles(monkeypatch):
    """Tiles are timed at compile time (tune_config through tune_fp4_linear), never by a call: the
    launcher runs the default tile; off the GPU tune_fp4_linear chooses nothing."""
    from graphopt.kernels.fp4 import tune

    x, kw, b, ref = _case("nvfp4", 2, 48, 256, torch.bfloat16, True, seed=8)

    def refuse(*args, **kwargs):
        raise AssertionError("a call timed tiles")

    monkeypatch.setattr(tune, "tune_config", refuse)
    monkeypatch.setattr(tune, "_cold_decode_timer", refuse)
    _assert_close(fp4.fp4_linear(x, kw, b), ref, torch.bfloat16)
    if not x.is_cuda:
        assert fp4.tune_fp4_linear(2, kw.codes, kw.scales, kw.global_scale, b, 48, 256, "nvfp4", torch.bfloat16,
                                   allow_gluon=True, path="gemv") == ""


def test_op_runs_the_tile_its_kernel_argument_names():
    """graphopt::fp4_linear's kernel argument ("lo-hi=path=<tile>") selects the tile for token counts
    in its range and the default elsewhere; a malformed one is a clear error."""
    from graphopt.kernels import tuning

    cfg = KernelConfig(16, 2, 64, split_k=2, num_warps=4, num_stages=1)
    kernel = f"1-2=gemv={tuning.encode(cfg)}"
    assert fp4.kernel_choice(kernel, 2) == ("gemv", cfg)
    assert fp4.kernel_choice(kernel, 3) == (None, None)
    assert fp4.kernel_choice("", 1) == (None, None)
    ranges = "1-16=gemv=;17-=dequant="  # paths per token range (the last open-ended), default tiles
    assert fp4.kernel_string([(1, 16, "gemv", None), (17, None, "dequant", None)]) == ranges
    assert [fp4.kernel_choice(ranges, t) for t in (1, 16, 17, 10**9)] == [("gemv", None)] * 2 + [("dequant", None)] * 2
    assert fp4.kernel_choice(fp4.kernel_string([(1, 2, "gemv", cfg)]), 2) == ("gemv", cfg)
    with pytest.raises(ValueError, match="not 'lo-hi=path=<tile json>'"):
        fp4.kernel_choice("gemv", 1)
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        fp4.kernel_choice("1-2=fast={}", 1)
    x, kw, b, ref = _case("nvfp4", 2, 40, 128, torch.bfloat16, True, seed=9)
    y = torch.ops.graphopt.fp4_linear(x, kw.codes, kw.codes.view(torch.float4_e2m1fn_x2), kw.scales, kw.global_scale,
                                      b, 40, 128, "nvfp4", kernel)
    _assert_close(y, ref, torch.bfloat16)


@pytest.mark.parametrize("tile", [None, (8, 128, 4, 0), (4, 128, 4, 1)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_is_exact(fmt, tile):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(37, 200, generator=g)
    kw = to_kernel_layout(quantize_fp4(w, fmt))
    expected = fp4.dequantize_kernel_layout(kw.codes, kw.scales, kw.global_scale, 37, 200, fmt)
    got = fp4.dequantize_triton(kw.codes.to(DEVICE), kw.scales.to(DEVICE), kw.global_scale.to(DEVICE), 37, 200, fmt,
                                dtype=torch.float32, tile=tile)
    assert torch.equal(got.cpu(), expected)
