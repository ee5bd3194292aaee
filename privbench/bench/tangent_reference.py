"""What ``privbench bench tangent`` measures against: the ORIGINAL Hugging Face suffix (forward and
``torch.func.jvp``), seeded deltas, the float64 JVP check, and the timing helpers of its interleaved rounds.

Torch is imported inside the functions (``privbench bench --list`` stays torch-free).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.errors import ConfigError
from privbench.bench.harness import Interleaved, Progress

__all__ = [
    "PlainSuffix",
    "group_runs",
    "jvp_error_float64",
    "max_rel",
    "random_delta",
    "reporter",
    "sync_fn",
    "timed",
]


def random_delta(model: Any, std: float, gen: Any) -> dict[str, Any]:
    """A delta with the structure of ``model.get_delta()``, entries ``N(0, std^2)`` from ``gen``."""
    import torch

    return {
        n: (torch.randn(t.shape, generator=gen, dtype=torch.float64) * std).to(t) for n, t in model.get_delta().items()
    }


@functools.cache
def _suffix_class() -> type:
    """The ``nn.Module`` class of :class:`PlainSuffix` (built lazily: ``privbench bench --list`` stays torch-free)."""
    from torch import nn

    class HFSuffix(nn.Module):
        """``logits = head(LN(blocks(h))[:, 0])`` with the original HF modules, ``h: (B, N, D)``."""

        def __init__(self, blocks: Sequence[nn.Module], layernorm: nn.Module, head: nn.Module) -> None:
            super().__init__()
            self.blocks, self.layernorm, self.head = nn.ModuleList(blocks), layernorm, head

        def forward(self, h: Any) -> Any:
            for blk in self.blocks:
                out = blk(h)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.layernorm(h)[:, 0])  # (B, N, D) -> CLS (B, D) -> (B, C)

    return HFSuffix


class PlainSuffix:
    """The ORIGINAL Hugging Face last ``k`` blocks, final LayerNorm and head (shared, not copied), as
    ``self.module`` (``blocks.<j>.*``, ``layernorm.*``, ``head.*``); :meth:`tangents` lines a
    ``TangentModel`` delta up with these parameters for :meth:`jvp` (``torch.func``)."""

    def __init__(self, backbone: Any, head: Any, k: int, *, module: Any = None) -> None:
        layers = backbone.encoder.layer if backbone is not None else None
        self.first = len(layers) - k if layers is not None else 0
        self.module = (
            module if module is not None else _suffix_class()(list(layers[self.first :]), backbone.layernorm, head)
        )

    def __call__(self, h: Any) -> Any:
        return self.module(h)

    def double(self) -> PlainSuffix:
        """A float64 deep copy (the backbone's modules are copied, not converted in place)."""
        out = PlainSuffix(None, None, 0, module=copy.deepcopy(self.module).double())
        out.first = self.first
        return out

    def params(self) -> dict[str, Any]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def name_of(self, source: str) -> str:
        """``encoder.layer.<i>.X`` -> ``blocks.<i - first>.X``; ``layernorm.*`` / ``head.*`` unchanged."""
        if source.startswith("encoder.layer."):
            i, rest = source[len("encoder.layer.") :].split(".", 1)
            return f"blocks.{int(i) - self.first}.{rest}"
        return source

    def tangents(self, model: Any, delta: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """``Delta-w`` on these parameters (zeros where the tangent model has no delta) and the number
        of delta tensors mapped."""
        import torch

        out = {n: torch.zeros_like(p) for n, p in self.params().items()}
        covered = 0
        for d_name, src in model.source_names.items():
            name = self.name_of(src)
            if name not in out:
                raise ConfigError(f"delta {d_name!r} perturbs {src!r}, which the plain suffix lacks ({name!r})")
            out[name] = delta[d_name].to(out[name])
            covered += 1
        return out, covered

    def jvp(self, h: Any, params: Mapping[str, Any], tangents: Mapping[str, Any]) -> tuple[Any, Any]:
        """``(f(h; w), J_w f(h; w) Delta-w)`` by ``torch.func.jvp`` over ``functional_call``."""
        import torch

        def f(p: Mapping[str, Any]) -> Any:
            return torch.func.functional_call(self.module, dict(p), (h,))

        return torch.func.jvp(f, (dict(params),), (dict(tangents),))


def max_rel(a: Any, ref: Any) -> float:
    scale = float(ref.abs().max())
    diff = float((a - ref).abs().max())
    return diff / scale if scale > 0 else diff


def sync_fn(device: str) -> Callable[[], None]:
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def timed(fn: Callable[[], Any], inner: int, sync: Callable[[], None]) -> Callable[[], float]:
    """A sample = mean wall seconds of ``inner`` calls of ``fn`` (synchronised on CUDA)."""

    def call() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return (time.perf_counter() - t0) / inner

    return call


def reporter(progress: Progress, label: str, repeats: int) -> Callable[[int, str, Any], None]:
    def report(r: int, name: str, sample: Any) -> None:
        progress.print(f"  {label} round {r + 1}/{repeats} {name:<16} {float(sample) * 1e3:10.2f} ms")

    return report


def group_runs(runs: Interleaved, ratios: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    return {
        "order": runs.order,
        "samples_s": {n: runs.samples(n) for n in runs.names},
        "ratio_samples": {key: runs.ratio_samples(*pair) for key, pair in ratios.items()},
    }


def jvp_error_float64(model: Any, plain: PlainSuffix, h: Any, delta: Mapping[str, Any]) -> float:
    """The JVP error on float64 copies of the same suffix (last k blocks, LN, head; the prefix is shared)."""
    import torch

    from core.tangent.experiments import float64_suffix

    model64 = float64_suffix(model)
    plain64 = plain.double()
    delta64 = {n: t.double() for n, t in delta.items()}
    model64.set_delta(delta64)
    tangents, _ = plain64.tangents(model64, delta64)
    h64 = h.double()
    with torch.no_grad():
        _, ref = plain64.jvp(h64, plain64.params(), tangents)
        model64.predict_jvp_only = True
        ours = model64.forward_from_cache(h64)
    return max_rel(ours, ref)
