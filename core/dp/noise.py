"""The Gaussian mechanism of DP-SGD on parameter gradients (paper eq. 3.1).

The clipping step (``core.dp.clipping`` / Phantom Clipping) leaves in every ``p.grad`` the **sum**
over the batch of clipped per-example gradients, whose L2 sensitivity (all parameters together)
is the clip norm ``C``. This module releases that sum through the Gaussian mechanism,

    G = ( sum_i clip_C(g_i) + N(0, (sigma C)^2 I) ) / (q N),                          (eq. 3.1)

normalising by the *expected* batch size ``q N`` of Poisson sampling (Opacus's convention for
``loss_reduction="mean"``), not by the realised batch size, which is data dependent.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch

from core.dp.accounting import check_clip_norm, check_noise_multiplier
from core.errors import ConfigError, PrivacyError

__all__ = ["add_gaussian_noise_", "privatize_grads_"]


def _check_noise_args(noise_multiplier: float, clip_norm: float) -> None:
    check_noise_multiplier(noise_multiplier)
    check_clip_norm(clip_norm)


def _gaussian_like(reference: torch.Tensor, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """``N(0, std^2)`` of ``reference``'s shape/dtype/device, sampled in at least float32."""
    sample_dtype = torch.promote_types(reference.dtype, torch.float32)
    noise = torch.normal(
        mean=0.0,
        std=std,
        size=tuple(reference.shape),
        generator=generator,
        device=reference.device,
        dtype=sample_dtype,
    )
    return noise.to(reference.dtype)


def add_gaussian_noise_(
    params: Iterable[torch.Tensor],
    *,
    noise_multiplier: float,
    clip_norm: float,
    generator: torch.Generator | None,
) -> None:
    """Add i.i.d. ``N(0, (noise_multiplier * clip_norm)^2)`` to every ``p.grad``, in place.

    ``p.grad`` must hold the SUM of clipped per-example gradients. Every parameter passed receives
    noise -- pass exactly the trainable parameters of the model. A parameter whose ``grad`` is
    ``None`` (e.g. unused by this batch, or the batch was empty) gets a **noise-only** gradient of its
    own shape: DP-SGD releases noise on every trained coordinate at every step, otherwise "this
    parameter got no gradient" would itself leak information about the batch.

    Raises :class:`PrivacyError` if a gradient holds NaN/inf (clipping failed, the sensitivity bound
    no longer holds) and :class:`ConfigError` if the generator's device differs from a gradient's.
    Gradients keep their dtype and device; noise is sampled in at least float32 precision.
    """
    _check_noise_args(noise_multiplier, clip_norm)
    params = list(params)
    for index, p in enumerate(params):
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            raise PrivacyError(
                f"non-finite gradient in parameter #{index} (shape {tuple(p.shape)}): NaN/inf after clipping "
                "breaks the sensitivity bound; refusing to add noise -- fix the loss or the clipping"
            )
        if generator is not None and generator.device != p.device:
            raise ConfigError(
                f"generator is on {generator.device} but parameter #{index} is on {p.device}; "
                "pass a torch.Generator(device=...) on the parameters' device"
            )
    std = float(noise_multiplier) * float(clip_norm)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p.detach(), memory_format=torch.preserve_format)
        if std > 0:
            p.grad.add_(_gaussian_like(p.grad, std, generator))


def privatize_grads_(
    params: Iterable[torch.Tensor],
    *,
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
) -> None:
    """Eq. 3.1 in place: add ``N(0, (sigma C)^2)`` to the summed clipped grads, then divide by ``q N``.

    ``expected_batch_size`` is ``sample_rate * n`` (a float is fine); with Poisson sampling it is the
    denominator regardless of the realised batch size, including on empty batches.
    """
    if not (
        isinstance(expected_batch_size, numbers.Real) and math.isfinite(expected_batch_size) and expected_batch_size > 0
    ):
        raise ConfigError(
            "expected_batch_size must be a finite number > 0, "
            f"got expected_batch_size={expected_batch_size!r}; pass sample_rate * n"
        )
    params = list(params)
    add_gaussian_noise_(params, noise_multiplier=noise_multiplier, clip_norm=clip_norm, generator=generator)
    for p in params:
        p.grad.div_(float(expected_batch_size))
