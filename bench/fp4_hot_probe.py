import sys, torch, json
sys.path.insert(0, ".")
from graphopt.kernels import fp4
from graphopt.kernels.fp4 import KernelConfig
from graphopt.timing import cold_graph_ms
rows = json.load(open("bench/results/fp4_decode_h100_joined_sweep.json"))["rows"]
for r in rows:
    if "config" not in r: continue
    k, n = map(int, r["shape"].split("->"))
    cfg = KernelConfig(**r["config"])
    fp4._MMA_DECODE = "joined" if r["kernel"] == "joined-mma" else "per-position"
    w = torch.randn(n, k, device="cuda") * 0.02
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, "nvfp4"))
    x = torch.randn(r["tokens"], k, device="cuda", dtype=torch.bfloat16)
    run = lambda: fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, "nvfp4", path="gemv", config=cfg)
    hot = cold_graph_ms([run] * 8, reps=20)
    print(f"{r['shape']} m={r['tokens']} {r['kernel']} {r['tile']}: cold {r['ms']*1e3:.1f} us, hot (L2) {hot*1e3:.1f} us", flush=True)
