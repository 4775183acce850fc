"""Q4_0 / Q8_1 formats (byte-exact with ggml's reference quantizers), the kernel weight layout, and
the Triton kernels (under TRITON_INTERPRET=1 without a GPU) against float64 references."""

import math
import struct

import numpy as np
import pytest
import torch

import graphopt  # noqa: F401  (registers graphopt::* ops)
from graphopt.kernels import q4, split_k, tuning

F32 = np.float32


# ---- scalar ports of ggml's C reference quantizers, building the bytes by hand ---------------
def _fp16_bytes(value: np.float32) -> bytes:
    return np.array([value], dtype=np.float16).tobytes()  # round to nearest even, like F16C


def _hand_q4_0_block(xs: list[float]) -> bytes:
    x = [F32(v) for v in xs]
    amax, vmax = F32(0), F32(0)
    for v in x:
        if amax < abs(v):  # strict: the first value of largest magnitude wins
            amax, vmax = abs(v), v
    d = F32(vmax / F32(-8))
    inv_d = F32(F32(1) / d) if d != 0 else F32(0)
    out = bytearray(_fp16_bytes(d))
    for j in range(16):
        lo = min(15, math.trunc(float(F32(F32(x[j] * inv_d) + F32(8.5)))))
        hi = min(15, math.trunc(float(F32(F32(x[j + 16] * inv_d) + F32(8.5)))))
        out.append(lo | (hi << 4))
    return bytes(out)


def _roundf(v: np.float32) -> int:
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))  # exact for |v| < 2^23


def _hand_q8_1_block(xs: list[float]) -> bytes:
    x = [F32(v) for v in xs]
    amax = F32(0)
    for v in x:
        amax = max(amax, abs(v))
    d = F32(amax / F32(127))
    inv_d = F32(F32(1) / d) if d != 0 else F32(0)
    qs = [_roundf(F32(v * inv_d)) for v in x]
    s = F32(F32(sum(qs)) * d)
    return _fp16_bytes(d) + _fp16_bytes(s) + struct.pack("32b", *qs)


def _blocks(rng: np.random.Generator) -> list[list[float]]:
    blocks = [list(rng.standard_normal(32) * s) for s in (1.0, 1e-3, 300.0)]
    blocks.append([0.0] * 32)  # d = 0
    tie = list(rng.uniform(-1, 1, 32))
    tie[3], tie[20] = -2.0, 2.0  # equal magnitude: the first (negative) one sets the sign of d
    blocks.append(tie)
    pos = list(rng.uniform(0, 1, 32))
    pos[7] = 1.5  # positive max: d < 0, the most negative values clamp to nibble 15
    blocks.append(pos)
    halves = [(i - 16) * 0.5 for i in range(32)]  # x * (1/d) lands on .5 boundaries
    blocks.append(halves)
    return blocks


def test_q4_0_bytes_match_hand_built_ggml_blocks():
    rng = np.random.default_rng(0)
    blocks = _blocks(rng)
    x = torch.tensor([v for b in blocks for v in b], dtype=torch.float32, device=DEVICE).reshape(1, -1)
    got = q4.quantize_q4_0(x)
    assert got.shape == (1, len(blocks), 18) and got.dtype == torch.uint8
    expected = b"".join(_hand_q4_0_block(b) for b in blocks)
    assert bytes(got.flatten().tolist()) == expected


def test_q8_1_bytes_match_hand_built_ggml_blocks():
    rng = np.random.default_rng(1)
    blocks = _blocks(rng) + [[(i - 16) * 127 / 254 for i in range(32)]]  # exact .5 quotients
    x = torch.tensor([v for b in blocks for v in b], dtype=torch.float32, device=DEVICE).reshape(1, -1)
    got = q4.quantize_q8_1(x)
    assert got.shape == (1, len(blocks), 36)
    expected = b"".join(_hand_q8_1_block(b) for b in blocks)
    assert bytes(got.flatten().tolist()) == expected


