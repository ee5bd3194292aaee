"""The membership view pairs each DP audit with the non-private model of its own audit, seed and method: the power
of ``empirical-epsilon-below-accountant`` is what the same attacks certified on that control, and a DP model whose
method has no non-private model audited (DPFormer) gets none, not another architecture's."""

from __future__ import annotations

import math
from pathlib import Path

from storage import views
from storage.recording import record_run


def _audit(parent: object, method: str, label: str, seed: int, one_run: float, accountant: float | None) -> None:
    with record_run(
        flow="attacks",
        stage="attacks",
        technique=f"mia-{method}",
        config={"seed": seed},
        dataset="d",
        parent=parent,
        track=False,
    ) as rec:
        rec.attack(
            attack="loss",
            target=f"d:{method}",
            setting=f"{label},shadows=1",
            auc=0.6,
            accountant_epsilon=accountant,
            extra={"one_run_epsilon_lo_family": one_run, "empirical_epsilon_lo_family": one_run / 2},
        )


def test_each_dp_model_is_paired_with_its_own_methods_control(home: Path) -> None:
    with record_run(flow="attacks", stage="attacks", technique="flow", config={}, track=False) as parent:
        pass
    for seed, reach in ((0, 2.0), (1, 3.0)):
        _audit(parent.ref, "transformer", "nonprivate", seed, reach, None)
        _audit(parent.ref, "transformer", "eps=1", seed, 0.1, 1.0)
        _audit(parent.ref, "dpformer", "eps=1", seed, 0.2, 1.0)
    frame = views.membership()
    rows = frame[frame["private"]]
    transformer = rows[rows["method"] == "transformer"].sort_values("started_at")
    assert list(transformer["nonprivate_one_run_epsilon_lo_family"]) == [2.0, 3.0]  # its own seed's control
    assert list(transformer["nonprivate_epsilon_lo_family"]) == [1.0, 1.5]
    dpformer = rows[rows["method"] == "dpformer"]
    assert len(dpformer) == 2 and all(math.isnan(v) for v in dpformer["nonprivate_one_run_epsilon_lo_family"])


def test_the_power_is_capped_by_the_dp_runs_own_ceiling(home: Path) -> None:
    """A control that certifies more than the DP run's own guess counts allow a perfect attack does not make the run
    able to fail: the power is the smaller of the control's bound and the run's own ceiling."""
    with record_run(flow="attacks", stage="attacks", technique="flow", config={}, track=False) as parent:
        pass
    _audit(parent.ref, "transformer", "nonprivate", 0, 2.0, None)
    for label, ceiling in (("eps=1", 0.0), ("eps=8", 9.0)):
        with record_run(
            flow="attacks",
            stage="attacks",
            technique="mia-transformer",
            config={"seed": 0},
            dataset="d",
            parent=parent.ref,
            track=False,
        ) as rec:
            rec.attack(
                attack="loss",
                target="d:transformer",
                setting=f"{label},shadows=1",
                auc=0.5,
                accountant_epsilon=float(label.split("=")[1]),
                extra={"one_run_epsilon_lo_family": 0.0, "one_run_certifiable_epsilon_max_family": ceiling},
            )
    rows = views.membership()
    rows = rows[rows["private"]].sort_values("epsilon")
    assert list(rows["nonprivate_one_run_epsilon_lo_family"]) == [2.0, 2.0]
    assert list(rows["one_run_power_family"]) == [0.0, 2.0]  # capped by the run's ceiling 0; the control's 2 < 9
