"""Stage 3 (tangent): Tangent Transformers (TAFT) on a pretrained ViT (the ``tangent`` section)."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from pbconfig.base import Delta, Epsilon, FrozenConfig, SeedPasses

TangentRegime = Literal["full", "bitfit", "layernorm", "fc"]
TANGENT_REGIMES: tuple[str, ...] = get_args(TangentRegime)
RegStart = Literal["zero", "head"]
TaskRunner = Literal["process", "thread", "dask"]
TASK_RUNNERS: tuple[str, ...] = get_args(TaskRunner)


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
    ``nlft_lr`` and ``fc_lr`` the non-linear baselines' (cross-entropy). ``shards`` are the shard
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
