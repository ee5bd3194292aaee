"""The DP membership audit can fail: a DP step with its noise switched off (the accountant still reporting the
configured epsilon) is caught, its one-run lower bound (one_run_epsilon_lo, the claim's) above the accountant's
epsilon and within the audit's power (one_run_certifiable_epsilon_max), while the same audit of the intact DP step
stays below it. The audit runs through its real code path on a tiny recommender that can memorise its users: the
task's logic (``audit_point``) and, for the recorded rows, the task itself (``audit_seqrec.fn``) and the membership
view."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.data.sequential import SequentialDataset
from core.dp import trainer
from pbconfig.attacks import AuditConfig
from pbconfig.train_dp import TrainDPConfig
from storage import views
from storage.recording import record_run
from tasks.audit import audit_point, audit_seqrec
from tasks.prepare import MANIFEST, PREP_VERSION
from tasks.train_dp import GridPoint, train_overrides
from tests.core.data.random_sequences import random_sequences

EPSILON = 1.0
AUDIT = AuditConfig(
    datasets=("tiny",),
    methods=("transformer",),
    epsilons=(EPSILON,),
    nonprivate=False,
    shadows=1,
    attacks=("loss",),
    unlearning=False,
)
TRAIN = TrainDPConfig(
    datasets=({"name": "tiny", "dropout": 0.0},),
    methods=("transformer",),
    epsilons=(EPSILON,),
    nonprivate=False,
    peers=(),
    epochs=30,
    lrs=(0.01,),
    batch_sizes=(32,),
    weight_decay=0.0,
    warmup_frac=0.1,
    max_len=16,
    d_model=32,
    n_layers=1,
    eval_every=30,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(n_users: int = 200, n_items: int = 300, seed: int = 0) -> SequentialDataset:
    """Users with random sequences of 12-16 items: nothing to generalise, everything to memorise."""
    return random_sequences(n_users, n_items, min_len=12, max_len=16, seed=seed, source="tiny random sequences")


def _overrides() -> dict[str, Any]:
    point = GridPoint("tiny", "", 0.0, "transformer", EPSILON, AUDIT.seed, TRAIN.lrs[0], TRAIN.batch_sizes[0])
    return train_overrides(point, TRAIN)


def _noise_off(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Break the DP step: the trainer's noise multiplier is forced to 0 where the noise is added, while the
    calibration and the accountant keep the configured one. Returns the multipliers the accountant was told."""
    told: list[float] = []
    privatize = trainer.privatize_grads_

    def broken(params: Any, *, noise_multiplier: float, **kw: Any) -> None:
        told.append(noise_multiplier)
        privatize(params, noise_multiplier=0.0, **kw)

    monkeypatch.setattr(trainer, "privatize_grads_", broken)
    return told


def _claim_margins(results: dict[str, dict]) -> tuple[list[float], list[float]]:
    """Per attack row: one_run_epsilon_lo_family - accountant_epsilon (the claim's value, every run <= 0) and
    one_run_certifiable_epsilon_max_family - accountant_epsilon (its power, > 0 where the row can fail)."""
    values = [r["one_run_epsilon_lo_family"] - r["accountant_epsilon"] for r in results.values()]
    power = [r["one_run_certifiable_epsilon_max_family"] - r["accountant_epsilon"] for r in results.values()]
    return values, power


def test_a_dp_step_without_noise_fails_the_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    told = _noise_off(monkeypatch)
    done = audit_point(_tiny(), "transformer", EPSILON, AUDIT, _overrides())
    ledger = done.target.ledger
    assert ledger is not None and EPSILON * 0.9 < ledger.epsilon <= EPSILON  # the accountant reports the budget
    assert told[0] == done.target.noise_multiplier > 1.0  # ... for noise that was never added (target first)
    values, power = _claim_margins(done.results)
    assert min(power) > 1.0  # ~100 evaluated users certify up to ~2.3 > 1 with the one-run bound
    assert max(values) > 0.0  # the rule "every run's one_run_epsilon_lo - accountant_epsilon <= 0" fails
    loss = done.results["loss"]
    assert loss["auc"] > 0.95 and loss["accountant_epsilon"] < loss["one_run_epsilon_lo"]
    assert loss["one_run_epsilon_lo"] <= loss["one_run_certifiable_epsilon_max"] + 1e-9  # never above the power
    # the many-runs estimator catches it too
    assert loss["accountant_epsilon"] < loss["empirical_epsilon_ci"][0] <= loss["certifiable_epsilon_max"] + 1e-9


