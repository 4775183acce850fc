"""Compile graphopt's Triton kernels for sm_90 (H100/H200) on a machine without a GPU, and report
registers, stack (spills), shared memory and the instructions of the hot loop.

    python bench/offline_sm90.py sparse [--causal] [--partial-keys] [--host-descriptors] [--stages 2] [--warps 4] [--sequence] [--prologue]
    python bench/offline_sm90.py sparse-configs HEAD_DIM {bf16,fp16,fp32} [--causal] [--all]
    python bench/offline_sm90.py q4gemm BLOCK_M BLOCK_N PAIRS WARPS STAGES {fused,separate} [--swap]
    python bench/offline_sm90.py q4gemv ROWS BLOCK_N PAIRS WARPS {fused,separate}
    python bench/offline_sm90.py fp4gemv {fma,mma,int} BLOCK_M BLOCK_N BLOCK_K WARPS [--mxfp4] [--permute-x]
    python bench/offline_sm90.py persistent {nvfp4,mxfp4,q4_0} ROWS WARPS K [--depth D] [--tokens T]
    python bench/offline_sm90.py pool SLICE_ELEMENTS WARPS LOOP_STAGES

`sparse` builds the block-sparse attention kernel's single-loop body (D=128, bf16, 128 x 64 tiles,
TMA) and prints the SASS instructions per thread of its unmasked tile loop; --sequence prints the order of its TMA loads, barrier waits and MMAs in the TTGIR (how many
load latencies run one after another); --prologue the global and TMA loads and barrier waits
before the first MMA, in SASS order (the memory round trips a program makes before its first tile). `sparse-configs` builds every autotune config the block-sparse attention kernel keeps for a
head dim and dtype on an aligned sm_90 launch (--all: the whole space, unpruned; Lk not a multiple
of the key block) and prints each one's ptxas time, registers, spills and SASS size. `q4gemm` builds the Q4_0 x Q8_1 tensor-core GEMM with the
activations fused (bf16 in) or pre-quantized (Q8_1 blocks in), and prints the innermost loop's
SASS instructions per thread and the warp-instructions per output element and K value
(loop instructions x warps / (BLOCK_M x BLOCK_N x 64 x PAIRS)), and per weight value
(loop instructions x warps / (BLOCK_N x 64 x PAIRS)), the figure that matters for decode, where
BLOCK_M covers every token. --swap builds the operand-swapped decode variant (the "swap" configs)
and prints how its dots are lowered (warpgroup MMA with A from registers, or not). `q4gemv` builds
the dp4a decode kernel (ROWS token rows per program) and prints its K loop's SASS instructions per
thread and per 32-bit weight word. `fp4gemv` builds an FP4 decode kernel (CUDA-core FMA, tensor-core
or integer-dot, BLOCK_M tokens per program, bf16 activations) and prints the same per-word figure.
`persistent` builds a persistent decode (fp4/ or q4/decode_persistent.py; ROWS
rows per warp, K input features) and prints its group loop's SASS instructions per thread and per
code word. `pool` builds the sparse predictor's pooling launch (D=128, bf16, 128-token query and 64-token key
blocks) and prints its registers (which bound how many programs an SM holds) and its global loads.

Uses the installed triton's bundled cuobjdump / nvdisasm; the figures depend on the triton version
(a figure holds for the version it was built with).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_sm90(fn, types: dict, constexprs: dict, div16: list[str], num_warps: int, num_stages: int = 1,
                 gluon: bool = False, maxnreg: int | None = None):
    """Build `fn` (a @triton.jit kernel, or with `gluon` a @gluon.jit one) for sm_90 without a GPU:
    `types` maps argument names to Triton type strings (the rest are i32), `div16` names the
    arguments declared divisible by 16; `maxnreg`: ptxas's register cap. The offline-build tests use it too."""
    names = fn.arg_names
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in names and n not in constexprs}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def sass_and_resources(kernel) -> tuple[str, str]:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([f"{bindir}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{bindir}/nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    resources = " ".join(re.findall(r"(REG:\d+|STACK:\d+)", usage)) + f" shared:{kernel.metadata.shared}"
    return sass, resources


def loops(sass: str) -> list[tuple[str, int, list]]:
    """(label, instructions, most common opcodes) of every backward branch's body."""
    label_at, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            label_at[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            ins.append((m.group(2), m.group(3)))
    out = []
    for i, (op, rest) in enumerate(ins):
        target = re.search(r"(\.L_x_\d+)", rest) if op.startswith("BRA") else None
        if target and label_at.get(target.group(1), 1 << 30) < i:
            body = [o for o, _ in ins[label_at[target.group(1)]:i + 1]]
            out.append((target.group(1), len(body), collections.Counter(body).most_common(int(os.environ.get("TOP_OPS", "8")))))
    return out


def print_word_loop(sass: str, words_per_thread: float) -> None:
    """A decode kernel's K loop (the last backward branch; inner loops unroll): instructions per
    thread per step and per 32-bit weight word (words_per_thread of them per step)."""
    body = loops(sass)
    if body:
        label, count, top = body[-1]
        print(f"  K loop {label}: {count} instructions per thread per step, {count / words_per_thread:.1f} per "
              f"weight word; top {top}")


def last_loop(sass: str) -> tuple[str, str]:
    """(the code before the last loop, the loop's body up to its backward branch): a persistent
    kernel's prologue and group loop."""
    label = loops(sass)[-1][0]
    start = sass.index(label + ":")
    body = sass[start:]
    return sass[:start], body[:body.index(label, len(label) + 1)]


def print_before_loop(sass: str) -> None:
    """The instructions a program runs before its last loop (a persistent kernel's group loop): its
    prologue, which every program of the grid pays once."""
    before = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)",
                                              last_loop(sass)[0], re.M)]
    counts = collections.Counter(op.split(".")[0] for op in before)
    print(f"  before the group loop: {len(before)} instructions; BAR {counts['BAR']}, SHFL {counts['SHFL']}, "
          f"MUFU {counts['MUFU']}, LDG {counts['LDG']}")