def test_dequantize_reads_the_layout():
    d = np.float16(0.0375)
    nibbles = list(range(16)) + list(range(15, -1, -1))
    block = _fp16_bytes(np.float32(d)) + bytes(nibbles[j] | (nibbles[j + 16] << 4) for j in range(16))
    values = q4.dequantize_q4_0(torch.tensor(list(block), dtype=torch.uint8).reshape(1, 1, 18))
    assert torch.equal(values[0], (torch.tensor(nibbles, dtype=torch.float32) - 8) * float(d))
    qs = list(range(-16, 16))
    q8 = _fp16_bytes(np.float32(0.5)) + _fp16_bytes(np.float32(-8.0)) + struct.pack("32b", *qs)
    values = q4.dequantize_q8_1(torch.tensor(list(q8), dtype=torch.uint8).reshape(1, 1, 36))
    assert torch.equal(values[0], torch.tensor(qs, dtype=torch.float32) * 0.5)


@pytest.mark.parametrize("k", [32, 64, 96, 4096])  # 32: one scale per row (the (N, 1) transpose)
def test_kernel_layout_round_trips_losslessly(k):
    w = torch.randn(6, k)
    blocks = q4.quantize_q4_0(w)
    qweight, scales = q4.pack_q4_0(blocks)
    assert qweight.shape == (6, 32 * math.ceil(k / 64)) and scales.shape == (2 * math.ceil(k / 64), 6)
    assert torch.equal(q4.unpack_q4_0(qweight, scales, k), blocks)
    assert torch.equal(q4.dequantize_packed(qweight, scales, k), q4.dequantize_q4_0(blocks))


