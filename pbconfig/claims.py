"""The claims registry: one entry per headline claim of each paper, as data (``configs/claims/<paper>.yaml``).

An entry says what the paper claims (``statement``, ``source``: the table or figure, ``paper_value``), how the
results store measures ours (``measure``: which rows, which value, which two sides are compared) and the rule
that turns the measurement into a verdict (``rule``). ``storage.claims`` evaluates them; ``privbench report``
renders the verdicts. Nothing here touches the store: this module only loads and validates the registry.

A measure reads one ``source``: a ``storage.views`` view (``privacy_utility``, ``film``, ...) or ``metrics`` (the
scalar metrics of the finished runs of a ``stage``, optionally of some ``techniques``, one column per metric name,
with the run's ``method`` (its technique), ``dataset`` and its config as ``config.<dotted path>`` columns).
``where`` keeps rows whose column equals a value (or is in a list of values); ``value`` is a column, or an
arithmetic expression of columns (``empirical_epsilon - accountant_epsilon``), giving one number per row; the rows
of one run reduce to one number (``reduce``: mean, max or min), the repeats of one seed at one commit to their mean
(``storage.claims``: a newer commit's runs supersede an older one's). ``a`` (and
``b`` for a comparison) select the two sides by column values; ``value_b`` (optional) is side b's value when it is
another column. ``b_source`` (optional, instead of ``b``) reads side b from another source: a peer's runs against
ours (RecBole's SASRec against our non-private Transformer); its ``source``, ``stage``, ``techniques``, ``where``
and ``value`` mean what they mean for the measure, every row it keeps is side b, and ``profile`` (optional) names
the profile of its runs: without it side b reads the runs of every profile and of every chain (the report's
``profile``, ``root`` and ``commit`` filters select our runs, not the peer's). Its seeds are never paired with
ours (a seed number means nothing across implementations): the two sides' intervals are unpaired (Welch).
``per`` names the columns whose values are the *contexts* compared separately (the privacy budget,
the number of shards); a context without both sides is left out. ``require`` maps a ``per`` column to the values
that must all be measured for a verdict (``{epsilon: [5, 8, 10]}``); contexts with other values are left out.
``stat`` is what the rule is applied to, per context:

* ``value``: side a's value;
* ``difference``: a - b;  ``relative``: a / b - 1;  ``ratio``: a / b.

Rules (``rule.kind``):

* ``above`` / ``below`` with ``bound``: the stat's 95% interval over seeds must lie entirely above (below) the
  bound for ``reproduced`` (with at least ``min_n`` seeds); entirely on the other side, with at least ``min_n``
  seeds, is ``not reproduced``; straddling it with n >= ``min_n`` is ``inconclusive``; fewer seeds than ``min_n``
  (or one seed and no interval) is ``underpowered``, whichever side the interval lies on;
* ``all_at_most`` / ``all_at_least`` with ``bound``: every run's value must satisfy the bound (deterministic
  checks such as exactness to a tolerance: no interval needed, one run decides). ``measure.power`` (stat
  ``value``) gives, per run, the most extreme stat the run could have given (what its attacks reach on a model
  without noise, the whole of a quality it can lose): a run whose power does not reach past the bound could not
  have failed and is set aside; every run so is ``underpowered`` (so too for an interval rule with ``power``).

``projected: true`` marks a value read from a fit (a length no run measured): the verdict is ``projected``, never
``reproduced``, and its reason says whether the projection meets the bound and the fit's relative error on a
measured run it was not fitted on (``validation``). ``applies_at`` (on the claim) names the run config at which the
bound applies (GPT-2 shape): runs elsewhere are ``not applicable at this scale``.

``run_interval`` (``[low, high]`` columns, stat ``value`` or ``difference``): a context measured by one run (one
seed) per side takes the runs' own recorded 95% intervals (a bootstrap or DeLong interval over their test examples)
instead of none: for ``value`` side a's interval; for ``difference`` a - b +- 1.96 sqrt(se_a^2 + se_b^2), each
side's standard error its interval's larger half-width over 1.96 (the two runs taken as independent, which
overstates the error where they are scored on the same examples). With ``reduce: max`` (``min``) a run's interval
is that of its row with the largest (smallest) value. With two or more seeds the interval over seeds is used.
``min_n`` still counts seeds, so such a claim sets ``min_n: 1``.

A claim is ``not run`` when the store has no rows for it; ``not reproduced`` when any context is not reproduced;
else ``inconclusive`` when any context is (or a required one is not run); else ``underpowered`` when any context
is; else ``reproduced``.

``precondition`` (optional) names another claim that must hold for this one's comparison to mean anything (DPFormer
against the Transformer presupposes that the private Transformer has learned more than the most-popular-items
ranking under the same protocol: Re-Attention reweights attention over the user's history, and a model that ranks
by item counts makes no use of it). Where the precondition is not ``reproduced``, this claim's ``reproduced`` or
``not reproduced`` reads ``inconclusive`` (the measurement could not show the effect either way) and its reason
gives both measurements; its other verdicts stand, the precondition named.

Pre-registration: ``registered`` is the commit that added the claim (its date; no commit until the change is
committed) and ``history`` every later change of its measure, rule, precondition, scale or data: the old and new
value, the date and commit, the verdict the old rule gave in the reports of the time, and a reason that cites no
measured result. ``tests/test_claims_history.py`` checks the history against git.
"""

