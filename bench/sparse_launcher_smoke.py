"""GPU smoke check of the attention launchers, and the predictor's host time per call.

Keep-all sparse attention (simthreshd1=-1, cdfthreshd=1) and the dense flash kernel against SDPA
(max abs difference, bf16, B=1, H=4, L=1024, D=128, causal and not), then `predict_block_lut`
issued 300 times back to back with no sync: its GPU work is negligible at this size, so the time
per call is the host's (three launches). Session 15 ran it on the H100 after the launchers' device
capability query was cached (bench/results/sparse_launcher_smoke_h100.log).
"""
import time

import torch

from graphopt.kernels import flash_attention as fa
from graphopt.kernels import sparse_attention as sa

q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    out = sa.sparse_attention(q, k, v, is_causal=causal, simthreshd1=-1.0, cdfthreshd=1.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    print("sparse keep-all vs SDPA", causal, (out.float() - ref.float()).abs().max().item())
    o2 = fa.flash_attention(q, k, v, is_causal=causal)
    print("flash vs SDPA", causal, (o2.float() - ref.float()).abs().max().item())

    def predict(causal=causal):
        return sa.predict_block_lut(q, k, is_causal=causal)
    predict()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(300):
        predict()
    torch.cuda.synchronize()
    print("predictor host us per call (3 launches, tiny GPU work)", causal,
          round((time.perf_counter() - start) / 300 * 1e6, 1))
