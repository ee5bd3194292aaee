"""Seeded float64 draws shared by the Monte Carlo tests of core.dp (moments, Re-Attention)."""

from __future__ import annotations

import torch

F64 = torch.float64
N_MC = 40_000


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)