def test_the_intact_dp_step_holds_the_claim(home: Path, tmp_path: Path) -> None:
    data = _tiny()
    path = tmp_path / "tiny"
    data.save(path)
    (path / MANIFEST).write_text(json.dumps({"prep_version": PREP_VERSION, "content_hash": data.content_hash()}))
    with record_run(flow="attacks", stage="attacks", technique="flow", config={}, track=False) as parent:
        pass
    out = audit_seqrec.fn("tiny", "transformer", EPSILON, AUDIT, TRAIN, str(path), parent.ref)
    values, _ = _claim_margins(out["attacks"])
    assert max(values) <= 0.0  # no spurious violation
    # (the one-run audit guesses as many users as its DP shadows support, here few: its own ceiling is low, and the
    # claim takes its power from the non-private control instead; the Clopper-Pearson ceiling is still above 1)
    assert all(r["certifiable_epsilon_max_family"] > EPSILON for r in out["attacks"].values())
    frame = views.membership()
    assert list(frame["attack"]) == ["loss"]
    assert (frame["audit"] == "dp").all() and frame["private"].all() and (frame["epsilon"] == EPSILON).all()
    np.testing.assert_allclose(
        frame["certifiable_epsilon_max"], [out["attacks"][a]["certifiable_epsilon_max"] for a in frame["attack"]]
    )
    assert (frame["empirical_epsilon_lo"] - frame["accountant_epsilon"] <= 0).all()
    assert (frame["certifiable_epsilon_max"] - frame["accountant_epsilon"] > 0).all()
    for column in ("one_run_epsilon_lo", "one_run_epsilon_lo_family", "one_run_certifiable_epsilon_max_family"):
        np.testing.assert_allclose(frame[column], [out["attacks"][a][column] for a in frame["attack"]])
    assert (frame["one_run_epsilon_lo_family"] - frame["accountant_epsilon"] <= 0).all()
    np.testing.assert_allclose(frame["alpha_family"], AUDIT.alpha)  # one target, one attack: a family of one


def test_audit_seeds_audit_every_target_once_per_seed() -> None:
    """``seeds`` gives each target one audit per seed (its own target, shadows and halves of the users): the
    targets repeat per seed with that seed's config, and the seed is what the claims pair the two sides by."""
    from storage.leaderboard import config_seed
    from tasks.audit import audit_targets

    one = audit_targets(AUDIT)
    assert [(t.dataset, t.method, t.epsilon, t.config.seed) for t in one] == [("tiny", "transformer", EPSILON, 0)]
    seeded = audit_targets(AUDIT.model_copy(update={"seeds": (0, 1, 2), "nonprivate": True}))
    assert [(t.method, t.epsilon, t.config.seed) for t in seeded] == [
        (m, e, s) for s in (0, 1, 2) for m, e in (("transformer", EPSILON), ("transformer", None))
    ]
    for t in seeded:  # the recorded config's seed (config_seed reads the shallowest) is the pass's
        c = t.config
        assert c.seeds is None and config_seed({"dataset": "tiny", "audit": c.model_dump(mode="json")}) == c.seed


def test_both_arms_of_an_audit_train_at_the_dp_recipe() -> None:
    """The non-private target is the DP target's matched control: the same learning rate, batch size, epochs and
    seed (the search's DP choice where there is one), trained without the DP step; the non-private schedule of the
    train-dp grid does not apply to it."""
    from tasks.audit import audited_point
    from tasks.train_dp import recipe_key

    train = TRAIN.model_validate(
        TRAIN.model_dump() | {"nonprivate": True, "nonprivate_schedule": {"epochs": 99, "lr": 0.5, "batch_size": 7}}
    )
    choice = {"lr": 0.02, "batch_size": 16, "points": 2, "epsilon": 8.0, "seed": 100, "protocol": "masked"}
    picked = {recipe_key("tiny", "transformer", True): choice | {"valid": 0.1, "run_id": "r"}}
    for recipes, (lr, batch) in (({}, (0.01, 32)), (picked, (0.02, 16))):
        dp = audited_point("tiny", "/x", "transformer", EPSILON, AUDIT, train, recipes)
        plain = audited_point("tiny", "/x", "transformer", None, AUDIT, train, recipes)
        assert (dp.lr, dp.batch_size, dp.epochs, dp.seed) == (plain.lr, plain.batch_size, plain.epochs, plain.seed)
        assert (dp.lr, dp.batch_size, dp.epochs) == (lr, batch, None) and plain.epsilon is None
        dp_over, plain_over = train_overrides(dp, train), train_overrides(plain, train)
        assert plain_over["clipping"] == "nonprivate" and "clip_norm" in dp_over
        same = {k for k in plain_over if k not in ("clipping", "epsilon")}
        assert {k: plain_over[k] for k in same} == {k: dp_over[k] for k in same}


def test_the_epsilon_family_counts_every_attack_of_every_dp_target() -> None:
    from tasks.audit import epsilon_family

    assert epsilon_family(AUDIT) == 1  # one attack, one DP target
    wide = AUDIT.model_copy(update={"seeds": (0, 1, 2), "epsilons": (1.0, 8.0), "attacks": ("loss", "lira_online")})
    assert epsilon_family(wide) == 2 * 3 * 2  # the non-private targets are not judged by the epsilon claim
