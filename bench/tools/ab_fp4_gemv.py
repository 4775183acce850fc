"""Temporary A/B: old vs new FP4 CUDA-core decode kernel over the 1-token configs."""
import dataclasses
import torch
from graphopt.kernels import fp4, fp4_old
from graphopt.timing import cold_graph_ms, copies_for

cfgs = [c for c in fp4.DECODE_CONFIGS if c.block_m == 1]
for k, n in ((5120, 13824), (13824, 5120)):
    w = (torch.randn(n, k) * 0.02).cuda().bfloat16()
    q = fp4.quantize_fp4(w, "nvfp4")
    kws = [fp4.to_kernel_layout(q) for _ in range(min(16, copies_for(fp4.to_kernel_layout(q).nbytes)))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = fp4_old.fp4_linear_triton(x, kws[0].codes, kws[0].scales, kws[0].global_scale, None, n, k, "nvfp4", path="gemv").float()
    best = {}
    for cfg in cfgs:
        if not fp4._valid_config(cfg, "gemv", 1, n, kws[0].codes.shape[1] * 2, 16):
            continue
        line = []
        for name, mod, c in (("old", fp4_old, cfg), ("new", fp4, cfg), ("new+wc", fp4, dataclasses.replace(cfg, word_columns=True))):
            if name == "old":
                c = fp4_old.KernelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(fp4_old.KernelConfig)})
            run = lambda kw, mod=mod, c=c: mod.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, "nvfp4",
                                                                 path="gemv", config=c)
            err = (run(kws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
            ms = cold_graph_ms([lambda kw=kw: run(kw) for kw in kws], reps=20)
            best[name] = min(best.get(name, 9), ms)
            line.append(f"{name} {ms*1e3:5.1f}us{'' if err < 1e-2 else ' ERR'}")
        print(f"{k}->{n} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.split_k}: " + "  ".join(line), flush=True)
    print(f"{k}->{n} best: " + "  ".join(f"{a} {b*1e3:.1f}us" for a, b in best.items()), flush=True)
