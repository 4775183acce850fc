"""fp4_tma: the Gluon NVFP4 decode. On a Hopper GPU its outputs are checked against the
dequantize-then-matmul reference; everywhere (CI has no GPU) it is built offline for sm_90 with
Triton's bundled ptxas, which checks that the kernel compiles on this Triton, that the decoded
words are the MMA's register operand (no trip through shared memory), and that nothing spills."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from bench.offline_sm90 import compile_sm90, sass_and_resources
from graphopt.kernels import fp4, fp4_tma
from graphopt.kernels.fp4 import KernelConfig

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_gluon = pytest.mark.skipif(fp4_tma.gluon is None, reason="this Triton has no Gluon")


def _tile(block_n, block_m, block_k, split_k, stages, num_warps=4) -> KernelConfig:
    return KernelConfig(block_n, block_m, block_k, split_k, num_warps=num_warps, num_stages=stages, tma=True)


def _sm90_build(cfg: KernelConfig):
    w = cfg.block_k // 8
    w_layout, x_tile_layout, x_box_layout = fp4_tma.shared_layouts(cfg.block_n, cfg.block_m, w)
    s_layout = fp4_tma.scale_shared_layout(cfg.block_n, w)
    types = dict(x_desc=f"tensordesc<bf16[4,{cfg.block_m},{2 * w}],{x_box_layout!r}>",
                 w_desc=f"tensordesc<i32[{cfg.block_n},{w}],{w_layout!r}>",
                 s_desc=f"tensordesc<u8[{cfg.block_n},{w // 2}],{s_layout!r}>",
                 global_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", counter_ptr="*fp32")
    consts = dict(HAS_BIAS=True, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, W=w, SPLIT_K=cfg.split_k,
                  STAGES=cfg.num_stages, WORD_LAYOUT=fp4_tma.word_layout(cfg.block_n, w, cfg.num_warps),
                  X_TILE_LAYOUT=x_tile_layout, PAIR_LAYOUT=fp4_tma.word_pair_layout(cfg.block_n, w, cfg.num_warps),
                  num_warps=cfg.num_warps)
    return compile_sm90(fp4_tma._fp4_decode_tma_kernel, types, consts, ["out_ptr", "ws_ptr", "N", "K_PADDED"],
                        cfg.num_warps, gluon=True)


@needs_gluon
@pytest.mark.parametrize("cfg", [_tile(128, 16, 256, split_k=4, stages=4), _tile(64, 32, 256, split_k=1, stages=2),
                                 _tile(128, 16, 256, split_k=2, stages=3, num_warps=8)], ids=str)
def test_builds_for_sm90_with_the_words_as_the_mma_register_operand(cfg, pristine_triton_language):
    kernel = _sm90_build(cfg)
    ttgir = kernel.asm["ttgir"]
    # the words come out of shared memory in WORD_LAYOUT; their decode feeds warp_group_dot from
    # registers, and no decoded tile is written back to shared memory
    assert re.search(r"ttg\.local_load .* -> tensor<\d+x\d+xi32, #linear", ttgir)
    assert "ttng.warp_group_dot" in ttgir and "tensor<" in ttgir.split("ttng.warp_group_dot")[1].split("*")[0]
    assert not re.search(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xbf16", ttgir)
    # the block scales come by TMA too, and each thread reads its own words' bytes from shared memory
    assert re.search(r"ttg\.local_load .*xi8, .* -> tensor<\d+x\d+xi8, #ttg\.slice<\{dim = 2", ttgir)
    assert len(re.findall(r"ttng\.async_tma_copy_global_to_local", ttgir)) == 3 * (cfg.num_stages + 1)
    sass, usage = sass_and_resources(kernel)
    assert re.search(r"STACK:0\b", usage), usage  # no spills
    assert "HGMMA" in sass and "UTMALDG" in sass


@needs_gluon
def test_word_layout_covers_every_word_once():
    layout = fp4_tma.word_layout(128, 32, 4)
    coords = set()
    regs, lanes, warps = len(layout.reg_bases), len(layout.lane_bases), len(layout.warp_bases)
    for index in range(1 << (regs + lanes + warps)):
        bases = layout.reg_bases + layout.lane_bases + layout.warp_bases
        r = c = 0
        for bit, (dr, dc) in enumerate(bases):
            if index >> bit & 1:
                r ^= dr
                c ^= dc
        coords.add((r, c))
    assert coords == {(r, c) for r in range(128) for c in range(32)}


@pytest.mark.skipif(not HOPPER or fp4_tma.gluon is None, reason="Gluon's TMA kernel runs on sm_90+ GPUs")
@pytest.mark.parametrize("n,k", [(200, 512), (384, 1280)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 33])
@pytest.mark.parametrize("split_k,stages", [(1, 2), (2, 4), (4, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_dequantized_reference_on_the_gpu(n, k, tokens, split_k, stages, with_bias):
    gen = torch.Generator().manual_seed(n * k + tokens)
    w = torch.randn(n, k, generator=gen) * 0.05
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, "nvfp4"))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16) if with_bias else None
    for block_n, block_k, warps in ((128, 256, 4), (64, 256, 4), (128, 256, 8)):
        # a split past the K steps is clamped, as the tuner's tiles are (_valid_config)
        cfg = _tile(block_n, 16 if tokens <= 16 else 64, block_k, min(split_k, k // block_k), stages, warps)
        assert fp4_tma.supports(x) and fp4_tma.tiles_k(codes.shape[1] * 2, block_k)
        got = fp4.fp4_linear_triton(x, codes, scales, gscale, bias, n, k, "nvfp4", path="gemv", config=cfg).float()
        ref = fp4.reference_fp4_linear(x.double(), codes, scales, gscale, None if bias is None else bias.double(),
                                       n, k, "nvfp4").double()
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 8e-3, (cfg, err.item())
        # twice more: the split-K buffers and counters are left re-armed
        again = fp4.fp4_linear_triton(x, codes, scales, gscale, bias, n, k, "nvfp4", path="gemv", config=cfg).float()
        assert torch.equal(again, got) or split_k > 1 and (again - got).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.skipif(not HOPPER or fp4_tma.gluon is None, reason="Gluon's TMA kernel runs on sm_90+ GPUs")
def test_weights_at_unaligned_addresses_still_decode_correctly():
    """TMA needs 16-byte-aligned bases; codes and scales that are views at odd offsets (a weight
    sliced out of a larger buffer) are copied by the launcher, not rejected or misread."""
    gen = torch.Generator().manual_seed(7)
    n, k = 192, 768
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k, generator=gen) * 0.05, "nvfp4"))

    def unaligned(t):  # a copy of t (one-byte elements) one byte past an aligned base
        view = torch.empty(t.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    codes, scales = unaligned(kw.codes.cuda()), unaligned(kw.scales.cuda())
    assert codes.data_ptr() % 16 and scales.data_ptr() % 16
    x = torch.randn(6, k, generator=gen).to("cuda", torch.bfloat16)
    cfg = _tile(64, 16, 256, split_k=1, stages=2)
    got = fp4.fp4_linear_triton(x, codes, scales, kw.global_scale.cuda(), None, n, k, "nvfp4", path="gemv",
                                config=cfg).double()
    ref = fp4.reference_fp4_linear(x.double(), kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda(), None, n, k,
                                   "nvfp4").double()
    assert (got - ref).abs().max() / ref.abs().max() < 8e-3


def test_tma_tiles_are_valid_only_for_nvfp4_with_aligned_k():
    cfg = next(c for c in fp4.DECODE_CONFIGS if c.tma and c.block_k == 256)
    assert fp4._valid_config(cfg, "gemv", 16, 4096, 4096, 16)
    assert not fp4._valid_config(cfg, "gemv", 16, 4096, 4096, 32)  # MXFP4
    assert not fp4._valid_config(cfg, "gemv", 16, 4096, 4160, 16)  # K steps do not tile K
    assert not fp4._valid_config(dataclasses.replace(cfg, block_k=128), "gemv", 16, 4096, 4096, 16)  # 8 scale bytes
    assert not fp4._valid_config(cfg, "gemm", 16, 4096, 4096, 16)


def test_tma_tiles_never_run_without_a_hopper_gpu():
    x2 = torch.randn(4, 512, dtype=torch.bfloat16)
    cfg = next(c for c in fp4.DECODE_CONFIGS if c.tma)
    assert not fp4._runs_here(cfg, x2, torch.bfloat16)
    assert fp4._runs_here(dataclasses.replace(cfg, tma=False), x2, torch.bfloat16)
    if torch.cuda.is_available():
        return
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(64, 512), "nvfp4"))
    with pytest.raises(ValueError, match="sm_90"):
        fp4.fp4_linear_triton(x2, kw.codes, kw.scales, kw.global_scale, None, 64, 512, "nvfp4", path="gemv",
                              config=cfg)


@pytest.mark.skipif(not HOPPER or fp4_tma.gluon is None, reason="Gluon's TMA kernel runs on sm_90+ GPUs")
@pytest.mark.parametrize("tokens", [2, 16, 40])
def test_the_launcher_runs_the_tma_tiles_and_its_tuner_may_pick_them(tokens):
    gen = torch.Generator().manual_seed(tokens)
    n, k = 320, 1024
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(torch.randn(n, k, generator=gen) * 0.05, "nvfp4"))
    codes, scales, gscale = kw.codes.cuda(), kw.scales.cuda(), kw.global_scale.cuda()
    x = torch.randn(tokens, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    ref = fp4.reference_fp4_linear(x, codes, scales, gscale, bias, n, k, "nvfp4").float()
    tiles = [c for c in fp4.DECODE_CONFIGS if c.tma and fp4._valid_config(c, "gemv", tokens, n, k, 16)]
    assert tiles
    for cfg in tiles:
        got = fp4.fp4_linear_triton(x, codes, scales, gscale, bias, n, k, "nvfp4", path="gemv", config=cfg).float()
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-2, cfg
    picked = fp4.tune_config("gemv", (x, codes, scales.view(torch.uint8), gscale, bias, n, k, "nvfp4", torch.bfloat16))
    assert fp4._runs_here(picked, x, torch.bfloat16)
