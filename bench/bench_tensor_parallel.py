"""Decode tokens/s and per-GPU memory of LLaMA-3-8B (random weights) split over N GPUs by PyTorch's tensor parallelism.

Run it with torchrun; the tensor-parallel size is the number of processes (N = 1: the one-GPU
model, not split):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tensor_parallel.py --loops decode
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tensor_parallel.py --loops generate
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tensor_parallel.py --loops collectives
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tensor_parallel.py --loops decode \
        --variants inductor,graphopt,graphopt-allreduce,graphopt-fp4,graphopt-fp4-allreduce
    torchrun --nproc-per-node 2 bench/bench_tensor_parallel.py --shapes tiny --device cpu --force \\
        --prompt 16 --new-tokens 8 --repeats 1                                      # CPU smoke (gloo)

The split is the one gpt-fast and torchtitan use, through torch.distributed.tensor.parallel
.parallelize_module: ColwiseParallel on q/k/v and gate/up, RowwiseParallel on o and down (an
all-reduce after each), lm_head column-parallel with its logits gathered, the embedding
row-parallel (both as transformers' own plan and torchtitan shard them). Every rank builds the
same random model (one seed) and keeps its shards. NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, set here when unset), as the machines require.

Loops (--loops), batch 1 by default, CUDA graphs on (mode="reduce-overhead"):
- decode: gpt-fast's loop (bench/llama_models.py DecodeLoop, as bench_decode_loop.py): a
  StaticCache filled by the plain model, then the compiled one-token step in a Python loop;
- generate: HF generate with a static cache and CompileConfig (bench_generate.py's measurement,
  without its HF-overhead column).
- collectives: the all-reduce alone, bf16, at the sizes of COLLECTIVE_BYTES (a decode step's are
  hidden size x batch x 2 bytes): microseconds per all-reduce through NCCL (dist.all_reduce) and
  through graphopt::all_reduce's one-shot kernel over symmetric memory (two buffers, alternating),
  each called back to back eagerly and replayed from a CUDA graph of COLLECTIVE_CALLS calls; the
  one-shot results checked against NCCL's sum. Needs 2 or more GPUs.
Variants (--variants; default: all but the two all-reduce ones): inductor (bf16), graphopt (its
default passes, bf16), graphopt-fp4 (fp4_linear on every linear the cost model takes; --force for
all), quantized-fp4 (the split model through graphopt.quantize_(format="nvfp4"), which releases
the bf16 linears, then graphopt-fp4's compile; it runs last in each loop and the model is built
again for the next loop), graphopt-allreduce and graphopt-fp4-allreduce (graphopt and graphopt-fp4
with the all_reduce pass on: the all-reduce after each row-parallel linear as graphopt::all_reduce;
they run after the others: once a process has set up symmetric memory, its later NCCL-only
variants ran slower, bench/RESULTS.md section 10).
Each rank quantizes its own shards, with the whole weight's NVFP4 global scale (one all-reduce).

--skip-guard-eval runs the decode steps after the first decode under
torch.compiler.set_stance(skip_guard_eval_unsafe=True): Dynamo then skips its per-call guard checks,
which in Python check every DTensor parameter's spec (a loop that cannot recompile may do this).

Per row: tok_s (rank 0's; every rank runs the same steps in lock step), ms_step; peak_gb: each
rank's torch.cuda.max_memory_allocated over the variant; weight_gb: each rank's weight bytes as
the compiled step reads them, i.e. its parameter shards (the replicated norms counted on every
rank) minus what graphopt's rewrites saved (FP4 codes and scales in place of bf16); the
quantized variants keep the bf16 parameters too, which peak_gb counts. identical: the greedy
tokens equal the inductor variant's of the same loop; ranks_agree: every rank generated the same
tokens. The rows go to bench/results/tensor_parallel_<gpu>_tp<N>.json (--out), merged with the
rows already there for other loops, variants or shapes, so a sweep can be split over invocations.
Each invocation of one loop at the 8B shape (32 layers) and three variants is sized to finish in
well under 9 minutes on H100s; --layers shrinks the model, --variants drops variants.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script, bench/ is sys.path[0]; `bench.*` and `graphopt` live at the root
    sys.path.insert(0, REPO)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL makes a communicator

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench import bench_decode_loop, bench_generate  # noqa: E402
from bench.common import environment, print_table  # noqa: E402
from bench.llama_models import SHAPES, build_model, fresh_start, gpu_slug, random_prompt  # noqa: E402

LOOPS = ("decode", "generate", "collectives")
VARIANTS = ("inductor", "graphopt", "graphopt-fp4", "quantized-fp4", "graphopt-allreduce", "graphopt-fp4-allreduce")
DEFAULT_VARIANTS = VARIANTS[:4]
COLLECTIVE_BYTES = (8192, 65536, 262144, 2097152)
COLLECTIVE_CALLS = 64  # all-reduces recorded in one CUDA graph
COLLECTIVE_COLUMNS = ["bytes", "nccl_eager_us", "nccl_graph_us", "one_shot_eager_us", "one_shot_graph_us",
                      "graph_speedup", "one_shot_max_err", "matches_nccl"]
COLUMNS = ["loop", "variant", "tp", "tok_s", "vs_inductor", "ms_step", "compile_s", "weight_gb", "peak_gb", "identical",
           "ranks_agree", "error"]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default 8b; tiny on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's, 32 for 8b)")
    parser.add_argument("--loops", default="decode,generate", help=f"comma list of {', '.join(LOOPS)} (default decode,generate)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma list of {', '.join(VARIANTS)} (default {', '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--mode", default=None, help="torch.compile mode (default reduce-overhead on CUDA, default on CPU)")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda or cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (the median is reported)")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="HF attention implementation")
    parser.add_argument("--skip-guard-eval", action="store_true",
                        help="decode loop: steps after the first decode run under torch.compiler.set_stance("
                             "skip_guard_eval_unsafe=True), without Dynamo's per-call guard checks")
    parser.add_argument("--force", action="store_true", help="graphopt-fp4 with force=True (on CPU, the way to run the rewrite)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/tensor_parallel_<gpu>_tp<N>.json)")
    parser.add_argument("--summarize", nargs="*", default=None, metavar="JSON",
                        help="run nothing: compare the result files given (default: this GPU's, every TP size) "
                             "across tensor-parallel sizes")
    return parser


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    opts.device = ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device
    opts.dtype = torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    opts.shapes = (opts.shapes or ("8b" if opts.device.startswith("cuda") else "tiny")).split(",")
    opts.loops, opts.variants = opts.loops.split(","), opts.variants.split(",")
    # quantized-fp4 last (it quantizes the model in place), the all-reduce variants before it
    opts.variants.sort(key=lambda v: (v == "quantized-fp4", v.endswith("-allreduce")))
    opts.mode = opts.mode or ("reduce-overhead" if opts.device.startswith("cuda") else "default")
    for name, values, valid in (("shape", opts.shapes, SHAPES), ("loop", opts.loops, LOOPS),
                                ("variant", opts.variants, VARIANTS)):
        bad = [v for v in values if v not in valid]
        if bad:
            raise SystemExit(f"unknown {name} {bad}; valid choices: {', '.join(valid)}")
    if opts.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (decode speed is measured past the first token)")
    opts.hf_overhead = False  # bench_generate.measure: no extra Inductor loop per row
    return opts


def start_processes(device: str) -> tuple[int, int]:
    """(rank, world size): torchrun's processes joined in one group (NCCL on GPUs, gloo on CPU),
    each on its own GPU; a plain `python` run is one process without a group."""
    if "RANK" not in os.environ:
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # a rank that fails leaves the others waiting in a collective: give up after minutes, not NCCL's default
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(minutes=5))
    return rank, world


def parallelize_llama(model: nn.Module, world: int, device: str) -> nn.Module:
    """The model split over `world` ranks (unchanged for one)."""
    if world == 1:
        return model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    if heads % world or kv_heads % world:
        raise SystemExit(f"{heads} query and {kv_heads} key/value heads do not split over {world} ranks; "
                         f"run this shape on a number of processes that divides {kv_heads}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world,))
    layer_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                  "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                  "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    if not model.config.tie_word_embeddings:  # a tied weight would be split twice
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return parallelize_module(model, mesh, plan)


def weight_bytes(model: nn.Module) -> int:
    """This rank's weight bytes: its shards of the split parameters, the replicated ones whole, and
    the packed buffers of graphopt.quantize_'s layers."""
    from graphopt.quant import quantized_layers

    total = sum(layer.packed_nbytes for layer in quantized_layers(model).values())
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def saved_bytes(decisions: list) -> int:
    """Weight bytes graphopt's applied rewrites no longer read, each layer counted once (a
    recompile records its decisions again)."""
    saved: dict = {}
    for d in decisions:
        if d.applied and d.details.get("memory_saved_bytes"):
            saved[(d.pass_name, d.location)] = int(d.details["memory_saved_bytes"])
    return sum(saved.values())


