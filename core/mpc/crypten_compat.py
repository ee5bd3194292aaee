"""One import point for CrypTen 0.4.1 on recent torch.

CrypTen 0.4.1 imports ``torch.onnx._internal.registration`` in ``crypten/nn/onnx_converter.py``; that module
is gone from torch 2.13. The ONNX converter is not used by the MPC core (encrypted matmul, softmax, comparisons,
``crypten.mpc``), so a stand-in module with an empty ``registry`` is registered under that name before
``import crypten``. Communication bytes and rounds are only counted when ``crypten.cfg.communicator.verbose``
is true, so :func:`import_crypten` turns it on. (CrypTen's own communication *time* counter is wrong: it calls
``timeit.timeit()`` as a clock; time with ``time.perf_counter`` instead, see :mod:`core.mpc.accounting`.)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from core.errors import PrivbenchError

_STANDIN = "torch.onnx._internal.registration"
_INSTALL_HINT = "pip install --no-deps crypten==0.4.1 (plus omegaconf onnx pandas pyyaml scipy scikit-learn future)"


class CryptenUnavailableError(PrivbenchError, ImportError):
    """CrypTen is not installed (or cannot be imported) in this environment."""


def _install_standin() -> None:
    """Register a stand-in for the torch module CrypTen's ONNX converter imports, if torch lacks it."""
    if _STANDIN in sys.modules:
        return
    try:
        importlib.import_module(_STANDIN)
        return
    except ImportError:
        pass
    stub = types.ModuleType(_STANDIN)
    stub.registry = None  # type: ignore[attr-defined]  # only imported by the (unused) ONNX converter
    sys.modules[_STANDIN] = stub


def import_crypten() -> Any:
    """Import and return the ``crypten`` module, patched for torch 2.13 and with comm counting on.

    Idempotent. Raises :class:`CryptenUnavailableError` (a ``PrivbenchError``) naming the install command when
    CrypTen is missing.
    """
    if "crypten" in sys.modules and getattr(sys.modules["crypten"], "_privbench_ready", False):
        return sys.modules["crypten"]
    _install_standin()
    try:
        import crypten
    except ImportError as exc:
        raise CryptenUnavailableError(f"CrypTen cannot be imported ({exc}); install it with: {_INSTALL_HINT}") from exc
    crypten.cfg.communicator.verbose = True
    crypten._privbench_ready = True
    return crypten


def crypten_available() -> bool:
    """True when :func:`import_crypten` would succeed."""
    try:
        import_crypten()
    except CryptenUnavailableError:
        return False
    return True