def test_k_not_multiple_of_32_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.quantize_q4_0(torch.randn(4, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.quantize_q8_1(torch.randn(4, 33))


def test_weight_sqnr_of_gaussian_weights():
    w = torch.randn(64, 4096)
    qweight, scales = q4.quantize_weight(w)
    sqnr = q4.weight_sqnr_db(w, qweight, scales)
    assert 17.0 < sqnr < 25.0  # 4-bit blocks of 32 with an absmax scale: ~20 dB on Gaussians


def test_quantize_weight_in_row_chunks_gives_the_bytes_of_one_pass(monkeypatch):
    """quantize_weight rounds weight_chunks.CHUNK_ELEMENTS at a time to bound its temporaries; the
    packed weight and its (K/32 padded to pairs, N) scales must not depend on the chunking."""
    from graphopt.kernels import weight_chunks

    w = torch.randn(37, 224, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    qweight, scales = q4.quantize_weight(w)
    monkeypatch.setattr(weight_chunks, "CHUNK_ELEMENTS", 4 * 224)  # 10 chunks, the last of one row
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a pass may quantize under the user's autocast
        chunked_q, chunked_s = q4.quantize_weight(w)
    assert torch.equal(chunked_q, qweight) and torch.equal(chunked_s, scales) and scales.shape == (8, 37)  # 7 blocks padded to pairs
    err = w.double() - q4.dequantize_packed(qweight, scales, 224, torch.float64)
    whole_db = 10 * math.log10(w.double().square().sum() / err.square().sum())
    assert q4.weight_sqnr_db(w, qweight, scales) == pytest.approx(whole_db, rel=1e-9)  # summed a chunk at a time


# ---- references and kernels --------------------------------------------------------------
# Triton kernels run on the GPU when there is one, else in the interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(m, n, k, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    qweight, scales = q4.quantize_weight(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g)
    return tuple(t.to(device) for t in (x, qweight, scales, bias))


def _dequant_matmul64(x, qweight, scales, bias=None):
    """dequantize(Q8_1(x)) @ dequantize(Q4_0(W)).T in float64."""
    a = q4.dequantize_q8_1(q4.quantize_q8_1(x)).double()
    w = q4.dequantize_packed(qweight, scales, x.shape[-1], torch.float64)
    y = a @ w.T
    return y if bias is None else y + bias.double()


def _assert_close_fp32_sum(y, ref64, out_dtype):
    """Equal up to fp32 summation order (and the output dtype's rounding)."""
    scale = ref64.abs().max().item()
    eps = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[out_dtype]
    err = (y.double() - ref64).abs().max().item()
    assert err <= eps * scale + 1e-6, f"max error {err:.3e} vs output scale {scale:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,n", [((5,), 40), ((2, 3), 37), ((1,), 4096)])
def test_dequantized_q4_linear_computes_the_q4_product(shape, n, dtype):
    """The dense-GEMM form of the product (for layers held only as Q4_0 without a correct tile):
    the float64 product of the Q8_1 and Q4_0 values, at odd N, K with a padding block (96), a
    LLaMA-width N, and leading dims; also compiled by Inductor, which must keep the fp16 rounding
    of the activation steps."""
    k = 96 if n != 4096 else 2048
    g = torch.Generator().manual_seed(n + len(shape))
    x = torch.randn(*shape, k, generator=g).to(dtype).to(DEVICE)
    qweight, scales = (t.to(DEVICE) for t in q4.quantize_weight(torch.randn(n, k, generator=g)))
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    ref = _dequant_matmul64(x, qweight, scales, bias)
    y = q4.dequantized_q4_linear(x, qweight, scales, bias)
    assert y.shape == (*shape, n) and y.dtype == dtype
    _assert_close_fp32_sum(y, ref, dtype)
    if n != 4096:  # one compile is enough
        compiled = torch.compile(q4.dequantized_q4_linear, fullgraph=True)(x, qweight, scales, bias)
        _assert_close_fp32_sum(compiled, ref, dtype)


def test_reference_formula_equals_dequantize_then_matmul():
    x, qweight, scales, bias = _problem(5, 40, 96, torch.float32, device="cpu")
    ref = _dequant_matmul64(x, qweight, scales, bias)
    _assert_close_fp32_sum(q4.reference_q4_linear(x, qweight, scales, bias), ref, torch.float32)
    xq = q4.quantize_q8_1(x)
    _assert_close_fp32_sum(q4.reference_q4_q8_gemm(xq, qweight, scales, bias), ref, torch.float32)


@pytest.mark.parametrize("k", [160, 512])  # a partial last group of blocks, and whole groups only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_q8_1_quantization_is_byte_exact(dtype, k):
    x = (torch.randn(3, k, generator=torch.Generator().manual_seed(k)) * 4).to(dtype)
    x[1, :32] = 0  # an all-zero block
    assert torch.equal(q4.quantize_q8_1_triton(x.to(DEVICE)).cpu(), q4.quantize_q8_1(x))


def test_triton_q8_1_rounding_ties_match_hand_built_ggml_blocks():
    """x * (1/d) landing on (or within an ulp of) .5: roundf goes away from zero, unlike rint."""
    rng = np.random.default_rng(2)
    exact_ties = [127.0] + [i - 15.5 for i in range(31)]  # d = 1: x * (1/d) = k + 0.5 exactly
    blocks = _blocks(rng) + [exact_ties, [(i - 16) * 127 / 254 for i in range(32)], [(i - 16) * 0.5 + 1e-7 for i in range(32)]]
    x = torch.tensor([v for b in blocks for v in b], dtype=torch.float32, device=DEVICE).reshape(1, -1)
    expected = b"".join(_hand_q8_1_block(b) for b in blocks)
    assert bytes(q4.quantize_q8_1_triton(x).flatten().tolist()) == expected


GEMM_CONFIGS = [q4.TileConfig("gemm", 16, 32, 2, 4, 3), q4.TileConfig("gemm", 32, 16, 1, 4, 2)]
SPLIT_GEMM_CONFIGS = [q4.TileConfig("gemm", 16, 32, 1, 4, 2, split_k=3, reduce="workspace"),
                      q4.TileConfig("gemm", 16, 16, 2, 4, 2, split_k=0, reduce="atomic")]
# the operand-swapped decode variant: weights on the MMA's M side; single-launch split-K too
SWAP_CONFIGS = [q4.TileConfig("swap", 16, 32, 2, 4, 1),
                q4.TileConfig("swap", 8, 16, 1, 4, 2, split_k=3, reduce="last"),
                q4.TileConfig("swap", 16, 16, 2, 4, 1, split_k=0, reduce="workspace"),
                q4.TileConfig("swap", 16, 16, 4, 4, 1, split_k=2, reduce="last")]  # 4 pairs a step: scale picks


@pytest.mark.parametrize("config", GEMM_CONFIGS + SPLIT_GEMM_CONFIGS + SWAP_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (17, 24, 224)])  # odd sizes: partial tiles, odd block count
def test_fused_kernel_equals_dequantize_then_matmul(config, m, n, k):
    x, qweight, scales, bias = _problem(m, n, k, torch.float32, seed=m)
    y = q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.float32)


