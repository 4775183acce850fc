"""Block-sparse attention (graphopt.kernels.sparse_attention) vs FlexAttention vs cuDNN dense.

    python bench/bench_sparse_attention.py            # H100/H200: bf16, D=128, B=1, H=16
    python bench/bench_sparse_attention.py --cpu-smoke  # tiny sizes on CPU (interpreter), logic only

For L in {4k, 8k, 16k, 32k}, causal and not, and block density 100/50/25/10 %:
- a random block mask at 128x128 granularity (under causality: a fraction of the blocks at/below
  the diagonal, with the diagonal blocks always kept), the same for every kernel;
- ours: the Triton kernel over the mask (its 128x64 blocks are the 128x128 ones split in two);
- FlexAttention (torch.compile'd flex_attention) with a BlockMask of the same blocks (full blocks
  unmasked; diagonal blocks partial with the causal mask_mod);
- cuDNN dense SDPA as the baseline (density 100 % means the same work as dense).
- cuDNN, ours and FlexAttention are timed in 5 interleaved rounds per row (rotating start); each
  row's speedups use that row's own cuDNN time.
- at 100 %, also our dense Triton flash-attention kernel (graphopt/kernels/flash_attention/),
  the same tile loop without a block list: the gap to it is what the LUT costs.
Correctness first: ours against FlexAttention on the same mask (and against cuDNN at 100 %).
Then the predictor: its time on structured local+sink inputs, as ms and as % of cuDNN dense, both
eager (do_bench: includes the host launch path when the GPU work is shorter) and replayed from a
CUDA graph (GPU time only; the predictor has no host sync, so it can be captured), the sparsity it
finds there with the default thresholds, and the end-to-end time (predictor + kernel) against
dense. Then the predictor breakdown (also alone with --predictor-only, L >= 8k): the pooling launch
alone, the LUT stage alone and the whole predictor, for every variant (v3: the default, the LUT
stage in two launches; v2: scores and selection in one LUT launch), eager and CUDA graph, as % of
cuDNN dense; the variants' block masks are compared with v2's and the torch reference's first. Prints the
issue's targets (met / not met) last. Writes JSON and a speed-vs-density PNG to $OUT (or bench/out).

    python bench/bench_sparse_attention.py --predictor-only   # the breakdown alone (~1 min)

The predictor inside a compiled model (also alone with --in-model; default L 8192): a LLaMA-3-8B
attention block (hidden 4096, 32 query heads, 8 KV heads of 128, HF's rotary embedding, bf16),
causal and not. The sparse_attention pass (forced) emits the predictor's block statistics (pooled
Q/K blocks, self-similarity) next to the projections and RoPE that produce q and k, for Inductor to
fuse there; what is left in the op reads only the pooled rows. Rows: the Q/K/V producer
(projections + RoPE) compiled by Inductor alone and with the statistics as extra outputs (their
difference is the statistics' cost where they fuse; `extra_kernels` counts the kernels Inductor
generated for them), the op's remaining predictor on those statistics (`select_block_lut`), the
predictor that pools Q and K itself (`predict_block_lut`), cuDNN dense attention, and the whole
block compiled by graphopt with the sparse pass off and forced on. predictor_in_model_% =
(statistics' cost + remaining predictor) / cuDNN dense attention (the issue's target: <= 3% at 8k).
On a CPU it says so and exits 0 (--cpu-smoke runs the logic at tiny sizes).

    python bench/bench_sparse_attention.py --in-model --lengths 8192
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DENSITIES = (1.0, 0.5, 0.25, 0.1)
FLEX_BLOCK = 128


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1) to exercise the logic")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 4096,8192,16384,32768)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--predictor-only", action="store_true",
                   help="only the predictor breakdown (pool / LUT / whole, every variant; default L 8192,16384,32768)")
    p.add_argument("--v3-configs", default="",
                   help="extra v3 launch shapes for the breakdown, ';'-separated, each 'key=value,...' with the keys "
                        "of graphopt.kernels.sparse_attention.V3_SHAPE; e.g. 'select_rows=2;precision=tf32x3'")
    p.add_argument("--in-model", action="store_true",
                   help="only the predictor inside a compiled LLaMA attention block (default L 8192)")
    p.add_argument("--skip-flex-above", type=int, default=32768,
                   help="skip FlexAttention for non-causal L above this (compile time); default: never skip")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cpu_smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if not ARGS.cpu_smoke:
    import torch as _torch

    if not _torch.cuda.is_available():
        print("bench_sparse_attention needs a CUDA GPU (none here); --cpu-smoke runs its logic at tiny sizes on the CPU")
        sys.exit(0)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (cuda_graph_ms, gbps, interleaved_ms, median_ms, out_dir, print_table,  # noqa: E402
                          random_block_mask, split_key_blocks, tflops, write_json)
from graphopt.kernels import sparse_attention as sa  # noqa: E402

DEVICE = "cpu" if ARGS.cpu_smoke else "cuda"
DTYPE = torch.float32 if ARGS.cpu_smoke else torch.bfloat16
LENGTHS = [int(x) for x in ARGS.lengths.split(",")] if ARGS.lengths else ([256, 384] if ARGS.cpu_smoke else [4096, 8192, 16384, 32768])
HEADS = 2 if ARGS.cpu_smoke else ARGS.heads
HEAD_DIM = 32 if ARGS.cpu_smoke else ARGS.head_dim
TARGET_MIN_L = 0 if ARGS.cpu_smoke else 8192
V3_CONFIGS = [{k: (int(v) if v.isdigit() else v) for k, v in (kv.split("=") for kv in c.split(","))}
              for c in ARGS.v3_configs.split(";") if c]  # the targets apply at L >= 8k


def time_ms(fn) -> float:
    if ARGS.cpu_smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return median_ms(fn)


def row_times(fns: dict) -> dict[str, float]:
    """Median ms of each (non-None) variant; on the GPU over 5 interleaved rounds with a rotating
    start (bench.common.interleaved_ms), so no variant always runs first or after the same one."""
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    if ARGS.cpu_smoke:
        return {name: time_ms(fn) for name, fn in fns.items()}
    rounds = interleaved_ms(fns, rounds=5, rep_ms=40, rotate=True)
    return {name: statistics.median(times) for name, times in rounds.items()}


def to_kernel_mask(mask128: torch.Tensor, length: int) -> torch.Tensor:
    """The FLEX_BLOCK-square mask at the kernel's blocks (BLOCK_M x BLOCK_N)."""
    assert sa.BLOCK_M == FLEX_BLOCK
    return split_key_blocks(mask128, length, FLEX_BLOCK, sa.BLOCK_N)


