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


# CrypTen's communicator hands CUDA shares straight to torch.distributed. The gloo backend (the only one that runs
# two parties on one GPU: NCCL refuses two ranks on the same device) moves CUDA tensors only for all_reduce and
# broadcast (PyTorch's distributed docs); it does not support send, recv, reduce, gather, all_gather or scatter of a
# CUDA tensor. :func:`stage_cuda_communication` routes every tensor operation of the communicator through host
# memory instead: the CUDA (or CUDALongTensor) arguments are copied to the CPU, the original method runs (and
# counts its bytes and rounds, which are the same), and the results are copied back to the arguments' device and
# type. The copies cost PCIe time, which gloo's own CUDA path pays too.
STAGED_METHODS = ("send", "recv", "scatter", "reduce", "all_reduce", "gather", "all_gather", "broadcast")


def _to_host(obj: Any, found: list[Any]) -> Any:
    """``obj`` with every CUDA tensor (plain or CrypTen's CUDALongTensor) copied to the CPU; ``found`` collects the
    originals (the first one decides where and as what results go back)."""
    import torch

    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(o, found) for o in obj)
    if getattr(obj, "is_cuda", False) and (torch.is_tensor(obj) or hasattr(obj, "_tensor")):
        found.append(obj)
        return obj.cpu()  # CUDALongTensor.cpu() is its int64 tensor on the CPU
    return obj


def _to_device(obj: Any, like: Any) -> Any:
    import torch

    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(o, like) for o in obj)
    if torch.is_tensor(obj) and not obj.is_cuda:
        moved = obj.to(like.device)
        return type(like)(moved) if not torch.is_tensor(like) else moved  # CUDALongTensor in, CUDALongTensor out
    return obj


def _staged(method: Any) -> Any:
    import functools

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        found: list[Any] = []
        host_args = _to_host(list(args), found)
        host_kwargs = {k: _to_host(v, found) for k, v in kwargs.items()}
        device = host_kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):  # scatter(..., device=cuda) on a receiver
            host_kwargs["device"] = "cpu"
            if not found:
                import torch
                from crypten.cuda import CUDALongTensor

                found.append(CUDALongTensor(torch.zeros(0, dtype=torch.long, device=device)))
        result = method(self, *host_args, **host_kwargs)
        if method.__name__ == "broadcast" and found:  # in place, as gloo does (CrypTen's TTP provider relies on it)
            received = result if isinstance(result, list | tuple) else [result]
            for original, value in zip(found, received, strict=True):
                original.data.copy_(value)
            return found if isinstance(result, list | tuple) else found[0]
        return _to_device(result, found[0]) if found else result

    wrapper._privbench_staged = True
    return wrapper


def stage_cuda_communication(crypten: Any) -> None:
    """Route CrypTen's tensor communication through host memory (see ``STAGED_METHODS``). Idempotent; needed only
    when the parties compute on CUDA over gloo."""
    from crypten.communicator.distributed_communicator import DistributedCommunicator

    for name in STAGED_METHODS:
        method = getattr(DistributedCommunicator, name)
        if not getattr(method, "_privbench_staged", False):
            setattr(DistributedCommunicator, name, _staged(method))