# gemv: rows per program (0 = all, up to 8), weight rows, pairs per iteration, warps, stages, split-K
GEMV_CONFIGS = [q4.TileConfig("gemv", 0, 16, 2, 2, 1),
                q4.TileConfig("gemv", 2, 16, 1, 2, 1, split_k=2, reduce="workspace"),
                q4.TileConfig("gemv", 0, 32, 4, 4, 1, split_k=0, reduce="atomic"),
                q4.TileConfig("dp4a", 0, 16, 2, 2, 1),
                q4.TileConfig("dp4a", 2, 32, 4, 4, 1, split_k=0, reduce="atomic"),
                q4.TileConfig("dp4a", 0, 8, 1, 1, 1, split_k=3, reduce="last"),  # one launch, last split writes
                q4.TileConfig("gemv", 2, 16, 1, 1, 1, split_k=2, reduce="last"),
                # several steps per split, splits that end inside a step
                q4.TileConfig("dp4a", 0, 16, 2, 1, 1, split_k=3, reduce="last")]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=lambda c: c.name)
# K not a multiple of the chunk; 608: 19 blocks, several steps per split
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 24, 224), (16, 24, 160), (1, 24, 608)])
def test_decode_gemv_kernel_equals_dequantize_then_matmul(config, m, n, k):
    x, qweight, scales, bias = _problem(m, n, k, torch.float32, seed=m)
    y = q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.float32)


@pytest.mark.parametrize("config", [GEMV_CONFIGS[1], GEMV_CONFIGS[5], SPLIT_GEMM_CONFIGS[1], SWAP_CONFIGS[1]],
                         ids=lambda c: c.name)
def test_split_k_bf16_output_with_bias(config):
    x, qweight, scales, bias = _problem(2, 24, 128, torch.bfloat16, seed=6)
    y = q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 24)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.bfloat16)


def test_last_split_reduces_into_buffers_of_its_own_call(monkeypatch):
    """REDUCE_LAST: every call takes fresh zeroed buffers (one arrival counter per output tile) and
    keeps none, so a second call gives the same output. Sums and counters are separate allocations:
    a kernel that writes two views of one base breaks torch's functionalization in compiled graphs."""
    config = q4.TileConfig("dp4a", 0, 8, 1, 1, 1, split_k=3, reduce="last")
    x, qweight, scales, bias = _problem(3, 40, 224, torch.float32, seed=9)
    taken = []

    def split_buffers(*args):
        taken.append(split_k.split_buffers(*args))
        return taken[-1]

    monkeypatch.setattr(q4.launcher, "split_buffers", split_buffers)
    y1 = q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config)
    y2 = q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config)
    assert torch.equal(y1, y2)
    _assert_close_fp32_sum(y2, _dequant_matmul64(x, qweight, scales, bias), torch.float32)
    assert len(taken) == 2 and taken[0][0] is not taken[1][0]
    assert taken[0][0].shape == (3, 40) and taken[0][1].numel() == 5  # 5 tiles of 8 rows
    sums, counters = taken[0]
    assert sums.untyped_storage().data_ptr() != counters.untyped_storage().data_ptr()
    assert sums.dtype == torch.float32 and counters.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs run concurrently only on a GPU")
@pytest.mark.parametrize("config", [q4.TileConfig("dp4a", 0, 16, 8, 1, 1, split_k=4, reduce="last"),
                                    q4.TileConfig("dp4a", 2, 32, 4, 1, 1, split_k=0, reduce="last"),
                                    q4.TileConfig("swap", 8, 64, 1, 4, 1, split_k=0, reduce="last")], ids=lambda c: c.name)
def test_last_split_counters_under_concurrency(config):
    """Many N tiles, several token tiles and K splits in flight at once (the interpreter runs
    programs one after another, so a shared or misindexed arrival counter only races here)."""
    x, qweight, scales, bias = _problem(5, 1000, 2048, torch.float32, seed=13)
    ref = _dequant_matmul64(x, qweight, scales, bias)
    for _ in range(3):
        _assert_close_fp32_sum(q4.q4_linear_triton(x, qweight, scales, bias, "fused", config=config), ref, torch.float32)


