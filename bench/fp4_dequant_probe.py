import sys, torch, torch.nn.functional as F
sys.path.insert(0, ".")
from graphopt.kernels import fp4
from triton.testing import do_bench
for k, n in ((4096, 11008), (4096, 14336), (13824, 5120), (5120, 13824), (4096, 4096), (11008, 4096)):
    w = torch.randn(n, k, device="cuda") * 0.02
    kw = fp4.to_kernel_layout(fp4.quantize_fp4(w, "nvfp4"))
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    wb = w.to(torch.bfloat16)
    deq = lambda: fp4.dequantize_triton(kw.codes, kw.scales, kw.global_scale, n, k, "nvfp4", torch.bfloat16)
    wd = deq()
    t_deq = do_bench(deq, warmup=25, rep=100, return_mode="median")
    t_lin = do_bench(lambda: F.linear(x, wb), warmup=25, rep=100, return_mode="median")
    t_lin_d = do_bench(lambda: F.linear(x, wd), warmup=25, rep=100, return_mode="median")
    t_path = do_bench(lambda: fp4.fp4_linear_triton(x, kw.codes, kw.scales, kw.global_scale, None, n, k, "nvfp4", path="dequant"), warmup=25, rep=100, return_mode="median")
    gb = (kw.nbytes + 2 * n * k) / 1e9
    print(f"{k}->{n}: dequant {t_deq*1e3:.1f} us ({gb / (t_deq*1e-3):.0f} GB/s), linear(model W) {t_lin*1e3:.1f} us, linear(dequantized W) {t_lin_d*1e3:.1f} us, dequant path {t_path*1e3:.1f} us", flush=True)
