"""ONNX: graphopt::attention as the standard opset-23 Attention operator."""

from __future__ import annotations

import importlib

import torch

from graphopt.onnx_registry import register_onnx_translation

# ---------------------------------------------------------------------------------------------
# ONNX: the standard opset-23 Attention operator
# ---------------------------------------------------------------------------------------------
# One known difference: a query row whose every key is masked by a large negative additive bias
# (HF's finfo.min padding mask on a left-padded row) gets the mean of V from PyTorch (a softmax of
# equal scores) and zeros from onnxruntime's Attention (1.32). Such rows are padding, which
# models ignore; every row with at least one visible key matches.
def register() -> None:
    """Register the translation (where onnxscript is installed)."""
    importlib.import_module("graphopt.ops")  # registers graphopt::attention, which the translation names
    try:
        from onnxscript import opset23 as op
    except Exception:  # onnxscript missing or too old: export of this op reports it
        return

    @register_onnx_translation(torch.ops.graphopt.attention.default, form="standard")
    def attention_to_onnx(q, k, v, bias=None, scale: float = 1.0, is_causal: bool = False, num_kv_groups: int = 1,
                          backend: str = "", softcap: float = 0.0, alibi_slopes=None):
        # 4-D inputs (B, H, L, D): ONNX reads the head counts from the shapes (q_num_heads /
        # kv_num_heads are only for 3-D inputs); GQA follows from K having fewer heads.
        # Attention has four outputs (Y, present_key, present_value, qk_matmul_output); Y is ours.
        # Its softcap attribute caps the scores as ours does. (The attention pass emits no ALiBi
        # slopes for export: there ALiBi stays part of the bias.)
        if alibi_slopes is not None:
            raise ValueError("graphopt::attention with alibi_slopes has no ONNX Attention form; export keeps ALiBi a bias")
        extra = {"softcap": float(softcap)} if softcap else {}
        if bias is None:
            y, _, _, _ = op.Attention(q, k, v, is_causal=int(is_causal), scale=float(scale), **extra)
        else:
            y, _, _, _ = op.Attention(q, k, v, bias, is_causal=int(is_causal), scale=float(scale), **extra)
        return y