def test_split_k_program_count_and_pairs():
    # 216 block pairs (K = 13824), 80 output tiles, 4 programs per SM on 132 SMs -> 7 splits of 32 pairs
    assert q4._split_k(7, 80, 216, 8, torch.device("cpu")) == (7, 32)
    assert q4._split_k(1, 80, 216, 8, torch.device("cpu")) == (1, 216)
    assert q4._split_k(64, 1, 3, 2, torch.device("cpu")) == (2, 2)  # never more splits than K steps


def test_tile_config_rejects_invalid_choices():
    with pytest.raises(ValueError, match="valid choices: workspace, atomic, last"):
        q4.TileConfig("gemv", 0, 32, 4, reduce="tree")
    with pytest.raises(ValueError, match="valid choices: gemm, swap, gemv, dp4a"):
        q4.TileConfig("mma", 16, 32)
    with pytest.raises(ValueError, match="power-of-two"):
        q4.TileConfig("gemv", 0, 32, 3)
    x, qweight, scales, _ = _problem(1, 16, 64, torch.float32)
    with pytest.raises(ValueError, match="only 'gemm', 'swap' and 'dp4a' configs"):
        q4.q4_q8_gemm_triton(q4.quantize_q8_1(x), qweight, scales, None, torch.float32, config=GEMV_CONFIGS[0])


@pytest.mark.parametrize("config", [GEMM_CONFIGS[0], SPLIT_GEMM_CONFIGS[0], SWAP_CONFIGS[1]] + GEMV_CONFIGS[3:6]
                         + GEMV_CONFIGS[7:],
                         ids=lambda c: c.name)
# odd block counts: the last pair has no second block; 16 tokens (the slowest in the interpreter) in the slow run
@pytest.mark.parametrize("m,k", [(6, 96), pytest.param(16, 160, marks=pytest.mark.slow)])
def test_separate_integer_gemm_equals_dequantize_then_matmul(config, m, k):
    """Q8_1 blocks in: the tensor-core GEMM, and the dp4a decode kernel reading the blocks as words."""
    x, qweight, scales, bias = _problem(m, 40, k, torch.float32, seed=3)
    y = q4.q4_q8_gemm_triton(q4.quantize_q8_1_triton(x), qweight, scales, bias, torch.float32, config=config)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.float32)


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_swap_kernel_on_32_token_blocks(mode):
    """17-64 tokens: the operand-swapped kernel with 32 tokens on the MMA's N side (two token blocks,
    the second partial), split along K, bf16 in and out with bias."""
    config = q4.TileConfig("swap", 32, 16, 1, 4, 1, split_k=2, reduce="last")
    x, qweight, scales, bias = _problem(45, 24, 160, torch.bfloat16, seed=12)
    y = q4.q4_linear_triton(x, qweight, scales, bias, mode, config=config)
    assert y.dtype == torch.bfloat16 and y.shape == (45, 24)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.bfloat16)


def test_swap_tiles_are_candidates_from_17_to_64_tokens():
    for m in (17, 64):
        assert any(c.kernel == "swap" and c.block_m == 32 for c in q4.candidate_configs(m, fused=True))
        assert any(c.kernel == "swap" and c.block_m == 32 for c in q4.candidate_configs(m, fused=False))
    assert not any(c.kernel == "swap" for c in q4.candidate_configs(65, fused=True))


def test_bf16_activations_through_the_fused_kernel():
    x, qweight, scales, _ = _problem(4, 32, 64, torch.bfloat16, seed=4)
    y = q4.q4_linear_triton(x, qweight, scales, None, "fused", config=GEMM_CONFIGS[0])
    assert y.dtype == torch.bfloat16
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales), torch.bfloat16)
    dense = x.double() @ q4.dequantize_packed(qweight, scales, 64, torch.float64).T
    noise = (y.double() - dense).pow(2).sum()
    assert 10 * math.log10(dense.pow(2).sum() / noise) > 30  # Q8_1 activations cost little


