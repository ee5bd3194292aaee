"""The unlearning audit on a tiny ViT and tiny images: the composed TAFT model before and after forgetting half of
its shards is attacked, with a two-sample test of the forgotten samples against non-members."""

from __future__ import annotations

from pathlib import Path

import pytest

from pbconfig.attacks import AuditConfig
from storage.recording import record_run
from storage.repository import ResultsRepository
from tasks.audit import audit_unlearning
from tests.flows.test_tangent_flow import _config, prepared  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_unlearning_audit_records_before_and_after(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    tangent = _config(epochs=2).tangent
    with record_run(flow="attacks", stage="attacks", technique="flow", config={}, track=False) as parent:
        pass
    out = audit_unlearning.fn(tangent, AuditConfig(shadows=4), prepared["images"], prepared["model"], parent.ref)
    assert out["n_shards"] == 3 and len(out["removed"]) == 1 and out["n_forgotten"] == 16  # 48 images / 3 shards
    assert set(out["settings"]) == {
        "before: members vs non-members",
        "before: to-be-forgotten vs non-members",
        "after: forgotten vs non-members",
        "after: kept vs non-members",
    }
    assert 0.0 <= out["two_sample"]["ks_pvalue"] <= 1.0 and 0.0 <= out["two_sample"]["mw_pvalue"] <= 1.0
    _, rows = ResultsRepository().query(
        "select a.setting, a.auc, a.empirical_epsilon_lo, a.empirical_epsilon_hi from attack_results a join runs r "
        "on r.id = a.run_id where r.technique = 'mia-unlearning' and r.status = 'finished'"
    )
    assert len(rows) == 4 and all(0.0 <= auc <= 1.0 and 0.0 <= lo <= hi for _, auc, lo, hi in rows)


def test_a_shorter_audit_keeps_only_the_milestones_inside_its_epochs() -> None:
    """The audit trains the composition fewer epochs than the tangent stage; App. A's milestones past its end are
    dropped (they failed the training config's check before, at the end of a reference run)."""
    from tasks.tangent_inputs import shortened, train_config

    tangent = _config(epochs=10).tangent.model_copy(update={"lr_milestones": (5, 8)})
    full = train_config(tangent, "taft")
    assert full.lr_milestones == (5, 8)
    assert shortened(full, 3).lr_milestones == () and shortened(full, 3).epochs == 3
    assert shortened(full, 6).lr_milestones == (5,)
    assert shortened(full, 10) == full


def test_the_unlearning_audit_runs_under_a_stage_schedule_longer_than_its_own(
    home: Path,
    prepared: dict[str, str],  # noqa: F811
) -> None:
    tangent = _config(epochs=10).tangent.model_copy(update={"lr_milestones": (5, 8)})
    with record_run(flow="attacks", stage="attacks", technique="flow", config={}, track=False) as parent:
        pass
    cfg = AuditConfig(shadows=4, unlearning_epochs=2)
    out = audit_unlearning.fn(tangent, cfg, prepared["images"], prepared["model"], parent.ref)
    assert out["n_shards"] == 3
