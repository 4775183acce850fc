"""The `graphopt::*` custom ops: the single nodes that passes emit.

Each op is a `torch.library.custom_op` with a fake (meta) implementation, so Dynamo, AOTAutograd
and Inductor trace through it, and an autograd formula where the op is trainable. The CPU
implementation is always the kernel family's torch reference (correct and testable anywhere);
on CUDA the op runs the Triton kernel, or the library kernel the cost model chose.

One section per kernel family, in the order of graphopt/kernels/. Importing this module registers
every op; `graphopt/__init__.py` imports it.
"""

from __future__ import annotations

import torch  # noqa: F401  (sections below use it)

# ==== attention (graphopt/kernels/flash_attention.py, passes/attention.py) ====================
# ==== end attention ============================================================================

# ==== sparse_attention (graphopt/kernels/sparse_attention.py, passes/sparse_attention.py) ======
# ==== end sparse_attention =====================================================================

# ==== fp4 (graphopt/kernels/fp4.py, passes/fp4_linear.py) =====================================
# ==== end fp4 ==================================================================================

# ==== q4 (graphopt/kernels/q4.py, passes/q4_linear.py) ========================================
# ==== end q4 ===================================================================================

# ==== fft_chain (graphopt/kernels/fft_chain.py, passes/fft_linear.py) =========================
# ==== end fft_chain ============================================================================