def print_prologue(sass: str) -> None:
    """A program's memory operations and barrier waits before its first warpgroup MMA, in code
    order: the loads a program waits on, one after another, before its first tile can start."""
    print("  before the first MMA (global loads, TMA loads, barrier waits):")
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]+)(.*?);", line)
        if not m:
            continue
        address, predicate, op, rest = m.groups()
        if op.startswith("HGMMA"):
            break
        if op.startswith(("LDG", "UTMALDG", "SYNCS.PHASECHK")):
            print(f"    {address}  {predicate}{op}{rest}")


def sparse(args) -> None:
    from graphopt.kernels import sparse_attention as sa

    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, IS_CAUSAL=args.causal, PV_SKIP=False,
                  PV_PER_HEAD=False, DOT_PRECISION="tf32", PREFETCH_INDEX=1, USE_TMA=1, PAIR_BLOCKS=0, SINGLE_LOOP=True,
                  PARTIAL_KEYS=args.partial_keys, HOST_DESCRIPTORS=args.host_descriptors,
                  MERGED_SUFFIX=args.merged_suffix)
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", lut_ptr="*i32", count_ptr="*i32",
                 pv_thresh_ptr="*fp32", pv_thresh="fp32", qk_scale="fp32")
    if args.host_descriptors:  # the launcher's descriptors over all heads' rows
        types.update(q_hdesc="tensordesc<bf16[128,128]>", k_hdesc="tensordesc<bf16[64,128]>",
                     v_hdesc="tensordesc<bf16[64,128]>", o_hdesc="tensordesc<bf16[128,128]>")
    else:
        consts.update(q_hdesc=None, k_hdesc=None, v_hdesc=None, o_hdesc=None)
    fn = sa._sparse_attention_kernel
    div16 = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("stride_") and not n.endswith("b"))]
    kernel = compile_sm90(fn, types, consts, div16, args.warps, args.stages)
    sass, resources = sass_and_resources(kernel)
    print(f"sparse single loop causal={args.causal} partial_keys={args.partial_keys} "
          f"host_descriptors={args.host_descriptors} warps={args.warps} stages={args.stages}: {resources}")
    # the unmasked tile loop: the smallest loop with warpgroup MMAs (the others are the masked
    # suffix's loop, barrier-wait spins, and branches spanning both loops)
    tile_loops = [(count, label, top) for label, count, top in loops(sass) if any(op.startswith("HGMMA") for op, _ in top)]
    if tile_loops:
        count, label, top = min(tile_loops)
        print(f"  unmasked tile loop {label}: {count} instructions per thread per tile; top {top}")
    if args.prologue:
        print_prologue(sass)
    if args.sequence:
        wanted = r"(ttng\.async_tma_copy_global_to_local|ttng\.wait_barrier|ttng\.warp_group_dot |scf\.for|scf\.if)"
        for line in kernel.asm["ttgir"].splitlines():
            m = re.search(wanted, line)
            if m:
                print(" " * (len(line) - len(line.lstrip())) + m.group(1))


