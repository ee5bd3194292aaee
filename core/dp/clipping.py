"""Per-sample gradient clipping for DP-SGD (eq. 3.1): one interface, several exact implementations.

Every DP clipper leaves in ``p.grad`` (added to what is there, like ``Tensor.backward``) the
**sum** over the batch of the clipped per-sample gradients ``sum_i c_i g_i`` -- no noise, no
averaging: the optimizer / trainer adds ``N(0, sigma^2 C^2)`` and divides by the batch size. A
DP clipper writes a gradient (possibly zero) for every trainable parameter, so that noise is added
to all of them.

Coefficients (:func:`clip_coefficients`):

* flat clipping, eq. 3.1: ``c_i = min(1, C / (||g_i|| + 1e-6))`` (Opacus' exact formula; the 1e-6
  guards zero gradients and keeps ``||c_i g_i|| < C``);
* normalisation / automatic clipping (Bu et al., 2023; the paper "normalize[s] the gradients and
  set[s] C=1"): ``c_i = C / (||g_i|| + gamma)`` with stability constant gamma (default 0.01, as in
  Bu et al.); ``||c_i g_i|| < C`` holds as well.

Methods (registered in :data:`CLIPPERS` by :func:`register_clipper`; :class:`ClippingMethod` names the built-in
ones):

* ``nonprivate``: plain ``sum_i L_i`` backward, no clipping (baseline).
* ``phantom``: :class:`core.dp.phantom.PhantomClipping` (norms without per-sample gradients, tied
  embeddings included, book-keeping instead of a second backward).
* ``ghost_tied``: the paper's baseline (Fig. 3), Ghost Clipping extended to the shared embedding
  (:class:`core.dp.ghost_tied.GhostTiedClipping`: the tied embedding's norm from (B, L+M, L+M) Gram
  matrices, O(B M^2) memory); exact, slow for a large vocabulary M.
* ``opacus_hooks``: Opacus ``GradSampleModule`` materialises per-sample gradients (a tied embedding
  works: its grad samples from both uses are summed).
* ``opacus_ghost``: Opacus 1.6 ``GradSampleModuleFastGradientClipping`` (ghost norms, then a second
  backward of ``sum_i c_i L_i``); refuses tied parameters.
* ``loop``: slow reference, one ``autograd.grad`` per sample.

A new method is one class registered under a new name (``docs/contributing.md``, example A)::

    @register_clipper("my_method")
    class MyClipper(DPClipper):
        def backward(self, per_sample_loss: Tensor) -> Tensor: ...

``make_clipper("my_method", model, clip_norm=..., normalize=..., gamma=...)`` then builds it, and
``DPTrainConfig(clipping="my_method", ...)`` accepts it.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

from core.dp.ghost_tied import GhostTiedClipping
from core.dp.phantom import PhantomClipping
from core.errors import ConfigError, DataError, PrivacyError
from core.registry import lookup

FLAT_CLIP_EPS = 1e-6


class ClippingMethod(str, Enum):
    """The built-in clipping methods' names (see the module docstring); :data:`CLIPPERS` holds every registered
    method, these and any other."""

    NONPRIVATE = "nonprivate"
    PHANTOM = "phantom"
    GHOST_TIED = "ghost_tied"  # the paper's baseline: Ghost Clipping over the shared embedding's L + M lookups
    OPACUS_HOOKS = "opacus_hooks"
    OPACUS_GHOST = "opacus_ghost"
    LOOP = "loop"  # brute-force reference


@runtime_checkable
class Clipper(Protocol):
    """One clipping step: ``loss = f(clipper.model(x)); norms = clipper.backward(loss)``."""

    model: nn.Module  # the module to call forward on (Opacus may wrap the original)

    def backward(self, per_sample_loss: Tensor) -> Tensor | None:
        """per_sample_loss (B,). Adds to each trainable p.grad the SUM over samples of the clipped
        per-sample gradients (no noise, no averaging); returns the per-sample norms before clipping
        (B,) (None for nonprivate, where p.grad += grad of per_sample_loss.sum())."""
        ...

    def close(self) -> None:
        """Remove every hook the clipper attached to the model."""
        ...


ClipperT = TypeVar("ClipperT", bound=type)

#: Every clipping method by name, in registration order: the class :func:`make_clipper` builds as
#: ``cls(model, clip_norm=C, normalize=..., gamma=...)``. Filled by :func:`register_clipper`.
CLIPPERS: dict[str, type[Clipper]] = {}

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def register_clipper(name: str) -> Callable[[ClipperT], ClipperT]:
    """Class decorator: register a :class:`Clipper` class as clipping method ``name``.

    The class is built as ``cls(model, clip_norm=C, normalize=..., gamma=...)`` (subclass :class:`DPClipper` for
    those settings and :meth:`DPClipper.coefficients`); its ``backward(per_sample_loss)`` adds to every trainable
    ``p.grad`` the sum of the clipped per-sample gradients, each of norm at most ``C``, and returns the per-sample
    norms before clipping. ConfigError for a name that is not lower-case ``snake_case`` or is already taken."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"a clipping method's name must be lower-case snake_case, got {name!r}")

    def register(cls: ClipperT) -> ClipperT:
        taken = CLIPPERS.get(name)
        if taken is not None and taken is not cls:
            raise ConfigError(
                f"clipping method {name!r} is already registered ({taken.__module__}.{taken.__qualname__}); "
                f"pick another name (taken: {', '.join(CLIPPERS)})"
            )
        CLIPPERS[name] = cls
        return cls

    return register