def gather(value, world: int) -> list:
    if world == 1:
        return [value]
    out: list = [None] * world
    dist.all_gather_object(out, value)
    return out


def run_variant(model, prompt, opts, loop: str, variant: str, world: int) -> tuple[dict, torch.Tensor | None]:
    """One row (rank 0's view, memory of every rank) and this rank's tokens."""
    from graphopt.compiler import recording_decisions

    measure = {"decode": bench_decode_loop.measure, "generate": bench_generate.measure}[loop]
    compiled_as = variant
    if variant == "quantized-fp4":
        import graphopt

        graphopt.quantize_(model, format="nvfp4")
        compiled_as = "graphopt-fp4"
    fresh_start(opts.device, model)
    if world > 1:
        dist.barrier()
    row: dict = {"loop": loop, "variant": variant, "tp": world, "mode": opts.mode}
    if opts.skip_guard_eval and loop == "decode":
        row["skip_guard_eval"] = True
    tokens = None
    try:
        with recording_decisions() as decisions, torch.no_grad():
            result, tokens = measure(model, prompt, opts, compiled_as, opts.mode)
        row.update(tok_s=result["tok_s"], compile_s=result["compile_s"],
                   ms_step=result.get("ms_step") or (1e3 * prompt.shape[0] / result["tok_s"] if result["tok_s"] else None))
        weight_gb = (weight_bytes(model) - saved_bytes(decisions)) / 1e9
        rewrites, declined = {}, {}
        for d in decisions:
            rewrites[d.pass_name] = rewrites.get(d.pass_name, 0) + int(d.applied)
            if not d.applied:  # why, so that a row with fewer rewrites than layers explains itself
                key = f"{d.pass_name}: {d.reason[:160]}"
                declined[key] = declined.get(key, 0) + 1
        local = {"peak_gb": result["peak_gb"], "weight_gb": weight_gb, "rewrites": rewrites, "declined": declined}
    except Exception as exc:  # noqa: BLE001 - reported in its row; the other variants still run
        local = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    per_rank = gather(local, world)
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row, None
    row.update(peak_gb=[r["peak_gb"] for r in per_rank], weight_gb=[round(r["weight_gb"], 6) for r in per_rank],
               rewrites=per_rank[0]["rewrites"], declined=per_rank[0]["declined"])
    all_tokens = gather(tokens.cpu(), world)
    row["ranks_agree"] = all(torch.equal(t, all_tokens[0]) for t in all_tokens)
    return row, tokens


