"""Shims that let RecBole 1.2.1 run unmodified on this project's numpy 2 / torch 2.13 / pandas 3, as installed
here (``pip install --no-deps recbole==1.2.1``: only what RecBole really needs is present).

Used only inside the ``recbole-sasrec`` benchmark's worker process (``privbench.bench._worker``), so nothing here
reaches the CLI or another benchmark. Each shim is the least that works, and none edits the installed package:

* **numpy 2 names** (:func:`numpy_aliases`): RecBole's ``Config.compatibility_settings`` re-creates ``np.float``,
  ``np.int``, ``np.long``, ... from ``np.float_``, ``np.complex_`` and ``np.unicode_``, which numpy 2 removed;
  giving numpy those three names (as ``float64``, ``complex128``, ``str_``) lets RecBole set its aliases as it
  intends (its metrics use ``np.float``).
* **optional imports** (:func:`stub_missing_modules`): ``recbole.utils`` imports ``colorlog`` (coloured console
  logs), ``texttable`` (the environment table of ``quick_start``) and ``torch.utils.tensorboard`` (which needs the
  ``tensorboard`` package) at import time. The benchmark uses none of them, so where one is not installed a stub
  stands in: ``colorlog.ColoredFormatter`` is ``logging.Formatter``, ``Texttable`` raises if used, and
  ``SummaryWriter`` writes nothing (no ``log_tensorboard/`` folder in the working directory). An installed
  package is used as is.
* **the command line** (:func:`no_command_line`): RecBole's ``Config`` reads ``sys.argv`` as ``--key=value``
  settings; the worker's argv is its JSON spec, so ``Config`` is built with ``sys.argv`` cut to the program name.
* **checkpoints** (not a shim, the benchmark's own code): torch >= 2.6 loads with ``weights_only=True``, which
  refuses RecBole's checkpoints (they pickle its ``Config``); the benchmark loads the best checkpoint its own run
  just wrote with ``weights_only=False`` and evaluates with ``load_best_model=False``.

``quick_start`` is not used (it imports ``ray`` for hyper-parameter tuning); pandas 3's copy-on-write makes
RecBole's in-place ``fillna`` on missing values a no-op, harmless here: the loaded ml-100k columns (user, item,
timestamp) have no missing value.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["install", "no_command_line", "numpy_aliases", "stub_missing_modules"]


def numpy_aliases() -> None:
    """Give numpy 2 the three names RecBole's ``compatibility_settings`` reads (numpy 1 had them)."""
    import numpy as np

    for name, value in (("float_", np.float64), ("complex_", np.complex128), ("unicode_", np.str_)):
        if name not in np.__dict__:
            setattr(np, name, value)


class _Texttable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("texttable is not installed: RecBole's environment table is not available")


class _SummaryWriter:
    """A TensorBoard writer that writes nothing (RecBole's Trainer always creates one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def stub_missing_modules() -> list[str]:
    """Stand-ins for the optional modules RecBole imports but the benchmark never uses; returns the stubbed names."""
    stubs: dict[str, dict[str, Any]] = {}
    if not _installed("colorlog"):
        stubs["colorlog"] = {"ColoredFormatter": logging.Formatter}
    if not _installed("texttable"):
        stubs["texttable"] = {"Texttable": _Texttable}
    if not _installed("tensorboard"):
        stubs["torch.utils.tensorboard"] = {"SummaryWriter": _SummaryWriter}
    for name, attrs in stubs.items():
        module = types.ModuleType(name, f"privbench stub for RecBole (privbench.bench.recbole_compat): {name}")
        module.__dict__.update(attrs)
        sys.modules[name] = module
    return sorted(stubs)


@contextlib.contextmanager
def no_command_line() -> Iterator[None]:
    """``sys.argv`` cut to the program name while RecBole's ``Config`` parses it."""
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        yield
    finally:
        sys.argv = saved


def install() -> list[str]:
    """Every shim above that is needed here (numpy names, stubs); returns the stubbed module names."""
    numpy_aliases()
    return stub_missing_modules()