def clipper_class(method: ClippingMethod | str) -> type[Clipper]:
    """The class registered as ``method``; ConfigError listing the registered methods for an unknown one."""
    return lookup("clipping method", CLIPPERS, method.value if isinstance(method, ClippingMethod) else method)


def clip_coefficients(norms: Tensor, *, clip_norm: float, normalize: bool, gamma: float = 0.01) -> Tensor:
    """Per-sample scale factors c (B,) so that ``||c_i g_i|| < clip_norm`` (flat or normalised)."""
    if normalize:
        return clip_norm / (norms + gamma)
    return (clip_norm / (norms + FLAT_CLIP_EPS)).clamp(max=1.0)


def check_per_sample_loss(per_sample_loss: Tensor) -> None:
    """Raise unless the loss is a finite (B,) tensor with B >= 1 that requires grad."""
    if not isinstance(per_sample_loss, Tensor) or per_sample_loss.dim() != 1:
        shape = tuple(per_sample_loss.shape) if isinstance(per_sample_loss, Tensor) else type(per_sample_loss)
        raise DataError(
            f"per_sample_loss must be a 1-D (B,) tensor, got {shape}; reduce over positions per "
            "sequence, not over the batch (e.g. sequence_loss(..., reduction='none'))"
        )
    if per_sample_loss.shape[0] == 0:
        raise PrivacyError(
            "empty batch (B=0): there is no gradient to clip; a Poisson-sampled empty batch must "
            "still be a noise-only step, handle it before calling the clipper"
        )
    bad = (~torch.isfinite(per_sample_loss.detach())).nonzero().flatten()
    if bad.numel():
        raise PrivacyError(
            f"non-finite per-sample loss at batch indices {bad[:10].tolist()} "
            f"(values {per_sample_loss.detach()[bad[:10]].tolist()}); lower the learning rate or check the inputs"
        )
    if not per_sample_loss.requires_grad:
        raise PrivacyError("per_sample_loss does not require grad; compute it from the clipper's model")


def _check_norms(norms: Tensor) -> None:
    if not torch.isfinite(norms).all():
        raise PrivacyError(
            f"non-finite per-sample gradient norm at indices "
            f"{(~torch.isfinite(norms)).nonzero().flatten()[:10].tolist()}; "
            "the gradients overflowed, lower the learning rate or use float32/float64"
        )


