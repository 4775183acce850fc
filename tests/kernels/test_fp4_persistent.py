"""fp4/decode_persistent.py: the persistent one-token Gluon decode. On a GPU its outputs are checked
against the float64 reference (odd sizes, both formats, bf16 and fp16, one and many groups per
program); everywhere (CI has no GPU) it is built offline for sm_90, which checks that it compiles on
this Triton, uses dp2a and 16-byte loads, and does not spill at the tiles the launcher allows."""

from __future__ import annotations

import re

import pytest
import torch

from bench.offline_sm90 import compile_sm90, last_loop, loops, sass_and_resources
from tests.conftest import replayed_in_cuda_graph
from graphopt.kernels import fp4
from graphopt.kernels.fp4 import decode_persistent as dp

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
needs_gluon = pytest.mark.skipif(dp.gluon is None, reason="this Triton has no Gluon")


@needs_gluon
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows,warps,k,depth,even", [(4, 4, 4096, 1, True), (2, 4, 14336, 3, True),
                                                     (1, 8, 1344, 2, False), (1, 4, 4096, 7, False)])
def test_builds_for_sm90_with_integer_dots_and_wide_loads(fmt, rows, warps, k, depth, even, pristine_triton_language,
                                                          monkeypatch):
    monkeypatch.setenv("TOP_OPS", "1000")  # every opcode of a loop body, not the most common few
    sass, usage = _build(fmt, rows, warps, k, depth, even)
    assert re.search(r"STACK:0\b", usage), usage
    # eight dp2a per code word (magnitudes and negative lanes), the e4m3 scales by one cvt per pair
    assert "IDP.2A" in sass
    if fmt == "nvfp4":
        assert "E4M3" in sass
    if even:  # the group loop's weight loads are not masked (the activations' before it are)
        _, body = last_loop(sass)
        assert "LDG.E.128" in body and not re.search(r"@!?P\d+\s+LDG\.E\.128", body)
    # barriers only while the activations are rounded: a row's sum is reduced inside its warp
    assert not [ops for _, _, ops in loops(sass) if any(op.startswith("BAR") for op, _ in ops)]
    # one 16-byte load per row and chunk, each chunk's issued ahead of the decode
    assert len(re.findall(r"LDG\.E\.128", sass)) >= rows * dp.chunks(k, warps)[0]


def _build(fmt, rows, warps, k, depth, even, gated=False, norm=False, residual=False, maxnreg=None, dependent=True):
    types = dict(x_ptr="*bf16", words_ptr="*u8", scales_ptr="*u8", global_scale_ptr="*fp32", bias_ptr="*bf16",
                 norm_ptr="*bf16", residual_ptr="*bf16", out_ptr="*bf16", norm_eps="fp32")
    k_chunks, chunks_pad = dp.chunks(k, warps)
    kernel = compile_sm90(dp._fp4_gemv_persistent_kernel, types,
                          dict(IS_NVFP4=fmt == "nvfp4", HAS_BIAS=True, ROWS=rows, WARPS=warps, K_CHUNKS=k_chunks,
                               CHUNKS_PAD=chunks_pad, DEPTH=depth, EVEN=even, E4M3_CVT=True, GATED=gated, NORM=norm,
                               HAS_RESIDUAL=residual, DEPENDENT=dependent),
                          ["x_ptr", "words_ptr", "scales_ptr", "out_ptr", "norm_ptr", "residual_ptr", "K", "K_WORDS",
                           "stride_wn", "stride_sn", "N"], warps, gluon=True, maxnreg=maxnreg)
    return sass_and_resources(kernel)


def _loads_before_the_wait(sass: str) -> list[str]:
    """The global loads a kernel issues before griddepcontrol.wait (SASS ACQBULK), which must appear."""
    before, wait, _ = sass.partition("ACQBULK")
    assert wait, "no griddepcontrol.wait in the dependent kernel"
    return re.findall(r"LDG\.E[.\w]*", before)


