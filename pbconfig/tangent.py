"""Stage 3 (tangent): Tangent Transformers (TAFT) on a pretrained ViT (the ``tangent`` section)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pbconfig.base import Delta, Epsilon, FrozenConfig, SeedPasses

TangentRegime = Literal["full", "bitfit", "layernorm", "fc"]
TANGENT_REGIMES: tuple[str, ...] = get_args(TangentRegime)
RegStart = Literal["zero", "head"]
TaskRunner = Literal["process", "thread", "dask"]
TASK_RUNNERS: tuple[str, ...] = get_args(TaskRunner)
Table1Method = Literal["taft", "nlft", "fc"]
TABLE1_METHODS: tuple[str, ...] = get_args(Table1Method)
# the methods whose shard models Table 2 composes (TAFT) or averages (Model Soup, from NLFT shards)
TABLE2_METHODS: tuple[str, ...] = ("taft", "nlft")
# the stage's one value a null knob of ``search`` keeps
_SINGLE = {"taft": "lr", "nlft": "nlft_lr", "fc": "fc_lr", "pts": "not reinit_last_block", "cls": "linearize_cls_token"}


def _check_lrs(values: tuple[float, ...], where: str) -> tuple[float, ...]:
    if not values:
        method = where.rsplit(".", 1)[-1]
        raise ValueError(f"{where} is empty; give at least one learning rate, or null for [{_SINGLE[method]}]")
    bad = [v for v in values if not (math.isfinite(v) and v > 0.0)]
    if bad:
        raise ValueError(f"every learning rate in {where} must be a finite number > 0, got {bad}; e.g. [0.001, 0.0001]")
    if len(set(values)) != len(values):
        raise ValueError(f"learning rates in {where} must be distinct, got {list(values)}")
    return values


def _check_flags(values: tuple[bool, ...] | None, name: str, knob: str) -> tuple[bool, ...] | None:
    if values is not None and not values:
        raise ValueError(f"{name} is empty; give [true], [false] or [true, false], or null for [{_SINGLE[knob]}]")
    if values is not None and len(set(values)) != len(values):
        raise ValueError(f"{name} values must be distinct, got {list(values)}; [true, false] searches both")
    return values


class TangentSearchLrs(FrozenConfig):
    """The learning rates each Table 1 method searches (App. A: ``{1e-3, 1e-4}`` for TAFT and NLFT). A method left
    null keeps its one rate (``lr``, ``nlft_lr``, ``fc_lr``): no search for it."""

    taft: tuple[float, ...] | None = Field(None, description="TAFT-k's Adam learning rates; null: [lr]")
    nlft: tuple[float, ...] | None = Field(
        None, description="NLFT-k's (and so Model Soup's and SISA's shards'); null: [nlft_lr]"
    )
    fc: tuple[float, ...] | None = Field(None, description="the linear probe's; null: [fc_lr]")

    @model_validator(mode="before")
    @classmethod
    def _known_methods(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in TABLE1_METHODS)
            if unknown:
                raise ValueError(
                    f"search.lrs names {unknown}, not Table 1 methods; known: {', '.join(TABLE1_METHODS)} "
                    "(e.g. lrs: {taft: [0.001, 0.0001], nlft: [0.001, 0.0001]})"
                )
        return data

    @field_validator("taft", "nlft", "fc")
    @classmethod
    def _lrs(cls, values: tuple[float, ...] | None, info: ValidationInfo) -> tuple[float, ...] | None:
        return None if values is None else _check_lrs(values, f"search.lrs.{info.field_name}")


class TangentSearchConfig(FrozenConfig):
    """Tables 1-2: each method's fine-tuning recipe chosen on validation data (App. A).

    TAFT searches ``lrs.taft x pts x cls`` (``pts``: PT, ``true`` linearises the pretrained last block, ``false``
    resets it first; ``cls``: whether the CLS token is linearised, ``linearize_cls_token``); NLFT and FC search
    their learning rates only (``lrs.nlft``, ``lrs.fc``: the paper tunes PT and CLS for TAFT). Every point trains on
    the training images less a validation part (``val_fraction`` of them, drawn from the seed) and is scored there,
    never on the test set; the best (the first in grid order on ties) is retrained on all the training images for
    Table 1, and Table 2's shards (and Fig. 1, which reads them) train at the point TAFT and NLFT chose there. A
    knob left null keeps the stage's one value (``lr``, ``nlft_lr``, ``fc_lr``, ``not reinit_last_block``,
    ``linearize_cls_token``); a method whose grid has one point is not searched: it trains once, on all the images,
    as without this section.
    """

    lrs: TangentSearchLrs = Field(default_factory=TangentSearchLrs, description="learning rates per method")
    pts: tuple[bool, ...] | None = Field(None, description="TAFT's PT values searched; null: [not reinit_last_block]")
    cls: tuple[bool, ...] | None = Field(None, description="TAFT's CLS values searched; null: [linearize_cls_token]")
    val_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the training images a searched method is scored on"
    )

    @field_validator("pts")
    @classmethod
    def _pts(cls, values: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
        return _check_flags(values, "search.pts (PT)", "pts")

    @field_validator("cls")
    @classmethod
    def _cls(cls, values: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
        return _check_flags(values, "search.cls (CLS)", "cls")


@dataclass(frozen=True)
class MethodGrid:
    """One Table 1 method's grid, every knob resolved: learning rates, PT and CLS values (one each: no search)."""

    lrs: tuple[float, ...]
    pts: tuple[bool, ...] = (True,)
    cls: tuple[bool, ...] = (False,)

    @property
    def points(self) -> int:
        return len(self.lrs) * len(self.pts) * len(self.cls)