@contextmanager
def _opacus_backward() -> Iterator[None]:
    """Silence torch's notice that a full backward hook fires on a module whose inputs need no
    grad (the embedding layers): expected for Opacus' hooks, and repeated at every step otherwise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        yield


def _check_training_mode(model: nn.Module) -> None:
    if not model.training:
        raise PrivacyError(
            "Opacus records per-sample gradients only in training mode; call model.train() before "
            "the forward (set dropout=0 in the config for a deterministic model)"
        )


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _add_grad(p: nn.Parameter, grad: Tensor) -> None:
    grad = grad.to(p.dtype).view_as(p)
    p.grad = grad if p.grad is None else p.grad + grad


def _stash_grads(params: list[nn.Parameter]) -> list[Tensor | None]:
    """Take the current p.grad out of the way (Opacus' backward writes unclipped grads there)."""
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stash


@contextmanager
def _grads_set_aside(params: list[nn.Parameter]) -> Iterator[list[Tensor | None]]:
    """Set p.grad aside for an Opacus backward; on error put it back (never leave unclipped grads)."""
    stash = _stash_grads(params)
    try:
        yield stash
    except BaseException:
        for p, old in zip(params, stash, strict=True):
            p.grad = old
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        raise


@register_clipper(ClippingMethod.NONPRIVATE.value)
class NonPrivateClipper:
    """No clipping: ``p.grad += d(sum_i L_i)/dp``; returns None (the clipping settings are ignored)."""

    def __init__(self, model: nn.Module, **_settings: float) -> None:
        self.model = model

    def backward(self, per_sample_loss: Tensor) -> None:
        check_per_sample_loss(per_sample_loss)
        per_sample_loss.sum().backward()

    def close(self) -> None:
        return None


class DPClipper:
    """Base of the DP clipping methods: the settings (``clip_norm`` C, ``normalize``, ``gamma``), the trainable
    parameters ``params`` in ``model.parameters()`` order, and :meth:`coefficients`. A subclass implements
    ``backward`` (see :class:`Clipper`) and, if it attaches hooks, ``close``."""

    def __init__(self, model: nn.Module, *, clip_norm: float, normalize: bool, gamma: float) -> None:
        self.model = model
        self.clip_norm, self.normalize, self.gamma = clip_norm, normalize, gamma
        self.params = _trainable(model)

    def coefficients(self, norms: Tensor) -> Tensor:
        """Per-sample scale factors (B,) for the norms (B,) under this clipper's settings; PrivacyError for a
        non-finite norm."""
        _check_norms(norms)
        return clip_coefficients(norms, clip_norm=self.clip_norm, normalize=self.normalize, gamma=self.gamma)

    def close(self) -> None:
        return None


@register_clipper(ClippingMethod.PHANTOM.value)
class PhantomClipper(DPClipper):
    """Phantom Clipping (Sec. 4.2): exact norms incl. tied embeddings, then book-keeping."""

    clipping: type[PhantomClipping] = PhantomClipping

    def __init__(self, model: nn.Module, **settings: float) -> None:
        super().__init__(model, **settings)
        self.phantom = self.clipping(model)

    def backward(self, per_sample_loss: Tensor) -> Tensor:
        check_per_sample_loss(per_sample_loss)
        norms = self.phantom.per_sample_norms(per_sample_loss)
        self.phantom.accumulate_grad(self.coefficients(norms))
        return norms.detach()

    def close(self) -> None:
        self.phantom.remove()


@register_clipper(ClippingMethod.GHOST_TIED.value)
class GhostTiedClipper(PhantomClipper):
    """The paper's baseline: Ghost Clipping extended to the shared embedding (O(B M^2) memory)."""

    clipping = GhostTiedClipping


@register_clipper(ClippingMethod.OPACUS_HOOKS.value)
class OpacusHooksClipper(DPClipper):
    """Opacus ``GradSampleModule``: materialised per-sample gradients ``p.grad_sample`` (B, *p.shape)."""

    def __init__(self, model: nn.Module, **settings: float) -> None:
        super().__init__(model, **settings)
        from opacus.grad_sample import GradSampleModule  # imported where used: a second of start-up otherwise

        self.model = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)

    def backward(self, per_sample_loss: Tensor) -> Tensor:
        check_per_sample_loss(per_sample_loss)
        _check_training_mode(self.model)
        with _grads_set_aside(self.params) as stash:
            with _opacus_backward():
                per_sample_loss.sum().backward()
            samples = [self._take_grad_sample(p, per_sample_loss.shape[0]) for p in self.params]
            norms = torch.stack([gs.flatten(1).norm(dim=1) for gs in samples]).norm(dim=0)  # (B,)
            coef = self.coefficients(norms)
        for p, old, gs in zip(self.params, stash, samples, strict=True):
            p.grad = old
            _add_grad(p, torch.tensordot(coef.to(gs.dtype), gs, dims=1))
        return norms.detach()

    @staticmethod
    def _take_grad_sample(p: nn.Parameter, B: int) -> Tensor:
        gs = getattr(p, "grad_sample", None)
        p.grad_sample = None
        if gs is None:
            return p.new_zeros(B, *p.shape)  # parameter unused in this forward
        if isinstance(gs, list) or gs.shape[0] != B:
            raise PrivacyError(
                "Opacus recorded several forward passes before this backward; run exactly one "
                "forward per backward in training mode"
            )
        return gs  # (B, *p.shape)

    def close(self) -> None:
        self.model.cleanup()


