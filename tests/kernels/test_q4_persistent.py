"""q4/decode_persistent.py: the persistent Q4_0 x Q8_1 Gluon decode of 1-8 tokens. On a GPU its outputs
are checked against the float64 reference (odd sizes, K not a multiple of the 1024-value chunk, one
and many groups per program, chunks loaded ahead across group ends); everywhere (CI has no GPU) it
is built offline for sm_90: it compiles on this Triton, uses dp4a and 16-byte weight loads, has no
barrier in its loops and does not spill at the tiles built here (at K = 14336 ptxas issues many
chunks' loads early, and tiles of 2-4 rows per warp spill a few bytes there)."""

from __future__ import annotations

import re

import pytest
import torch

from bench.offline_sm90 import compile_sm90, loops, sass_and_resources
from tests.conftest import q4_gluon_node, replayed_in_cuda_graph
from graphopt.kernels import q4
from graphopt.kernels.q4 import decode_persistent as dp

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
needs_gluon = pytest.mark.skipif(dp.gluon is None, reason="this Triton has no Gluon")


@needs_gluon
@pytest.mark.parametrize("rows,warps,k,depth,tokens", [(2, 8, 4096, 1, 1), (1, 8, 14336, 1, 1), (1, 8, 14336, 3, 1),
                                                    (4, 4, 4096, 1, 1), (1, 4, 1344, 7, 1), (2, 8, 4096, 1, 8),
                                                    (1, 8, 14336, 1, 2)])