@needs_gluon
@pytest.mark.parametrize("fmt,depth", [("nvfp4", 3), ("mxfp4", 2)])
def test_a_dependent_launch_reads_only_weights_before_it_waits(fmt, depth, pristine_triton_language):
    """Launched as a dependent (dependent_launch), the kernel requests its first `depth` chunks of
    words (one 16-byte load per row) and their scale bytes, then waits for the kernel before it: the
    activations, norm weight and residual are read after the wait. Without the flag there is no wait."""
    sass, usage = _build(fmt, 1, 8, 4096, depth, True, norm=True, residual=True)
    assert re.search(r"STACK:0\b", usage), usage
    loads = _loads_before_the_wait(sass)
    assert loads.count("LDG.E.128") == depth
    assert len(loads) == 2 * depth  # a scale load per chunk besides its words
    plain, _ = _build(fmt, 1, 8, 4096, depth, True, norm=True, residual=True, dependent=False)
    assert "ACQBULK" not in plain


@needs_gluon
@pytest.mark.parametrize("rows,warps,k,gated,norm,residual", [(1, 8, 4096, False, True, False),
                                                              (2, 8, 14336, True, False, True),
                                                              (2, 4, 1344, True, True, True)])
def test_builds_with_the_fused_neighbours_without_spilling(rows, warps, k, gated, norm, residual,
                                                           pristine_triton_language):
    """linear_fusion's prologues and epilogue: the RMSNorm's reciprocal root (MUFU.RSQ), the SiLU's
    exponential (MUFU.EX2), no local memory; the word loop stays unmasked where the tiles are whole."""
    sass, usage = _build("nvfp4", rows, warps, k, 3 if rows == 1 else 1, k % 1024 == 0, gated, norm, residual)
    assert re.search(r"STACK:0\b", usage), usage
    assert ("MUFU.RSQ" in sass) == norm and ("MUFU.EX2" in sass) == gated
    assert "IDP.2A" in sass


@needs_gluon
def test_the_capped_tile_fits_four_programs_of_eight_warps_with_the_norm_prologue(pristine_triton_language):
    """The RMSNorm prologue can take the r1 w8 tile past 64 registers (three programs of eight warps
    per SM instead of four); its capped twin (max_registers 64, one of the tuner's tiles) builds in
    64, any spill kept out of the word loop (with Triton 3.9: 16 bytes, three stores and loads in
    the prologue)."""
    (capped,) = [cfg for cfg in _persistent_tiles()
                 if cfg.max_registers and (cfg.block_n, cfg.num_warps, cfg.programs_per_sm) == (8, 8, 4)]
    sass, usage = _build("nvfp4", 1, 8, 4096, 3, True, norm=True, maxnreg=capped.max_registers)
    assert re.search(r"REG:64\b", usage), usage
    _, body = last_loop(sass)
    assert "LDL" not in body and "STL" not in body


def test_every_capped_tile_fits_its_programs_in_the_register_file():
    capped = [cfg for cfg in _persistent_tiles() if cfg.max_registers]
    assert capped
    for cfg in capped:
        assert cfg.max_registers * 32 * cfg.num_warps * cfg.programs_per_sm <= 65536, cfg


@needs_gluon
def test_the_five_program_tile_builds_within_its_cap_at_the_13b_down_projection(pristine_triton_language):
    """2 rows per warp, 4 warps, 5 programs per SM, three chunks ahead, capped at 96 registers (one of
    the tuner's tiles): at K = 13824 it builds in 96, where uncapped it takes more than twice that (two
    programs per SM). The cap makes ptxas keep part of the unrolled chunks in local memory, which L1
    holds; the tile won its timing with those spills (bench_decode_persistent.py --shapes 13b)."""
    (tile,) = [cfg for cfg in _persistent_tiles() if (cfg.block_n, cfg.num_warps, cfg.programs_per_sm) == (8, 4, 5)]
    _, usage = _build("nvfp4", 2, 4, 13824, tile.num_stages, False, maxnreg=tile.max_registers)
    assert int(re.search(r"REG:(\d+)", usage).group(1)) <= tile.max_registers, usage
    _, uncapped = _build("nvfp4", 2, 4, 13824, tile.num_stages, False)
    assert int(re.search(r"REG:(\d+)", uncapped).group(1)) > 2 * tile.max_registers, uncapped


