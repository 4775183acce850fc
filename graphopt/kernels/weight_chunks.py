"""Weights handled a chunk of rows at a time. The quantizers (fp4/format.py, q4/format.py) and
their weight-SQNR checks make fp32 and float64 temporaries several times a weight's bytes, which
for a LLaMA-3 lm_head (128256 x 4096) would be many GB at once; rows are independent in both."""

from __future__ import annotations

import math
from typing import Iterable

import torch

CHUNK_ELEMENTS = 1 << 24  # weights a quantizer or SQNR check works on at a time


def chunk_rows(row_length: int) -> int:
    """Rows of `row_length` elements to a chunk (at least one)."""
    return max(1, CHUNK_ELEMENTS // max(row_length, 1))


def sqnr_db_of_parts(parts: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """10 log10(sum ref^2 / sum (ref - approx)^2) in dB over (ref, approx) pairs, summed in float64:
    inf without noise, -inf for an infinite noise, NaN where a sum is NaN."""
    signal = noise = 0.0
    for ref, approx in parts:
        ref = ref.detach().to(torch.float64)
        signal += float(ref.square().sum())
        noise += float((ref - approx.detach().to(torch.float64)).square().sum())
    if noise == 0:
        return math.inf
    ratio = signal / noise
    return 10.0 * math.log10(ratio) if ratio > 0 else (ratio if math.isnan(ratio) else -math.inf)
