"""Q4_0 weights x Q8_1 activations: ggml formats, torch references and Triton kernels.

Modules, in reading order:
  format.py    the ggml formats (`quantize_q4_0`, `quantize_q8_1` and their `dequantize_*`), the
               kernel layout of the weights (`pack_q4_0` / `unpack_q4_0`) and the torch references
               of the ops (`reference_q4_linear`, ...); plain torch.
  configs.py   `TileConfig`, the tile candidates per token count and the untuned defaults.
  kernels.py   the Triton GEMM (`_q4_gemm_kernel`: tensor cores, fused / separate / static
               activations) and decode (`_q4_gemv_kernel`: fp32 FMAs or dp4a) kernels.
  launcher.py  `q4_linear_triton`, `q4_q8_gemm_triton`, `q4_linear_static_triton`,
               `quantize_q8_1_triton`, `tma_linear`: check the inputs, allocate the outputs, launch
               the tile they are handed (`kernel_config` reads it from an op's kernel string).
  tune.py      the compile-time tuner (`tune_q4_linear`).
  decode_persistent.py  the persistent Gluon decode of 1-8 tokens (`q4_gemv_persistent`; sm_80+), a
               tuner candidate under CUDA graphs through graphopt::q4_gluon_linear.
Beside this package: q8_1.py (the Q8_1 quantize kernels these share with q4_tma.py) and q4_tma.py
(the Gluon TMA decode of the separate mode). The cost model of these kernels, and so the choice of
mode, is graphopt.cost.q4. Every name is importable from here.
"""

from graphopt.kernels.launch import INTERPRET
from graphopt.kernels.q4.configs import (DECODE_MAX_TOKENS, GEMV_MAX_ROWS, GEMV_MAX_TOKENS, PERSISTENT_MAX_OFFERED_TOKENS,
                                         PROGRAMS_PER_SM, REDUCE_MODES, TILE_KERNELS, TileConfig, candidate_configs,
                                         default_config, describe_configs, persistent_configs, swap_configs,
                                         tma_configs)
from graphopt.kernels.q4.format import (Q4_0_BLOCK_BYTES, Q8_1_BLOCK_BYTES, QK, SUPPORTED_ACT_DTYPES, _q8_1_parts,
                                        dequantize_packed, dequantize_q4_0, dequantize_q8_1, dequantized_q4_linear,
                                        pack_q4_0, quantize_q4_0, quantize_q8_1, quantize_weight, reference_q4_linear,
                                        reference_q4_linear_static, reference_q4_q8_gemm, static_quantize,
                                        static_result_dtype, unpack_q4_0, weight_sqnr_db)
from graphopt.kernels.q4.kernels import (ACT_FUSED, ACT_PREQUANTIZED, ACT_STATIC, _load_act_block, _q4_gemm_kernel,
                                         _q4_gemv_kernel)
from graphopt.kernels.q4.launcher import (_split_k, _tma_runs, kernel_config, persistent_linear, persistent_runs,
                                          q4_linear_static_triton, q4_linear_triton, q4_q8_gemm_triton,
                                          quantize_q8_1_triton, tma_linear)
from graphopt.kernels.q4.tune import tune_q4_linear
from graphopt.kernels.q8_1 import quantize_for_tma

__all__ = [
    "quantize_q4_0", "dequantize_q4_0", "quantize_q8_1", "dequantize_q8_1", "pack_q4_0", "unpack_q4_0",
    "dequantize_packed", "dequantized_q4_linear", "quantize_weight", "weight_sqnr_db", "reference_q4_linear", "reference_q4_q8_gemm",
    "reference_q4_linear_static", "quantize_q8_1_triton", "q4_linear_triton", "q4_q8_gemm_triton",
    "q4_linear_static_triton", "TileConfig", "candidate_configs", "default_config", "kernel_config", "tune_q4_linear",
    "QK", "Q4_0_BLOCK_BYTES", "Q8_1_BLOCK_BYTES", "SUPPORTED_ACT_DTYPES", "static_quantize", "static_result_dtype",
    "REDUCE_MODES", "TILE_KERNELS", "GEMV_MAX_ROWS", "GEMV_MAX_TOKENS", "DECODE_MAX_TOKENS", "PROGRAMS_PER_SM",
    "swap_configs", "tma_configs", "describe_configs", "ACT_PREQUANTIZED", "ACT_FUSED", "ACT_STATIC", "tma_linear",
    "quantize_for_tma", "INTERPRET", "PERSISTENT_MAX_OFFERED_TOKENS", "persistent_configs", "persistent_linear",
    "persistent_runs",
]
# Helpers the kernel tests reach through this package.
__all__ += ["_q8_1_parts", "_load_act_block", "_q4_gemm_kernel", "_q4_gemv_kernel", "_split_k", "_tma_runs"]