def sparse_config_builds(head_dim: int, dtype: str, causal: bool = False, pruned: bool = True):
    """Build the block-sparse attention kernel for sm_90 once per autotune config (those the
    pruning keeps for an aligned Hopper launch, or all of them) and yield (config, ptxas seconds,
    resources, SASS instructions). The offline-build tests use it too."""
    import time

    from triton.backends.nvidia.compiler import CUDABackend

    from graphopt.kernels.sparse_attention import attention_kernel as ak

    configs = ak._attention_configs()
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if dtype == "fp32" else "tf32"
    if pruned:
        configs = ak._kept_configs(configs, head_dim, precision, tma_kv=True,
                                   single_loop=ak._single_loop_body_supported(head_dim, False))
    types = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", o_ptr=f"*{dtype}", lut_ptr="*i32",
                 count_ptr="*i32", pv_thresh_ptr="*fp32", pv_thresh="fp32", qk_scale="fp32")
    fn = ak._sparse_attention_kernel
    div16 = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("stride_") and not n.endswith("b"))]
    ptxas_seconds = []
    make_cubin = CUDABackend.make_cubin

    def timed_make_cubin(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return make_cubin(self, *args, **kwargs)
        finally:
            ptxas_seconds.append(time.perf_counter() - start)

    CUDABackend.make_cubin = timed_make_cubin
    try:
        for config in configs:
            meta = dict(PREFETCH_INDEX=1, USE_TMA=0, PAIR_BLOCKS=0, SINGLE_LOOP=0, MERGED_SUFFIX=0) | config.kwargs
            consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=128, BLOCK_N=64, IS_CAUSAL=causal, PV_SKIP=False,
                          PV_PER_HEAD=False, DOT_PRECISION=precision, PARTIAL_KEYS=True, HOST_DESCRIPTORS=False,
                          TMA_ELIGIBLE=2 if meta["SINGLE_LOOP"] else 1, q_hdesc=None, k_hdesc=None, v_hdesc=None,
                          o_hdesc=None, **meta)
            ptxas_seconds.clear()
            kernel = compile_sm90(fn, types, consts, div16, config.num_warps, config.num_stages)
            sass, resources = sass_and_resources(kernel)
            instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+.*;", sass, flags=re.M))
            yield config, sum(ptxas_seconds), resources, instructions
    finally:
        CUDABackend.make_cubin = make_cubin