def test_builds_for_sm90_with_dp4a_and_wide_loads(rows, warps, k, depth, tokens, pristine_triton_language):
    types = dict(x_ptr="*bf16", words_ptr="*u8", scales_ptr="*fp16", bias_ptr="*bf16", out_ptr="*bf16")
    k_padded = -(-k // 64) * 64
    k_chunks, chunks_pad = dp.chunks(k_padded, warps)
    kernel = compile_sm90(dp._q4_gemv_persistent_kernel, types,
                          dict(HAS_BIAS=True, ROWS=rows, WARPS=warps, K_CHUNKS=k_chunks, CHUNKS_PAD=chunks_pad,
                               DEPTH=depth, TOKENS=tokens),
                          ["x_ptr", "words_ptr", "scales_ptr", "out_ptr", "K", "K_WORDS", "stride_wn", "stride_sb", "N",
                           "stride_xm", "stride_om"],
                          warps, gluon=True)
    sass, usage = sass_and_resources(kernel)
    assert re.search(r"STACK:0\b", usage), usage
    assert len(re.findall(r"IDP\.4A", sass)) >= 2 * rows * 4 * k_chunks * tokens  # two per word and token
    assert not [ops for _, _, ops in loops(sass) if any(op.startswith("BAR") for op, _ in ops)]
    assert len(re.findall(r"LDG\.E\.128", sass)) >= rows * k_chunks  # one 16-byte load per row and chunk


def test_bad_arguments_name_the_problem():
    qweight, scales = q4.quantize_weight(torch.randn(16, 64))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"1 <= M <= 8 tokens"):
        dp.q4_gemv_persistent(torch.randn(9, 64), qweight, scales, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        dp.q4_gemv_persistent(torch.randn(1, 48), qweight, scales, None)
    with pytest.raises(ValueError, match=r"rows in \(1, 2, 4, 8\)"):
        dp.q4_gemv_persistent(x, qweight, scales, None, rows=3)
    with pytest.raises(ValueError, match="fewer rows or a smaller depth"):
        dp.q4_gemv_persistent(x, qweight, scales, None, rows=4, depth=2)
    with pytest.raises(ValueError, match="max_registers 300: expected 0"):
        dp.q4_gemv_persistent(x, qweight, scales, None, max_registers=300)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        dp.q4_gemv_persistent(x, qweight, scales, None)  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
@pytest.mark.parametrize("n,k,rows,warps", [(200, 512, 4, 4), (37, 1344, 2, 4), (4096, 4096, 2, 8),
                                            (61, 14336, 2, 8), (1000, 8192, 1, 2), (300, 11008, 2, 4),
                                            (128, 96, 1, 4)])
# fp16 (its activation loads and output cast) at two tilings: each case is a Gluon build
@pytest.mark.parametrize("programs_per_sm,depth,tokens,dtype", [
    (1, 1, 1, torch.bfloat16), (4, 3, 1, torch.bfloat16), (8, 7, 1, torch.bfloat16), (2, 1, 3, torch.bfloat16),
    (4, 1, 8, torch.bfloat16), (4, 3, 1, torch.float16), (2, 1, 3, torch.float16)])
def test_matches_the_float64_reference_on_the_gpu(n, k, rows, warps, programs_per_sm, depth, tokens, dtype):
    depth = min(depth, dp.MAX_ROWS_IN_FLIGHT // rows - 1)  # the launcher's register bound
    gen = torch.Generator().manual_seed(n * k + rows)
    qweight, scales = q4.quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    qweight, scales = qweight.cuda(), scales.cuda()
    # varied magnitudes along K and across tokens
    x = (torch.randn(tokens, k, generator=gen) * torch.linspace(0.1, 4.0, k)
         * torch.linspace(1.0, 3.0, tokens)[:, None]).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    assert dp.supports(x)
    got = dp.q4_gemv_persistent(x, qweight, scales, bias, rows=rows, num_warps=warps,
                                programs_per_sm=programs_per_sm, depth=depth)
    ref = q4.reference_q4_linear(x.double(), qweight, scales, bias.double()).double()
    assert got.dtype == dtype and got.shape == (tokens, n)
    # the same Q8_1 integers as the reference: only fp32 sums and the output's rounding differ
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < (8e-3 if dtype == torch.bfloat16 else 1e-3), err.item()
    again = dp.q4_gemv_persistent(x, qweight, scales, bias, rows=rows, num_warps=warps,
                                  programs_per_sm=programs_per_sm, depth=depth)
    assert torch.equal(again, got)  # no state between calls


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
@pytest.mark.parametrize("n,k", [(5120, 13824), (333, 4160)])
def test_a_register_cap_fits_more_programs_and_keeps_the_result(n, k):
    """Five programs of 4 warps per SM need at most 102 registers a thread: the capped build must
    still match the float64 reference at LLaMA-2-13B's down projection and at an odd shape."""
    gen = torch.Generator().manual_seed(n + k)
    qweight, scales = q4.quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    qweight, scales = qweight.cuda(), scales.cuda()
    x = (torch.randn(1, k, generator=gen) * torch.linspace(0.1, 4.0, k)).to("cuda", torch.bfloat16)
    got = dp.q4_gemv_persistent(x, qweight, scales, None, rows=2, num_warps=4, programs_per_sm=5, depth=1,
                                max_registers=96)
    ref = q4.reference_q4_linear(x.double(), qweight, scales, None).double()
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3


def test_persistent_tiles_are_decode_configs_the_launcher_accepts():
    tiles = q4.persistent_configs(1)
    assert tiles and all(cfg.kernel == "persistent" and cfg.programs_per_sm > 0 for cfg in tiles)
    for cfg in tiles:
        rows = cfg.block_n // cfg.num_warps
        assert rows * (cfg.num_stages + 1) <= dp.MAX_ROWS_IN_FLIGHT and cfg.name.startswith("persistent_r")
    for m in (2, 3, 4):  # the tile of a token bucket runs any count up to MAX_TOKENS
        assert {cfg.block_m for cfg in q4.persistent_configs(m)} == {1 << (m - 1).bit_length()}
    # past 4 tokens q4_tma's tiles won on every shape measured: the tuner is not offered the kernel
    assert q4.PERSISTENT_MAX_OFFERED_TOKENS == 4 < dp.MAX_TOKENS
    assert all(q4.persistent_configs(m) == [] for m in (5, 8, 9, 16))
    assert all(cfg.kernel != "persistent" for m in (1, 4, 64, 512) for fused in (True, False)
               for cfg in q4.candidate_configs(m, fused))  # offered by the tuner only where Gluon is allowed
    assert dp.shared_memory_bytes(8, 16) <= 227 * 1024  # 8 tokens at K = 14336 fit one sm_90 program
    # Gluon's shared-memory shapes are powers of two: 3 tokens launch (and take the room of) 4
    assert dp.shared_memory_bytes(3, 16) == dp.shared_memory_bytes(4, 16)
    with pytest.raises(ValueError, match="programs_per_sm > 0 goes with the persistent kernel"):
        q4.TileConfig("dp4a", 0, 16, 4, 1, 1, 8, "last", programs_per_sm=2)
    with pytest.raises(ValueError, match="persistent configs take block_m 1-8"):
        q4.TileConfig("persistent", 1, 16, 1, 4, 2, 1, "workspace", programs_per_sm=4)  # 4 rows, 2 ahead
    assert not q4.persistent_runs(torch.randn(1, 64, dtype=torch.bfloat16))  # a CPU tensor


def test_a_persistent_kernel_string_runs_the_opaque_gluon_op(monkeypatch):
    """q4_linear's body (a triton_op that Inductor emits as source) never launches a Gluon kernel
    itself: in either mode a persistent tile goes to graphopt::q4_gluon_linear, one opaque node in a
    trace, which refuses strings that select no Gluon tile."""
    from graphopt.kernels import tuning

    qw, sc = q4.quantize_weight(torch.randn(64, 256))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    tile = q4.persistent_configs(1)[0]
    kernel = tuning.encode(tile)
    assert q4.kernel_config(kernel) == tile
    calls = []

    def decode(x2, qweight, scales, bias, config):
        calls.append(config)
        return torch.zeros(x2.shape[0], qweight.shape[0], dtype=x2.dtype, device=x2.device)

    monkeypatch.setattr(q4, "persistent_linear", decode)
    if GPU:
        for mode in ("fused", "separate"):
            out = torch.ops.graphopt.q4_linear(x.cuda().reshape(1, 1, 256), qw.cuda(), sc.cuda(), None, mode, kernel)
            assert out.shape == (1, 1, 64)
        assert calls == [tile, tile]

    node = q4_gluon_node(x, qw, sc, kernel)
    assert node.target is torch.ops.graphopt.q4_gluon_linear.default
    assert node.meta["val"].shape == (1, 64) and node.meta["val"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="selects no Gluon tile"):
        torch.ops.graphopt.q4_gluon_linear(x, qw, sc, None, tuning.encode(q4.candidate_configs(1, True)[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
def test_the_op_on_a_persistent_tile_matches_eager_inside_a_cuda_graph():
    from graphopt.kernels import tuning

    import graphopt.ops  # noqa: F401

    n, k = 4096, 4096
    qw, sc = q4.quantize_weight(torch.randn(n, k) * 0.05)
    qw, sc = qw.cuda(), sc.cuda()
    kernel = tuning.encode(q4.persistent_configs(1)[0])
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def call():
        return torch.ops.graphopt.q4_linear(x, qw, sc, None, "fused", kernel)

    eager = call()
    assert torch.equal(replayed_in_cuda_graph(call), eager)
    ref = q4.reference_q4_linear(x.double(), qw, sc).double()
    assert ((eager.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3
