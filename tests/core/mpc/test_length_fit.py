"""The length fit of encrypted generation costs against exact polynomial costs and scipy's NNLS, and its hold-out
check: exact where the model holds, a large reported error where it does not."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from core.mpc.length_fit import (
    MeasuredGeneration,
    fit_length,
    fit_seconds,
    nnls_small,
    predict_held_out,
    project,
    rel_err,
    split_longest,
)


def _f(c: tuple[float, ...], n: int) -> float:
    c = (*c, 0.0) if len(c) == 3 else c
    return c[0] + c[1] * n + c[2] * n**2 + c[3] * math.log2(n)


def _run(prefix: int, gen: int, c: tuple[float, ...], d: tuple[float, float], head: float = 7.0):
    """A generation whose step i >= 1 costs f(n) (n = prefix + i) and whose decode is d0 + d1 G."""
    steps = [head] + [_f(c, prefix + i) for i in range(1, gen)]
    return MeasuredGeneration(prefix, gen, prefix=3.0 * prefix, steps=tuple(steps), decode=d[0] + d[1] * gen)


def _brute_total(prefix: int, total_len: int, c, d, head: float = 7.0) -> float:
    run = _run(prefix, total_len - prefix, c, d, head)
    return run.total


@pytest.mark.parametrize("c", [(5e8, 3e6, 2e3), (2e3, 0.0, 0.0), (1.5, 0.02, 0.0), (300.0, 0.0, 0.0, 40.0)])
def test_polynomial_costs_are_recovered_and_projected_exactly(c) -> None:
    d = (4e5, 2e4)
    runs = [_run(8, 6, c, d), _run(40, 3, c, d)]
    fit = fit_length(runs)
    assert fit.max_rel_residual < 1e-9 and fit.decode_model == "linear" and fit.n_range == (9, 42)
    assert fit.decode == pytest.approx(d, rel=1e-9)
    head = runs[0].prefix + runs[0].steps[0]
    for total in (14, 128, 512):  # 14 is measured (8 + 6), 128 and 512 are projections
        assert project(fit, head, 8, total) == pytest.approx(_brute_total(8, total, c, d), rel=1e-9)


def test_one_generated_length_makes_decode_proportional() -> None:
    runs = [_run(8, 6, (1.0, 0.1, 0.0), (0.0, 2.0)), _run(20, 6, (1.0, 0.1, 0.0), (0.0, 2.0))]
    fit = fit_length(runs)
    assert fit.decode_model == "proportional" and fit.decode == pytest.approx((0.0, 2.0))


def test_noisy_costs_stay_non_negative_and_close() -> None:
    g = torch.Generator().manual_seed(0)
    c, d = (2.0, 0.05, 0.0), (1.0, 0.5)
    runs = []
    for prefix, gen in ((8, 6), (40, 3)):
        r = _run(prefix, gen, c, d)
        noisy = tuple(s * (1 + 0.02 * float(torch.randn((), generator=g))) for s in r.steps)
        runs.append(MeasuredGeneration(prefix, gen, r.prefix, noisy, r.decode))
    fit = fit_length(runs)
    assert min(fit.step) >= 0 and min(fit.decode) >= 0
    assert project(fit, runs[0].head, 8, 128) == pytest.approx(_brute_total(8, 128, c, d), rel=0.1)


def test_nnls_small_equals_scipy() -> None:
    optimize = pytest.importorskip("scipy.optimize")
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        a = torch.randn(9, 4, generator=g, dtype=torch.float64)
        y = torch.randn(9, generator=g, dtype=torch.float64)
        ours = nnls_small(a, y)
        ref, _ = optimize.nnls(a.numpy(), y.numpy())
        assert torch.allclose(ours, torch.from_numpy(ref), atol=1e-9)


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="distinct lengths"):
        fit_length([_run(8, 4, (1.0, 0.0, 0.0), (0.0, 1.0))])  # steps 1, 2, 3 only
    with pytest.raises(ConfigError, match="one per step"):
        MeasuredGeneration(8, 3, 1.0, (1.0, 2.0), 0.0)
    with pytest.raises(ConfigError, match="finite numbers >= 0"):
        MeasuredGeneration(8, 2, 1.0, (1.0, float("nan")), 0.0)
    fit = fit_length([_run(8, 6, (1.0, 0.0, 0.0), (0.0, 1.0))])
    with pytest.raises(ConfigError, match="must exceed prefix_len"):
        project(fit, 1.0, 8, 8)


def test_seconds_priced_by_bytes_and_rounds_project_like_the_work() -> None:
    """s = a bytes + b rounds + c per step: the rates are recovered and the projection follows the bytes."""
    cb, cr, d = (2e9, 7e7, 2e5), (1500.0, 0.0, 0.0, 30.0), (1e3, 5.0)
    a, b, c = 3e-9, 2e-3, 0.5
    runs = {"bytes": [_run(8, 6, cb, d), _run(40, 3, cb, d)], "rounds": [_run(8, 6, cr, d), _run(40, 3, cr, d)]}
    runs["s"] = [
        MeasuredGeneration(
            rb.prefix_len,
            rb.gen_len,
            1.0,
            tuple(a * x + b * y + c for x, y in zip(rb.steps, rr.steps)),
            0.2 * rb.gen_len,
        )
        for rb, rr in zip(runs["bytes"], runs["rounds"])
    ]
    fit = fit_seconds(runs["s"], runs["bytes"], runs["rounds"])
    assert (fit.per_byte, fit.per_round, fit.per_step) == pytest.approx((a, b, c), rel=1e-6)
    assert fit.max_rel_residual < 1e-9 and fit.decode == pytest.approx((0.0, 0.2), abs=1e-9)
    head = runs["s"][0].head
    for total in (128, 512):
        want = head + sum(a * _f(cb, 8 + i) + b * _f(cr, 8 + i) + c for i in range(1, total - 8)) + 0.2 * (total - 8)
        assert project(fit, head, 8, total) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ConfigError, match="same runs"):
        fit_seconds(runs["s"][:1], runs["bytes"], runs["rounds"])


RUNS = ((8, 6), (20, 3), (40, 3))  # the paper profile's: lengths 14, 23 and 43


def test_split_longest_holds_out_the_longest_run_wherever_it_is() -> None:
    runs = [_run(p, g, (1.0, 0.1, 0.0), (0.0, 1.0)) for p, g in ((40, 3), (8, 6), (20, 3))]
    fit_runs, held = split_longest(runs)
    assert held is runs[0] and fit_runs == (runs[1], runs[2])
    with pytest.raises(ConfigError, match="distinct total lengths, got total lengths \\[14, 14\\]"):
        split_longest([runs[1], _run(11, 3, (1.0, 0.0, 0.0), (0.0, 1.0))])
    with pytest.raises(ConfigError, match="2 or more runs"):
        split_longest(runs[:1])


@pytest.mark.parametrize("c", [(5e8, 3e6, 2e3), (300.0, 0.0, 0.0, 40.0), (1.5, 0.02, 0.0)])
def test_held_out_run_is_predicted_exactly_where_the_model_holds(c) -> None:
    """Steps that are the fit's own model, fitted without the longest run: it is predicted to float tolerance,
    both its total (its head measured) and its steps i >= 1 with the decoding."""
    d = (4e5, 2e4)
    fit_runs, held = split_longest([_run(p, g, c, d) for p, g in RUNS])
    fit = fit_length(fit_runs)
    assert fit.n_range == (9, 22)  # the longest run's steps (41, 42) are not seen
    got = predict_held_out(fit, held)
    assert got.measured == held.total and got.tail_measured == pytest.approx(sum(held.steps[1:]) + held.decode)
    assert got.rel_err < 1e-9 and got.tail_rel_err < 1e-9
    assert got.predicted == pytest.approx(_brute_total(40, 43, c, d), rel=1e-9)
    assert got.as_dict()["rel_err"] == got.rel_err


def test_held_out_error_is_large_where_the_model_is_wrong() -> None:
    """Cubic steps against the at most quadratic model: close on the lengths fitted (6% residual), 39% off at
    the held-out length, which the residual alone would not show."""
    c = (5000.0, 0.0, 0.0)
    cubic = [
        MeasuredGeneration(p, g, 1.0, (7.0, *(c[0] + (p + i) ** 3 for i in range(1, g))), 2.0 * g) for p, g in RUNS
    ]
    fit_runs, held = split_longest(cubic)
    fit = fit_length(fit_runs)
    got = predict_held_out(fit, held)
    assert fit.max_rel_residual < 0.1 and got.tail_rel_err > 0.3
    assert got.predicted < got.measured  # a quadratic falls behind a cubic
    assert got.rel_err == pytest.approx(abs(got.predicted - got.measured) / got.measured)


def test_seconds_quadratic_in_bytes_are_caught_by_the_hold_out() -> None:
    """The rate model prices seconds linearly in bytes; seconds that grow with the square of the bytes are
    predicted at the held-out length far off, against the exact prediction of seconds linear in them."""
    cb, cr = (1e6, 2e4, 300.0), (100.0, 0.0, 0.0, 10.0)
    bytes_ = [_run(p, g, cb, (0.0, 1.0)) for p, g in RUNS]
    rounds = [_run(p, g, cr, (0.0, 1.0)) for p, g in RUNS]
    for price, exact in ((lambda b, r: 3e-9 * b + 2e-3 * r + 0.5, True), (lambda b, r: (b / 1e6) ** 2, False)):
        seconds = [
            MeasuredGeneration(b.prefix_len, b.gen_len, 1.0, tuple(map(price, b.steps, r.steps)), 0.2 * b.gen_len)
            for b, r in zip(bytes_, rounds, strict=True)
        ]
        split = [split_longest(x) for x in (seconds, bytes_, rounds)]
        fit = fit_seconds(*(fit_runs for fit_runs, _ in split))
        got = predict_held_out(fit, split[0][1])
        assert (got.rel_err < 1e-6) if exact else (got.tail_rel_err > 0.3), (exact, got)


def test_held_out_measured_total_replaces_the_phase_sum() -> None:
    c, d = (2.0, 0.1, 0.0), (1.0, 0.5)
    fit_runs, held = split_longest([_run(p, g, c, d) for p, g in RUNS])
    fit = fit_length(fit_runs)
    got = predict_held_out(fit, held, measured_total=held.total + 5.0)  # the slower party's total, 5 over
    assert got.measured == held.total + 5.0 and got.predicted == pytest.approx(held.total + 5.0, rel=1e-9)
    assert rel_err(2.0, 4.0) == 0.5 and rel_err(0.0, 0.0) == 0.0
