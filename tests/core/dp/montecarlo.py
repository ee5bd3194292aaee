"""Seeded float64 draws shared by the Monte Carlo tests of core.dp (moments, Re-Attention), and their tolerances.

Monte Carlo tolerances: a sample variance over n draws has relative sd sqrt((kurtosis - 1) / n);
with n = N_MC = 40_000 and kurtosis <= 9 (products of Gaussians) that is <= 1.4%, so the 6% bands used for
exact formulas are >= 4 sd. First-order (delta-method) formulas get wider, stated bands. All seeds
are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import torch

F64 = torch.float64
N_MC = 40_000


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)