class TangentDPConfig(FrozenConfig):
    """Table 3: DP-SGD fine-tuning of tangent ("Ours") vs original ("Reg") parameters per regime and epsilon.

    App. A's recipe: cross-entropy, ``epochs`` at a constant learning rate, each step's gradient over the whole
    training set (``full_batch``: sampling rate 1, one step per epoch), PT searched per epsilon. Each column
    ("Ours", "Reg") of each regime gets the same search over ``lrs x pts`` (``pts``: ``true`` linearises/fine-tunes
    the pretrained last block, ``false`` resets it first), every point trained with DP-SGD on the DP training
    images less a validation part (``val_fraction`` of them, drawn from the seed) and scored there, never on the
    test set; the chosen point is then retrained on all the DP training images and evaluated on the test set. The
    search runs at every epsilon (``search_epsilon: null``, the paper's) or once per column at ``search_epsilon``,
    its choice then used at every epsilon. A single point (one lr, one PT) is no search: it trains at once.
    ``lr`` is accepted for a one-lr grid (``lrs: [lr]``).
    """

    regimes: tuple[TangentRegime, ...] = TANGENT_REGIMES
    epsilons: tuple[Epsilon, ...] = Field((1.0, 3.0, 8.0), min_length=1)
    delta: Delta | None = Field(None, description="None: 1/(10 n) for the n DP training images")
    clip_norm: float = Field(1.0, gt=0.0)
    accountant: Literal["rdp", "prv"] = "rdp"
    epochs: int = Field(10, ge=1, description="passes over the training images (App. A: 50); full_batch: the steps")
    full_batch: bool = Field(False, description="each step's gradient over the whole training set (App. A)")
    batch_size: int | None = Field(256, ge=1, description="expected Poisson batch q n; null with full_batch")
    lrs: tuple[float, ...] = Field((1e-3,), min_length=1, description="Adam learning rates searched per column")
    pts: tuple[bool, ...] = Field((True,), min_length=1, description="PT values searched (false: last block reset)")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the DP training images the search scores")
    search_epsilon: Epsilon | None = Field(None, description="None: search at every epsilon; else once, at this one")
    n_train: int | None = Field(None, ge=2, description="first n of the training subset (None: all)")
    reg_start: RegStart = Field(
        "zero",
        description=(
            "where Reg starts: zero (it predicts f(w) - f(w_0), the zero function Ours starts from, with the same "
            "head at w_0) or head (the random head's output, an offset Ours does not have)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _one_lr(cls, data: Any) -> Any:
        if isinstance(data, dict) and "lr" in data:
            if "lrs" in data:
                raise ValueError(f"give lrs only, got both lr={data['lr']!r} and lrs={data['lrs']!r}")
            data = {k: v for k, v in data.items() if k != "lr"} | {"lrs": [data["lr"]]}
        return data

    @field_validator("lrs")
    @classmethod
    def _lrs(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not (math.isfinite(v) and v > 0.0)]
        if bad:
            raise ValueError(f"every learning rate must be a finite number > 0, got {bad}; e.g. [0.001, 0.0001]")
        if len(set(values)) != len(values):
            raise ValueError(f"learning rates must be distinct, got {list(values)}")
        return values

    @field_validator("pts")
    @classmethod
    def _pts(cls, values: tuple[bool, ...]) -> tuple[bool, ...]:
        if len(set(values)) != len(values):
            raise ValueError(f"PT values must be distinct, got {list(values)}; [true, false] searches both")
        return values

    @model_validator(mode="after")
    def _schedule(self) -> TangentDPConfig:
        if self.full_batch and self.batch_size is not None:
            raise ValueError(
                f"batch_size={self.batch_size} with full_batch=true: a full-batch step takes every training image "
                "(sampling rate 1); set batch_size: null, or full_batch: false for Poisson batches"
            )
        if not self.full_batch and self.batch_size is None:
            raise ValueError("batch_size=None needs full_batch=true; give an expected Poisson batch size")
        if self.search_epsilon is not None and self.search_epsilon not in self.epsilons:
            raise ValueError(
                f"search_epsilon={self.search_epsilon:g} is not one of epsilons {list(self.epsilons)}; "
                "pick one of them, or null to search at every epsilon"
            )
        return self

    @property
    def search_points(self) -> int:
        """Points of the (lr, PT) grid; 1 is no search."""
        return len(self.lrs) * len(self.pts)


class TangentConfig(SeedPasses):
    """Stage 3: Tangent Transformers (TAFT) on a pretrained ViT: Tables 1-3 and Fig. 1 of the paper.

    ``epochs``/``lr``/``batch_size``/``ridge``/``kappa`` are TAFT's (App. A: Adam, RSL with kappa 15);
    ``nlft_lr`` and ``fc_lr`` the non-linear baselines' (cross-entropy); ``reinit_last_block`` and
    ``linearize_cls_token`` TAFT's PT (reset: PT=F) and CLS. ``search`` (:class:`TangentSearchConfig`) replaces any
    of these five by a grid chosen on validation for Tables 1-2 (the default searches nothing). ``shards`` are the shard
    counts of Table 2; ``fig1_shards`` (one of them) is the composition whose shards Fig. 1 removes,
    over ``fig1_trials`` random removal orders; ``forget_fractions`` are the shares of the training set
    forgotten by shard retraining in Fig. 1(c). One forget request of ``forget_request_examples`` images held by
    ``forget_request_shards`` of those shards is served by TAFT, SISA and full retraining, each measured for its
    forgetting cost, accuracy and inference cost after forgetting. ``seeds`` (None: the one ``seed``) runs the
    whole stage once per seed, in place of ``seed`` (:meth:`seed_configs`), so that its comparisons get intervals
    over seeds.
    """

    dataset: str
    model: str
    k: int = Field(1, ge=1, description="number of last blocks linearised (TAFT-k / NLFT-k)")
    reinit_last_block: bool = False
    linearize_cls_token: bool = False
    epochs: int = Field(30, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    lr_milestones: tuple[int, ...] = ()
    loss: Literal["rsl", "ce"] = "rsl"
    alpha: float = Field(1.0, gt=0.0)
    kappa: float = 15.0
    ridge: float = Field(0.0, ge=0.0)
    ball_radius: float | None = Field(None, gt=0.0)
    nlft_lr: float = Field(1e-4, gt=0.0)
    nlft_epochs: int | None = Field(None, ge=1, description="None: the same as epochs")
    fc_lr: float = Field(1e-3, gt=0.0)
    shards: tuple[int, ...] = Field((10, 25, 50), min_length=1)
    fig1_shards: int | None = Field(None, ge=2, description="None: the largest of shards")
    fig1_trials: int = Field(5, ge=1)
    forget_fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    forget_request_examples: int = Field(1, ge=1, description="training images one forget request names")
    forget_request_shards: int = Field(1, ge=1, description="how many of the fig1_shards shards hold them")
    search: TangentSearchConfig = Field(
        default_factory=TangentSearchConfig,
        description="Tables 1-2: each method's lr (TAFT: and PT, CLS) chosen on validation; default: no search",
    )
    dp: TangentDPConfig | None = None
    workers: int = Field(2, ge=1, description="tasks trained in parallel")
    threads_per_worker: int = Field(1, ge=1)
    task_runner: TaskRunner = "process"
    dask_address: str | None = Field(
        None,
        description="scheduler of an existing Dask cluster (tcp://host:8786); "
        "None with task_runner=dask starts a local cluster",
    )
    eval_batch_size: int = Field(256, ge=1)

    @field_validator("shards")
    @classmethod
    def _shard_counts(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        bad = [v for v in values if v < 2]
        if bad:
            raise ValueError(f"every shard count must be >= 2, got {bad}; Table 2 uses 10, 25 and 50")
        if len(set(values)) != len(values):
            raise ValueError(f"shard counts must be distinct, got {list(values)}")
        return values

    @field_validator("forget_fractions")
    @classmethod
    def _fractions(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not 0.0 < v < 1.0]
        if bad:
            raise ValueError(f"forget fractions must lie in (0, 1), got {bad}; e.g. [0.1, 0.25, 0.5]")
        return values

    @model_validator(mode="after")
    def _fig1_and_runner(self) -> TangentConfig:
        if self.fig1_shards is not None and self.fig1_shards not in self.shards:
            raise ValueError(
                f"fig1_shards={self.fig1_shards} is not one of shards {list(self.shards)}; "
                "Fig. 1 removes shards of a composition trained in Table 2"
            )
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError(
                f"dask_address={self.dask_address!r} needs task_runner='dask', got task_runner={self.task_runner!r}"
            )
        n, r = self.fig1_n_shards, self.forget_request_shards
        if not r <= self.forget_request_examples or not r < n:
            raise ValueError(
                f"forget_request_shards={r} must be at most forget_request_examples="
                f"{self.forget_request_examples} and below the {n} shards of Fig. 1 (one shard must stay)"
            )
        ms = list(self.lr_milestones)
        if ms != sorted(set(ms)) or any(not 1 <= m < self.epochs for m in ms):
            raise ValueError(f"lr_milestones must be strictly increasing epochs in [1, {self.epochs}), got {ms}")
        return self

    @property
    def fig1_n_shards(self) -> int:
        return self.fig1_shards if self.fig1_shards is not None else max(self.shards)

    def method_grid(self, method: str) -> MethodGrid:
        """The grid ``method`` (one of :data:`TABLE1_METHODS`) searches: ``search``'s knobs, each null one the
        stage's single value (so the defaults are one point: today's recipe)."""
        s = self.search
        if method == "taft":
            return MethodGrid(
                s.lrs.taft or (self.lr,),
                s.pts or (not self.reinit_last_block,),
                s.cls or (self.linearize_cls_token,),
            )
        if method == "nlft":
            return MethodGrid(s.lrs.nlft or (self.nlft_lr,))
        if method == "fc":
            return MethodGrid(s.lrs.fc or (self.fc_lr,))
        raise ValueError(f"unknown Table 1 method {method!r}; known: {', '.join(TABLE1_METHODS)}")

    @property
    def searches_table2(self) -> bool:
        """Whether a method whose shards Table 2 trains (TAFT, NLFT) is searched, so its shards wait for the choice."""
        return any(self.method_grid(m).points > 1 for m in TABLE2_METHODS)

    def with_point(self, method: str, *, lr: float, pretrained: bool = True, cls: bool = False) -> TangentConfig:
        """This config with ``method``'s recipe fixed at one point (its grid collapsed to it): what Table 2's shards
        and Fig. 1 train with once Table 1's search has chosen. PT and CLS are TAFT's only."""
        s = self.search
        if method == "taft":
            update: dict[str, Any] = {"lr": lr, "reinit_last_block": not pretrained, "linearize_cls_token": cls}
            search = s.model_copy(update={"lrs": s.lrs.model_copy(update={"taft": None}), "pts": None, "cls": None})
        elif method in ("nlft", "fc"):
            if not pretrained or cls:
                raise ValueError(f"PT and CLS are TAFT's knobs; {method} has neither, got {pretrained=}, {cls=}")
            update = {f"{method}_lr": lr}
            search = s.model_copy(update={"lrs": s.lrs.model_copy(update={method: None})})
        else:
            raise ValueError(f"unknown Table 1 method {method!r}; known: {', '.join(TABLE1_METHODS)}")
        return self.model_copy(update=update | {"search": search})
