"""FP4 (e2m1) weights: the MXFP4 and NVFP4 formats, and Triton weight-only GEMMs that read them.

Modules, in reading order:
  format.py    the formats (`quantize_fp4` / `dequantize_fp4`, `Fp4Tensor`), the kernel layout
               (`to_kernel_layout` / `from_kernel_layout`, `Fp4KernelWeight`) and the torch
               reference of graphopt::fp4_linear (`reference_fp4_linear`); plain torch.
  gptq.py      GPTQ-style quantization (`quantize_fp4_gptq`) and model calibration (`calibrate_fp4`);
               plain torch.
  configs.py   `KernelConfig`, the tile candidates and defaults, and which tile runs which shape.
  common.py, decode.py, prefill.py
               the Triton kernels: decode ("gemv": CUDA-core, integer-dot and tensor-core word-tile
               kernels), prefill ("gemm": fused dequant-GEMM; "dequant": dequantize, then cuBLAS).
  launcher.py  `fp4_linear_triton`, `fp4_linear`, `dequantize_triton`: check the inputs, allocate the
               outputs, launch the path and tile they are handed (`kernel_choice` reads them from the
               op's kernel string).
  tune.py      the compile-time tuner (`tune_config`, `tune_fp4_linear`).
fp4_tma.py (beside this package) is the Gluon TMA decode on the same layout. The cost model of
these kernels, and so the choice of path, is graphopt.cost.fp4. Every name is importable from here.
"""

from graphopt.kernels.fp4.configs import (DECODE_CONFIGS, DEQUANT_CONFIG, DEQUANT_TILES, FMA_BLOCK_M, INT_BLOCK_M,
                                          INTERPRET_DECODE_CONFIG, INTERPRET_PREFILL_CONFIG, MIN_DECODE_BLOCK_N,
                                          MMA_BLOCK_M, PATHS, PREFILL_CONFIGS, KernelConfig, _candidates,
                                          _runs_here, _token_bucket, _valid_config, _worth_timing, default_path)
from graphopt.kernels.fp4.format import (BLOCK_SIZES, E2M1_MAX, E2M1_VALUES, E4M3_MAX, FORMATS, KERNEL_K_MULTIPLE,
                                         Fp4KernelWeight, Fp4Tensor, _best_scale_candidate, _check_format, _padded_k,
                                         block_decode_scales, dequantize_fp4, dequantize_kernel_layout,
                                         e2m1_values, fp4_weight_bytes, from_kernel_layout, pack_nibbles,
                                         quantize_fp4, reference_fp4_linear, round_to_e2m1_codes, sqnr_db,
                                         to_kernel_layout, unpack_nibbles, weight_sqnr_db)
from graphopt.kernels.fp4.gptq import GPTQ_CHUNK, GPTQ_DAMP, _linear_groups, calibrate_fp4, quantize_fp4_gptq
from graphopt.kernels.fp4.launcher import (_launch, default_config, dequantize_triton, fp4_linear, fp4_linear_triton,
                                           kernel_choice, kernel_string, permuted_activations, triton)
from graphopt.kernels.fp4.tune import NoCorrectTile, _cold_decode_timer, tune_config, tune_fp4_linear

__all__ = [
    "FORMATS", "BLOCK_SIZES", "E2M1_MAX", "E4M3_MAX", "E2M1_VALUES", "KERNEL_K_MULTIPLE", "Fp4Tensor",
    "Fp4KernelWeight", "quantize_fp4", "dequantize_fp4", "block_decode_scales", "round_to_e2m1_codes", "e2m1_values",
    "pack_nibbles", "unpack_nibbles", "sqnr_db", "weight_sqnr_db", "to_kernel_layout", "from_kernel_layout", "dequantize_kernel_layout",
    "fp4_weight_bytes", "reference_fp4_linear", "GPTQ_CHUNK", "GPTQ_DAMP", "quantize_fp4_gptq", "calibrate_fp4",
    "KernelConfig", "PATHS", "FMA_BLOCK_M", "INT_BLOCK_M", "MMA_BLOCK_M", "MIN_DECODE_BLOCK_N", "DECODE_CONFIGS",
    "PREFILL_CONFIGS", "INTERPRET_DECODE_CONFIG", "INTERPRET_PREFILL_CONFIG", "DEQUANT_CONFIG", "DEQUANT_TILES",
    "default_path", "default_config", "dequantize_triton", "permuted_activations", "kernel_choice", "kernel_string",
    "fp4_linear_triton", "fp4_linear", "tune_config", "tune_fp4_linear", "NoCorrectTile",
]

# Helpers the kernel tests and benchmarks reach through this package (the cost model imports _padded_k).
__all__ += ["_candidates", "_runs_here", "_token_bucket", "_valid_config", "_worth_timing", "_best_scale_candidate",
            "_check_format", "_padded_k", "_linear_groups", "_launch", "_cold_decode_timer"]

if triton is not None:  # the Triton helpers the kernel tests build their own kernels from
    from graphopt.kernels.fp4.common import _block_scales
    from graphopt.kernels.fp4.decode import (_bf16_scale_pair, _bf16_scaled_pair, _decode_shift, _dp2a,
                                             _e2m1_int8_lanes, _e2m1_pair_bits, _fp4_gemv_int_kernel,
                                             _fp4_gemv_words_kernel, _fp4_gemv_words_mma_kernel)
    from graphopt.kernels.fp4.prefill import _fp4_dequantize_kernel, _fp4_gemm_kernel

    __all__ += ["_block_scales", "_bf16_scale_pair", "_bf16_scaled_pair", "_decode_shift", "_dp2a", "_e2m1_int8_lanes",
                "_e2m1_pair_bits", "_fp4_gemv_int_kernel", "_fp4_gemv_words_kernel", "_fp4_gemv_words_mma_kernel",
                "_fp4_dequantize_kernel", "_fp4_gemm_kernel"]