def sparse_configs(args) -> None:
    for config, seconds, resources, instructions in sparse_config_builds(args.head_dim, args.dtype, args.causal,
                                                                         pruned=not args.all):
        print(f"triton {triton.__version__} D={args.head_dim} {args.dtype} causal={args.causal} "
              f"warps={config.num_warps} stages={config.num_stages} {config.kwargs}: ptxas {seconds:.1f} s, "
              f"{resources}, {instructions} SASS instructions", flush=True)


def q4gemm(args) -> None:
    from graphopt.kernels import q4

    fused = args.mode == "fused"
    types = dict(a_ptr="*bf16" if fused else "*i8", ad_ptr="*fp16", w_ptr="*u8", ws_ptr="*fp16", bias_ptr="*bf16",
                 out_ptr="*bf16", acc_ptr="*fp32", counter_ptr="*fp32")
    consts = dict(ACT_MODE=q4.ACT_FUSED if fused else q4.ACT_PREQUANTIZED, QUOT_DTYPE=tl.float32, QMIN=-128, QMAX=127,
                  HAS_BIAS=False, REDUCE=0, EXACT=False, BLOCK_M=args.block_m, BLOCK_N=args.block_n, PAIRS=args.pairs,
                  SWAP_AB=args.swap, USE_ASM=True)
    div16 = ["M", "N", "K", "a_ptr", "w_ptr", "ws_ptr", "out_ptr", "stride_am", "stride_wn", "stride_wsb", "stride_om"]
    kernel = compile_sm90(q4._q4_gemm_kernel, types, consts, div16, args.warps, args.stages)
    sass, resources = sass_and_resources(kernel)
    print(f"q4 {'swap' if args.swap else 'gemm'} {args.mode} {args.block_m}x{args.block_n} pairs={args.pairs} "
          f"warps={args.warps} stages={args.stages}: {resources}")
    for line in kernel.asm["ttgir"].splitlines():
        m = re.search(r"ttng\.warp_group_dot %\S+, %\S+, %\S+.*?: (tensor<|!ttg\.memdesc<)", line)
        if m:
            print(f"  dot: warpgroup MMA, A from {'registers' if m.group(1) == 'tensor<' else 'shared memory'}")
            break
        if re.search(r"\btt\.dot ", line):
            print("  dot: tt.dot (mma.sync, not a warpgroup MMA)")
            break
    body = loops(sass)
    if body:  # the innermost (K) loop is the first backward branch
        label, count, top = body[0]
        per_value = count * args.warps / (args.block_m * args.block_n * 64 * args.pairs)
        per_weight = count * args.warps / (args.block_n * 64 * args.pairs)
        print(f"  K loop {label}: {count} instructions per thread per step, {per_value:.4f} warp-instructions per "
              f"output element and K value, {per_weight:.4f} per weight value; top {top}")


def q4gemv(args) -> None:
    from graphopt.kernels import q4

    fused = args.mode == "fused"
    types = dict(x_ptr="*bf16" if fused else "*i32", w_ptr="*i32", ws_ptr="*fp16", bias_ptr="*bf16", out_ptr="*bf16",
                 acc_ptr="*fp32", counter_ptr="*fp32")
    consts = dict(HAS_BIAS=False, REDUCE=3, EXACT=False, USE_DP4A=True, USE_ASM=True, PREQUANTIZED=not fused,
                  ROWS=args.rows, BLOCK_N=args.block_n, CHUNK=args.pairs)
    div16 = ["N", "K", "x_ptr", "w_ptr", "ws_ptr", "out_ptr", "stride_xm", "stride_wn", "stride_wsb", "stride_om"]
    kernel = compile_sm90(q4._q4_gemv_kernel, types, consts, div16, args.warps, 1)
    sass, resources = sass_and_resources(kernel)
    print(f"q4 dp4a {args.mode} rows={args.rows} block_n={args.block_n} pairs={args.pairs} warps={args.warps} "
          f": {resources}")
    print_word_loop(sass, args.block_n * args.pairs * 8 / (32 * args.warps))


