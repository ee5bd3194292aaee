"""Which rows of the results store measure a claim (step 1 of ``storage.claims``): the claim's ``measure.source``
(a ``storage.views`` view, or the scalar metrics and config values of a stage's runs) restricted by the filters and
by ``where``, with ``value`` evaluated per row; a ``b_source`` adds side b's rows from a peer's own runs; and
which of them are at the scale where the claim's bound applies (``applies_at``: :func:`at_scale`)."""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import select

from core.errors import ConfigError
from pbconfig.claims import Claim, Measure, SideSource, dotted_name
from storage import view_query as vq
from storage import views


def _evaluate(expression: str, frame: pd.DataFrame) -> pd.Series:
    """The ``value`` expression (validated by ``pbconfig.claims``) on the columns of ``frame``, as floats."""

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Attribute | ast.Name):
            return pd.to_numeric(frame[dotted_name(node)], errors="coerce").astype(float)
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            return -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        assert isinstance(node, ast.BinOp)
        left, right = walk(node.left), walk(node.right)
        with np.errstate(divide="ignore", invalid="ignore"):
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right

    out = walk(ast.parse(expression, mode="eval").body)
    return out if isinstance(out, pd.Series) else pd.Series(out, index=frame.index, dtype=float)


def _metric_rows(
    db_url: str | None, stage: str | None, techniques: tuple[str, ...], columns: set[str], **filters: Any
) -> pd.DataFrame:
    """Source ``metrics``: the finished runs of ``stage`` (and ``techniques``) with the scalar metrics and config
    values named in ``columns``."""
    from storage.models import Run

    engine, f = vq.engine(db_url), vq.filters(filters)
    conditions = [Run.stage == stage]
    if techniques:
        conditions.append(Run.technique.in_(list(techniques)))
    base = vq.result_runs(engine, f, *conditions)
    base = base.rename(columns={"technique": "method"})
    base["technique"] = base["method"]
    configs = [flat_config(vq.parse_config(c)) for c in base["config_json"]]
    for key in sorted({k for c in configs for k in c} & columns):
        base[key] = [c.get(key) for c in configs]
    own = set(base.columns)
    names = sorted(c for c in columns if c not in own)
    if base.empty:
        return base.assign(**{n: pd.Series(dtype=float) for n in names})
    return base.merge(vq.metrics_wide(engine, base["run_id"].tolist(), names), on="run_id", how="left")


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def _listed(value: list[Any]) -> str | None:
    """A list of scalars (or of lists of scalars, such as a search grid's points) as one string the scale column can
    show, in brackets so that it never reads as the several values ``/`` joins there: ``[5, 8]``,
    ``[[0.03, True], [0.01, False]]``, ``[]``; None for a list of anything else. A ``where`` cannot select on it (a
    list there names the values allowed)."""

    def one(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    if all(_scalar(v) for v in value):
        return "[" + ", ".join(map(one, value)) + "]"
    if all(isinstance(v, list) and all(_scalar(x) for x in v) for v in value):
        return "[" + ", ".join("[" + ", ".join(map(one, v)) + "]" for v in value) + "]"
    return None


def flat_config(config: dict[str, Any], prefix: str = "config") -> dict[str, Any]:
    """A run's config as ``config.<dotted path>`` -> scalar; a list of scalars (or of scalar lists) as one string
    (``_listed``); nulls and lists of anything else left out."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, path))
        elif _scalar(value):
            out[path] = value
        elif isinstance(value, list) and (listed := _listed(value)) is not None:
            out[path] = listed
    return out


def _source_rows(
    db_url: str | None,
    claim_id: str,
    source: str,
    stage: str | None,
    techniques: tuple[str, ...],
    columns: set[str],
    **filters: Any,
) -> pd.DataFrame:
    """The rows of one source; raises ValueError naming a column of ``columns`` the source does not have."""
    if source == "metrics":
        frame = _metric_rows(db_url, stage, techniques, columns, **filters)
    else:
        frame = getattr(views, source)(db_url, **filters)
    missing = sorted(c for c in columns if c not in frame.columns)
    if missing:
        raise ConfigError(
            f"claim {claim_id!r}: source {source!r} has no column(s) {', '.join(missing)}; "
            f"its columns: {', '.join(map(str, frame.columns))}"
        )
    return frame


def _peer_rows(
    db_url: str | None, claim_id: str, peer: SideSource, per: tuple[str, ...], **filters: Any
) -> pd.DataFrame:
    """Side b's rows from ``measure.b_source`` (after its ``where``), with ``value``: the filters that select our
    runs (profile, root, commit) give way to the peer's own ``profile``."""
    given = {k: v for k, v in filters.items() if k not in ("profile", "root", "commit")}
    if peer.profile is not None:
        given["profile"] = peer.profile
    frame = _source_rows(db_url, claim_id, peer.source, peer.stage, peer.techniques, peer.columns(per), **given)
    frame = frame[matches(frame, peer.where)].copy()
    frame["value"] = _evaluate(peer.value, frame) if len(frame) else pd.Series(dtype=float)
    return frame


def claim_rows(db_url: str | None, claim: Claim, **filters: Any) -> pd.DataFrame:
    """The rows that measure ``claim`` (after ``where``), with a ``value`` column (and a ``side`` column, ``a`` or
    ``b``, when side b comes from a ``b_source``); raises ValueError naming a column a source does not have."""
    m = claim.measure
    frame = _source_rows(db_url, claim.id, m.source, m.stage, m.techniques, m.columns | set(claim.shows), **filters)
    frame = frame[matches(frame, m.where)].copy()
    frame["value"] = _evaluate(m.value, frame) if len(frame) else pd.Series(dtype=float)
    if m.run_interval is not None:
        for column, expression in zip(("low", "high"), m.run_interval, strict=True):
            frame[column] = _evaluate(expression, frame) if len(frame) else pd.Series(dtype=float)
    for column, expression in (("power", m.power), ("validation", m.validation), ("family", m.family)):
        if expression is not None:
            frame[column] = _evaluate(expression, frame) if len(frame) else pd.Series(dtype=float)
    if m.value_b is not None and len(frame):
        in_b = matches(frame, m.b or {}) & ~matches(frame, m.a)
        frame.loc[in_b, "value"] = _evaluate(m.value_b, frame)[in_b]
    if m.b_source is not None:
        keep = list(dict.fromkeys(["run_id", "value", "dataset", *m.per]))
        peer = _peer_rows(db_url, claim.id, m.b_source, m.per, **filters)
        parts = [
            p.reindex(columns=keep).assign(side=side) for p, side in ((frame[matches(frame, m.a)], "a"), (peer, "b"))
        ]
        parts = [p for p in parts if len(p)]
        frame = pd.concat(parts, ignore_index=True) if parts else frame.reindex(columns=[*keep, "side"])
    measured = frame[frame["value"].notna()]
    # runs the claim selects whose value is missing (e.g. recorded before the measure existed): the reason counts them
    measured.attrs["unmeasured_runs"] = int(frame.loc[frame["value"].isna(), "run_id"].nunique()) if len(frame) else 0
    return measured


def choose_once(frame: pd.DataFrame, m: Measure) -> tuple[pd.DataFrame, dict[tuple[Any, ...], Any]]:
    """``measure.choose``: per context (the ``per`` columns), the value of ``choose.among`` whose rows have the
    highest mean ``choose.by`` over the rows of both sides together (every run and seed pooled; ties to the first in
    sorted order), and ``frame`` cut to its rows; with ``{context key: chosen value}``. One choice for both sides,
    made on ``by`` (data the judged value does not read), so neither side is judged under its own best pick.
    ``storage.claims`` applies it to the rows the rule keeps (at the claim's scale, the newest commit's runs)."""
    assert m.choose is not None
    sides = matches(frame, m.a) | (matches(frame, m.b) if m.b is not None else False)
    by = _evaluate(m.choose.by, frame)
    pool = frame.assign(_by=by)[sides & by.notna()]
    chosen: dict[tuple[Any, ...], Any] = {}
    keep = pd.Series(False, index=frame.index)
    keys = list(m.per)
    groups = pool.groupby(keys, dropna=False, sort=True) if keys else [((), pool)]
    for key, rows in groups:
        key = key if isinstance(key, tuple) else (key,)
        means = rows.groupby(m.choose.among, sort=True)["_by"].mean()
        if means.empty:
            continue
        best = means.index[int(np.argmax(means.to_numpy()))]  # argmax: the first of equal maxima in sorted order
        chosen[key] = best
        in_context = matches(frame, dict(zip(keys, key, strict=True))) if keys else pd.Series(True, index=frame.index)
        keep |= in_context & matches(frame, {m.choose.among: best})
    return frame[keep].copy(), chosen


def matches(frame: pd.DataFrame, selector: dict[str, Any]) -> pd.Series:
    """The rows of ``frame`` whose columns hold one of the values ``selector`` names per column (``None``: null;
    numbers compared with a relative tolerance of 1e-9)."""
    keep = pd.Series(True, index=frame.index)
    for column, wanted in selector.items():
        allowed = wanted if isinstance(wanted, list) else [wanted]
        keep &= frame[column].map(lambda v, allowed=allowed: any(_equal(v, w) for w in allowed))
    return keep


def _equal(value: Any, wanted: Any) -> bool:
    if wanted is None:
        return value is None or (isinstance(value, float) and math.isnan(value))
    if isinstance(wanted, bool) or isinstance(value, bool | np.bool_):
        return bool(value) == bool(wanted) if isinstance(value, bool | np.bool_) else False
    if isinstance(wanted, int | float):
        try:
            return math.isclose(float(value), float(wanted), rel_tol=1e-9, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    return str(value) == str(wanted)


def at_scale(db_url: str | None, claim: Claim, rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of runs at the scale where the claim's bound applies (``applies_at``: the run's config, or its
    nearest ancestor's, matches ``where``), and how the other runs' scale reads ("config.n_embd=128")."""
    assert claim.applies_at is not None
    wanted = claim.applies_at.where
    configs = run_configs(db_url, rows["run_id"].drop_duplicates().tolist())
    flat = pd.DataFrame(
        [{"run_id": r, **{k: c.get(k) for k in wanted}} for r, c in configs.items()], columns=["run_id", *wanted]
    )
    keep = set(flat.loc[matches(flat, wanted), "run_id"])
    other = flat[~flat["run_id"].isin(keep)]
    elsewhere = "; ".join(
        sorted(
            {
                ", ".join(f"{k.removeprefix('config.')}={v}" for k, v in zip(wanted, vals, strict=True))
                for vals in other[list(wanted)].itertuples(index=False)
            }
        )
    )
    return rows[rows["run_id"].isin(keep)], elsewhere or "another scale"


def run_configs(db_url: str | None, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per run: its config flattened as ``config.<dotted path>``, a value it lacks taken from its nearest
    ancestor's config (a method's child run holds only what differs from its stage run)."""
    from storage.models import Run

    engine = vq.engine(db_url)
    known: dict[str, tuple[str | None, dict[str, Any]]] = {}
    pending = list(dict.fromkeys(run_ids))
    for _ in range(8):  # flow > task > sub-task: a few levels at most
        todo = [r for r in pending if r and r not in known]
        if not todo:
            break
        found = vq.read(
            engine,
            select(Run.id, Run.parent_id, Run.config_json.label("c")).where(Run.id.in_(todo)),
            ["id", "parent_id", "c"],
        )
        for run, parent, config in zip(found["id"], found["parent_id"], found["c"], strict=True):
            known[run] = (parent, flat_config(vq.parse_config(config)))
        pending = [p for p, _ in (known[r] for r in todo if r in known) if p]
    out: dict[str, dict[str, Any]] = {}
    for run in run_ids:
        merged: dict[str, Any] = {}
        node: str | None = run
        while node in known:
            parent, config = known[node]
            merged = {**config, **merged}
            node = parent
        out[run] = merged
    return out