@pytest.mark.parametrize("config", [GEMM_CONFIGS[1], SWAP_CONFIGS[1]], ids=lambda c: c.name)
@pytest.mark.parametrize("per_row", [False, True])
def test_static_scale_kernel_matches_fake_quant_idiom(per_row, config):
    x, qweight, scales, bias = _problem(5, 24, 64, torch.float32, seed=5)
    s = x.abs().amax(-1, keepdim=True) / 100 if per_row else torch.tensor(0.015, device=x.device)
    w = q4.dequantize_packed(qweight, scales, 64)
    idiom = (torch.round(x / s).clamp(-128, 127) * s) @ w.T + bias
    y = q4.q4_linear_static_triton(x, s, qweight, scales, bias, -128, 127, config=config)
    _assert_close_fp32_sum(y, idiom.double(), torch.float32)
    _assert_close_fp32_sum(q4.reference_q4_linear_static(x, s, qweight, scales, bias), idiom.double(), torch.float32)


def test_ops_fake_and_bad_inputs():
    x, qweight, scales, bias = _problem(3, 40, 96, torch.float32)
    y = torch.ops.graphopt.q4_linear(x, qweight, scales, bias, "separate")
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.float32)
    xq = torch.ops.graphopt.quantize_q8_1(x)
    assert torch.equal(xq, q4.quantize_q8_1(x))
    assert torch.equal(torch.ops.graphopt.q4_q8_gemm(xq, qweight, scales, bias, torch.float32), y)
    from torch._subclasses.fake_tensor import FakeTensorMode

    x3 = x.reshape(1, 3, 96).to(torch.bfloat16)
    with FakeTensorMode() as mode:
        fx_ = mode.from_tensor(x3)
        out = torch.ops.graphopt.q4_linear(fx_, mode.from_tensor(qweight), mode.from_tensor(scales), None, "fused")
        assert out.shape == (1, 3, 40) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="valid choices: fused, separate"):
        torch.ops.graphopt.q4_linear(x, qweight, scales, bias, "fastest")
    with pytest.raises(ValueError, match="K=64"):
        q4.reference_q4_linear(x[:, :64], qweight, scales)


# ---- the ops: a compile-time tile, never tuned in the call ------------------------------------
def _tile_problem(m, seed=21):
    x, qweight, scales, bias = _problem(m, 40, 160, torch.bfloat16, seed=seed)
    return x, qweight, scales, bias.to(torch.bfloat16)


def test_ops_never_tune(monkeypatch):
    """A call, eager or traced, runs the tile it is given or the untuned default: no timing, no
    tuning-cache lookup."""
    def refuse(*args, **kwargs):
        raise AssertionError("an op tried to tune")

    for name in ("_time_config", "tune_q4_linear"):
        monkeypatch.setattr(q4.tune, name, refuse)
    monkeypatch.setattr(tuning, "lookup", refuse)
    x, qweight, scales, bias = _tile_problem(3)
    ref = _dequant_matmul64(x, qweight, scales, bias)
    ops = torch.ops.graphopt
    for mode in ("fused", "separate"):
        _assert_close_fp32_sum(ops.q4_linear(x, qweight, scales, bias, mode), ref, torch.bfloat16)
    _assert_close_fp32_sum(ops.q4_q8_gemm(ops.quantize_q8_1(x), qweight, scales, bias, torch.bfloat16), ref,
                           torch.bfloat16)
    s = torch.tensor(0.02, device=x.device)
    assert ops.q4_linear_static(x.float(), s, qweight, scales, None, -128, 127).shape == (3, 40)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert ops.q4_linear(mode.from_tensor(x), qweight, scales, bias, "fused").shape == (3, 40)


def test_tune_q4_linear_picks_nothing_off_the_gpu():
    qweight, scales = q4.quantize_weight(torch.randn(40, 160))
    for mode in ("fused", "separate"):
        assert q4.tune_q4_linear((4, 160), qweight, scales, True, torch.bfloat16, mode, True) == ""
    with pytest.raises(ValueError, match="valid choices: fused, separate"):
        q4.tune_q4_linear((4, 160), qweight, scales, True, torch.bfloat16, "auto", False)