from __future__ import annotations

import ast
import datetime as dt
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig
from pbconfig.stages import CHAIN, STAGE_NAMES
from pbconfig.verdicts import Verdict

CLAIMS_DIR = Path(__file__).resolve().parent.parent / "configs" / "claims"
SOURCES = (
    "privacy_utility",
    "clipping_bench",
    "tangent_accuracy",
    "unlearning",
    "mpc_costs",
    "stip_overhead",
    "stip_attacks",
    "film",
    "membership",
    "metrics",
)


VERDICTS = tuple(Verdict)
Scalar = str | int | float | bool | None


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name (metric names are dotted), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _names(expression: str) -> set[str]:
    """The column names (dotted metric names too) an arithmetic ``value`` expression uses; raises ValueError on
    anything but names, numbers, + - * / and parentheses."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"value {expression!r} is not an expression: {exc.msg}") from None
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Attribute | ast.Name):
            dotted = dotted_name(node)
            if dotted is None:
                raise ValueError(f"value {expression!r}: {ast.unparse(node)!r} is not a column name")
            names.add(dotted)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            visit(node.left)
            visit(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            visit(node.operand)
        elif not (isinstance(node, ast.Constant) and isinstance(node.value, int | float)):
            raise ValueError(  # noqa: TRY004 - pydantic turns ValueError into a validation error
                f"value {expression!r}: only column names (dotted metric names too), numbers, + - * / and "
                f"parentheses are allowed, found {ast.unparse(node)!r}"
            )

    visit(tree.body)
    return names


def column_names(expression: str) -> set[str]:
    """The column names a claim's ``value``-style expression reads (public form of the registry's own check)."""
    return _names(expression)


def _check_source(source: str, stage: str | None, techniques: tuple[str, ...], where: str) -> None:
    if source == "metrics" and not stage:
        raise ValueError(f"source 'metrics' needs the runs' stage: set {where}stage (e.g. stage: tangent)")
    if source != "metrics" and (stage or techniques):
        raise ValueError(f"stage/techniques apply to source 'metrics' only, not {source!r}; use where")


def _naming(value: str, what: str) -> str:
    """``value`` when the expression names a column; a ValueError naming ``what`` otherwise."""
    if not _names(value):
        raise ValueError(f"{what} {value!r} names no column")
    return value


class Choice(FrozenConfig):
    """``measure.choose``: one value of column ``among`` (e.g. which attack) chosen once per context, before the rule
    reads anything, as the one whose rows score highest on ``by`` (their mean over every run of both sides, every seed
    pooled; ties to the first in sorted order); only its rows are judged. ``by`` must be data the judged ``value``
    does not read (a selection half where the value is the held-out half): a choice made on the judged data is the
    best-of-several after the fact this avoids."""

    among: str = Field(min_length=1)
    by: str

    _by = field_validator("by")(classmethod(lambda cls, value: _naming(value, "choose.by")))

    def columns(self) -> set[str]:
        return {self.among} | _names(self.by)


class SideSource(FrozenConfig):
    """Side b read from another source than side a (``measure.b_source``; see the module docstring)."""

    source: Literal[SOURCES]  # type: ignore[valid-type]
    stage: str | None = None
    techniques: tuple[str, ...] = ()
    where: dict[str, Scalar | list[Scalar]] = Field(default_factory=dict)
    value: str
    profile: str | None = None  # only the runs of this profile (None: every profile)

    _value = field_validator("value")(classmethod(lambda cls, value: _naming(value, "value")))

    @model_validator(mode="after")
    def _consistent(self) -> SideSource:
        _check_source(self.source, self.stage, self.techniques, "measure.b_source.")
        return self

    def columns(self, per: tuple[str, ...]) -> set[str]:
        """Every column side b reads from its source (the contexts' ``per`` columns too)."""
        return _names(self.value) | set(self.where) | set(per)

    @property
    def label(self) -> str:
        """How the report names side b: its techniques, else its source, with its ``where``."""
        what = ", ".join(self.techniques) or self.source
        return f"{what}, {_side(dict(self.where))}" if self.where else what


class Measure(FrozenConfig):
    """Which rows of the store measure the claim, and what is compared (see the module docstring)."""

    source: Literal[SOURCES]  # type: ignore[valid-type]
    stage: str | None = None  # source "metrics": the runs' stage
    techniques: tuple[str, ...] = ()  # source "metrics": only these techniques (empty: all)
    where: dict[str, Scalar | list[Scalar]] = Field(default_factory=dict)
    value: str
    value_b: str | None = None  # side b's value when it is another column (a cost of another technique)
    reduce: Literal["mean", "max", "min"] = "mean"
    a: dict[str, Scalar | list[Scalar]] = Field(default_factory=dict)
    b: dict[str, Scalar | list[Scalar]] | None = None
    b_source: SideSource | None = None  # side b from another source (a peer's runs), instead of b
    per: tuple[str, ...] = ()
    require: dict[str, list[Scalar]] = Field(default_factory=dict)
    stat: Literal["value", "difference", "relative", "ratio"] = "value"
    # stat value or difference: the columns (low, high) where a run records its own 95% interval of the value (a
    # bootstrap or DeLong over its test examples), used for a context that one run (one seed) per side measures
    run_interval: tuple[str, str] | None = None
    # how the stat is shown: as is, a signed percentage (relative), a multiple, accuracy points, a share
    unit: Literal["", "%", "x", "pt", "share"] = ""
    # per row, the most extreme stat the run could have given (the strongest result its attacks reach, the whole
    # of a quality it can lose): a run whose power does not reach past the bound could not have failed the rule
    power: str | None = None
    # the value is read from a fit (a length the runs did not measure): the verdict is "projected", never
    # "reproduced"; ``validation`` is the fit's relative prediction error on a measured run it was not fitted on
    projected: bool = False
    validation: str | None = None
    # per row, the share of alpha its bound was computed at (a Bonferroni family: a claim that takes the strongest of
    # many bounds): the judged rows' shares must add up to at most 1 - CONFIDENCE, else the strongest of them is not a
    # 95% statement and the verdict is "inconclusive" (e.g. seeds audited after the family was fixed)
    family: str | None = None
    # one value of a column (e.g. the attack) chosen once per context on data the value does not read (Choice)
    choose: Choice | None = None

    @field_validator("value", "value_b", "power", "validation", "family")
    @classmethod
    def _expression(cls, value: str | None) -> str | None:
        if value is not None and not _names(value):
            raise ValueError(f"value {value!r} names no column")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Measure:
        if self.validation is not None and not self.projected:
            raise ValueError("validation (a projection's hold-out error) needs projected: true")
        if self.power is not None and self.stat != "value":
            raise ValueError(f"power applies to stat 'value' (one run's own result), got stat {self.stat!r}")
        _check_source(self.source, self.stage, self.techniques, "measure.")
        if self.b is not None and self.b_source is not None:
            raise ValueError("give side b as b (rows of the same source) or as b_source (another source), not both")
        if self.b_source is not None and self.value_b is not None:
            raise ValueError("value_b does not apply to b_source: give its value as b_source.value")
        if (self.stat == "value") != (self.b is None and self.b_source is None):
            raise ValueError(
                f"stat {self.stat!r} "
                + ("takes no side b" if self.stat == "value" else "needs a side b to compare with (b or b_source)")
            )
        stray = sorted(set(self.require) - set(self.per))
        if stray:
            raise ValueError(f"require names column(s) {', '.join(stray)} that are not in per {list(self.per)}")
        if self.value_b is not None and self.b is None:
            raise ValueError("value_b needs a side b")
        if self.run_interval is not None and self.stat not in ("value", "difference"):
            raise ValueError(f"run_interval applies to stat 'value' or 'difference', got stat {self.stat!r}")
        if self.choose is not None:
            if self.b_source is not None:
                raise ValueError("choose pools both sides' runs of one source: it does not apply with b_source")
            judged = _names(self.value).union(*(_names(b) for b in self.run_interval or ()))
            if self.choose.columns() & judged - {self.choose.among}:
                raise ValueError(
                    f"choose.by {self.choose.by!r} reads the judged value ({self.value!r}): choose on data the value "
                    f"does not read (e.g. a selection half, where the value is the held-out half)"
                )
            if self.choose.among in self.where or self.choose.among in self.per:
                raise ValueError(
                    f"choose.among {self.choose.among!r} is also in where or per: the choice would have nothing to "
                    f"choose among; drop it from there"
                )
        if self.run_interval is not None and self.b_source is not None:
            raise ValueError("run_interval does not apply to a b_source (a peer's runs record no interval of ours)")
        for bound in self.run_interval or ():
            if not _names(bound):
                raise ValueError(f"run_interval column {bound!r} names no column")
        return self

    @property
    def columns(self) -> set[str]:
        """Every column the measure reads from its own source (side b's from ``b_source``: ``b_source.columns``)."""
        cols = _names(self.value) | _names(self.value_b or "0") | set(self.where) | set(self.a) | set(self.per)
        for bound in self.run_interval or ():
            cols |= _names(bound)
        for extra in (self.power, self.validation, self.family):
            cols |= _names(extra) if extra else set()
        if self.choose is not None:
            cols |= self.choose.columns()
        return cols | set(self.b or {})


class Rule(FrozenConfig):
    kind: Literal["above", "below", "all_at_most", "all_at_least"]
    bound: float = Field(allow_inf_nan=False)
    min_n: int = Field(default=3, ge=1)  # seeds needed on each side for "reproduced" (interval rules)

    def describe(self, stat: str, unit: str) -> str:
        shown = _shown(self.bound, unit)
        return {
            "above": f"{stat} 95% interval above {shown}, n >= {self.min_n}",
            "below": f"{stat} 95% interval below {shown}, n >= {self.min_n}",
            "all_at_most": f"every run's {stat} <= {shown}",
            "all_at_least": f"every run's {stat} >= {shown}",
        }[self.kind]


def _shown(value: float, unit: str) -> str:
    if unit in ("%", "pt"):
        return f"{100 * value:+g}{'%' if unit == '%' else ' pt'}" if value else ("0%" if unit == "%" else "0 pt")
    if unit == "share":
        return f"{100 * value:g}%"
    if unit == "x":
        return f"{value:g}x"
    return f"{value:g}"


class AppliesAt(FrozenConfig):
    """The scale at which a claim's bound applies (``applies_at``): runs whose config does not match ``where``
    (``config.<dotted path>`` of the run's config, as in ``measure.where`` of source ``metrics``) are judged
    ``not applicable at this scale`` instead of against a bound meant for another shape."""

    where: dict[str, Scalar | list[Scalar]]
    scale: str  # how the report names it: "GPT-2 124M shape (width 768, 12 layers)"

    @field_validator("where")
    @classmethod
    def _config_keys(cls, where: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(k for k in where if not k.startswith("config."))
        if not where or bad:
            raise ValueError(f"applies_at.where names run config values as config.<path>; got {bad or 'nothing'}")
        return where


class Registration(FrozenConfig):
    """Where a claim's rule was registered: the commit that added it to the registry (None until that change is
    committed: ``tests/test_claims_history.py`` checks it against git), and its date."""

    commit: str | None = Field(default=None, pattern=r"^[0-9a-f]{7,40}$")
    date: dt.date


class RuleChange(FrozenConfig):
    """One change of a registered rule (``history``): which fields of the measure, rule or precondition changed,
    from what to what, when, the verdict the old rule gave in the reports of the time, and a reason that cites no
    measured result (pre-registration: ``docs/claims.md``)."""

    date: dt.date
    commit: str | None = Field(default=None, pattern=r"^[0-9a-f]{7,40}$")  # None: the change not yet committed
    change: dict[str, tuple[Any, Any]]  # dotted field (measure.per, rule.min_n, precondition) -> (old, new)
    verdict_before: str  # the old rule's verdict in the committed reports of the time ("none": no report had it)
    reason: str = Field(min_length=20)


# the profile section each stage's claims read (bench claims read the bench runs' own configs)
STAGE_SECTIONS = {f.name: f.section for f in CHAIN if f.name in STAGE_NAMES}  # stage -> its config section
PROFILE_HISTORY = CLAIMS_DIR.parent / "history" / "profiles.yaml"
ReportedProfile = Literal["quick", "reference"]


class ProfileChange(FrozenConfig):
    """One change of a reported profile's stage section (``configs/history/profiles.yaml``): the data, recipe or
    budget every claim of that stage reads. Pre-registration covers these too: a change after a report showed the
    stage's claims carries the verdicts of the time and a reason that cites no result, and the report lists it under
    the rule history (``tests/test_claims_history.py`` checks every change against git)."""

    date: dt.date
    commit: str | None = Field(default=None, pattern=r"^[0-9a-f]{7,40}$")  # None: the change not yet committed
    profiles: tuple[ReportedProfile, ...] = Field(min_length=1)
    section: Literal["train_dp", "tangent", "secure_inference", "stip", "attacks"]
    change: dict[str, tuple[Any, Any]] = Field(min_length=1)  # dotted key within the section -> (old, new)
    verdict_before: str  # the stage's claims' verdicts in the committed reports of the time ("none": no report)
    reason: str = Field(min_length=20)


class _ProfileHistory(FrozenConfig):
    changes: tuple[ProfileChange, ...] = ()


def load_profile_history(path: Path | None = None) -> tuple[ProfileChange, ...]:
    """Every recorded change of a reported profile's stage sections, oldest first."""
    path = path or PROFILE_HISTORY
    if not path.exists():
        return ()
    try:
        return _ProfileHistory.model_validate(yaml.safe_load(path.read_text()) or {}).changes
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"profile history {path.name}: {exc}") from None


class Claim(FrozenConfig):
    """One headline claim of one paper."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    paper: str = ""  # filled from the file's ``paper`` when absent
    stage: str
    source: str  # "Table 1", "Fig. 3", "eq. 13"
    statement: str
    paper_value: str
    measure: Measure
    rule: Rule
    note: str = ""  # what a reader should know (a deviation from the paper's setting)
    # the id of a claim this one presupposes (the private models learn more than item counts): where that claim is
    # not reproduced, this one's comparison cannot show either way, so "reproduced" and "not reproduced" read
    # "inconclusive" (module docstring)
    precondition: str | None = None
    applies_at: AppliesAt | None = None
    # why this claim is exploratory: it was registered after a result it bears on was seen (a sibling added once the
    # registered claim failed); its verdict is shown as "exploratory" with what its rule reads, never counted as
    # reproduced or not (docs/claims.md)
    exploratory: str | None = None
    # why this is a check privbench adds, not a claim its paper makes (what the paper presupposes, a peer's level, a
    # design of ours the paper leaves open): its verdict stands in the table, marked ``privbench check``, and the
    # report counts the papers' own claims apart from the checks
    check: str | None = None
    # columns of the judged rows the report's scale column names per technique and side (a search's chosen point,
    # the schedule, the steps a stopping rule reached): one value, a range, or the values seen; read by no rule
    shows: tuple[str, ...] = ()
    registered: Registration
    history: tuple[RuleChange, ...] = ()

    @property
    def stat_label(self) -> str:
        m = self.measure
        a = _side(m.a)
        if m.stat == "value":
            return f"{m.value} ({a})" if a else m.value
        b = _side(m.b or {})
        op = {"difference": "-", "relative": "/", "ratio": "/"}[m.stat]
        if m.b_source is not None:
            label = f"{m.value}{f' ({a})' if a else ''} {op} {m.b_source.value} ({m.b_source.label})"
        elif m.value_b is None:
            label = f"{m.value}: {a} {op} {b}"
        else:
            label = f"{m.value} ({a}) {op} {m.value_b} ({b})"
        return f"{label} - 1" if m.stat == "relative" else label


def _side(selector: dict[str, Any]) -> str:
    def shown(v: Any) -> str:
        return "|".join(map(str, v)) if isinstance(v, list) else str(v)

    return ", ".join(
        shown(v) if k in {"method", "design", "embedding"} else f"{k.removeprefix('config.')}={shown(v)}"
        for k, v in selector.items()
    )


class ClaimsFile(FrozenConfig):
    paper: str
    order: int = 100  # the report's order of papers (the mission's stage order)
    title: str
    file: str  # the paper's PDF under shared/papers
    claims: tuple[Claim, ...]


def load_claims(directory: Path | None = None) -> list[Claim]:
    """Every claim of ``directory`` (default ``configs/claims``), file by file in name order; raises ConfigError
    naming the file and the bad entry on an invalid file or a duplicate id."""
    directory = directory or CLAIMS_DIR
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise ConfigError(f"no claims registry files (*.yaml) in {directory}")
    claims: list[Claim] = []
    seen: dict[str, Path] = {}
    for path, parsed in sorted(((p, _parse(p)) for p in files), key=lambda x: (x[1].order, x[0].name)):
        for claim in parsed.claims:
            if claim.id in seen:
                raise ConfigError(f"claim id {claim.id!r} is in both {seen[claim.id].name} and {path.name}; rename one")
            seen[claim.id] = path
            claims.append(claim if claim.paper else claim.model_copy(update={"paper": parsed.paper}))
    for claim in claims:
        if claim.precondition is not None and (claim.precondition not in seen or claim.precondition == claim.id):
            raise ConfigError(
                f"claims registry {seen[claim.id].name}: claim {claim.id!r} has precondition {claim.precondition!r}, "
                "which is no other claim of the registry; give the id of another claim, or drop the precondition"
            )
    return claims


def load_papers(directory: Path | None = None) -> dict[str, ClaimsFile]:
    """The registry files by paper name (titles and PDF names for the report's headings)."""
    directory = directory or CLAIMS_DIR
    parsed = sorted((_parse(p) for p in sorted(directory.glob("*.yaml"))), key=lambda f: f.order)
    return {f.paper: f for f in parsed}


def _parse(path: Path) -> ClaimsFile:
    try:
        return ClaimsFile.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"claims registry {path.name}: {exc}") from None


__all__ = [
    "CLAIMS_DIR",
    "PROFILE_HISTORY",
    "SOURCES",
    "STAGE_SECTIONS",
    "VERDICTS",
    "AppliesAt",
    "Choice",
    "Claim",
    "ClaimsFile",
    "Measure",
    "ProfileChange",
    "Registration",
    "Rule",
    "RuleChange",
    "SideSource",
    "Verdict",
    "dotted_name",
    "load_claims",
    "load_papers",
    "load_profile_history",
]
