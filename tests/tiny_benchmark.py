"""The tiny private-training benchmark of the flow tests: a 5% synthetic slice of ml-1m (``ml-1m-tiny``) and a
train-dp grid on it that trains in seconds (one epoch at epsilon 8, lr 0.005, batch 64, 16-item sequences, 16-dim
models). Each test names its methods and changes what it needs (``tiny_benchmark``)."""

from __future__ import annotations

from typing import Any

from pbconfig.benchmark import BenchmarkConfig, validate

DATASET = "ml-1m-tiny"


def tiny_benchmark(
    train_dp: dict[str, Any], *, texts: list[dict[str, Any]] | None = None, **sections: Any
) -> BenchmarkConfig:
    """Profile ``tiny``: ``ml-1m-tiny`` (and ``texts``, if given) to prepare, the tiny train-dp grid updated with
    ``train_dp``, and any other stage ``sections`` as given."""
    prepare: dict[str, Any] = {
        "datasets": [
            {"name": DATASET, "source": "synthetic", "synthetic": {"preset": "ml-1m", "scale": 0.05, "seed": 3}}
        ]
    }
    if texts is not None:
        prepare["texts"] = texts
    grid = {
        "datasets": [{"name": DATASET}],
        "epsilons": [8],
        "epochs": 1,
        "lrs": [0.005],
        "batch_sizes": [64],
        "max_len": 16,
        "d_model": 16,
    }
    config = {"profile": "tiny", "prepare": prepare, "train_dp": grid | train_dp, **sections}
    return validate(BenchmarkConfig, config, origin="test")