def fp4gemv(args) -> None:
    from graphopt.kernels import fp4

    fn = {"fma": fp4._fp4_gemv_words_kernel, "mma": fp4._fp4_gemv_words_mma_kernel, "int": fp4._fp4_gemv_int_kernel}[
        args.variant]
    types = dict(x_ptr="*bf16", words_ptr="*i32", scales_ptr="*u8", global_scale_ptr="*fp32", bias_ptr="*bf16",
                 out_ptr="*bf16", ws_ptr="*fp32", counter_ptr="*fp32")
    nvfp4 = not args.mxfp4
    consts = dict(IS_NVFP4=nvfp4, HAS_BIAS=False, BLOCK_SIZE=16 if nvfp4 else 32, BLOCK_M=args.block_m,
                  BLOCK_N=args.block_n, WORDS_PER_ITER=args.block_k // 8, SPLIT_K=2, USE_ASM=True,
                  UPCAST_DOT=False, DIRECT_BF16=nvfp4, X_PERMUTED=args.permute_x)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    div16 = ["x_ptr", "words_ptr", "scales_ptr", "out_ptr", "ws_ptr", "K", "K_PADDED", "N", "stride_xm", "stride_wn",
             "stride_sn", "stride_om"]
    kernel = compile_sm90(fn, types, consts, div16, args.warps, args.stages)
    sass, resources = sass_and_resources(kernel)
    print(f"fp4 stages={args.stages} {args.variant} {'nvfp4' if nvfp4 else 'mxfp4'} block_m={args.block_m} block_n={args.block_n} "
          f"block_k={args.block_k} warps={args.warps}: {resources}")
    print_word_loop(sass, args.block_n * args.block_k / 8 / (32 * args.warps))


def persistent(args) -> None:
    from graphopt.kernels.fp4 import decode_persistent as fp4_persistent
    from graphopt.kernels.q4 import decode_persistent as q4_persistent

    k_chunks, chunks_pad = fp4_persistent.chunks(args.k, args.warps)
    consts = dict(HAS_BIAS=False, ROWS=args.rows, WARPS=args.warps, K_CHUNKS=k_chunks, CHUNKS_PAD=chunks_pad,
                  DEPTH=args.depth)
    if args.format == "q4_0":
        fn = q4_persistent._q4_gemv_persistent_kernel
        types = dict(x_ptr="*bf16", words_ptr="*u8", scales_ptr="*fp16", bias_ptr="*bf16", out_ptr="*bf16")
        consts["TOKENS"] = 1 << (args.tokens - 1).bit_length()  # the launch pads the count to a power of two
    else:
        fn = fp4_persistent._fp4_gemv_persistent_kernel
        types = dict(x_ptr="*bf16", words_ptr="*u8", scales_ptr="*u8", global_scale_ptr="*fp32", bias_ptr="*bf16",
                     norm_ptr="*bf16", residual_ptr="*bf16", out_ptr="*bf16", norm_eps="fp32")
        # as the launcher builds it on an sm_90 GPU for N a multiple of the group (LLaMA's layers)
        consts.update(IS_NVFP4=args.format == "nvfp4", EVEN=k_chunks * fp4_persistent.CHUNK_WORDS * 8 == args.k,
                      E4M3_CVT=True, GATED="silu_gate" in args.fused, NORM="rms_norm" in args.fused,
                      HAS_RESIDUAL="residual" in args.fused, DEPENDENT=True)
    div16 = [n for n in ("x_ptr", "words_ptr", "scales_ptr", "out_ptr", "norm_ptr", "residual_ptr", "K", "K_WORDS", "N",
                         "stride_wn", "stride_sn", "stride_sb", "stride_xm", "stride_om") if n in fn.arg_names]
    kernel = compile_sm90(fn, types, consts, div16, args.warps, gluon=True)
    sass, resources = sass_and_resources(kernel)
    print(f"persistent {args.format} rows={args.rows} warps={args.warps} K={args.k} depth={args.depth} "
          f"tokens={args.tokens}: {resources}")
    # the group loop holds every chunk of a row, unrolled: rows x 4 words per lane and chunk
    print_word_loop(sass, args.rows * 4 * k_chunks)
    print_before_loop(sass)


