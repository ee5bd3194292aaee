"""The Gaussian mechanism of DP-SGD on parameter gradients (paper eq. 3.1).

The clipping step (``core.dp.clipping`` / Phantom Clipping) leaves in every ``p.grad`` the **sum**
over the batch of clipped per-example gradients, whose L2 sensitivity (all parameters together)
is the clip norm ``C``. This module releases that sum through the Gaussian mechanism,

    G = ( sum_i clip_C(g_i) + N(0, (sigma C)^2 I) ) / (q N),                          (eq. 3.1)

normalising by the *expected* batch size ``q N`` of Poisson sampling (Opacus's convention for
``loss_reduction="mean"``), not by the realised batch size, which is data dependent.

**Where the noise comes from** (:data:`NOISE_SOURCES`). The guarantee holds against an adversary who does not
know the noise. ``secure_mode=False`` (the default, reproducible research runs) draws it from the caller's
``generator``; the trainer seeds that from the run's recorded ``seed``, so anyone who reads the seed regenerates
the noise stream and subtracts it from a released model's updates: such a run is DP only while its seed is kept
secret. ``secure_mode=True`` (as Opacus's ``secure_mode``, ``opacus.optimizers.optimizer._generate_noise``)
ignores every seed: each call draws from a fresh generator seeded with ``secrets.randbits(64)`` (the OS CSPRNG)
that is never stored or recorded, and releases ``(z_1 + z_2 + z_3 + z_4) / 2`` after discarding one sample, the
sum of four Gaussians that defeats the floating-point attacks on a single sample (Mironov 2012; Holohan and
Braghin 2021, Sec. 5.1, n = 2). This is a CSPRNG-*seeded* PRNG (64 bits of entropy per step), not a CSPRNG stream:
``torchcsprng``, which Opacus uses for that, is not installed here.
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Iterable
from typing import Literal

import torch

from core.errors import ConfigError, PrivacyError

__all__ = ["NOISE_SOURCES", "NoiseSource", "add_gaussian_noise_", "noise_source", "privatize_grads_"]

NoiseSource = Literal["seeded", "secure"]
#: What a run records as its noise source (tag ``privbench.noise_source``; module docstring).
NOISE_SOURCES: dict[str, str] = {
    "seeded": "seeded (reproducible; the DP guarantee needs the seed kept secret)",
    "secure": (
        "secure (a generator seeded from secrets.randbits(64) per step, never recorded: a CSPRNG-seeded PRNG, "
        "not a CSPRNG stream; sum of 4 Gaussians against floating-point attacks)"
    ),
}


def check_noise_multiplier(noise_multiplier: float) -> None:
    if not (isinstance(noise_multiplier, numbers.Real) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"noise_multiplier must be a finite number >= 0, got noise_multiplier={noise_multiplier!r}")


def check_clip_norm(clip_norm: float) -> None:
    if not (isinstance(clip_norm, numbers.Real) and math.isfinite(clip_norm) and clip_norm > 0):
        raise ConfigError(f"clip_norm must be a finite number > 0, got clip_norm={clip_norm!r}")


def noise_source(secure_mode: bool) -> str:
    """The :data:`NOISE_SOURCES` entry of a run with this ``secure_mode``."""
    return NOISE_SOURCES["secure" if secure_mode else "seeded"]


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


def _secure_generator(device: torch.device) -> torch.Generator:
    """A fresh generator on ``device`` seeded from the OS CSPRNG; the seed lives only in its state."""
    return torch.Generator(device).manual_seed(secrets.randbits(64))


def _secure_gaussian_like(reference: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """Opacus's secure-mode sample: one draw discarded, then ``(z_1 + ... + z_4) / 2 ~ N(0, std^2)``."""
    sample_dtype = torch.promote_types(reference.dtype, torch.float32)
    kw = {"generator": generator, "device": reference.device, "dtype": sample_dtype}
    torch.normal(mean=0.0, std=std, size=(1, 1), **kw)  # thrown away, as Opacus does
    total = torch.zeros(tuple(reference.shape), device=reference.device, dtype=sample_dtype)
    for _ in range(4):
        total += torch.normal(mean=0.0, std=std, size=tuple(reference.shape), **kw)
    return (total / 2).to(reference.dtype)


