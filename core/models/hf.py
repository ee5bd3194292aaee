"""One Hugging Face model load or construction at a time per process.

transformers changes process-wide state while it builds or loads a model, and restores it afterwards:
``from_pretrained`` swaps ``PreTrainedModel.tie_weights`` for a no-op on the class (``no_tie_weights``) and sets
torch's default dtype; every construction swaps the ``torch.nn.init`` functions for guarded ones
(``guard_torch_init_functions``). Each swap saves "the original" on entry and puts it back on exit, so two threads
that overlap corrupt each other:

* a model built while another thread loads gets the no-op ``tie_weights``: its LM head stays untied (twice the
  embedding parameters, a head the state dict never sets);
* two loads that overlap save each other's no-op as the original, and the later exit leaves ``tie_weights`` a
  no-op for the rest of the process: every tied model built after it keeps a separate head, and a loaded model
  whose checkpoint omits its tied head (SmolLM2's GGUF) keeps that head uninitialised memory.

Prefect's thread task runner runs tasks side by side in one process. Every load and construction of an HF model in
privbench goes through :func:`load` or :func:`build`, which hold one re-entrant lock, so none overlaps another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["build", "exclusive", "load"]

T = TypeVar("T")

_LOCK = threading.RLock()  # re-entrant: a load may build a model, a builder may call another builder


@contextmanager
def exclusive() -> Iterator[None]:
    """Hold the process's HF model lock (for code that builds or loads a model by other means)."""
    with _LOCK:
        yield


def build(cls: Callable[..., T], config: Any, *args: Any, **kwargs: Any) -> T:
    """``cls(config, ...)`` (e.g. ``GPT2LMHeadModel(cfg)``) under the lock."""
    with _LOCK:
        return cls(config, *args, **kwargs)


def load(loader: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``loader(...)`` (e.g. ``AutoModelForCausalLM.from_pretrained``) under the lock."""
    with _LOCK:
        return loader(*args, **kwargs)
