"""The Plotly figure builders on small hand-made frames shaped like the views' output."""

from __future__ import annotations

import math

import pandas as pd

from dashboards import plots


def _names(fig) -> list[str]:
    return [t.name for t in fig.data]


def test_privacy_utility_has_a_line_per_method_and_a_non_private_reference() -> None:
    frame = pd.DataFrame(
        {
            "method": ["dpformer", "dpformer", "transformer", "transformer", "transformer"],
            "dataset": ["d"] * 5,
            "private": [True, True, True, True, False],
            "epsilon": [8.0, 1.0, 8.0, 1.0, math.nan],
            "ndcg_at_10": [0.2, 0.1, 0.15, 0.05, 0.3],
            "train_wall_s": [1.0, 1.0, 2.0, 2.0, 0.5],
        }
    )
    fig = plots.privacy_utility(frame)
    assert _names(fig) == ["dpformer", "transformer", "transformer non-private"]
    assert list(fig.data[0].x) == [1.0, 8.0] and list(fig.data[0].y) == [0.1, 0.2]  # sorted by epsilon
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 0.3  # the horizontal non-private reference
    assert list(plots.train_time(frame).data[0].y) == [1.0, 2.0]


def test_privacy_utility_draws_the_popularity_floor_where_recorded() -> None:
    frame = pd.DataFrame(
        {
            "method": ["transformer", "transformer"],
            "dataset": ["d"] * 2,
            "private": [True, True],
            "epsilon": [8.0, 1.0],
            "ndcg_at_10": [0.2, 0.1],
            "popularity_ndcg_at_10": [0.15, 0.15],
        }
    )
    fig = plots.privacy_utility(frame)
    assert _names(fig) == ["transformer", "most popular items"]
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 0.15 and line.line.dash == "dot"
    with_hit = frame.assign(hit_at_10=[0.3, 0.2])
    assert len(plots.privacy_utility(with_hit, "hit_at_10").layout.shapes) == 0  # no floor recorded for HIT@10


def test_privacy_utility_averages_seeds_with_their_interval() -> None:
    frame = pd.DataFrame(
        {
            "method": ["dpformer"] * 4,
            "dataset": ["d"] * 4,
            "private": [True] * 4,
            "epsilon": [8.0, 8.0, 8.0, 1.0],
            "ndcg_at_10": [1.0, 2.0, 3.0, 0.5],
        }
    )
    (line,) = plots.privacy_utility(frame).data
    assert list(line.x) == [1.0, 8.0] and list(line.y) == [0.5, 2.0]  # one point per epsilon: the mean
    assert list(line.customdata) == [1, 3]  # seeds
    assert line.error_y.array[0] == 0.0  # one seed: no interval
    assert math.isclose(line.error_y.array[1], 4.302652729911275 / math.sqrt(3))  # t(0.975, 2) * 1 / sqrt(3)


def test_clipping_bars_take_the_newest_run_per_method() -> None:
    frame = pd.DataFrame(
        {
            "method": ["phantom", "phantom", "opacus_hooks"],
            "step_s": [0.2, 0.1, 0.3],
            "peak_mem_mb": [10.0, 11.0, 12.0],
            "started_at": pd.to_datetime(["2025-01-01", "2025-01-02", "2025-01-01"], utc=True),
        }
    )
    fig = plots.clipping_speed_memory(frame)
    assert [t.type for t in fig.data] == ["bar", "bar"]
    assert dict(zip(fig.data[0].x, fig.data[0].y, strict=True)) == {"opacus_hooks": 300.0, "phantom": 100.0}
    assert dict(zip(fig.data[1].x, fig.data[1].y, strict=True)) == {"opacus_hooks": 12.0, "phantom": 11.0}


def test_tangent_and_unlearning_curves() -> None:
    acc = pd.DataFrame(
        {
            "method": ["taft", "taft", "soup", "sisa", "nlft"],
            "n_shards": [1, 2, 2, 2, 1],
            "test_accuracy": [0.9, 0.85, 0.7, 0.8, 0.88],
        }
    )
    assert _names(plots.tangent_accuracy(acc)) == ["nlft", "sisa", "soup", "taft"]
    curves = pd.DataFrame(
        {
            "run_id": ["a"] * 4 + ["old"],
            "method": ["taft", "taft", "sisa", "sisa", "taft"],
            "shards_removed": [1, 0, 0, 1, 0],
            "fraction_removed": [0.5, 0.0, 0.0, 0.5, 0.0],
            "accuracy": [0.8, 0.9, 0.85, 0.7, 0.1],
            "started_at": pd.to_datetime(["2025-02-01"] * 4 + ["2025-01-01"], utc=True),
        }
    )
    fig = plots.unlearning(curves)
    assert _names(fig) == ["sisa", "taft"] and list(fig.data[1].y) == [0.9, 0.8]  # newest run, sorted