def _device_of(device: torch.device) -> torch.device:
    """``device`` with its index made explicit: ``torch.Generator(device="cuda")`` reports ``cuda`` (the current
    device), while tensors report ``cuda:0``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def add_gaussian_noise_(
    params: Iterable[torch.Tensor],
    *,
    noise_multiplier: float,
    clip_norm: float,
    generator: torch.Generator | None,
    secure_mode: bool = False,
) -> None:
    """Add i.i.d. ``N(0, (noise_multiplier * clip_norm)^2)`` to every ``p.grad``, in place.

    ``p.grad`` must hold the SUM of clipped per-example gradients. Every parameter passed receives
    noise -- pass exactly the trainable parameters of the model. A parameter whose ``grad`` is
    ``None`` (e.g. unused by this batch, or the batch was empty) gets a **noise-only** gradient of its
    own shape: DP-SGD releases noise on every trained coordinate at every step, otherwise "this
    parameter got no gradient" would itself leak information about the batch.

    ``secure_mode``: draw from a fresh OS-CSPRNG-seeded generator per call and device instead (module
    docstring); ``generator`` must then be None, so that no seeded stream can be passed by mistake.

    Raises :class:`PrivacyError` if a gradient holds NaN/inf (clipping failed, the sensitivity bound
    no longer holds) and :class:`ConfigError` if the generator's device differs from a gradient's, or a
    generator is passed with ``secure_mode``.
    Gradients keep their dtype and device; noise is sampled in at least float32 precision.
    """
    _check_noise_args(noise_multiplier, clip_norm)
    if not isinstance(secure_mode, bool):
        raise ConfigError(f"secure_mode must be a bool, got {secure_mode=!r}")
    if secure_mode and generator is not None:
        raise ConfigError(
            "secure_mode=True draws its own OS-CSPRNG-seeded generator; pass generator=None (a seeded generator "
            "would make the noise regenerable from its seed)"
        )
    params = list(params)
    for index, p in enumerate(params):
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            raise PrivacyError(
                f"non-finite gradient in parameter #{index} (shape {tuple(p.shape)}): NaN/inf after clipping "
                "breaks the sensitivity bound; refusing to add noise -- fix the loss or the clipping"
            )
        if generator is not None and _device_of(generator.device) != _device_of(p.device):
            raise ConfigError(
                f"generator is on {generator.device} but parameter #{index} is on {p.device}; "
                "pass a torch.Generator(device=...) on the parameters' device"
            )
    std = float(noise_multiplier) * float(clip_norm)
    secure: dict[torch.device, torch.Generator] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p.detach(), memory_format=torch.preserve_format)
        if std > 0 and secure_mode:
            if p.grad.device not in secure:  # one fresh generator per call and device
                secure[p.grad.device] = _secure_generator(p.grad.device)
            p.grad.add_(_secure_gaussian_like(p.grad, std, secure[p.grad.device]))
        elif std > 0:
            p.grad.add_(_gaussian_like(p.grad, std, generator))


def privatize_grads_(
    params: Iterable[torch.Tensor],
    *,
    noise_multiplier: float,
    clip_norm: float,
    expected_batch_size: float,
    generator: torch.Generator | None,
    secure_mode: bool = False,
) -> None:
    """Eq. 3.1 in place: add ``N(0, (sigma C)^2)`` to the summed clipped grads, then divide by ``q N``.

    ``expected_batch_size`` is ``sample_rate * n`` (a float is fine); with Poisson sampling it is the
    denominator regardless of the realised batch size, including on empty batches. ``generator`` and
    ``secure_mode``: as :func:`add_gaussian_noise_`.
    """
    if not (
        isinstance(expected_batch_size, numbers.Real) and math.isfinite(expected_batch_size) and expected_batch_size > 0
    ):
        raise ConfigError(
            "expected_batch_size must be a finite number > 0, "
            f"got expected_batch_size={expected_batch_size!r}; pass sample_rate * n"
        )
    params = list(params)
    add_gaussian_noise_(
        params, noise_multiplier=noise_multiplier, clip_norm=clip_norm, generator=generator, secure_mode=secure_mode
    )
    for p in params:
        p.grad.div_(float(expected_batch_size))
