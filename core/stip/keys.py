"""The STIP secrets: where they come from and what may be recorded about them.

P1 (the model developer, ``core.stip.parties``) draws three kinds of secret permutation (Yuan et al., Sec. 3):

    pi     (d,)  the model dimension, Theorem 1
    rho_l  (m,)  the MLP hidden dimension of layer l (optional hardening: the activation is element-wise)
    sigma  (V,)  the vocabulary, ``vocab_perm`` design only

A secret is only as strong as its source. A permutation drawn from ``torch.Generator().manual_seed(seed)`` is a
function of ``seed``: if the seed is written anywhere (a run config, an MLflow param), whoever reads it
regenerates the secret, and the 1/d! argument of the paper is void. So every secret here is drawn from the
operating system's CSPRNG (``secrets.SystemRandom``, i.e. ``os.urandom``) and is never derived from anything
recorded; the config seed drives only public things (model initialisation, prompts, corpus splits). What is
recorded about a run's secrets is :data:`SECRET_SOURCE` (the tag ``privbench.secret_source``), never a value.

Unit tests of the permutation algebra may pass their own permutations (``draw_keys(..., source=...)``, the
``keys=`` argument of the parties, ``pi=``/``sigma=`` of the attacks); the flow and the benchmark never do.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import ConfigError
from core.secret_source import SECRET_SOURCE_TAG
from core.stip.transform import check_permutation, mlp_hidden_sizes

__all__ = [
    "SECRET_SOURCE",
    "SECRET_SOURCE_TAG",
    "PermutationSource",
    "StipKeys",
    "draw_keys",
    "secure_permutation",
]

PermutationSource = Callable[[int], torch.Tensor]
SECRET_SOURCE = "secrets.SystemRandom (OS CSPRNG), fresh per run, never recorded"


def secure_permutation(d: int) -> torch.Tensor:
    """A uniformly random permutation of ``range(d)``, int64, shape ``(d,)``, from the OS CSPRNG.

    Fisher-Yates with ``secrets.SystemRandom`` (every draw reads ``os.urandom``): no seed exists, so there is
    nothing to record and nothing to regenerate it from; a forked process draws its own.
    """
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ConfigError(f"permutation size must be a positive int, got {d=!r}")
    order = list(range(d))
    secrets.SystemRandom().shuffle(order)
    return torch.tensor(order, dtype=torch.int64)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class StipKeys:
    """P1's secrets for one deployment: ``pi`` (d,), one ``rho`` (m,) per layer, ``sigma`` (V,) or None.

    The repr names the sizes only, so a log line or a traceback never prints a secret.
    """

    pi: torch.Tensor
    rho: tuple[torch.Tensor, ...]
    sigma: torch.Tensor | None

    def __repr__(self) -> str:
        vocab = None if self.sigma is None else self.sigma.numel()
        return f"StipKeys(d={self.pi.numel()}, mlp_layers={len(self.rho)}, vocab={vocab})"


def draw_keys(model: nn.Module, design: str, *, source: PermutationSource | None = None) -> StipKeys:
    """Fresh secrets for ``model`` and ``design`` (``"user_embed"``: no ``sigma``; ``"vocab_perm"``: with one).

    ``source`` (tests only) replaces :func:`secure_permutation`; each permutation it returns is validated.
    """
    if design not in ("user_embed", "vocab_perm"):
        raise ConfigError(f"design must be one of ('user_embed', 'vocab_perm'), got {design=!r}")
    draw = secure_permutation if source is None else source
    d = int(model.config.hidden_size)
    pi = check_permutation(draw(d), d)
    rho = tuple(check_permutation(draw(m), m) for m in mlp_hidden_sizes(model))
    sigma = None
    if design == "vocab_perm":
        vocab = int(model.get_input_embeddings().weight.shape[0])
        sigma = check_permutation(draw(vocab), vocab)
    return StipKeys(pi=pi, rho=rho, sigma=sigma)
