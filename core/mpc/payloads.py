"""MPC payloads of random weights, for the scaling sweep (MERGE Fig. 4): an encrypted run's time and bytes depend
on the model's shape, not on its values, so a model size is measured on a random GPT-2 of that shape.

A payload is what a method's engine runs (:mod:`core.mpc.methods`): :class:`~core.mpc.gpt2.GPT2Weights` for the
gpt2 engine, :class:`~core.mpc.merge_spec.MergeSpec` for the merge engine, whose constant attention ``C^n``
(H, n_max, n_max) is the random model's average attention over 4 random sequences of ``n_max`` ids (eq. 8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from core.mpc import merge
from core.mpc.gpt2 import GPT2Weights, weights_from_hf
from core.mpc.merge_spec import MergeSpec
from core.mpc.methods import method_spec
from core.mpc.recipes import GPT2Shape, build_gpt2, seeded

__all__ = ["payload_params", "random_payload"]


def random_payload(method: str, shape: GPT2Shape, *, n_max: int, seed: int) -> GPT2Weights | MergeSpec:
    """The payload ``method`` runs, of a GPT-2 of ``shape`` drawn from ``seed`` (merge engines: its merge module
    with the average attention over 4 sequences of ``n_max`` ids below ``shape.eos``, drawn from ``seed`` too).
    The caller's global RNG is left as it was."""
    with seeded(seed):
        model = build_gpt2(shape)
        if method_spec(method).engine == "gpt2":
            return weights_from_hf(model)
        ids = torch.randint(0, shape.eos, (4, n_max), generator=torch.Generator().manual_seed(seed))  # (4, n_max)
        return merge.export_spec(merge.build_merge_model(model, [ids], n_max).eval())


def payload_params(payload: Any) -> int:
    """The number of values a payload holds: every tensor's ``numel``, through lists, tuples and dataclasses
    (a ``GPT2Weights`` or ``MergeSpec`` and their layers); anything else counts 0."""
    if isinstance(payload, torch.Tensor):
        return payload.numel()
    if isinstance(payload, list | tuple):
        return sum(payload_params(p) for p in payload)
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        return sum(payload_params(getattr(payload, f.name)) for f in dataclasses.fields(payload))
    return 0