_FLEX_MASK_MODS: dict = {}


def flex_runner(q, k, v, mask128: torch.Tensor, causal: bool):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n = mask128.shape[-1]
    idx = torch.arange(n, device=mask128.device)
    diagonal = (idx[:, None] == idx[None, :]) if causal else torch.zeros(n, n, dtype=torch.bool, device=mask128.device)
    partial = mask128 & diagonal
    full = mask128 & ~diagonal
    partial_idx, partial_cnt = sa.block_mask_to_lut(partial)
    full_idx, full_cnt = sa.block_mask_to_lut(full)

    # The mask_mod also encodes the block mask (eager flex evaluates it densely; the compiled
    # kernel calls it only inside partial blocks). It reads one buffer per (L, causal), updated in
    # place, so the compiled flex_attention is not recompiled for every density.
    key = (mask128.shape, causal)
    if key not in _FLEX_MASK_MODS:
        buffer = torch.zeros_like(mask128)

        def mask_mod(b, h, q_idx, kv_idx):
            keep = buffer[0, h, q_idx // FLEX_BLOCK, kv_idx // FLEX_BLOCK]
            return keep & (q_idx >= kv_idx) if causal else keep

        _FLEX_MASK_MODS[key] = (buffer, mask_mod)
    buffer, mask_mod = _FLEX_MASK_MODS[key]
    buffer.copy_(mask128)
    block_mask = BlockMask.from_kv_blocks(partial_cnt, partial_idx, full_cnt, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                          mask_mod=mask_mod)
    fn = flex_attention if ARGS.cpu_smoke else FLEX_COMPILED
    return lambda: fn(q, k, v, block_mask=block_mask)


FLEX_COMPILED = None if ARGS.cpu_smoke else torch.compile(__import__(
    "torch.nn.attention.flex_attention", fromlist=["flex_attention"]).flex_attention, dynamic=False)


def graph_ms(fn):
    """GPU-only time of fn replayed from a CUDA graph (None on CPU or if capture fails)."""
    if ARGS.cpu_smoke:
        return None
    try:
        return cuda_graph_ms(fn)
    except Exception as exc:  # a capture failure is reported, never fatal
        print(f"FAIL CUDA-graph timing: {type(exc).__name__}: {exc}")
        return None


def triton_dense(q, k, v, causal):
    from graphopt.kernels.flash_attention import flash_attention

    return lambda: flash_attention(q, k, v, is_causal=causal)


def cudnn_dense(q, k, v, causal):
    if ARGS.cpu_smoke:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    err = (out.float() - ref.float()).abs().max().item()
    ok = err <= tol
    print(f"{'PASS' if ok else 'FAIL'} {name}: max abs error {err:.3e} (tol {tol:g})")
    return ok


START = time.perf_counter()


def predictor_breakdown(lengths: list[int]) -> list[dict]:
    """Per (L, causal): every predictor variant on local+sink inputs, by launch (v3's LUT stage is
    its two launches). Rows for print_table."""
    rows: list[dict] = []
    for length in lengths:
        for causal in (False, True):
            try:
                qs, ks, _ = sa.local_sink_qkv(1, HEADS, length, HEAD_DIM, seed=1, window=max(256, length // 64),
                                              dtype=DTYPE, device=DEVICE)
                dense_ms = time_ms(cudnn_dense(qs, ks, qs, causal))
                stages = {variant: sa.predictor_stages(qs, ks, is_causal=causal, variant=variant)
                          for variant in sa.PREDICTOR_VARIANTS}
                for v3_config in V3_CONFIGS:  # v3 with other launch shapes
                    label = "v3/" + ",".join(f"{k}={v}" for k, v in v3_config.items())
                    stages[label] = sa.predictor_stages(qs, ks, is_causal=causal, variant="v3", v3_shape=v3_config)
                masks = {}
                for variant, (pool, lut, (lut_out, counts)) in stages.items():
                    pool()
                    lut()
                    masks[variant] = sa.lut_to_block_mask(lut_out, counts)
                ref = sa.predict_block_mask(qs, ks, is_causal=causal)
                for variant in [v for v in stages if v != "v2"]:
                    differ = int((masks[variant] != masks["v2"]).sum())
                    rows_differ = int((masks[variant] != masks["v2"]).any(-1).sum())
                    print(f"{'PASS' if differ == 0 else 'FAIL'} predictor {variant} vs v2 L={length} causal={causal}: "
                          f"{differ} of {ref.numel()} blocks differ ({rows_differ} rows)")
                print(f"predictor vs torch reference L={length} causal={causal}: "
                      + ", ".join(f"{v} {int((m != ref).sum())} blocks differ" for v, m in masks.items()))
                read_bytes = (qs.numel() + ks.numel()) * qs.element_size()
                for variant in stages:
                    pool, lut, _ = stages[variant]

                    def whole(pool=pool, lut=lut):
                        pool()
                        lut()
                    row = {"L": length, "causal": causal, "variant": variant, "cudnn_ms": dense_ms,
                           "kept": round(masks[variant].float().mean().item(), 3)}
                    parts = getattr(lut, "parts", {})  # v3: its two LUT-stage launches, also one by one
                    for name, fn in (("pool", pool), ("lut", lut), *parts.items(), ("whole", whole)):
                        row[f"{name}_ms"] = time_ms(fn)
                        row[f"{name}_graph_ms"] = graph_ms(fn)
                    row["pool_GBps"] = gbps(read_bytes, row["pool_graph_ms"] or row["pool_ms"])
                    row["whole_%_of_dense"] = 100 * row["whole_ms"] / dense_ms
                    if row["whole_graph_ms"] is not None:
                        row["whole_graph_%_of_dense"] = 100 * row["whole_graph_ms"] / dense_ms
                    # the public entry point (allocations + two launches), as the pass calls it
                    if variant in sa.PREDICTOR_VARIANTS:
                        row["predict_block_lut_ms"] = time_ms(lambda v=variant: sa.predict_block_lut(qs, ks, is_causal=causal, variant=v))
                    rows.append(row)
                by_variant = {r["variant"]: r for r in rows[-len(stages):]}
                v2 = by_variant["v2"]
                for variant, r in by_variant.items():
                    for key in ("pool_ms", "lut_ms", "whole_ms", "whole_graph_ms"):
                        if variant != "v2" and v2.get(key) and r.get(key):
                            r[f"speedup_{key[:-3]}"] = v2[key] / r[key]
            except Exception as exc:
                print(f"FAIL predictor breakdown L={length} causal={causal}: {type(exc).__name__}: {exc}")
    return rows


BREAKDOWN_COLUMNS = ["L", "causal", "variant", "kept", "cudnn_ms", "pool_ms", "pool_graph_ms", "pool_GBps", "lut_ms",
                     "lut_graph_ms", "scores_graph_ms", "select_graph_ms", "whole_ms", "whole_graph_ms", "predict_block_lut_ms", "whole_%_of_dense",
                     "whole_graph_%_of_dense", "speedup_pool", "speedup_lut", "speedup_whole", "speedup_whole_graph"]


def main_predictor_only() -> int:
    lengths = [int(x) for x in ARGS.lengths.split(",")] if ARGS.lengths else ([256, 333] if ARGS.cpu_smoke else [8192, 16384, 32768])
    rows = predictor_breakdown(lengths)
    write_json("bench_sparse_attention_predictor", rows,
               config={"B": 1, "H": HEADS, "D": HEAD_DIM, "dtype": str(DTYPE), "block_m": sa.BLOCK_M, "block_n": sa.BLOCK_N})
    print(f"total bench time: {time.perf_counter() - START:.0f} s")
    print_table("sparse attention predictor breakdown per variant (local+sink inputs, default thresholds; "
                "graph = CUDA-graph replay; speedup = v2 / variant)", rows, BREAKDOWN_COLUMNS)
    return 0


IN_MODEL_COLUMNS = ["L", "causal", "cudnn_ms", "producer_ms", "producer_stats_ms", "statistics_ms", "extra_kernels",
                    "selection_ms", "own_pooling_predictor_ms", "predictor_in_model_%", "own_pooling_%",
                    "block_dense_ms", "block_sparse_ms", "block_speedup", "sparse_rewrites", "statistics_in_graph"]


class LlamaAttentionBlock(torch.nn.Module):
    """LLaMA's attention (HF's rotary embedding and rotation), bf16, with SDPA causal or not."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, causal: bool):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, hidden // heads, causal
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                                                       num_key_value_heads=kv_heads))

    def qkv(self, x):
        """The producer of q and k: projections and RoPE, (B, H, L, D) q and (B, Hkv, L, D) k, v."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, torch.arange(L, device=x.device)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(self, x):
        q, k, v = self.qkv(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape))


def predictor_in_model(lengths: list[int]) -> list[dict]:
    """Per (L, causal): the predictor's share of dense attention inside a compiled LLaMA attention
    block, where its block statistics fuse with the Q/K producer (see the module docstring)."""
    import torch._inductor.metrics as inductor_metrics

    import graphopt
    from graphopt.compiler import recording_decisions

    hidden, heads, kv_heads = (64, 4, 2) if ARGS.cpu_smoke else (4096, 32, 8)
    rows: list[dict] = []
    for length in lengths:
        for causal in (False, True):
            try:
                torch.manual_seed(length)
                block = LlamaAttentionBlock(hidden, heads, kv_heads, causal).to(DEVICE, DTYPE).eval()
                x = torch.randn(1, length, hidden, device=DEVICE, dtype=DTYPE)
                timed = graph_ms if not ARGS.cpu_smoke else time_ms
                row = {"L": length, "causal": causal}
                def qkv_statistics(x):
                    q, k, v = block.qkv(x)
                    return (q, k, v, *sa.block_statistics(q, k))

                with torch.no_grad():
                    torch._dynamo.reset()
                    kernels, compiled = {}, {}
                    for name, fn in (("producer", block.qkv), ("producer_stats", qkv_statistics)):
                        inductor_metrics.reset()
                        compiled[name] = torch.compile(fn)
                        outputs = compiled[name](x)
                        kernels[name] = inductor_metrics.generated_kernel_count
                    producer, producer_stats = compiled["producer"], compiled["producer_stats"]
                    q, k, v, *stats = outputs
                    row["extra_kernels"] = kernels["producer_stats"] - kernels["producer"]
                    row["producer_ms"] = timed(lambda: producer(x)) or time_ms(lambda: producer(x))
                    row["producer_stats_ms"] = timed(lambda: producer_stats(x)) or time_ms(lambda: producer_stats(x))
                    row["statistics_ms"] = row["producer_stats_ms"] - row["producer_ms"]
                    own = sa.predict_block_lut(q, k, is_causal=causal)
                    given = sa.select_block_lut(stats, length, length, is_causal=causal)
                    differ = int((sa.lut_to_block_mask(*own) != sa.lut_to_block_mask(*given)).sum())
                    print(f"{'PASS' if differ == 0 else 'NOTE'} predictor on in-graph statistics vs its own pooling "
                          f"L={length} causal={causal}: {differ} blocks differ"
                          + (" (Inductor sums the statistics in another fp32 order)" if differ else ""))
                    select = lambda: sa.select_block_lut(stats, length, length, is_causal=causal)  # noqa: E731
                    own_pooling = lambda: sa.predict_block_lut(q, k, is_causal=causal)  # noqa: E731
                    row["selection_ms"] = timed(select) or time_ms(select)
                    row["own_pooling_predictor_ms"] = timed(own_pooling) or time_ms(own_pooling)
                    dense = cudnn_dense(q, k.repeat_interleave(heads // kv_heads, 1),
                                        v.repeat_interleave(heads // kv_heads, 1), causal)
                    row["cudnn_ms"] = time_ms(dense)
                    in_model = max(row["statistics_ms"], 0.0) + row["selection_ms"]
                    row["predictor_in_model_%"] = 100 * in_model / row["cudnn_ms"]
                    row["own_pooling_%"] = 100 * row["own_pooling_predictor_ms"] / row["cudnn_ms"]
                    for name, passes in (("block_dense_ms", {"sparse_attention": False}),
                                         ("block_sparse_ms", {"sparse_attention": True})):
                        torch._dynamo.reset()
                        options = {"passes": passes, "force": True}
                        if ARGS.cpu_smoke:
                            options["downstream"] = "eager"
                        compiled_block = torch.compile(block, backend=graphopt.backend(**options))
                        with recording_decisions(reset=True) as sink:
                            compiled_block(x)
                        row[name] = timed(lambda: compiled_block(x)) or time_ms(lambda: compiled_block(x))
                    sparse = [d for d in sink if d.pass_name == "sparse_attention"]
                    row["sparse_rewrites"] = f"{sum(d.applied for d in sparse)}/{len(sparse)}"
                    row["statistics_in_graph"] = all(d.details.get("statistics_in_graph") for d in sparse if d.applied)
                    row["block_speedup"] = row["block_dense_ms"] / row["block_sparse_ms"]
                rows.append(row)
            except Exception as exc:
                print(f"FAIL predictor in a compiled model L={length} causal={causal}: {type(exc).__name__}: {exc}")
    return rows


def main_in_model() -> int:
    lengths = [int(x) for x in ARGS.lengths.split(",")] if ARGS.lengths else ([256, 333] if ARGS.cpu_smoke else [8192])
    rows = predictor_in_model(lengths)
    targets = [{"target": "predictor in a compiled model (% of cuDNN dense)", "L": r["L"], "causal": r["causal"],
                "value": round(r["predictor_in_model_%"], 3), "goal": "<= 3%",
                "status": "met" if r["predictor_in_model_%"] <= 3.0 else "NOT met"}
               for r in rows if r["L"] >= TARGET_MIN_L]
    write_json("bench_sparse_attention_in_model", rows, targets=targets,
               config={"B": 1, "hidden": 64 if ARGS.cpu_smoke else 4096, "dtype": str(DTYPE)})
    print(f"total bench time: {time.perf_counter() - START:.0f} s")
    print_table("sparse attention predictor inside a compiled LLaMA attention block (statistics fused into the "
                "Q/K producer; ms, GPU time from CUDA-graph replays)", rows, IN_MODEL_COLUMNS)
    print_table("issue 47 target (L >= 8k)", targets, ["target", "L", "causal", "value", "goal", "status"])
    return 0


def main() -> int:
    rows: list[dict] = []
    predictor_rows: list[dict] = []
    tol = 1e-4 if DTYPE == torch.float32 else 2e-2
    for length in LENGTHS:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(length)
            q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).to(DEVICE, DTYPE) for _ in range(3))
            dense_fn = cudnn_dense(q, k, v, causal)
            dense_flops = 4.0 * HEADS * length * length * HEAD_DIM * (0.5 if causal else 1.0)
            try:
                dense_out = dense_fn()
                dense_ms = time_ms(dense_fn)
            except Exception as exc:
                print(f"FAIL cuDNN dense L={length} causal={causal}: {type(exc).__name__}: {exc}")
                dense_out, dense_ms = None, float("nan")
            for density in DENSITIES:
                mask128 = random_block_mask(HEADS, length, density, causal, seed=length + int(density * 100), block=FLEX_BLOCK).to(DEVICE)
                mask = to_kernel_mask(mask128, length)
                lut, counts = sa.block_mask_to_lut(mask)
                real_density = mask128.sum().item() / (random_block_mask(HEADS, length, 1.0, causal, 0, block=FLEX_BLOCK).sum().item())
                row = {"L": length, "causal": causal, "nominal": density, "density": round(real_density, 3), "cudnn_ms": dense_ms}
                if density == 1.0:
                    try:
                        tri_fn = triton_dense(q, k, v, causal)
                        tri_out = tri_fn()
                        if dense_out is not None:
                            check(f"Triton dense flash vs cuDNN L={length} causal={causal}", tri_out, dense_out, tol)
                        row["triton_dense_ms"] = time_ms(tri_fn)
                        row["triton_dense_TFLOPs"] = tflops(dense_flops, row["triton_dense_ms"])
                    except Exception as exc:
                        print(f"FAIL Triton dense flash L={length} causal={causal}: {type(exc).__name__}: {exc}")

                def ours():
                    return sa.block_sparse_attention(q, k, v, lut, counts, is_causal=causal)
                try:
                    out = ours()
                    flex_fn = None
                    if not causal and length > ARGS.skip_flex_above:
                        print(f"skip FlexAttention L={length} non-causal (--skip-flex-above)")
                    else:
                        flex_fn = flex_runner(q, k, v, mask128, causal)
                    if flex_fn is not None:
                        flex_out = flex_fn()
                        check(f"ours vs FlexAttention L={length} causal={causal} density={density:.0%}", out, flex_out, tol)
                    if density == 1.0 and dense_out is not None:
                        check(f"ours vs cuDNN dense L={length} causal={causal}", out, dense_out, tol)
                    # cuDNN, ours and Flex timed in interleaved rounds: the ratios then compare
                    # kernels run at the same clocks (a fresh machine's first seconds, or a
                    # power-hungry neighbour, move the 8k rows by up to 10% when cuDNN is timed
                    # once per length)
                    timed = row_times({"cudnn": dense_fn if dense_out is not None else None, "ours": ours,
                                       "flex": flex_fn})
                    row_dense_ms = timed.get("cudnn", dense_ms)
                    row["cudnn_ms"] = row_dense_ms
                    row["ours_ms"] = timed["ours"]
                    row["ours_graph_ms"] = graph_ms(ours)  # GPU only: shows how much of ours_ms is host time
                    row["ours_TFLOPs_eff"] = tflops(dense_flops * real_density, row["ours_ms"])
                    row["cudnn_TFLOPs"] = tflops(dense_flops, row_dense_ms)
                    row["speedup_vs_cudnn"] = row_dense_ms / row["ours_ms"]
                    if "flex" in timed:
                        row["flex_ms"] = timed["flex"]
                        row["flex_speedup_vs_cudnn"] = row_dense_ms / row["flex_ms"]
                        row["ours_vs_flex"] = row["flex_ms"] / row["ours_ms"]
                except Exception as exc:
                    print(f"FAIL ours L={length} causal={causal} density={density}: {type(exc).__name__}: {exc}")
                rows.append(row)
            # the predictor on structured inputs: overhead, sparsity found, end to end
            try:
                qs, ks, vs = sa.local_sink_qkv(1, HEADS, length, HEAD_DIM, seed=1, window=max(256, length // 64),
                                               dtype=DTYPE, device=DEVICE)
                predict = lambda: sa.predict_block_lut(qs, ks, is_causal=causal)  # noqa: E731
                lut_s, counts_s = predict()
                ref_mask = sa.predict_block_mask(qs, ks, is_causal=causal)
                same = (sa.lut_to_block_mask(lut_s, counts_s) == ref_mask).float().mean().item()
                print(f"{'PASS' if same > 0.999 else 'FAIL'} Triton predictor vs torch predictor L={length} "
                      f"causal={causal}: {same:.4%} of blocks agree")
                del ref_mask
                full = lambda: sa.sparse_attention(qs, ks, vs, is_causal=causal)  # noqa: E731
                _, skipped = sa.sparse_attention(qs, ks, vs, is_causal=causal, return_sparsity=True)
                dense_s = cudnn_dense(qs, ks, vs, causal)
                out_s = full()
                ref_s = dense_s()
                l1 = ((out_s.float() - ref_s.float()).abs().sum() / ref_s.float().abs().sum()).item()
                dense_s_ms = time_ms(dense_s)
                predictor_ms = time_ms(predict)
                predictor_graph_ms = graph_ms(predict)
                e2e_ms = time_ms(full)
                e2e_graph_ms = graph_ms(full)
                predictor_rows.append({
                    "L": length, "causal": causal, "sparsity_found": round(skipped, 3), "rel_L1_vs_dense": l1,
                    "cudnn_ms": dense_s_ms, "predictor_ms": predictor_ms,
                    "predictor_%_of_dense": 100 * predictor_ms / dense_s_ms,
                    "predictor_graph_ms": predictor_graph_ms,
                    "predictor_graph_%_of_dense": None if predictor_graph_ms is None else 100 * predictor_graph_ms / dense_s_ms,
                    "sparse_e2e_ms": e2e_ms, "e2e_speedup": dense_s_ms / e2e_ms,
                    "e2e_graph_speedup": None if e2e_graph_ms is None else dense_s_ms / e2e_graph_ms})
            except Exception as exc:
                print(f"FAIL predictor L={length} causal={causal}: {type(exc).__name__}: {exc}")
    breakdown_rows = predictor_breakdown([n for n in LENGTHS if n >= TARGET_MIN_L])
    targets = evaluate_targets(rows, predictor_rows)
    tuned = getattr(getattr(sa, "_sparse_attention_kernel_tuned", None), "cache", {}) or {}
    tuned_configs = {str(key): str(config) for key, config in tuned.items()}
    write_json("bench_sparse_attention", rows, predictor=predictor_rows, predictor_breakdown=breakdown_rows,
               targets=targets, tuned_configs=tuned_configs,
               config={"B": 1, "H": HEADS, "D": HEAD_DIM, "dtype": str(DTYPE), "block_m": sa.BLOCK_M, "block_n": sa.BLOCK_N})
    plot(rows)
    for key, config in tuned_configs.items():
        print(f"autotuned sparse kernel config {key}: {config}")
    print(f"total bench time: {time.perf_counter() - START:.0f} s")
    print_table("sparse attention predictor breakdown per variant (graph = CUDA-graph replay; speedup = v2 / variant)",
                breakdown_rows, BREAKDOWN_COLUMNS)
    print_table("sparse attention: predictor on local+sink inputs (default thresholds; graph = CUDA-graph replay, GPU only)",
                predictor_rows, ["L", "causal", "sparsity_found", "rel_L1_vs_dense", "cudnn_ms", "predictor_ms",
                                 "predictor_%_of_dense", "predictor_graph_ms", "predictor_graph_%_of_dense",
                                 "sparse_e2e_ms", "e2e_speedup", "e2e_graph_speedup"])
    print_table("sparse attention vs FlexAttention vs cuDNN dense (same block masks)", rows,
                ["L", "causal", "density", "cudnn_ms", "ours_ms", "ours_graph_ms", "flex_ms", "triton_dense_ms", "speedup_vs_cudnn",
                 "flex_speedup_vs_cudnn", "ours_vs_flex", "ours_TFLOPs_eff", "cudnn_TFLOPs", "triton_dense_TFLOPs"])
    print_table("issue 4 targets (L >= 8k; last)", targets, ["target", "L", "causal", "value", "goal", "status"])
    return 0


def evaluate_targets(rows: list[dict], predictor_rows: list[dict]) -> list[dict]:
    """One line per (target, L, causal): measured value, goal and met / not met (missing: no data)."""
    out: list[dict] = []

    def add(target, r, value, goal, ok):
        out.append({"target": target, "L": r["L"], "causal": r["causal"],
                    "value": None if value is None else round(value, 3), "goal": goal,
                    "status": "no data" if value is None else ("met" if ok else "NOT met")})

    for r in rows:
        if r["L"] < TARGET_MIN_L:
            continue
        speedup = r.get("speedup_vs_cudnn")
        if r["nominal"] == 0.5:
            add("50% density: speedup vs cuDNN", r, speedup, ">= 1.5x", speedup is not None and speedup >= 1.5)
            vs_flex = r.get("ours_vs_flex")
            add("50% density: faster than FlexAttention", r, vs_flex, "> 1.0x", vs_flex is not None and vs_flex > 1.0)
        elif r["nominal"] == 0.25:
            add("25% density: speedup vs cuDNN", r, speedup, ">= 2.8x", speedup is not None and speedup >= 2.8)
        elif r["nominal"] == 1.0:
            eff = r.get("ours_TFLOPs_eff")
            add("100% density: kernel TFLOP/s (internal goal)", r, eff, ">= 550", eff is not None and eff >= 550)
    for r in predictor_rows:
        if r["L"] < TARGET_MIN_L:
            continue
        pct = r.get("predictor_%_of_dense")
        add("predictor overhead, eager (% of cuDNN dense)", r, pct, "<= 5%", pct is not None and pct <= 5.0)
        pct_graph = r.get("predictor_graph_%_of_dense")
        add("predictor overhead, CUDA graph (% of cuDNN dense)", r, pct_graph, "<= 5%",
            pct_graph is not None and pct_graph <= 5.0)
    return out


def plot(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        for length in LENGTHS:
            sel = [r for r in rows if r["L"] == length and r["causal"] == causal and "ours_ms" in r]
            if not sel:
                continue
            line, = ax.plot([100 * (1 - r["density"]) for r in sel], [r["speedup_vs_cudnn"] for r in sel], "o-",
                            label=f"ours L={length}")
            flex = [r for r in sel if "flex_ms" in r]
            if flex:
                ax.plot([100 * (1 - r["density"]) for r in flex], [r["flex_speedup_vs_cudnn"] for r in flex], "x--",
                        color=line.get_color(), alpha=0.6, label=f"Flex L={length}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("block sparsity (%)")
        ax.set_title(f"{'causal' if causal else 'non-causal'}, D={HEAD_DIM}, H={HEADS}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over cuDNN dense")
    axes[1].legend(fontsize=7, ncol=2)
    path = out_dir() / "sparse_attention_speed_vs_sparsity.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main_in_model() if ARGS.in_model else main_predictor_only() if ARGS.predictor_only else main())
