"""Probe (session 19): which CUDA kernels a LLaMA-7B-shaped 2-layer prefill runs with HF's SDPA
attention under Inductor, against HF's eager attention under graphopt (which rewrites it to one
graphopt::attention on cuDNN). Prints each variant's top kernels by GPU time (torch.profiler)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import graphopt  # noqa: E402,F401

length = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
common = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
              vocab_size=32000, num_hidden_layers=2, max_position_embeddings=length)
ids = torch.randint(0, 32000, (1, length), device="cuda")
for attention, backend in (("sdpa", "inductor"), ("sdpa", "graphopt"), ("eager", "graphopt")):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(attn_implementation=attention, **common)).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            compiled(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                compiled(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
    print(f"\n=== {attention} attention under {backend}, {length} tokens (5 steps) ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
    del model, compiled
    torch.cuda.empty_cache()