OP_TILES = [q4.TileConfig("dp4a", 0, 8, 1, 1, 1, split_k=3, reduce="last"),
            q4.TileConfig("gemv", 2, 16, 1, 2, 1, split_k=2, reduce="workspace"),
            q4.TileConfig("gemm", 16, 32, 1, 4, 2, split_k=3, reduce="atomic"),
            q4.TileConfig("swap", 8, 16, 1, 4, 2, split_k=3, reduce="last")]


@pytest.mark.parametrize("tile", OP_TILES, ids=lambda c: c.name)
@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_ops_run_the_tile_their_kernel_string_names(tile, mode):
    """The kernel string round-trips to the TileConfig, and the op runs that tile (Triton, in the
    interpreter without a GPU) to the float64 reference's numbers."""
    kernel = tuning.encode(tile)
    assert q4.kernel_config(kernel) == tile and q4.kernel_config("") is None
    x, qweight, scales, bias = _tile_problem(3)
    ref = _dequant_matmul64(x, qweight, scales, bias)
    if mode == "separate" and tile.kernel == "gemv":
        with pytest.raises(ValueError, match="only 'gemm', 'swap' and 'dp4a'"):
            torch.ops.graphopt.q4_linear(x, qweight, scales, bias, mode, kernel)
        return
    _assert_close_fp32_sum(torch.ops.graphopt.q4_linear(x, qweight, scales, bias, mode, kernel), ref, torch.bfloat16)
    if tile.kernel != "gemv":
        xq = torch.ops.graphopt.quantize_q8_1(x)
        _assert_close_fp32_sum(torch.ops.graphopt.q4_q8_gemm(xq, qweight, scales, bias, torch.bfloat16, kernel), ref,
                               torch.bfloat16)
    if mode == "fused" and tile.kernel in ("gemm", "swap"):
        s = x.float().abs().amax(-1, keepdim=True) / 100
        w = q4.dequantize_packed(qweight, scales, 160)
        idiom = (torch.round(x.float() / s).clamp(-128, 127) * s) @ w.T
        y = torch.ops.graphopt.q4_linear_static(x.float(), s, qweight, scales, None, -128, 127, kernel)
        _assert_close_fp32_sum(y, idiom.double(), torch.float32)


def test_op_with_a_bad_kernel_string_is_a_clear_error():
    x, qweight, scales, bias = _tile_problem(2)
    with pytest.raises(ValueError, match="not a TileConfig"):
        torch.ops.graphopt.q4_linear(x, qweight, scales, bias, "fused", "gemm_m16n32")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 40, 200])