def test_mpc_stacked_bars_with_projections() -> None:
    rows = [
        {
            "method": m,
            "op_category": op,
            "seconds": s,
            "bytes": 2e6,
            "total_s": t,
            "lan_projected_s": t + 1,
            "wan_projected_s": t + 10,
            "started_at": pd.Timestamp("2025-01-01", tz="UTC"),
        }
        for m, t in (("vanilla", 5.0), ("merge", 2.0))
        for op, s in (("Linear", 1.0), ("Softmax", 0.5))
    ]
    fig = plots.mpc_costs(pd.DataFrame(rows))
    assert fig.layout.barmode == "stack"
    assert _names(fig) == ["Linear", "Linear", "Softmax", "Softmax", "LAN projection", "WAN projection"]
    assert list(fig.data[0].x) == ["merge", "vanilla"]  # cheapest first
    assert list(fig.data[1].y) == [2.0, 2.0]  # MB
    assert list(fig.data[-1].y) == [12.0, 15.0]


def test_stip_film_and_membership_figures() -> None:
    stip = pd.DataFrame(
        {
            "model": ["m", "m"],
            "design": ["user_embed", "vocab_perm"],
            "server_over_plaintext_time": [1.2, 1.5],
            "user_overhead_fraction": [0.1, 0.2],
            "bytes_up_per_token": [100, 80],
            "bytes_down_per_token": [50, 2e5],
        }
    )
    assert len(plots.stip_overhead(stip).data) == 4
    attacks = pd.DataFrame({"model": ["a", "b"], "attack": ["weight_matching"] * 2, "recovery_rate": [1.0, 0.9]})
    assert _names(plots.stip_attacks(attacks)) == ["a", "b"]
    film = pd.DataFrame(
        {
            "embedding": ["subword", "subword", "seb_co"],
            "attacker": ["subwords", "subwords", "bytes"],
            "batch_size": [1, 2, 1],
            "rougeL": [0.5, 0.4, 0.2],
            "recall": [1.0, 1.0, 0.9],
        }
    )
    fig = plots.film(film, "recall")
    assert _names(fig) == ["seb_co / bytes", "subword / subwords"] and list(fig.data[1].x) == [1, 2]
    mia = pd.DataFrame(
        {
            "audit": ["dp", "dp", "unlearning"],
            "method": ["transformer"] * 3,
            "setting": ["eps=8,shadows=4", "nonprivate,shadows=4", "before: x"],
            "attack": ["loss"] * 3,
            "auc": [0.5, 0.6, 0.5],
            "tpr_at_1pct_fpr": [0.01, 0.02, 0.0],
            "tpr_at_0_1pct_fpr": [0.0, 0.01, 0.0],
            "empirical_epsilon": [0.2, 0.8, math.nan],
            "empirical_epsilon_lo": [0.0, 0.1, math.nan],
            "empirical_epsilon_hi": [1.0, math.inf, math.nan],
            "accountant_epsilon": [7.9, math.nan, math.nan],
        }
    )
    eps = plots.membership_epsilon(mia)
    assert _names(eps) == ["empirical epsilon", "accountant epsilon"]
    top = eps.layout.yaxis.range[1]
    assert top > 7.9 and list(eps.data[0].error_y.array) == [0.8, top - 0.8]  # inf upper bound drawn to the top
    assert len(plots.membership_auc(mia).data) == 3
    roc = pd.DataFrame(
        {
            "method": ["t"] * 3,
            "setting": ["eps=8"] * 3,
            "attack": ["loss"] * 3,
            "fpr": [0.0, 0.5, 1.0],
            "tpr": [0.0, 0.6, 1.0],
        }
    )
    assert _names(plots.membership_roc(roc)) == ["t eps=8 loss", "chance"]
