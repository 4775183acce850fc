"""Autotune configurations of the flash-attention kernels: block sizes, warps and stages per
(head dim, causal, bias kind, soft-capping, ALiBi, sequence bucket); one small block under
TRITON_INTERPRET=1."""

from __future__ import annotations

from graphopt.kernels.launch import INTERPRET as _INTERPRET
from graphopt.kernels.launch import next_power_of_2

try:
    import triton
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    triton = None


def _seq_bucket(length: int) -> int:
    """Autotune key for sequence length: the next power of two, clamped to [256, 16384]."""
    return min(max(next_power_of_2(max(length, 1)), 256), 16384)


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _fwd_configs():
    if _INTERPRET:
        return [_config(32, 16, 4, 1)]  # BLOCK_M != BLOCK_N exercises the causal diagonal logic
    return [
        _config(128, 64, 8, 3), _config(128, 64, 8, 4), _config(128, 64, 4, 3),
        _config(128, 128, 8, 3), _config(128, 128, 8, 2),
        _config(64, 64, 4, 3), _config(64, 64, 4, 4), _config(64, 32, 4, 2),
    ]


def _bwd_dkdv_configs():
    if _INTERPRET:
        return [_config(16, 32, 4, 1)]
    return [_config(32, 128, 4, 3), _config(64, 128, 8, 3), _config(64, 64, 4, 3), _config(32, 64, 4, 2)]


def _bwd_dq_configs():
    if _INTERPRET:
        return [_config(32, 16, 4, 1)]
    return [_config(128, 32, 4, 3), _config(128, 64, 8, 3), _config(64, 64, 4, 3), _config(64, 32, 4, 2)]


def _prune(configs, named_args, **kwargs):
    """Drop tiles that cannot pay off: fp32 tiles are twice as large (shared memory), and short
    sequences do not fill 128-row blocks."""
    kept = list(configs)
    if named_args["q_ptr"].element_size() == 4:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    if named_args["SEQ_BUCKET"] <= 256:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs[-1:]


_KEY = ["HEAD_DIM", "IS_CAUSAL", "BIAS_KIND", "SOFTCAP", "ALIBI", "SEQ_BUCKET"]
