"""The tangent report's search parts: the fc control's gap, the table of the points each Table 3 column's search chose,
and the row of the points each searched Table 1 method chose."""

from __future__ import annotations

from tasks.tangent_report import fc_control_gap, table1_choices, table3_choices


def _cell(regime: str, kind: str, eps: float, acc: float, **tuning: object) -> dict[str, object]:
    return {"regime": regime, "parameters": kind, "target_epsilon": eps, "test_accuracy": acc} | tuning


def test_fc_control_gap_is_the_largest_column_difference() -> None:
    t3 = {"fc": {"ours": {"1": 0.50, "8": 0.70}, "reg": {"1": 0.50, "8": 0.65}}, "full": {"ours": {"1": 0.9}}}
    assert abs(fc_control_gap(t3) - 0.05) < 1e-12
    assert fc_control_gap({"fc": {"ours": {"1": 0.5}}}) is None  # one column: no control
    assert fc_control_gap({"full": {"ours": {"1": 0.5}, "reg": {"1": 0.4}}}) is None


def test_choices_list_the_searched_cells_only() -> None:
    searched = {"tuning.points": 4, "tuning.valid_accuracy": 0.4125, "lr": 0.01, "pretrained": False}
    rows = [
        _cell("full", "ours", 3.0, 0.5, **searched),
        _cell("full", "reg", 3.0, 0.5, **(searched | {"pretrained": True, "lr": 0.001})),
        _cell("fc", "ours", 3.0, 0.5, lr=0.001, pretrained=True),  # one point: nothing was chosen
    ]
    assert table3_choices(rows) == {"full": {"ours": {"3": "0.01 PT=F (41.2)"}, "reg": {"3": "0.001 PT=T (41.2)"}}}
    assert table3_choices(rows[2:]) == {}


def test_table1_choices_list_the_searched_methods_only() -> None:
    base = {"test_accuracy": 0.5, "train_accuracy": 0.6, "train_s": 1.0, "trainable_parameters": 10, "steps": 4}
    rows = [
        base
        | {"method": "taft-1", "lr": 0.0001, "pretrained": False, "cls": True}
        | {"tuning.points": 8, "tuning.valid_accuracy": 0.4125},
        base | {"method": "nlft-1", "lr": 0.001, "tuning.points": 2, "tuning.valid_accuracy": 0.5},
        base | {"method": "fc"},  # one point: nothing was chosen
    ]
    assert table1_choices(rows) == {"taft-1": "0.0001 PT=F CLS=T (41.2 of 8)", "nlft-1": "0.001 (50.0 of 2)"}
    assert table1_choices(rows[2:]) == {}
