"""The small typed error hierarchy every layer of privbench raises.

Messages name the bad value and say how to fix it, e.g.
``ConfigError("train.epsilon must be > 0, got epsilon=-1.0; pass a positive privacy budget")``.
"""

from __future__ import annotations


class PrivbenchError(Exception):
    """Base class of every error privbench raises on purpose."""


class ConfigError(PrivbenchError, ValueError):
    """A configuration value is invalid (names the key, the value and what is allowed)."""


class DataError(PrivbenchError, ValueError):
    """Input data is missing, malformed or empty (names the file and, where known, the line)."""


class PrivacyError(PrivbenchError):
    """An operation would break a privacy invariant (e.g. a DP step without an accountant)."""


class StoreError(PrivbenchError):
    """The results store or tracking backend cannot be reached or is inconsistent."""


class DivergedError(PrivbenchError, ValueError):
    """Training diverged: the loss (or a gradient) became NaN/inf, or exploded far above its initial value.

    Raised by :class:`core.divergence.DivergenceGuard` from every training loop. The message names the step, the
    loss and the limit it crossed, and what to lower (the learning rate, for DP-SGD also the clip norm); a
    ``ValueError`` because the cause is a hyper-parameter value, never retried as if transient.
    """
