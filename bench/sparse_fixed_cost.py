"""Probe: the block-sparse kernel's fixed cost per program, and two ways to cut it.

At 8k tokens, non-causal, the session-12 runs fit time = waves x (a + b x kept tiles) with about
2 us per 128 x 64 tile and about 10 us per program on top (two programs share an SM). At 25%
density a row keeps 32 tiles, so that fixed part is about 13% of the kernel. Candidates for it:
- each program builds four tensor descriptors on the device (global scratch writes and a proxy
  fence before the first TMA load);
- each program starts with an empty pipeline (Q load, then the first K/V loads, serialized) and
  ends with a drain and the O store, with nothing to overlap them but the SM's other program.

Variants, all the single-loop body at 4 warps on the same block lists (non-causal, whole blocks):
- `shipped`: the kernel in graphopt with device-side descriptors (HOST_DESCRIPTORS=0, its form
  before session 15), config fixed, no autotuning; `shipped host`: the same with the launcher's
  descriptors (HOST_DESCRIPTORS=1, the default since then);
- `host_desc`: the same loop with host-side descriptors over (B*H*L, D) views;
- `host_desc q_pointers`: that, with Q loaded through pointers (its wait moves to the first
  use, so the first K/V loads are issued before Q arrives);
- `host_desc lazy`: that, with the accumulator rescaled only when a row's max grew by more than
  2^8 (the FlashAttention-4 rule; exact, p may reach 256);
- `persistent`: host descriptors, PROGRAMS_PER_SM x SMs programs, each taking rows in a strided
  loop; with `flatten` Triton fuses the row loop and the tile loop so the next row's first
  loads are issued while this row's last tiles run.

Rows: uniform lists of n random kept blocks per query block (n = 4 ... 128) fit a + b x n per
variant; then the benchmark's random 50% / 25% masks. Outputs are compared with the shipped
kernel's (max abs difference); times are CUDA-graph replays, interleaved with a rotating start,
medians over rounds. B=1, H=16, D=128, bf16.

Outcome on the H100 with triton 3.6 (bench/RESULTS.md, session 15): host descriptors cut the fixed
cost from 9.8 to 7.3 us per program and were adopted (sparse_attention.py, HOST_DESCRIPTORS); the
lazy rescale cost 4% more per tile (its CTA-wide max and branch run on every tile); the persistent
loop, flattened or not, cost 47% more per tile; Q through pointers changed nothing. None of those
was kept. (The first two runs predate `shipped host`: in the second, `shipped` already ran the
module's default, host descriptors.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.common import cuda_graph_ms, print_table, random_block_mask, split_key_blocks, write_json  # noqa: E402
from graphopt.kernels import sparse_attention as sa  # noqa: E402

HEADS, HEAD_DIM = 16, 128
VARIANTS: list[str] = []  # --variants
SHIPPED_CONFIG = {"PREFETCH_INDEX": 1, "USE_TMA": 1, "PAIR_BLOCKS": 0, "SINGLE_LOOP": 1, "num_warps": 4}


@triton.jit
def _lazy_rescale_tile(acc, l_i, m_i, q, k_desc, v_desc, start_n, qk_scale, RESCALE_LOG2: tl.constexpr):
    """An unmasked tile whose running max moves only when some row's max grew by more than
    RESCALE_LOG2 (log2 units): p may then reach 2^RESCALE_LOG2, and the accumulator's rescale
    (a multiply of the whole 128 x D fp32 tile) is skipped on most steps. Exact: the final
    division uses the same stale max as every p."""
    qk = tl.dot(q, tl.trans(k_desc.load([start_n, 0])))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if tl.max(m_new - m_i, 0) > RESCALE_LOG2:
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.math.exp2(qk * qk_scale - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    v = v_desc.load([start_n, 0])
    return tl.dot(p.to(v.dtype), v, acc), l_i, m_i


@triton.jit
def _attend_row(q_desc, k_desc, v_desc, o_desc, lut_row, count, pid_bh, pid_m, Lq, Lk, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                q_ptr=None, Q_POINTERS: tl.constexpr = False):
    """One query block over its kept blocks (whole, unmasked) with descriptors over all heads' rows.
    Q_POINTERS: Q through a pointer load (contiguous (B*H*L, D) rows), whose wait comes at its first
    use, so the first K/V tiles' loads are issued before Q arrives (a TMA load of Q waits at once)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if Q_POINTERS:
        q = tl.load(q_ptr + (pid_bh * Lq).to(tl.int64) * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    else:
        q = q_desc.load([pid_bh * Lq + pid_m * BLOCK_M, 0])
    kv_row0 = pid_bh * Lk
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for it in range(0, count):
        start_n = tl.load(lut_row + it, eviction_policy="evict_last") * BLOCK_N
        if LAZY_RESCALE:
            acc, l_i, m_i = _lazy_rescale_tile(acc, l_i, m_i, q, k_desc, v_desc, kv_row0 + start_n, qk_scale, 8.0)
        else:
            acc, l_i, m_i = sa._attend_tile(
                acc, l_i, m_i, q, None, None, k_desc, v_desc, start_n, kv_row0, offs_m, offs_n, offs_d, 0.0, 0, 0,
                Lq, Lk, qk_scale, HEAD_DIM, False, False, False, False, "tf32", True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_desc.store([pid_bh * Lq + pid_m * BLOCK_M, 0], out.to(o_desc.dtype))


@triton.jit
def _host_desc_kernel(q_desc, k_desc, v_desc, o_desc, lut_ptr, count_ptr, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      LAZY_RESCALE: tl.constexpr = False, q_ptr=None, Q_POINTERS: tl.constexpr = False):
    """One program per (query block, head), query blocks fastest: the shipped single loop's unmasked
    path with descriptors built on the host."""
    row = tl.program_id(0)
    _attend_row(q_desc, k_desc, v_desc, o_desc, lut_ptr + row.to(tl.int64) * N_K_BLOCKS, tl.load(count_ptr + row),
                row // N_Q_BLOCKS, row % N_Q_BLOCKS, Lq, Lk, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, LAZY_RESCALE,
                q_ptr, Q_POINTERS)


@triton.jit
def _persistent_kernel(q_desc, k_desc, v_desc, o_desc, lut_ptr, count_ptr, Lq, Lk, N_Q_BLOCKS, N_K_BLOCKS, n_rows,
                       qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       FLATTEN: tl.constexpr):
    """Fewer programs than rows; program p takes rows p, p + P, ... (query blocks fastest)."""
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), flatten=FLATTEN):
        # int32 row offsets are enough for the probe's sizes
        _attend_row(q_desc, k_desc, v_desc, o_desc, lut_ptr + row * N_K_BLOCKS, tl.load(count_ptr + row),
                    row // N_Q_BLOCKS, row % N_Q_BLOCKS, Lq, Lk, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, False)


def host_descriptors(q, k, v, out):
    B, H, L, D = q.shape
    flat = [t.reshape(B * H * t.shape[2], D) for t in (q, k, v, out)]
    return (TensorDescriptor.from_tensor(flat[0], [sa.BLOCK_M, D]), TensorDescriptor.from_tensor(flat[1], [sa.BLOCK_N, D]),
            TensorDescriptor.from_tensor(flat[2], [sa.BLOCK_N, D]), TensorDescriptor.from_tensor(flat[3], [sa.BLOCK_M, D]))


def variants(q, k, v, lut, counts, stages: list[int], programs_per_sm: list[int]):
    """name -> zero-argument runner; each runner allocates nothing but its output."""
    B, H, L, D = q.shape
    n_q, n_k = L // sa.BLOCK_M, L // sa.BLOCK_N
    n_rows = B * H * n_q
    scale = D**-0.5 * sa.LOG2E
    out = torch.empty_like(q)
    descs = host_descriptors(q, k, v, out)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    fns = {}
    for s in stages:
        for host_flag, suffix in ((0, ""), (1, " host")):
            fns[f"shipped{suffix} s{s}"] = lambda s=s, host_flag=host_flag: sa.block_sparse_attention(
                q, k, v, lut, counts, config={**SHIPPED_CONFIG, "num_stages": s, "HOST_DESCRIPTORS": host_flag})

        for suffix, lazy, q_pointers in (("", False, False), (" lazy", True, False), (" q_pointers", False, True)):
            def host(s=s, lazy=lazy, q_pointers=q_pointers):
                _host_desc_kernel[(n_rows,)](*descs, lut, counts, L, L, n_q, n_k, scale, HEAD_DIM=D, BLOCK_M=sa.BLOCK_M,
                                             BLOCK_N=sa.BLOCK_N, LAZY_RESCALE=lazy, q_ptr=q if q_pointers else None,
                                             Q_POINTERS=q_pointers, num_warps=4, num_stages=s)
                return out
            fns[f"host_desc{suffix} s{s}"] = host
        for per_sm in programs_per_sm:
            for flatten in (True, False):
                def persistent(s=s, per_sm=per_sm, flatten=flatten):
                    grid = (min(n_rows, per_sm * sms),)
                    _persistent_kernel[grid](*descs, lut, counts, L, L, n_q, n_k, n_rows, scale, HEAD_DIM=D,
                                             BLOCK_M=sa.BLOCK_M, BLOCK_N=sa.BLOCK_N, FLATTEN=flatten, num_warps=4,
                                             num_stages=s)
                    return out
                fns[f"persistent{per_sm} {'flat' if flatten else 'nested'} s{s}"] = persistent
    return {name: fn for name, fn in fns.items() if not VARIANTS or any(v in name for v in VARIANTS)}


def uniform_lut(n_q: int, n_k: int, kept: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand(1, HEADS, n_q, n_k, generator=gen).topk(kept, dim=-1).indices.sort(-1).values
    lut = torch.zeros(1, HEADS, n_q, n_k, dtype=torch.int32)
    lut[..., :kept] = picks.to(torch.int32)
    return lut.cuda(), torch.full((1, HEADS, n_q), kept, dtype=torch.int32, device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--kept", default="4,8,16,32,64,128", help="uniform tiles per row (64-key blocks)")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--programs-per-sm", default="2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="", help="comma-separated name parts to keep (default: all)")
    args = parser.parse_args()
    VARIANTS.extend(filter(None, args.variants.split(",")))
    length = args.length
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n_q, n_k = length // sa.BLOCK_M, length // sa.BLOCK_N
    cases = [(f"uniform {n}", *uniform_lut(n_q, n_k, n, seed=n)) for n in map(int, args.kept.split(","))]
    for density in (0.5, 0.25):
        mask = split_key_blocks(random_block_mask(HEADS, length, density, False, seed=length + int(density * 100),
                                                  block=sa.BLOCK_M), length, sa.BLOCK_M, sa.BLOCK_N)
        cases.append((f"random {density:.0%}", *sa.block_mask_to_lut(mask.cuda())))
    stages = [int(s) for s in args.stages.split(",")]
    per_sm = [int(p) for p in args.programs_per_sm.split(",")]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn_ms = cuda_graph_ms(lambda: F.scaled_dot_product_attention(q, k, v))
    rows = []
    for case, lut, counts in cases:
        fns = variants(q, k, v, lut, counts, stages, per_sm)
        reference = sa.block_sparse_attention(q, k, v, lut, counts,
                                              config={**SHIPPED_CONFIG, "num_stages": 2, "HOST_DESCRIPTORS": 0}).float()
        usable = {}
        for name, fn in fns.items():
            try:
                diff = (fn().float() - reference).abs().max().item()
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"FAIL {case} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            verdict = "PASS" if diff <= 1e-2 else "FAIL"
            print(f"{verdict} {case} {name}: max abs diff vs shipped {diff:.2e}", flush=True)
            if verdict == "PASS":
                usable[name] = fn
        times = {name: [] for name in usable}
        names = list(usable)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(cuda_graph_ms(usable[name], rep_ms=60))
        kept_tiles = counts.float().mean().item()
        base = statistics.median(times.get("shipped s2", [float("nan")]))
        for name in names:
            ms = statistics.median(times[name])
            rows.append({"case": case, "tiles_per_row": round(kept_tiles, 1), "variant": name, "ms": round(ms, 4),
                         "vs_shipped_s2": round(base / ms, 3), "vs_cudnn": round(cudnn_ms / ms, 3)})
        print(rows[-len(names):], flush=True)
    fits = fit_fixed_cost(rows, n_rows=HEADS * n_q, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    write_json("sparse_fixed_cost", rows, cudnn_ms=cudnn_ms, fits=fits, length=length)
    print_table(f"L={length} non-causal, cuDNN {cudnn_ms:.4f} ms (CUDA graph medians)", rows)
    print_table("least-squares fit over the uniform rows: ms = fixed + per_tile x tiles", fits)
    return 0


def fit_fixed_cost(rows: list[dict], n_rows: int, sms: int) -> list[dict]:
    """Per variant, ms = fixed + per_tile x n over the uniform rows; also the fixed part per
    program slot in us (fixed / waves, with 2 programs per SM)."""
    fits = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["tiles_per_row"], r["ms"]) for r in rows if r["variant"] == name and r["case"].startswith("uniform")]
        if len(pts) < 2:
            continue
        xs, ys = zip(*pts)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        waves = n_rows / (2 * sms)
        fits.append({"variant": name, "fixed_ms": round(fixed, 4), "per_tile_ms": round(slope, 5),
                     "fixed_us_per_program": round(1000 * fixed / waves, 2),
                     "per_tile_us_per_program": round(1000 * slope / waves, 3)})
    return fits


if __name__ == "__main__":
    sys.exit(main())