def pool(args) -> None:
    from graphopt.kernels import sparse_attention as sa

    fn = sa._pool_blocks_kernel
    sub = max(1, args.slice_elements // 128)
    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, SUB_M=min(sub, 128), SUB_N=min(sub, 64),
                  stride_qd=1, stride_kd=1)  # the launcher's unit strides, which Triton specializes as constants
    if "LOOP_STAGES" in fn.arg_names:  # the pipelined slice loop's depth
        consts["LOOP_STAGES"] = args.loop_stages
    div16 = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("stride_") and not n.endswith("d"))]
    kernel = compile_sm90(fn, dict(q_ptr="*bf16", k_ptr="*bf16", work_ptr="*fp32"), consts, div16, args.warps, 1)
    sass, resources = sass_and_resources(kernel)
    loads = collections.Counter(re.findall(r"\b(LDG[.A-Z0-9]*|LDGSTS[.A-Z0-9]*)", sass))
    print(f"pool slice_elements={args.slice_elements} warps={args.warps} loop_stages={args.loop_stages}: "
          f"{resources}; global loads in the code {dict(loads)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kernel", required=True)
    p = sub.add_parser("sparse")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--partial-keys", action="store_true")
    p.add_argument("--host-descriptors", action="store_true", help="the launcher's descriptors (HOST_DESCRIPTORS)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--sequence", action="store_true")
    p.add_argument("--prologue", action="store_true", help="the loads and waits before the first MMA")
    p.add_argument("--merged-suffix", action="store_true", help="masked tiles in the main loop (MERGED_SUFFIX)")
    p = sub.add_parser("sparse-configs")
    p.add_argument("head_dim", type=int)
    p.add_argument("dtype", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--all", action="store_true", help="every config of the search space, unpruned")
    p = sub.add_parser("q4gemm")
    for name in ("block_m", "block_n", "pairs", "warps", "stages"):
        p.add_argument(name, type=int)
    p.add_argument("mode", choices=("fused", "separate"))
    p.add_argument("--swap", action="store_true")
    p = sub.add_parser("q4gemv")
    for name in ("rows", "block_n", "pairs", "warps"):
        p.add_argument(name, type=int)
    p.add_argument("mode", choices=("fused", "separate"))
    p = sub.add_parser("fp4gemv")
    p.add_argument("variant", choices=("fma", "mma", "int"))
    for name in ("block_m", "block_n", "block_k", "warps"):
        p.add_argument(name, type=int)
    p.add_argument("--mxfp4", action="store_true")
    p.add_argument("--permute-x", action="store_true", help="mma: activations pre-permuted (X_PERMUTED)")
    p.add_argument("--stages", type=int, default=1, help="num_stages (the launcher uses 1)")
    p = sub.add_parser("persistent")
    p.add_argument("format", choices=("nvfp4", "mxfp4", "q4_0"))
    for name in ("rows", "warps", "k"):
        p.add_argument(name, type=int)
    p.add_argument("--depth", type=int, default=1, help="chunks loaded ahead")
    p.add_argument("--tokens", type=int, default=1, help="q4_0: tokens per launch")
    p.add_argument("--fused", default="", help="fp4: neighbours taken in, comma-separated (rms_norm, silu_gate, residual)")
    p = sub.add_parser("pool")
    for name in ("slice_elements", "warps", "loop_stages"):
        p.add_argument(name, type=int)
    args = parser.parse_args()
    {"sparse": sparse, "sparse-configs": sparse_configs, "q4gemm": q4gemm, "q4gemv": q4gemv, "fp4gemv": fp4gemv,
     "persistent": persistent, "pool": pool}[args.kernel](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