def test_chunks_cover_the_row():
    assert dp.chunks(4096, 4) == (4, 4) and dp.chunks(4096, 8) == (4, 8)
    assert dp.chunks(14336, 4) == (14, 16) and dp.chunks(11008, 4) == (11, 16)
    assert dp.chunks(64, 4) == (1, 4)


def test_bad_arguments_name_the_choices():
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(16, 64), "nvfp4"))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="expected 'nvfp4' or 'mxfp4'"):
        dp.fp4_gemv_persistent(x, kw.codes, kw.scales, kw.global_scale, None, 16, 64, "int4")
    with pytest.raises(ValueError, match=r"expected \(1, 64\)"):
        dp.fp4_gemv_persistent(torch.randn(2, 64), kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4")
    with pytest.raises(ValueError, match=r"rows in \(1, 2, 4, 8\)"):
        dp.fp4_gemv_persistent(x, kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4", rows=3)
    with pytest.raises(ValueError, match="depth in"):
        dp.fp4_gemv_persistent(x, kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4", depth=8)
    with pytest.raises(ValueError, match="fewer rows or a smaller depth"):
        dp.fp4_gemv_persistent(x, kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4", rows=4, depth=2)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        dp.fp4_gemv_persistent(x.double(), kw.codes, kw.scales, kw.global_scale, None, 16, 64, "nvfp4")  # CPU, fp64


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k,rows,warps", [(200, 512, 4, 4), (37, 1344, 2, 4), (5, 4096, 4, 4), (4096, 4096, 2, 4),
                                            (61, 14336, 2, 8), (1000, 8192, 1, 2), (300, 11008, 2, 4)])
# at 1 program per SM, a program walks many groups; depths past a row's chunks reach into the next
# group; fp16 (its activation loads and output cast) at one tiling: each case is a Gluon build
@pytest.mark.parametrize("programs_per_sm,depth,dtype", [(1, 1, torch.bfloat16), (4, 3, torch.bfloat16),
                                                         (8, 7, torch.bfloat16), (4, 3, torch.float16)])
def test_matches_the_float64_reference_on_the_gpu(fmt, n, k, rows, warps, programs_per_sm, depth, dtype):
    depth = min(depth, dp.MAX_ROWS_IN_FLIGHT // rows - 1)  # the launcher's register bound
    gen = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, fmt))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    x = (torch.randn(1, k, generator=gen) * torch.linspace(0.1, 4.0, k)).to("cuda", dtype)  # varied magnitudes
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    assert dp.supports(x)
    got = dp.fp4_gemv_persistent(x, codes, scales, gscale, bias, n, k, fmt, rows=rows, num_warps=warps,
                                 programs_per_sm=programs_per_sm, depth=depth)
    ref = fp4.reference_fp4_linear(x.double(), codes, scales, gscale, bias.double(), n, k, fmt).double()
    assert got.dtype == dtype and got.shape == (1, n)
    # activations rounded to int16 per 32 K positions (2^-16 of their max), then the output's rounding
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < (8e-3 if dtype == torch.bfloat16 else 2e-3), err.item()
    again = dp.fp4_gemv_persistent(x, codes, scales, gscale, bias, n, k, fmt, rows=rows, num_warps=warps,
                                   programs_per_sm=programs_per_sm, depth=depth)
    assert torch.equal(again, got)  # no state between calls


def _persistent_tiles():
    return [cfg for cfg in fp4.DECODE_CONFIGS if cfg.programs_per_sm]


def test_tuner_offers_the_persistent_tiles_for_one_token_only_and_only_with_gluon_allowed():
    from graphopt.kernels.fp4 import configs

    tiles = _persistent_tiles()
    assert tiles and all(cfg.gluon for cfg in tiles)
    for cfg in tiles:
        assert configs._valid_config(cfg, "gemv", 1, 4096, 4096, 16)
        assert not configs._valid_config(cfg, "gemv", 2, 4096, 4096, 16)  # one token
        assert not configs._valid_config(cfg, "gemm", 1, 4096, 4096, 16)
        rows = cfg.block_n // cfg.num_warps
        assert rows * (cfg.num_stages + 1) <= dp.MAX_ROWS_IN_FLIGHT  # the launcher would refuse it
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    assert not any(configs._runs_here(cfg, x, torch.bfloat16) for cfg in tiles)  # a CPU tensor: no Gluon here


def test_a_persistent_tile_goes_to_the_opaque_gluon_op():
    """fp4_linear's body (a triton_op that Inductor emits as source) must not launch a Gluon kernel
    itself: a kernel string that selects a persistent tile is for graphopt::fp4_gluon_linear, which
    refuses strings that select none."""
    import graphopt.ops  # noqa: F401 - registers the ops

    tile = _persistent_tiles()[0]
    kernel = fp4.kernel_string([(1, 1, "gemv", tile)])
    path, cfg = fp4.kernel_choice(kernel, 1)
    assert path == "gemv" and cfg == tile and cfg.gluon
    plain = fp4.kernel_string([(1, 1, "gemv", fp4.DECODE_CONFIGS[0])])
    with pytest.raises(ValueError, match="selects no Gluon tile"):
        torch.ops.graphopt.fp4_gluon_linear(torch.randn(1, 64), torch.zeros(16, 32, dtype=torch.uint8),
                                            torch.zeros(16, 4, dtype=torch.uint8), torch.ones(1), None, 16, 64,
                                            "nvfp4", plain)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
def test_the_op_on_a_persistent_tile_matches_eager_inside_a_cuda_graph():
    import graphopt.ops  # noqa: F401

    n, k = 4096, 4096
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k) * 0.05, "nvfp4"))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    kernel = fp4.kernel_string([(1, 1, "gemv", _persistent_tiles()[0])])
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def call():
        return torch.ops.graphopt.fp4_linear(x, codes, codes, scales, gscale, None, n, k, "nvfp4", kernel)

    eager = call()
    assert torch.equal(replayed_in_cuda_graph(call), eager)
    ref = fp4.reference_fp4_linear(x.double(), codes, scales, gscale, None, n, k, "nvfp4").double()
    assert ((eager.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("fused", [("rms_norm",), ("silu_gate", "residual"), ("rms_norm", "residual"),
                                   ("silu_gate", "rms_norm", "residual")], ids="+".join)
@pytest.mark.parametrize("n,k,rows,warps,programs_per_sm,depth,cap", [
    (6144, 4096, 4, 4, 4, 1, 0), (4096, 14336, 2, 8, 2, 3, 0), (300, 1344, 1, 8, 4, 3, 0), (37, 4096, 2, 4, 1, 1, 0),
    (28672, 4096, 1, 8, 4, 3, 64), (5120, 13824, 2, 4, 5, 3, 96)])
def test_fused_neighbours_match_the_float64_reference_on_the_gpu(fmt, fused, n, k, rows, warps, programs_per_sm, depth,
                                                                 cap):
    """The RMSNorm prologue (its 1 / rms applied to the dot at the end), the SiLU gate over interleaved
    gate / up rows and the residual epilogues, against linear_fusion's torch form in float64, with a
    bias (which the norm's scale must not touch), at LLaMA's and odd shapes."""
    from graphopt.kernels.linear_fusion import example_fusion

    if "silu_gate" in fused:
        n += n % 2  # whole (gate, up) pairs

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, fmt))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    torch.manual_seed(n * 7 + k)
    fusion = example_fusion(fused, 1, k, n, torch.bfloat16, "cuda")
    x = (torch.randn(1, k) * 3).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    exact = fusion.epilogue(fp4.reference_fp4_linear(fusion.prologue(x.double()), codes, scales, gscale,
                                                     bias.double(), n, k, fmt).double()).double()
    tile = fp4.KernelConfig(block_n=rows * warps, block_m=1, block_k=8 * dp.CHUNK_WORDS, num_warps=warps,
                            num_stages=depth, programs_per_sm=programs_per_sm, max_registers=cap)
    kernel = fp4.kernel_string([(1, 1, "gemv", tile)])
    op = torch.ops.graphopt.fp4_linear(x, codes, codes, scales, gscale, bias, n, k, fmt, kernel,
                                       norm_weight=fusion.norm_weight, norm_eps=fusion.norm_eps, gated=fusion.gated,
                                       residual=fusion.residual)
    if fusion.gated and rows % 2:  # the pairs would straddle warps: the op runs the gate in torch instead
        with pytest.raises(ValueError, match=r"whole \(gate, up\) row pairs"):
            dp.fp4_gemv_persistent(x, codes, scales, gscale, bias, n, k, fmt, rows=rows, num_warps=warps,
                                   programs_per_sm=programs_per_sm, depth=depth, fusion=fusion, max_registers=cap)
        err = (op.double() - exact).abs().max() / exact.abs().max()
        assert op.shape == (1, n // 2) and err < 2e-2, err.item()  # gate and up rounded to bf16 first
        return
    got = dp.fp4_gemv_persistent(x, codes, scales, gscale, bias, n, k, fmt, rows=rows, num_warps=warps,
                                 programs_per_sm=programs_per_sm, depth=depth, fusion=fusion, max_registers=cap)
    err = (got.double() - exact).abs().max() / exact.abs().max()
    assert got.shape == (1, fusion.output_width(n)) and err < 8e-3, err.item()
    assert torch.equal(op, got)  # the op, as a compiled graph calls it, on the same tile: the same numbers


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or dp.gluon is None, reason="Gluon kernels run on sm_80+ GPUs")
@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "cuda_graph"])
def test_a_chain_of_dependent_launches_reads_each_previous_output(in_graph, monkeypatch):
    """Each call reads the previous call's output (as activation and as residual) and some calls follow
    a torch kernel: launched as dependents (sm_90) they may start before the previous kernel ends, so a
    read before its wait would see stale values. The chain equals the same chain launched the plain
    way bit for bit, eagerly and replayed from a CUDA graph (whose pool reuses the outputs' memory)."""
    from graphopt.kernels import dependent_launch
    from graphopt.kernels.linear_fusion import LinearFusion

    n = k = 4096
    gen = torch.Generator().manual_seed(5)
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k, generator=gen) * 0.05, "nvfp4"))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    norm = (1 + 0.1 * torch.randn(k, generator=gen)).to("cuda", torch.bfloat16)
    start = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)

    def chain():
        h = start
        for i in range(12):
            fusion = LinearFusion(norm_weight=norm, norm_eps=1e-5, residual=h)
            h = dp.fp4_gemv_persistent(h, codes, scales, gscale, None, n, k, "nvfp4", rows=1, num_warps=8,
                                       programs_per_sm=4, depth=3, fusion=fusion, dependent=True)
            if i % 3 == 2:
                h = h * 0.5  # a plain kernel between two dependents
        return h

    def run():
        return replayed_in_cuda_graph(chain) if in_graph else chain()

    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    plain = run()
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    dependent = run()
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all() and plain.abs().max() > 0
    assert torch.equal(dependent, plain)
