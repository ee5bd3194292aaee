"""Stage 3 (tangent): Tangent Transformers (TAFT) on a pretrained ViT (the ``tangent`` section)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from pbconfig.base import Delta, Epsilon, FrozenConfig, SeedPasses

TangentRegime = Literal["full", "bitfit", "layernorm", "fc"]
TANGENT_REGIMES: tuple[str, ...] = get_args(TangentRegime)
RegStart = Literal["zero", "head"]
TaskRunner = Literal["process", "thread", "dask"]
TASK_RUNNERS: tuple[str, ...] = get_args(TaskRunner)


class TangentDPConfig(FrozenConfig):
    """Table 3: DP-SGD fine-tuning of tangent ("Ours") vs original ("Reg") parameters per regime."""

    regimes: tuple[TangentRegime, ...] = TANGENT_REGIMES
    epsilons: tuple[Epsilon, ...] = Field((1.0, 3.0, 8.0), min_length=1)
    delta: Delta | None = Field(None, description="None: 1/(10 n) for n training images")
    clip_norm: float = Field(1.0, gt=0.0)
    accountant: Literal["rdp", "prv"] = "rdp"
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(256, ge=1, description="expected Poisson batch size q n")
    lr: float = Field(1e-3, gt=0.0)
    n_train: int | None = Field(None, ge=2, description="first n of the training subset (None: all)")
    reg_start: RegStart = Field(
        "zero",
        description=(
            "where Reg starts: zero (it predicts f(w) - f(w_0), the zero function Ours starts from, with the same "
            "head at w_0) or head (the random head's output, an offset Ours does not have)"
        ),
    )


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
