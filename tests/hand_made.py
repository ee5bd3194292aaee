"""Hand-made inputs: runs recorded by hand into the store, for the tests of the read side (leaderboards, claims),
claims of the registry's shape, and small sequential datasets written out item by item."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.data.sequential import SequentialDataset
from pbconfig.claims import Claim
from storage import provenance
from storage.recording import record_run


def sequential_dataset(items: list[list[int]], n_items: int) -> SequentialDataset:
    """User ``u``'s chronological items are ``items[u]`` (ids in ``1..n_items``), timestamps in order."""
    lens = [len(seq) for seq in items]
    return SequentialDataset(
        items=np.concatenate([np.asarray(seq) for seq in items]),
        timestamps=np.arange(sum(lens)),
        offsets=np.concatenate(([0], np.cumsum(lens))),
        raw_user_ids=np.arange(len(items)),
        raw_item_ids=np.arange(n_items),
    )


def record_train_dp(
    method: str,
    seed: int,
    ndcg: float,
    hit: float,
    wall: float,
    *,
    epsilon: float | None = 8.0,
    popularity: float | None = None,
) -> None:
    """A train-dp grid point on dataset ``d`` (profile ``tiny``) with its test metrics (and the popularity floor's
    test NDCG@10 when given), and its ledger when private."""
    with record_run(
        flow="train-dp",
        stage="train-dp",
        technique=method,
        dataset="d",
        profile="tiny",
        config={"point": {"method": method, "seed": seed, "epsilon": epsilon, "lr": 0.005}},
        track=False,
    ) as rec:
        rec.metrics({"test_ndcg_at_10": ndcg, "test_hit_at_10": hit, "train_wall_s": wall})
        if popularity is not None:
            rec.metric("popularity.test_ndcg_at_10", popularity)
        if epsilon is not None:
            rec.privacy(
                epsilon=epsilon,
                delta=1e-5,
                noise_multiplier=1.0,
                sample_rate=0.1,
                steps=10,
                accountant="rdp",
                target_epsilon=epsilon,
            )


T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom


def claim_of(measure: dict[str, Any], rule: dict[str, Any], **extra: Any) -> Claim:
    """A claim of the registry's shape with ``measure`` and ``rule`` (and ``extra`` fields), for a test."""
    return Claim.model_validate(
        {
            "id": "test-claim",
            "paper": "Test",
            "stage": "train-dp",
            "source": "Table 1",
            "statement": "a beats b",
            "paper_value": "+10%",
            "registered": {"commit": "911a767", "date": "2026-11-24"},
            "measure": measure,
            "rule": rule,
            **extra,
        }
    )


# dpformer above transformer per epsilon (5 and 8 required), relative NDCG@10 of the private train-dp runs
BEATS = {
    "source": "privacy_utility",
    "where": {"private": True},
    "value": "ndcg_at_10",
    "a": {"method": "dpformer"},
    "b": {"method": "transformer"},
    "per": ["epsilon"],
    "require": {"epsilon": [5, 8]},
    "stat": "relative",
    "unit": "%",
}


ABOVE = {"kind": "above", "bound": 0, "min_n": 3}


def at_commit(monkeypatch: pytest.MonkeyPatch, commit: str) -> None:
    """Record the runs that follow as measured at ``commit`` (a code change between two runs of one seed)."""
    monkeypatch.setattr(provenance, "git_commit", lambda: commit)


def record_dp(method: str, seed: int, ndcg: float, epsilon: float | None = 8.0) -> None:
    """A train-dp run whose test NDCG@10 and HIT@10 are both ``ndcg``."""
    record_train_dp(method, seed, ndcg, ndcg, 1.0, epsilon=epsilon)


def record_grid(values: dict[tuple[str, float], list[float]]) -> None:
    """``{(method, epsilon): [value of seed 0, seed 1, ...]}`` as train-dp runs (:func:`record_dp`)."""
    for (method, eps), ndcgs in values.items():
        for seed, ndcg in enumerate(ndcgs):
            record_dp(method, seed, ndcg, eps)


def record_metric_run(
    technique: str, metrics: dict[str, float], config: dict[str, Any] | None = None, **kw: Any
) -> str:
    """One finished ``tangent`` run of ``technique`` that records ``metrics`` (``kw``: more ``record_run``
    arguments, such as ``parent``); returns its id."""
    with record_run(
        flow="tangent",
        stage="tangent",
        technique=technique,
        dataset="imgs",
        profile="tiny",
        config=config or {},
        track=False,
        **kw,
    ) as rec:
        rec.metrics(metrics)
    return rec.run_id