@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_every_candidate_tile_the_tuner_may_pick_computes_the_product(tokens, mode):
    """The tuner picks whichever candidate is fastest, so every one must be right: split-K
    reductions, inline-asm dequantization and swapped tiles run only on the GPU (the interpreter
    runs other code paths), at a layer size where split-K splits a short K and at an odd one."""
    wrong = []
    for n, k, seed in ((256, 512, 1), (200, 1056, 2)):
        x, qweight, scales, bias = _problem(tokens, n, k, torch.bfloat16, seed=seed)
        bias = bias.to(torch.bfloat16)
        ref = _dequant_matmul64(x, qweight, scales, bias)
        tma = q4.tma_configs(tokens) if mode == "separate" and torch.cuda.get_device_capability() >= (9, 0) else []
        for config in q4.candidate_configs(tokens, mode == "fused") + tma:
            try:
                y = q4.q4_linear_triton(x, qweight, scales, bias, mode, config=config)
            except ValueError:  # a tile that states it does not take this shape (e.g. tma's K multiple)
                continue
            err = (y.double() - ref).abs().max().item()
            if not err <= 8e-3 * ref.abs().max().item() + 1e-6:
                wrong.append(f"{config.name} at {tokens}x{n}x{k}: max error {err:.3g}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.gpu
def test_the_tuner_leaves_out_a_tile_whose_product_is_wrong(monkeypatch, tmp_path, caplog):
    """Only the untuned default computes the right product here (every other tile's output is
    corrupted): the tuner must pick the default, whatever the others' speed."""
    from graphopt.kernels.q4 import tune

    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    x, qweight, scales, _ = _problem(4, 256, 512, torch.bfloat16, seed=3)
    default = q4.default_config(4, False)
    real = tune.q4_linear_triton

    def corrupted(*args, config=None, **kwargs):
        y = real(*args, config=config, **kwargs)
        return y if config == default else y * 1.5

    monkeypatch.setattr(tune, "q4_linear_triton", corrupted)
    with caplog.at_level("WARNING", logger=tune.__name__):
        kernel = q4.tune_q4_linear(tuple(x.shape), qweight, scales, False, x.dtype, "separate", False)
    assert q4.kernel_config(kernel) == default
    assert "wrong product" in caplog.text


@pytest.mark.parametrize("mode,tokens", [("separate", 4), ("fused", 40)])
def test_the_tuner_raises_and_stores_nothing_when_no_tile_is_right(mode, tokens, monkeypatch, tmp_path):
    """Every tile's product corrupted, the default's too: each candidate runs (compiled on a GPU,
    in the interpreter on the CPU) and fails the float64 check, the tuner raises NoCorrectTile and
    keeps no choice, in memory or on disk (the q4_linear pass then leaves the layer dense)."""
    from graphopt.kernels.q4 import tune

    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    monkeypatch.setattr(tune, "_tuning_device", lambda qweight: "test GPU")  # tiles are checked off the GPU too
    x, qweight, scales, _ = _problem(tokens, 64, 256, torch.bfloat16, seed=5)
    real, ran = tune.q4_linear_triton, []

    def corrupted(*args, config=None, **kwargs):
        y = real(*args, config=config, **kwargs)
        ran.append(config)  # ran to the end: the check, not an error, refused it
        return y * 1.5

    monkeypatch.setattr(tune, "q4_linear_triton", corrupted)
    with pytest.raises(tuning.NoCorrectTile, match=f"no Q4 {mode} tile .* M={tokens} N=64 K=256"):
        q4.tune_q4_linear(tuple(x.shape), qweight, scales, False, x.dtype, mode, False)
    assert ran == q4.candidate_configs(tokens, mode == "fused") and q4.default_config(tokens, mode == "fused") in ran
    assert not tuning._MEMORY and not any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tiles are timed on a GPU")
@pytest.mark.parametrize("mode,tokens", [("fused", 1), ("separate", 4), ("fused", 40)])
def test_tune_q4_linear_times_once_and_the_op_runs_its_choice(mode, tokens, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})  # nothing tuned earlier in this process
    x, qweight, scales, bias = _problem(tokens, 256, 512, torch.bfloat16, seed=tokens)
    bias = bias.to(torch.bfloat16)
    kernel = q4.tune_q4_linear(tuple(x.shape), qweight, scales, True, x.dtype, mode, False)
    assert q4.kernel_config(kernel).kernel != "tma"
    assert (tmp_path / "tuning.json").exists()

    def refuse(*args, **kwargs):
        raise AssertionError("timed twice")

    monkeypatch.setattr(q4.tune, "_time_config", refuse)
    assert q4.tune_q4_linear(tuple(x.shape), qweight, scales, True, x.dtype, mode, False) == kernel
    y = torch.ops.graphopt.q4_linear(x, qweight, scales, bias, mode, kernel)
    _assert_close_fp32_sum(y, _dequant_matmul64(x, qweight, scales, bias), torch.bfloat16)


def test_fp16_rounding_of_the_q8_1_scale_survives_compilation():
    """The Q8_1 scale d is used at its fp16 value. The integer-arithmetic rounding equals
    .to(float16) on normal, subnormal, tie and overflowing values, eager and through Inductor
    (which may skip a .to(float16) between float32 and float64)."""
    from graphopt.kernels.q4.format import _fp16_rounded

    torch.manual_seed(0)
    d = torch.cat([torch.rand(4096) * 0.05, torch.rand(512) * 1e-4, torch.rand(256) * 7e4,
                   torch.tensor([0.0, 2.0**-14, 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65520.0])])
    expected = d.to(torch.float16).to(torch.float32)
    torch.testing.assert_close(_fp16_rounded(d), expected, rtol=0, atol=0)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_fp16_rounded)(d), expected, rtol=0, atol=0)
