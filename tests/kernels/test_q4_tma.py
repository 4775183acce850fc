"""q4_tma: the quantize-for-TMA kernel (interpreter on the CPU), the Gluon decode built offline for
sm_90 (CPU), and the decode against the float64 reference (sm_90+ GPU)."""

import json
import re

import pytest
import torch

from bench.offline_sm90 import compile_sm90, sass_and_resources
import graphopt  # noqa: F401  (registers graphopt::* ops)
from graphopt.kernels import q4, q4_tma, tuning
from graphopt.kernels.q4 import TileConfig
from tests.conftest import q4_gluon_node

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_gluon = pytest.mark.skipif(q4_tma.gluon is None, reason="this Triton has no Gluon")
on_hopper = pytest.mark.skipif(not HOPPER or q4_tma.gluon is None, reason="Gluon's TMA kernel runs on sm_90+ GPUs")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tile(block_m=16, block_n=64, stages=2, split_k=1) -> TileConfig:
    return TileConfig("tma", block_m, block_n, 4, 4, stages, split_k, "last")


@pytest.mark.parametrize("m,k,k_padded", [(3, 320, 512), (1, 256, 256), (6, 96, 256)])
def test_quantize_for_tma_matches_ggml_q8_1(m, k, k_padded):
    """q and the per-block d (fp16-rounded, as fp32) equal quantize_q8_1's bytes; s = d * sum(q);
    the blocks past K (the weight's padding) are all zero."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(DEVICE, torch.bfloat16) * 3
    q, ds = q4_tma.quantize_for_tma(x, k_padded)
    ref = q4.quantize_q8_1(x.float().cpu())
    d_ref, _, q_ref = q4._q8_1_parts(ref)  # d (m, nb) fp32 of the fp16, s, q (m, nb, 32) int8
    nb = k // 32
    assert torch.equal(q.cpu()[:, :k].reshape(m, nb, 32), q_ref.to(torch.int8))
    assert not q.cpu()[:, k:].any()
    d = ds.cpu()[0::2, :m].t()  # (m, k_padded / 32)
    s = ds.cpu()[1::2, :m].t()
    assert torch.equal(d[:, :nb], d_ref.float())
    assert torch.equal(s[:, :nb], d_ref.float() * q_ref.float().sum(-1))
    assert not d[:, nb:].any() and not s[:, nb:].any()


def test_tma_configs_are_checked():
    assert q4.tma_configs(4)[0].block_m == 8 and q4.tma_configs(16)[0].block_m == 16
    with pytest.raises(ValueError, match="tma configs take"):
        TileConfig("tma", 16, 64, 2, 4, 2, 1, "last")  # K steps are four block pairs
    with pytest.raises(ValueError, match="tma configs take"):
        TileConfig("tma", 32, 64, 4, 4, 2, 1, "last")


def test_tma_config_needs_the_separate_path_and_a_hopper_gpu():
    qw, sc = q4.quantize_weight(torch.randn(64, 256))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="separate"):
        q4.q4_linear_triton(x, qw, sc, mode="fused", config=_tile())
    if not HOPPER:
        x, qw, sc = x.to(DEVICE), qw.to(DEVICE), sc.to(DEVICE)
        with pytest.raises(ValueError, match="sm_90"):
            q4.q4_linear_triton(x, qw, sc, mode="separate", config=_tile())
        with pytest.raises(ValueError, match="sm_90"):  # the op's tma kernel string: graphopt::q4_gluon_linear
            torch.ops.graphopt.q4_linear(x, qw, sc, None, "separate", tuning.encode(_tile()))
    with pytest.raises(ValueError, match="selects no Gluon tile"):
        torch.ops.graphopt.q4_gluon_linear(x, qw, sc, None, "")


def test_a_tma_kernel_string_runs_the_opaque_decode_op(monkeypatch):
    """Gluon kernels are not Triton JIT functions Inductor can launch: for a tma tile q4_linear's
    body calls graphopt::q4_gluon_linear, which a trace keeps as one opaque node."""
    qw, sc = q4.quantize_weight(torch.randn(64, 256))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    kernel = tuning.encode(_tile(block_m=8))
    calls = []

    def decode(x2, qweight, scales, bias, config):
        calls.append(config)
        return torch.zeros(x2.shape[0], qweight.shape[0], dtype=x2.dtype, device=x2.device)

    monkeypatch.setattr(q4, "tma_linear", decode)
    x, qw, sc = x.to(DEVICE), qw.to(DEVICE), sc.to(DEVICE)
    if x.is_cuda or q4.INTERPRET:  # where the body launches kernels rather than the reference
        assert torch.ops.graphopt.q4_linear(x.reshape(1, 3, 256), qw, sc, None, "separate", kernel).shape == (1, 3, 64)
        assert calls == [_tile(block_m=8)]

    node = q4_gluon_node(x, qw, sc, kernel)
    assert node.target is torch.ops.graphopt.q4_gluon_linear.default
    assert node.meta["val"].shape == (3, 64) and node.meta["val"].dtype == torch.bfloat16


def _sm90_build(block_n=64, block_m=16, split_k=2, stages=2):
    w_tile, q_tile, w_box, q_box, d4_layout, ds_layout = q4_tma.shared_layouts(block_n, block_m)
    types = dict(w_desc=f"tensordesc<i8[4,{block_n},32],{w_box!r}>", q_desc=f"tensordesc<i8[8,{block_m},32],{q_box!r}>",
                 d4_desc=f"tensordesc<fp16[8,{block_n}],{d4_layout!r}>",
                 ds_desc=f"tensordesc<fp32[16,{block_m}],{ds_layout!r}>",
                 bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", counter_ptr="*fp32")
    consts = dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split_k, STAGES=stages,
                  W_TILE_LAYOUT=w_tile, Q_TILE_LAYOUT=q_tile, D4_LAYOUT=q4_tma.d4_layout(block_n, 4), num_warps=4)
    return compile_sm90(q4_tma._q4_decode_tma_kernel, types, consts, ["out_ptr", "ws_ptr", "N", "K_PADDED"], 4,
                        gluon=True)


@needs_gluon
@pytest.mark.parametrize("block_m,stages,split_k", [(16, 2, 2), (8, 3, 1)])
def test_builds_for_sm90_with_the_nibbles_as_the_mma_register_operand(block_m, stages, split_k,
                                                                     pristine_triton_language):
    kernel = _sm90_build(block_m=block_m, stages=stages, split_k=split_k)
    ttgir = kernel.asm["ttgir"]
    # the weight bytes are read from shared memory straight into the MMA's A operand layout, and no
    # unpacked tile goes back to shared memory
    assert re.search(r"ttg\.local_load .* -> tensor<64x32xi8, #ttg\.dot_op<\{opIdx = 0", ttgir)
    assert not re.search(r"ttg\.local_alloc %\S+ : \(tensor", ttgir)
    assert len(re.findall(r"ttng\.async_tma_copy_global_to_local", ttgir)) == 4 * (stages + 1)
    sass, usage = sass_and_resources(kernel)
    assert re.search(r"STACK:0\b", usage), usage
    assert sass.count(f"IGMMA.64x{block_m}x32.S8.S8") == 8 and "UTMALDG" in sass
    # the weight scales' layout conversion moves no data: the one shuffle and shared store are the
    # split-K epilogue's
    assert sass.count("SHFL") <= 1 and sass.count("STS") <= 1


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("n,k", [(200, 512), (392, 1280), (64, 320)])
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("split_k,stages", [(1, 2), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_the_float64_reference_on_the_gpu(n, k, tokens, split_k, stages, dtype):
    gen = torch.Generator().manual_seed(n * k + tokens)
    qw, sc = q4.quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    qw, sc = qw.cuda(), sc.cuda()
    x = (torch.randn(tokens, k, generator=gen) * 2).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda", dtype) if split_k > 1 else None
    ref = q4.reference_q4_linear(x.double(), qw, sc, None if bias is None else bias.double()).double()
    cfg = _tile(8 if tokens <= 8 else 16, 64, stages, split_k)
    if not q4._tma_runs(x, n, qw):  # K = 320: not a whole number of 256-value steps
        assert k % 256
        with pytest.raises(ValueError, match="multiple of 256"):
            q4.q4_linear_triton(x, qw, sc, bias, mode="separate", config=cfg)
        return
    got = q4.q4_linear_triton(x, qw, sc, bias, mode="separate", config=cfg).double()
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # fp32 summation order; the output rounded to 16 bits
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    again = q4.q4_linear_triton(x, qw, sc, bias, mode="separate", config=cfg).double()  # split-K buffers re-armed
    assert (again - got).abs().max() <= tol * ref.abs().max()


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("allow_gluon", [True, False])
def test_the_separate_mode_tunes_over_the_tma_tiles_only_where_allowed(allow_gluon, monkeypatch, tmp_path):
    """Compile time: with allow_gluon (CUDA graphs) the tma tiles are candidates; the op runs the
    chosen kernel string (through graphopt::q4_gluon_linear for a tma tile) and stays exact."""
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    gen = torch.Generator().manual_seed(3)
    n, k = 512, 1024
    qw, sc = q4.quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    qw, sc = qw.cuda(), sc.cuda()
    x = torch.randn(4, k, generator=gen).to("cuda", torch.bfloat16)
    kernel = q4.tune_q4_linear(tuple(x.shape), qw, sc, False, x.dtype, "separate", allow_gluon)
    assert kernel
    if not allow_gluon:
        assert q4.kernel_config(kernel).kernel != "tma"
    got = torch.ops.graphopt.q4_linear(x, qw, sc, None, "separate", kernel).double()
    ref = q4.reference_q4_linear(x.double(), qw, sc).double()
    assert (got - ref).abs().max() <= 8e-3 * ref.abs().max()
    stored = json.loads((tmp_path / "tuning.json").read_text())
    # the key's mode field names the Gluon tiles offered (4 tokens: q4_tma's and the persistent kernel's);
    # its last field fingerprints every candidate
    assert [key.split("|")[-6] for key in stored] == ["separate+tma+persistent" if allow_gluon else "separate"]


def test_no_tokens_give_an_empty_output_on_the_separate_path():
    qw, sc = q4.quantize_weight(torch.randn(64, 256))
    for config in (None, _tile()):
        out = q4.q4_linear_triton(torch.randn(2, 0, 256, dtype=torch.bfloat16), qw, sc, mode="separate", config=config)
        assert out.shape == (2, 0, 64) and out.dtype == torch.bfloat16
