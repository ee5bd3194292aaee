"""Divergence guard shared by every training loop: stop a run whose loss is NaN/inf or has exploded.

A run with too large a learning rate does not crash by itself: its loss climbs to 1e25 (or NaN) and the
loop runs to the end, reporting garbage as a finished result. :class:`DivergenceGuard` sees the loss of
every step and raises :class:`~core.errors.DivergedError` instead.

**Rule.** With ``l_1`` the first loss the guard sees (the untrained model's), the loss ``l_t`` of step ``t``
is diverged when

* ``l_t`` is NaN or +-inf, at any step (the first included); or
* ``l_t > max(factor * |l_1|, |l_1| + margin)``, by default ``max(10 |l_1|, |l_1| + 10)``.

**Why it never fires on healthy training.** Training lowers the loss from its initial value; noise (DP-SGD,
small or Poisson batches, dropout) makes it fluctuate by tens of percent, not tenfold. For a
cross-entropy the initial loss is about ``log(classes)`` (uniform predictions), and ``10 log(classes)``
means the model puts probability below ``classes ** -10`` on the true class on average over a whole
batch -- confidently wrong everywhere, which only a diverging run does. The additive ``margin`` keeps
losses that start near zero (a distillation MSE, a model fine-tuned from a good start) from tripping on
a small absolute rise. A loop whose objective changes mid-run (e.g. two distillation stages) starts a
new guard for the new objective.

The guard costs one ``float(loss)`` per step, which every loop here already pays to log its loss.
"""

from __future__ import annotations

import math

from torch import Tensor

from core.errors import ConfigError, DivergedError

__all__ = ["DivergenceGuard"]


class DivergenceGuard:
    """Check the loss of every step against the rule of the module docstring.

    Args:
        hint: what the user should change, ending the message (e.g. ``"lower the learning rate (lr=0.1)"``).
        factor: > 1; the loss may grow to ``factor`` times its initial value.
        margin: >= 0; ... and always by ``margin`` (in the loss's units) above it.
        error: the :class:`~core.errors.DivergedError` subclass raised (a trainer's own, e.g.).

    Example::

        guard = DivergenceGuard(hint=f"lower the learning rate (lr={lr})")
        for step, batch in enumerate(batches, start=1):
            loss = model_loss(batch)
            guard.check(loss, step=step)   # raises DivergedError
            loss.backward(); opt.step()
    """

    def __init__(
        self,
        *,
        hint: str = "lower the learning rate",
        factor: float = 10.0,
        margin: float = 10.0,
        error: type[DivergedError] = DivergedError,
    ) -> None:
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 1):
            raise ConfigError(f"factor must be a finite number > 1, got {factor=!r}")
        if not (isinstance(margin, int | float) and math.isfinite(margin) and margin >= 0):
            raise ConfigError(f"margin must be a finite number >= 0, got {margin=!r}")
        if not (isinstance(error, type) and issubclass(error, DivergedError)):
            raise ConfigError(f"error must be a DivergedError subclass, got {error=!r}")
        self.hint, self.factor, self.margin, self.error = hint, float(factor), float(margin), error
        self.initial: float | None = None

    @property
    def limit(self) -> float:
        """The largest loss still accepted (``inf`` until the first loss is seen)."""
        if self.initial is None:
            return math.inf
        return max(self.factor * abs(self.initial), abs(self.initial) + self.margin)

    def check(self, loss: float | Tensor, *, step: int, epoch: int | None = None) -> float:
        """Raise ``error`` if the loss of ``step`` (``epoch``: for the message) diverged; else return it as a float.

        ``loss`` is a Python number or a one-element tensor (read with one ``float``, a device sync).
        """
        value = float(loss.detach() if isinstance(loss, Tensor) else loss)
        where = f"step {step}" if epoch is None else f"step {step} (epoch {epoch})"
        if not math.isfinite(value):
            raise self.error(f"training diverged: loss is {value} at {where}; {self.hint}")
        if self.initial is None:
            self.initial = value
        elif value > self.limit:
            raise self.error(
                f"training diverged at {where}: loss={value:.3g} > {self.limit:.3g} "
                f"(initial loss {self.initial:.3g}); {self.hint}"
            )
        return value
