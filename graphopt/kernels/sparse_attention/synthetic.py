"""Synthetic inputs with real block structure, for tests, tuner checks and benchmarks."""

from __future__ import annotations

import math

import torch


def local_sink_qkv(
    batch: int, heads: int, length: int, head_dim: int, *, window: int = 256, sink: int = 64, noise: float = 0.3,
    seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, L, D) whose attention is local (a band of roughly `window` tokens: q and k
    share sinusoidal position features with periods from 2*window to 32*window) plus a sink (the
    first `sink` keys carry a feature every query matches), with Gaussian token noise. Neighbouring
    tokens are similar, so blocks are self-similar, as in trained language models."""
    gen = torch.Generator().manual_seed(seed)
    n_freq = (head_dim - 2) // 2
    pos = torch.arange(length, dtype=torch.float64)
    periods = torch.logspace(math.log10(2 * window), math.log10(32 * window), n_freq, dtype=torch.float64)
    angles = 2 * math.pi * pos[:, None] / periods[None, :]
    features = torch.cat([angles.cos(), angles.sin()], -1) * math.sqrt(14 * math.sqrt(head_dim) / n_freq)  # (L, 2F)
    q = torch.zeros(batch, heads, length, head_dim, dtype=torch.float64)
    k = torch.zeros_like(q)
    q[..., : 2 * n_freq] = features
    k[..., : 2 * n_freq] = features
    sink_amplitude = math.sqrt(10 * math.sqrt(head_dim))  # sink logit 10 vs 14 at the band centre
    q[..., -1] = 0.5 * sink_amplitude
    k[..., :sink, -1] = 2 * sink_amplitude
    q += noise * torch.randn(q.shape, generator=gen, dtype=torch.float64)
    k += noise * torch.randn(k.shape, generator=gen, dtype=torch.float64)
    v = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))
