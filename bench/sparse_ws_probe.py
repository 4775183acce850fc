"""Probe: Triton's automatic warp specialization (Hopper, `tl.range(..., warp_specialize=True)`) for the
block-sparse attention loop, against the shipped kernel and cuDNN on the same block lists.

The specialized loop must be the kernel's only loop with no branch inside, so this kernel visits
every kept block through one loop; with MASKED (causal, or a partial last key block) every tile
applies the token mask. B=1, H=16, D=128, bf16; random block masks at 64-key granularity (the
diagonal blocks always kept under causality). Prints PASS/FAIL against the shipped kernel on the
same list, then a table of medians.

Outcome on the H100 with triton 3.6 (bench/RESULTS.md, session 11): the specialized loop gave
NaN at 3 stages and wrong causal tiles at 2, and the one correct form gained 0.5-1%; the kernel
kept the single loop without specialization (sparse_attention.py, SINGLE_LOOP).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.attention  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import median_ms, print_table, tflops, write_json  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

ARGS = argparse.ArgumentParser(description=__doc__)
ARGS.add_argument("--lengths", default="8192,16384")
ARGS.add_argument("--densities", default="1.0,0.5,0.25")
ARGS.add_argument("--configs", default="4:2,4:3,8:2,8:3", help="num_warps:num_stages of the probe kernel")
ARGS = ARGS.parse_args()


@triton.jit
def _probe_tile(acc, l_i, m_i, q, kd, vd, start_n, offs_m, qk_scale, Lk, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                IS_CAUSAL: tl.constexpr):
    k = kd.load([start_n, 0])
    qk = tl.dot(q, k.T)
    if MASKED:
        keys = start_n + tl.arange(0, BLOCK_N)
        valid = keys[None, :] < Lk
        if IS_CAUSAL:
            valid = valid & (keys[None, :] <= offs_m[:, None])
        s = tl.where(valid, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = vd.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _probe_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lut_ptr, count_ptr, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  MASKED: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    qd = tl.make_tensor_descriptor(q_ptr + bh.to(tl.int64) * Lq * HEAD_DIM, shape=[Lq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                   block_shape=[BLOCK_M, HEAD_DIM])
    kd = tl.make_tensor_descriptor(k_ptr + bh.to(tl.int64) * Lk * HEAD_DIM, shape=[Lk, HEAD_DIM], strides=[HEAD_DIM, 1],
                                   block_shape=[BLOCK_N, HEAD_DIM])
    vd = tl.make_tensor_descriptor(v_ptr + bh.to(tl.int64) * Lk * HEAD_DIM, shape=[Lk, HEAD_DIM], strides=[HEAD_DIM, 1],
                                   block_shape=[BLOCK_N, HEAD_DIM])
    od = tl.make_tensor_descriptor(o_ptr + bh.to(tl.int64) * Lq * HEAD_DIM, shape=[Lq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                   block_shape=[BLOCK_M, HEAD_DIM])
    row = bh * N_Q_BLOCKS + pid_m
    lut_row = lut_ptr + row.to(tl.int64) * N_K_BLOCKS
    count = tl.load(count_ptr + row)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = qd.load([pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for it in tl.range(0, count, warp_specialize=WS):
        start = tl.load(lut_row + it) * BLOCK_N
        acc, l_i, m_i = _probe_tile(acc, l_i, m_i, q, kd, vd, start, offs_m, qk_scale, Lk, BLOCK_N, MASKED, IS_CAUSAL)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    od.store([pid_m * BLOCK_M, 0], out.to(od.dtype))


def probe(q, k, v, lut, counts, causal, ws, warps, stages):
    B, H, L, D = q.shape
    out = torch.empty_like(q)
    n_q, n_k = lut.shape[2], lut.shape[3]
    masked = causal or L % sa.BLOCK_N != 0
    _probe_kernel[(n_q, B * H)](q, k, v, out, lut, counts, L, L, n_q, n_k, D ** -0.5 * sa.LOG2E, HEAD_DIM=D,
                                BLOCK_M=sa.BLOCK_M, BLOCK_N=sa.BLOCK_N, IS_CAUSAL=causal, MASKED=masked, WS=ws,
                                num_warps=warps, num_stages=stages)
    return out


def random_mask(h, n_q, n_k, density, causal, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(n_q)[:, None]
    cols = torch.arange(n_k)[None, :]
    ratio = sa.BLOCK_M // sa.BLOCK_N
    allowed = (cols < (rows + 1) * ratio) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    diagonal = (cols >= rows * ratio) & allowed if causal else torch.zeros(n_q, n_k, dtype=torch.bool)
    score = torch.rand(1, h, n_q, n_k, generator=gen).masked_fill(~allowed, -1.0).masked_fill(diagonal, 2.0)
    keep = torch.clamp((allowed.sum(-1).float() * density).round().long(), min=1)
    ranks = score.argsort(-1, descending=True).argsort(-1)
    return (ranks < keep[:, None]) & allowed


def main():
    sa._ensure_descriptor_allocator()
    heads, dim = 16, 128
    rows, checks = [], []
    configs = [tuple(int(x) for x in c.split(":")) for c in ARGS.configs.split(",")]
    for length in (int(x) for x in ARGS.lengths.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(length)
        q, k, v = (torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        n_q, n_k = -(-length // sa.BLOCK_M), -(-length // sa.BLOCK_N)
        for causal in (False, True):
            def cudnn():
                with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            cudnn_ms = median_ms(cudnn)
            for density in (float(x) for x in ARGS.densities.split(",")):
                mask = random_mask(heads, n_q, n_k, density, causal, seed=length + int(100 * density)).cuda()
                lut, counts = sa.block_mask_to_lut(mask)
                lut, counts = lut.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
                kept = mask.float().mean().item() * (2 if causal else 1)
                flops = 4 * heads * length * length * dim * mask.float().mean().item()
                shipped = lambda: sa.block_sparse_attention(q, k, v, lut, counts, is_causal=causal)  # noqa: E731
                ref = shipped()
                base = {"L": length, "causal": causal, "density": round(kept, 3), "cudnn_ms": cudnn_ms}
                t = median_ms(shipped)
                rows.append(dict(base, variant="shipped", ms=t, vs_cudnn=cudnn_ms / t, TFLOPs=tflops(flops, t)))
                for ws in (True, False):
                    for warps, stages in configs:
                        name = f"probe ws={int(ws)} w{warps}s{stages}"
                        try:
                            out = probe(q, k, v, lut, counts, causal, ws, warps, stages)
                            err = (out.float() - ref.float()).abs().max().item()
                            ok = err <= 2e-2
                            checks.append(ok)
                            print(f"{'PASS' if ok else 'FAIL'} {name} L={length} causal={causal} d={density}: max |diff| {err:.2e}")
                            t = median_ms(lambda: probe(q, k, v, lut, counts, causal, ws, warps, stages))
                            rows.append(dict(base, variant=name, ms=t, vs_cudnn=cudnn_ms / t, TFLOPs=tflops(flops, t)))
                        except Exception as exc:  # report, keep going
                            print(f"FAIL {name} L={length} causal={causal}: {type(exc).__name__}: {str(exc)[:300]}")
                            checks.append(False)
    write_json("sparse_ws_probe", rows)
    print_table("warp-specialized sparse loop probe (median ms; vs_cudnn = cuDNN dense ms / ms)", rows,
                ["L", "causal", "density", "variant", "ms", "vs_cudnn", "TFLOPs", "cudnn_ms"])
    print(f"checks: {sum(checks)}/{len(checks)} PASS")


if __name__ == "__main__":
    main()