@register_clipper(ClippingMethod.OPACUS_GHOST.value)
class OpacusGhostClipper(DPClipper):
    """Opacus 1.6 fast gradient (ghost) clipping: ghost norms, then a second backward of sum_i c_i L_i."""

    def __init__(self, model: nn.Module, **settings: float) -> None:
        super().__init__(model, **settings)
        from opacus.grad_sample import GradSampleModuleFastGradientClipping  # imported where used

        tied = tied_parameter_names(model, tuple(GradSampleModuleFastGradientClipping.NORM_SAMPLERS))
        if tied:
            raise ConfigError(
                f"opacus_ghost does not support parameter tying (Opacus: 'Parameter tying is not "
                f"supported with Ghost Clipping'), but {', '.join(tied)} are shared between modules; "
                "build the model with tied=False (the paper's footnote 5 also halves d_model) or use "
                "the phantom clipper"
            )
        recurrent = [name for name, m in model.named_modules() if getattr(m, "recurrent", False)]
        if recurrent:
            raise ConfigError(
                f"opacus_ghost cannot clip recurrent layers ({', '.join(recurrent)}: one nn.Linear called once per "
                "time step, which Opacus' ghost clipping refuses as parameter tying); use phantom or opacus_hooks"
            )
        self.model = GradSampleModuleFastGradientClipping(
            model,
            batch_first=True,
            loss_reduction="sum",
            max_grad_norm=self.clip_norm,
            use_ghost_clipping=True,
        )

    def backward(self, per_sample_loss: Tensor) -> Tensor:
        check_per_sample_loss(per_sample_loss)
        _check_training_mode(self.model)
        with _grads_set_aside(self.params) as stash:
            with _opacus_backward():
                per_sample_loss.sum().backward(retain_graph=True)
            norms = self.model.get_norm_sample()  # (B,)
            coef = self.coefficients(norms).to(per_sample_loss.dtype).detach()
            _stash_grads(self.params)  # drop the unclipped gradients of the first backward
            self.model.disable_hooks()
            try:
                with _opacus_backward():
                    (coef * per_sample_loss).sum().backward()
            finally:
                self.model.enable_hooks()
        for p, old in zip(self.params, stash, strict=True):
            new = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = old
            _add_grad(p, new)
        return norms.detach()

    def close(self) -> None:
        self.model.cleanup()


@register_clipper(ClippingMethod.LOOP.value)
class LoopClipper(DPClipper):
    """Reference: per-sample gradients by one ``autograd.grad`` per sample, then clip and sum."""

    def backward(self, per_sample_loss: Tensor) -> Tensor:
        check_per_sample_loss(per_sample_loss)
        B = per_sample_loss.shape[0]
        total = [torch.zeros_like(p) for p in self.params]
        norms = per_sample_loss.new_zeros(B)
        for i in range(B):
            grads = torch.autograd.grad(per_sample_loss[i], self.params, retain_graph=i < B - 1, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)]
            norms[i] = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            coef = self.coefficients(norms[i : i + 1])[0]
            for acc, g in zip(total, grads, strict=True):
                acc.add_(g, alpha=float(coef))
        for p, g in zip(self.params, total, strict=True):
            _add_grad(p, g)
        return norms.detach()


def tied_parameter_names(model: nn.Module, module_types: tuple[type[nn.Module], ...] | None = None) -> list[str]:
    """Names of trainable parameters owned by more than one module (of ``module_types`` if given)."""
    owners: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules():
        if module_types is not None and type(module) not in module_types:
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return [" = ".join(names) for names in owners.values() if len(names) > 1]


def make_clipper(
    method: ClippingMethod | str,
    model: nn.Module,
    *,
    clip_norm: float,
    normalize: bool,
    gamma: float = 0.01,
) -> Clipper:
    """Build the clipper for ``method`` on ``model``; call forward on the returned ``clipper.model``.

    Args:
        method: a name registered in :data:`CLIPPERS` ("nonprivate", "phantom", ...) or a :class:`ClippingMethod`.
        clip_norm: C > 0 (ignored by nonprivate).
        normalize: automatic clipping ``C / (||g|| + gamma)`` instead of flat clipping.
        gamma: stability constant of normalisation, > 0.
    """
    cls = clipper_class(method)
    if (
        isinstance(clip_norm, bool)
        or not isinstance(clip_norm, (int, float))
        or not math.isfinite(clip_norm)
        or clip_norm <= 0
    ):
        raise ConfigError(f"clip_norm must be a finite number > 0, got {clip_norm=}")
    if not isinstance(normalize, bool):
        raise ConfigError(f"normalize must be a bool, got {normalize=}")
    if not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma <= 0:
        raise ConfigError(f"gamma must be a finite number > 0, got {gamma=}")
    return cls(model, clip_norm=float(clip_norm), normalize=normalize, gamma=float(gamma))