def result_path(opts, world: int) -> Path:
    return Path(opts.out) if opts.out else Path(REPO) / "bench" / "results" / f"tensor_parallel_{gpu_slug()}_tp{world}.json"


def _key(row: dict, *fields: str) -> tuple:
    return tuple(str(row.get(k)) for k in ("shape", "layers", "loop", "mode", "batch", "skip_guard_eval", "bytes", *fields))


def write_rows(opts, world: int, rows: list[dict]) -> list[dict]:
    """Rows merged into the file's (a row replaces the one of the same shape, layers, loop, mode,
    batch and variant), vs_inductor set from the merged inductor rows; returns all the rows."""
    path = result_path(opts, world)
    new = {_key(r, "variant") for r in rows}
    kept = []
    if path.exists():
        kept = [r for r in json.loads(path.read_text()).get("rows", []) if _key(r, "variant") not in new]
    merged = kept + rows
    inductor = {_key(r): r.get("tok_s") for r in merged if r.get("variant") == "inductor"}
    for row in merged:
        base = inductor.get(_key(row))
        row["vs_inductor"] = row["tok_s"] / base if base and row.get("tok_s") else None
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {k: str(v) for k, v in vars(opts).items()}
    environment_info = {**environment(), "world_size": world, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    path.write_text(json.dumps({"environment": environment_info, "options": options, "rows": merged}, indent=2,
                               default=str))
    return merged


def summarize(paths: list[Path]) -> list[dict]:
    """One row per shape, layers, loop, mode, batch, variant and TP size, from the result files:
    tok_s and its ratio to TP = 1 (tp1_x), the largest per-GPU weight_gb and peak_gb and their
    ratios to TP = 1."""
    rows = [r for path in paths for r in json.loads(Path(path).read_text()).get("rows", []) if r.get("tok_s")]
    one = {_key(r, "variant"): r for r in rows if r.get("tp") == 1}
    table = []
    for r in sorted(rows, key=lambda r: (_key(r, "variant"), r.get("tp"))):
        base = one.get(_key(r, "variant"))
        weight, peak = max(r.get("weight_gb") or [0]), max(r.get("peak_gb") or [0], key=lambda v: v or 0)
        out = {k: r.get(k) for k in ("loop", "variant", "tp", "tok_s", "vs_inductor")}
        out.update(weight_gb=weight, peak_gb=peak, shape=f"{r.get('shape')} {r.get('layers')}L")
        if base:
            out["tp1_x"] = r["tok_s"] / base["tok_s"]
            out["weight_vs_tp1"] = weight / max(base.get("weight_gb") or [0]) if base.get("weight_gb") else None
        table.append(out)
    print_table("tensor parallel: every TP size (largest per-GPU memory)", table,
                ["shape", "loop", "variant", "tp", "tok_s", "tp1_x", "vs_inductor", "weight_gb", "weight_vs_tp1", "peak_gb"])
    return table


def _us_per_call(call, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the microseconds per call of `calls` back-to-back calls of
    call(index), timed with CUDA events after a warm-up and a barrier (every rank starts together)."""
    for i in range(20):
        call(i)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            call(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _graph_us_per_call(call, repeats: int = 30) -> float:
    """Microseconds per call of COLLECTIVE_CALLS calls of call(index) recorded in one CUDA graph
    (warmed up on a side stream first), the graph replayed `repeats` times per timing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(4):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COLLECTIVE_CALLS):
            call(i)
    return _us_per_call(lambda i: graph.replay(), repeats) / COLLECTIVE_CALLS


def collectives(opts, rank: int, world: int) -> list[dict]:
    """The collectives loop's rows (see the module docstring); none where it cannot run."""
    from graphopt.ops import all_reduce as ops

    if not opts.device.startswith("cuda") or world < 2:
        if rank == 0:
            print("collectives: needs 2 or more CUDA GPUs (torchrun --nproc-per-node N on a GPU host); skipped", flush=True)
        return []
    group = dist.group.WORLD.group_name
    device = torch.device("cuda", torch.cuda.current_device())
    bf16 = torch.bfloat16
    ops.prepare_buffers(group, bf16, max(COLLECTIVE_BYTES) // bf16.itemsize, device)
    rows = []
    for nbytes in COLLECTIVE_BYTES:
        numel = nbytes // bf16.itemsize
        x = torch.randn(numel, device=device, dtype=bf16, generator=torch.Generator(device=device).manual_seed(rank))
        expected = x.clone()
        dist.all_reduce(expected)
        error = max(float((torch.ops.graphopt.all_reduce(x, group, slot) - expected).abs().max()) for slot in ops.SLOTS)
        zeros = torch.zeros_like(x)  # NCCL sums in place: zeros stay finite call after call

        def nccl(i):
            dist.all_reduce(zeros)

        def one_shot(i):
            torch.ops.graphopt.all_reduce(x, group, ops.SLOTS[i % len(ops.SLOTS)])

        row = dict(loop="collectives", variant="all-reduce", tp=world, bytes=nbytes, mode="-",
                   nccl_eager_us=_us_per_call(nccl, 300), nccl_graph_us=_graph_us_per_call(nccl),
                   one_shot_eager_us=_us_per_call(one_shot, 300), one_shot_graph_us=_graph_us_per_call(one_shot),
                   one_shot_max_err=error, matches_nccl=error <= 1e-2 * float(expected.abs().max()))
        row["graph_speedup"] = row["nccl_graph_us"] / row["one_shot_graph_us"]
        rows.append(row)
    if rank == 0:
        write_rows(opts, world, rows)
        print_table(f"all-reduce over {world} GPUs, bf16 sum, us per all-reduce", rows, COLLECTIVE_COLUMNS)
        print(f"wrote {result_path(opts, world)}", flush=True)
    return rows


def main() -> None:
    parsed = arguments().parse_args()
    if parsed.summarize is not None:
        summarize(parsed.summarize or sorted((Path(REPO) / "bench" / "results").glob(f"tensor_parallel_{gpu_slug()}_tp*.json")))
        return
    opts = resolve(parsed)
    if opts.device == "cpu":  # Inductor's OpenMP kernels beside aten's threads: see llama_models.resolve
        torch.set_num_threads(1)
    rank, world = start_processes(opts.device)
    rows: list[dict] = []
    try:
        if "collectives" in opts.loops:
            rows += collectives(opts, rank, world)
        model_loops = [loop for loop in opts.loops if loop != "collectives"]
        for shape in opts.shapes if model_loops else ():
            model = None
            for loop in model_loops:
                if model is None or "quantized-fp4" in opts.variants:  # the last loop left it quantized
                    model = None
                    fresh_start(opts.device)
                    model = parallelize_llama(build_model(shape, opts.device, opts.dtype, opts.attn, layers=opts.layers),
                                              world, opts.device)
                layers = model.config.num_hidden_layers
                prompt = random_prompt(model, opts.batch, opts.prompt)
                table, reference = [], None
                for variant in opts.variants:
                    row, tokens = run_variant(model, prompt, opts, loop, variant, world)
                    row = {"shape": shape, "layers": layers, "batch": opts.batch, **row}
                    if variant == "inductor":
                        reference = tokens
                    if tokens is not None and reference is not None:
                        row["identical"] = bool(torch.equal(tokens.cpu(), reference.cpu()))
                    table.append(row)
                    if rank == 0:  # after every variant: a run cut short keeps what it measured
                        print(f"{shape} tp={world} {loop} {variant}: {row.get('tok_s') or 0:.1f} tok/s"
                              f"{'  ' + row['error'] if 'error' in row else ''}", flush=True)
                        merged = write_rows(opts, world, rows + table)
                rows += table
                if rank == 0:
                    table = [r for r in merged if _key(r) == _key(table[0])]  # with rows of earlier invocations
                    print_table(f"tensor parallel {world}, LLaMA {shape} ({layers} layers), {loop}, batch {opts.batch}, "
                                f"prompt {opts.prompt}, {opts.new_tokens} new tokens, {opts.mode}", table, COLUMNS)
                    print(f"wrote {result_path(opts, world)}", flush=True)
            del model
            fresh_start(opts.device)
    finally:
        with contextlib.suppress(Exception):
            if world > 1:
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
